"""Multinomial logistic regression with an L2 penalty, fitted full-batch by L-BFGS in JAX.

The objective (scikit-learn's `LogisticRegression(C=c)` with the lbfgs solver, in the mean form it
minimises internally since sklearn 1.1): over weights W [K, d] (sklearn's coef_ layout) and an
unpenalised intercept b [K],

    f(W, b) = (1/n) sum_i CE(x_i W^T + b, y_i) + ||W||_F^2 / (2 c n),

which is sklearn's `c * sum_i CE_i + ||W||^2 / 2` divided by c * n: the same minimiser, and a
gradient of O(1) size whatever n, so one absolute tolerance suits every n. Equivalently it is the
"mean loss + lambda/2 ||W||^2" form with lambda = 1 / (c n). Note that for K = 2 sklearn fits one
logit, not two: its binary model at C equals this two-logit model at 2C (the two weight vectors of
the optimum are w/2 and -w/2). Started from zero, every iterate keeps sum_k b_k = 0 and
sum_k W[k] = 0 (every gradient does), so the intercept, defined by the loss only up to a shift,
is the centred one in both implementations.

Solver: `optax.lbfgs` with its zoom line search (strong Wolfe), run in a `lax.while_loop` until the
Euclidean norm of the gradient of f (over W and b) is below `tol` or `max_iter` iterations are done.
Chosen over `jax.scipy.optimize.minimize`, whose BFGS keeps a dense (dK + K)^2 inverse Hessian
(5130^2 for 512-d features and 10 classes) and whose L-BFGS is marked experimental; optax's is
jittable, vmappable and uses O(memory_size * dK) memory.

Preconditioning (`precondition=True`, the default): the features of SSL encoders, random-init ones
above all, are strongly correlated even after standardisation (the feature correlation matrix of a
random-init LeNet-5 on Fashion-MNIST has condition number ~1e6), and plain L-BFGS then needs
thousands of iterations. L-BFGS therefore runs on V with W = V P, P = (Sigma + lambda I)^{-1/2}
(Sigma = x^T x / n on at most `PRECONDITION_ROWS` evenly spaced rows, from its eigendecomposition);
this is a change of variables of the same objective, so the minimiser and the stopping test (on the
gradient in the W coordinates) are unchanged. It cuts the iterations on those features severalfold
(docs/notes/evaluation.md#eval-9).

The fits are pure; their L-BFGS runs in one jitted program per shape. With `precondition=True` the
features `x` must be concrete (the preconditioner's eigendecomposition runs on the host first,
`feature_eigh`); `fit_logistic` is then vmappable over `c`, and under jit or a vmap over the data
pass precondition=False.
`fit_logistic_path` fits a grid of c values in one `lax.scan`, warm-starting each fit from the
previous one (pass c ascending: strongest penalty first, as sklearn's regularisation path); on CPU
this was faster than `jax.vmap(fit_logistic)` over the grid from zero, which runs every grid value
for as many iterations as the slowest one needs (docs/notes/evaluation.md#eval-9).
`select_and_refit` adds the held-out choice of c and the refit on all rows in the same program; row
masks (instead of row subsets) let the fitted part, the held-out part and the whole split share one
compiled program.

Speed notes (XLA:CPU; the measurements: docs/notes/performance.md#perf-64): the data term has a
hand-written gradient computed as r^T x with W stored [K, d] (autodiff's x^T r ran slower), and the
preconditioner's eigendecomposition runs in numpy on the host with one BLAS thread, before the fit's
program (XLA:CPU's eigh and numpy's with two OpenBLAS threads took far longer on busy cores). It used
to run inside the program through `jax.pure_callback`; on a machine with one CPU (or a process
pinned to one) that callback deadlocked in 4 of 6 probes, waiting for its own input buffer on the
only XLA thread.
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

PRECONDITION_ROWS = 8192   # rows used to estimate the feature covariance of the preconditioner
MAX_LINESEARCH_STEPS = 30


class LogisticFit(NamedTuple):
  """A fitted model and how the fit ended (leading grid axis [G] when vmapped or from a path).

  weights: float [K, d] (sklearn's coef_ layout: logits = x W^T + b); bias: float [K].
  num_iter: int32 [], L-BFGS iterations run.
  grad_norm: float [], ||grad f(W, b)||_2 at the returned point (mean form, W coordinates).
  loss: float [], f(W, b) at the returned point.
  """
  weights: jax.Array
  bias: jax.Array
  num_iter: jax.Array
  grad_norm: jax.Array
  loss: jax.Array


def l2_strength(c, n):
  """lambda = 1 / (c n) of the mean form for sklearn's C = c on n examples."""
  return 1.0 / (c * n)


def _ce(logits, y):
  return (jax.nn.logsumexp(logits, axis=-1)
          - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0])


@jax.custom_vjp
def _data_term(weights, bias, x, y, mask):
  """sum_i mask_i CE(x_i W^T + b, y_i) / sum_i mask_i for W [K, d]; hand-written gradient."""
  return jnp.sum(mask * _ce(x @ weights.T + bias, y)) / jnp.sum(mask)


def _data_term_fwd(weights, bias, x, y, mask):
  logits = x @ weights.T + bias
  return jnp.sum(mask * _ce(logits, y)) / jnp.sum(mask), (logits, x, y, mask)


def _data_term_bwd(res, g):
  logits, x, y, mask = res
  r = (jax.nn.softmax(logits, axis=-1) - jax.nn.one_hot(y, logits.shape[-1], dtype=logits.dtype))
  r = r * (mask * (g / jnp.sum(mask)))[:, None]
  # r^T x [K, d]: XLA:CPU ran x^T r [d, K] (what autodiff of x @ W [d, K] gives, and what it
  # rewrites (r^T x)^T into) slower (docs/notes/performance.md#perf-64); hence the [K, d] layout.
  return r.T @ x, jnp.sum(r, axis=0), None, None, None


_data_term.defvjp(_data_term_fwd, _data_term_bwd)


def _ones(x):
  return jnp.ones((x.shape[0],), x.dtype)


def objective(weights: jax.Array, bias: jax.Array, x: jax.Array, y: jax.Array, c,
              mask: Optional[jax.Array] = None) -> jax.Array:
  """f(W, b) = mean_i CE(x_i W^T + b, y_i) + ||W||^2 / (2 c n) (differentiable in W and b).

  Args:
    weights: float [K, d] (sklearn's coef_ layout); bias: float [K].
    x: float [n, d]; y: int [n] in [0, K); c > 0.
    mask: optional 0/1 float [n]: only the rows with mask 1 are the data (n = sum(mask)); the
      others are ignored (one compiled program serves several subsets of the same rows).
  Returns:
    float scalar.
  """
  mask = _ones(x) if mask is None else mask.astype(x.dtype)
  return (_data_term(weights, bias, x, y, mask)
          + 0.5 * l2_strength(c, jnp.sum(mask)) * jnp.sum(weights ** 2))


def predict(weights: jax.Array, bias: jax.Array, x: jax.Array) -> jax.Array:
  """int32 [m] argmax_k (x W^T + b)_k for W [K, d], x [m, d] (ties go to the smallest class)."""
  return jnp.argmax(x @ weights.T + bias, axis=-1).astype(jnp.int32)


def accuracy(weights: jax.Array, bias: jax.Array, x: jax.Array, y: jax.Array,
             mask: Optional[jax.Array] = None) -> jax.Array:
  """Fraction of the rows of x [m, d] (those with mask 1, if given) with predict == y [m]."""
  correct = (predict(weights, bias, x) == y).astype(jnp.float32)
  if mask is None:
    return jnp.mean(correct)
  mask = mask.astype(jnp.float32)
  return jnp.sum(correct * mask) / jnp.sum(mask)


def feature_eigh(x, max_rows: int = PRECONDITION_ROWS) -> Tuple[jax.Array, jax.Array]:
  """Eigendecomposition of x^T x / m over m <= max_rows evenly spaced rows of x [n, d], on the host.

  x must be concrete (not traced). Returns:
    (eigenvalues float [d], clipped at 0; eigenvectors float [d, d], columns), in x's dtype.
  """
  if isinstance(x, jax.core.Tracer):
    raise ValueError('feature_eigh needs concrete features (it runs on the host): call the fit '
                     'outside jit / a vmap over the data, or pass precondition=False')
  gram = np.asarray(_gram(x, max_rows=max_rows)).astype(np.float64)
  # One BLAS thread: with XLA's threads busy on 2 shared cores, OpenBLAS's two threads made a
  # 784 x 784 eigh many times slower (docs/notes/performance.md#perf-64). threadpoolctl comes with
  # scikit-learn; without it the decomposition runs with the BLAS library's default threads.
  with _one_blas_thread():
    s, u = np.linalg.eigh(gram)
  dtype = jnp.asarray(x).dtype
  return jnp.asarray(np.maximum(s, 0.0), dtype), jnp.asarray(u, dtype)


@functools.partial(jax.jit, static_argnames=('max_rows',))
def _gram(x, *, max_rows):
  n = x.shape[0]
  sub = x[::max(1, -(-n // max_rows))]
  return sub.T @ sub / sub.shape[0]


def _one_blas_thread():
  try:
    from threadpoolctl import threadpool_limits  # pylint: disable=g-import-not-at-top
  except ImportError:
    return contextlib.nullcontext()
  return threadpool_limits(limits=1, user_api='blas')


def _fit(x, y, mask, c, w0, b0, eig, *, tol, max_iter, memory_size):
  lam = l2_strength(c, jnp.sum(mask))
  if eig is None:
    to_w = from_w = lambda a: a
  else:
    s, u = eig
    scale = jax.lax.rsqrt(s + lam)
    p, p_inv = (u * scale) @ u.T, (u / scale) @ u.T    # P = (Sigma + lam)^(-1/2), symmetric
    # Rows of W [K, d] are w_k = P v_k, i.e. W = V P.
    to_w, from_w = (lambda v: v @ p), (lambda w: w @ p_inv)
    # grad_V f = grad_W f P, so grad_W f = grad_V f P^{-1}: from_w maps gradients back too.

  def fun(params):
    return objective(to_w(params['v']), params['b'], x, y, c, mask)

  opt = optax.lbfgs(memory_size=memory_size, linesearch=optax.scale_by_zoom_linesearch(
      max_linesearch_steps=MAX_LINESEARCH_STEPS, initial_guess_strategy='one'))
  value_and_grad = optax.value_and_grad_from_state(fun)

  def grad_norm(state):
    g = optax.tree_utils.tree_get(state, 'grad')
    return jnp.sqrt(jnp.sum(from_w(g['v']) ** 2) + jnp.sum(g['b'] ** 2))

  def step(carry):
    params, state = carry
    value, grad = value_and_grad(params, state=state)
    updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=fun)
    return optax.apply_updates(params, updates), state

  def keep_going(carry):
    _, state = carry
    count = optax.tree_utils.tree_get(state, 'count')
    # Iteration 0 has no gradient in the state yet; a NaN gradient norm stops.
    return (count == 0) | ((count < max_iter) & (grad_norm(state) >= tol))

  params = {'v': from_w(w0), 'b': b0}
  params, state = jax.lax.while_loop(keep_going, step, (params, opt.init(params)))
  return LogisticFit(weights=to_w(params['v']), bias=params['b'],
                     num_iter=optax.tree_utils.tree_get(state, 'count').astype(jnp.int32),
                     grad_norm=grad_norm(state), loss=optax.tree_utils.tree_get(state, 'value'))


def _zeros(x, num_classes):
  d = x.shape[1]
  return jnp.zeros((num_classes, d), x.dtype), jnp.zeros((num_classes,), x.dtype)


def _mask(x, mask):
  return _ones(x) if mask is None else jnp.asarray(mask).astype(x.dtype)


_STATIC = ('num_classes', 'max_iter', 'memory_size')


def fit_logistic(x: jax.Array, y: jax.Array, c, *, num_classes: int, tol=1e-4,
                 max_iter: int = 1000, memory_size: int = 10, precondition: bool = True,
                 init: Optional[Tuple[jax.Array, jax.Array]] = None,
                 mask: Optional[jax.Array] = None) -> LogisticFit:
  """Minimises `objective` over (W, b) with L-BFGS (module docstring).

  Args:
    x: float [n, d] features (standardise them first; see `protocol.standardize`).
    y: int [n] labels in [0, num_classes).
    c: scalar > 0, sklearn's inverse regularisation strength C (traced: vmappable).
    num_classes: K.
    tol: stop when ||grad f||_2 < tol (mean form: an O(1)-scaled gradient).
    max_iter: iteration cap (the fit then ends with grad_norm >= tol).
    memory_size: L-BFGS history length.
    precondition: run L-BFGS in the (Sigma + lambda)^{-1/2} coordinates (same minimiser); needs a
      concrete x (`feature_eigh`).
    init: optional warm start (W [K, d], b [K]); default zeros.
    mask: optional 0/1 [n], the rows that are data (`objective`); default all.
  Returns:
    LogisticFit (weights, bias in x's dtype).
  """
  x = jnp.asarray(x)
  w0, b0 = _zeros(x, num_classes) if init is None else init
  return _fit_logistic(x, y, jnp.asarray(c, x.dtype), w0, b0, _mask(x, mask),
                       feature_eigh(x) if precondition else None, num_classes=num_classes,
                       tol=tol, max_iter=max_iter, memory_size=memory_size)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _fit_logistic(x, y, c, w0, b0, mask, eig, *, num_classes, tol, max_iter, memory_size):
  del num_classes  # in the shapes of w0, b0; static so each K compiles once, like the others
  return _fit(x, y, mask, c, w0, b0, eig, tol=tol, max_iter=max_iter, memory_size=memory_size)


def _path(x, y, fit_mask, val_mask, cs, eig, num_classes, **kw):
  def one(carry, c):
    fit = _fit(x, y, fit_mask, c, *carry, eig, **kw)
    return (fit.weights, fit.bias), (fit, accuracy(fit.weights, fit.bias, x, y, val_mask))

  _, (fits, val_acc) = jax.lax.scan(one, _zeros(x, num_classes), jnp.asarray(cs, x.dtype))
  return fits, val_acc


def fit_logistic_path(x: jax.Array, y: jax.Array, cs: jax.Array, fit_mask: jax.Array,
                      val_mask: jax.Array, *, num_classes: int, tol=1e-4, max_iter: int = 1000,
                      memory_size: int = 10, precondition: bool = True
                      ) -> Tuple[LogisticFit, jax.Array]:
  """Fits every c of a grid in turn on the fit_mask rows, each warm-started from the previous fit.

  Args:
    x: float [n, d]; y: int [n].
    cs: float [G] values of C, best ascending (the first fit starts from zero).
    fit_mask: 0/1 [n], the rows fitted; val_mask: 0/1 [n], the held-out rows every fit is scored
      on (at least one).
    Other arguments as in `fit_logistic`.
  Returns:
    (LogisticFit with a leading [G] axis, float [G] accuracy on the val_mask rows).
  """
  x, fit_mask, val_mask, eig = _path_inputs(x, fit_mask, val_mask, precondition)
  return _fit_logistic_path(x, y, cs, fit_mask, val_mask, eig, num_classes=num_classes, tol=tol,
                            max_iter=max_iter, memory_size=memory_size)


def _path_inputs(x, fit_mask, val_mask, precondition):
  """(x, fit_mask, val_mask, eig) as the jitted path programs take them; eig from the host."""
  x = jnp.asarray(x)
  return x, _mask(x, fit_mask), _mask(x, val_mask), feature_eigh(x) if precondition else None


@functools.partial(jax.jit, static_argnames=_STATIC)
def _fit_logistic_path(x, y, cs, fit_mask, val_mask, eig, *, num_classes, **kw):
  return _path(x, y, fit_mask, val_mask, cs, eig, num_classes, **kw)


class SelectedFit(NamedTuple):
  """`select_and_refit`'s result: the path on the fitted part, and the refit on all rows.

  path: LogisticFit [G] on the fit_mask rows; val_acc: float [G] on the val_mask rows.
  best: int32 [], the index of the first maximum of val_acc (the smallest C among ties).
  final: LogisticFit on every row with cs[best], warm-started from path[best].
  """
  path: LogisticFit
  val_acc: jax.Array
  best: jax.Array
  final: LogisticFit


def select_and_refit(x: jax.Array, y: jax.Array, cs: jax.Array, fit_mask: jax.Array,
                     val_mask: jax.Array, *, num_classes: int, tol=1e-4, max_iter: int = 1000,
                     memory_size: int = 10, precondition: bool = True) -> SelectedFit:
  """`fit_logistic_path`, the held-out choice of C and the refit on all rows, as one program.

  One compiled program per shape serves the whole probe (the masks select the rows), so every draw
  of a label fraction reuses it. Arguments as in `fit_logistic_path` (cs ascending).
  """
  x, fit_mask, val_mask, eig = _path_inputs(x, fit_mask, val_mask, precondition)
  return _select_and_refit(x, y, cs, fit_mask, val_mask, eig, num_classes=num_classes, tol=tol,
                           max_iter=max_iter, memory_size=memory_size)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _select_and_refit(x, y, cs, fit_mask, val_mask, eig, *, num_classes, **kw):
  path, val_acc = _path(x, y, fit_mask, val_mask, cs, eig, num_classes, **kw)
  best = jnp.argmax(val_acc).astype(jnp.int32)
  c = jnp.asarray(cs, x.dtype)[best]
  final = _fit(x, y, _ones(x), c, path.weights[best], path.bias[best], eig, **kw)
  return SelectedFit(path=path, val_acc=val_acc, best=best, final=final)
