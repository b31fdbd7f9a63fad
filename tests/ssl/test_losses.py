"""SSL losses against independent numpy float64 references (values and gradients)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.ops import correlation
from fedjax_ssl.ssl import losses

RTOL, ATOL = 2e-5, 2e-6        # float32 jax vs float64 numpy values
G_RTOL, G_ATOL = 2e-4, 2e-5    # float32 jax.grad vs float64 central differences


# ----------------------------------------------------------------------------- numpy float64 references

def np_normalize(x):
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def np_cos(a, b):
  return np.sum(np_normalize(a) * np_normalize(b), axis=-1)


def np_byol(p1, p2, t1, t2):
  return np.mean(2 - 2 * np_cos(p1, t2)) + np.mean(2 - 2 * np_cos(p2, t1))


def np_simsiam(p1, p2, z1, z2):
  return 0.5 * -np.mean(np_cos(p1, z2)) + 0.5 * -np.mean(np_cos(p2, z1))


def np_nt_xent(z1, z2, temperature, zero_diagonal):
  """Per-anchor loops over the 2B samples."""
  z = np_normalize(np.concatenate([z1, z2]))
  n, b = len(z), len(z1)
  total = 0.0
  for i in range(n):
    pos = (i + b) % n
    denom = sum(np.exp(z[i] @ z[j] / temperature) for j in range(n) if j != i)
    if zero_diagonal:
      denom += np.exp(0.0)
    total += -np.log(np.exp(z[i] @ z[pos] / temperature) / denom)
  return total / n


def np_norm_clip(z, sqrt_mu):
  out = z.copy()
  for b in range(len(z)):
    norm = np.linalg.norm(z[b])
    if norm >= sqrt_mu:
      out[b] = sqrt_mu * z[b] / norm
  return out


def np_spectral(z0, z1, alpha=1.0, r_global=None, mu=None):
  if mu is not None:
    z0, z1 = np_norm_clip(z0, np.sqrt(mu)), np_norm_clip(z1, np.sqrt(mu))
  b = len(z0)
  pos = -2.0 / b * np.sum(z1 * z0)
  r = (z1.T @ z1 + z0.T @ z0) / (2 * b)
  if r_global is None:
    return pos + np.sum(r ** 2)
  return pos + alpha * np.sum(r ** 2) + 2 * (1 - alpha) * np.trace(r @ r_global)


def np_spectral_pairwise(z0, z1):
  """FedSC §3 / Eq. (1) with the batch as the population, in loops: -2 mean_b z0_b·z1_b + mean_{x,x⁻}(zᵀz⁻)²
  over all (2B)² ordered pairs of views (x and x⁻ independent draws, same-image pairs included)."""
  b = len(z0)
  views = list(z0) + list(z1)
  pos = -2.0 * sum(z0[i] @ z1[i] for i in range(b)) / b
  neg = sum((u @ v) ** 2 for u, v in itertools.product(views, views)) / (2 * b) ** 2
  return pos + neg


def np_vicreg(za, zb, sim=25.0, std=25.0, cov=1.0):
  """The authors' main_vicreg.py with numpy's own estimators: np.var / np.cov with ddof = 1."""
  d = za.shape[1]
  inv = np.mean((za - zb) ** 2)
  var = sum(np.mean(np.maximum(0.0, 1 - np.sqrt(np.var(z, axis=0, ddof=1) + 1e-4))) / 2
            for z in (za, zb))
  covariance = 0.0
  for z in (za, zb):
    c = np.cov(z, rowvar=False, ddof=1)
    covariance += (np.sum(c ** 2) - np.sum(np.diag(c) ** 2)) / d
  return sim * inv + std * var + cov * covariance


def np_barlow_twins(za, zb, lambd=0.0051):
  """The authors' main.py: affine-free BatchNorm1d in train mode (biased variance, eps 1e-5), then
  c = bn(za)ᵀ bn(zb) / B, in loops over the matrix entries."""
  b, d = za.shape
  na = (za - za.mean(0)) / np.sqrt(za.var(0) + 1e-5)
  nb = (zb - zb.mean(0)) / np.sqrt(zb.var(0) + 1e-5)
  total = 0.0
  for i in range(d):
    for j in range(d):
      c = sum(na[k, i] * nb[k, j] for k in range(b)) / b
      total += (1 - c) ** 2 if i == j else lambd * c ** 2
  return total


def fd_grad(f, args, wrt, eps=1e-6):
  """Central finite differences of scalar f(*args) w.r.t. args[wrt], float64."""
  args = [np.array(a, np.float64) for a in args]
  x = args[wrt]
  g = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    old = x[idx]
    x[idx] = old + eps
    up = f(*args)
    x[idx] = old - eps
    down = f(*args)
    x[idx] = old
    g[idx] = (up - down) / (2 * eps)
  return g


def randn(rng, *shape):
  return rng.normal(size=shape)


def check_value_and_grads(jax_fn, np_fn, args, grad_args, zero_grad_args=()):
  """Value vs np_fn; jax.grad vs finite differences for grad_args; exactly zero grads for zero_grad_args."""
  jargs = [jnp.asarray(a, jnp.float32) for a in args]
  # One compiled program each (eager op-by-op dispatch is slower on a busy 2-core machine).
  value, grads = jax.jit(jax.value_and_grad(jax_fn, argnums=tuple(range(len(args)))))(*jargs)
  np.testing.assert_allclose(float(value), np_fn(*args), rtol=RTOL, atol=ATOL)
  for i in grad_args:
    np.testing.assert_allclose(grads[i], fd_grad(np_fn, args, i), rtol=G_RTOL, atol=G_ATOL)
  for i in zero_grad_args:
    assert np.all(np.asarray(grads[i]) == 0.0), f'argument {i} must be stop-gradient'
    # The reference itself does depend on it, so the zero is the stop-gradient and not a trivial case.
    assert np.abs(fd_grad(np_fn, args, i)).max() > 1e-3


# ----------------------------------------------------------------------------- tests

def test_byol_value_grad_and_stop_gradient():
  rng = np.random.default_rng(0)
  args = [randn(rng, 5, 6) for _ in range(4)]
  check_value_and_grads(losses.byol_loss, np_byol, args, grad_args=(0, 1), zero_grad_args=(2, 3))


def test_byol_hand_values_and_zero_row():
  p = jnp.array([[1.0, 0.0], [0.0, 2.0]])
  # Same directions -> 0; opposite directions -> each term mean(2 - 2 * (-1)) = 4, two terms -> 8.
  assert float(losses.byol_loss(p, p, 3 * p, 3 * p)) == pytest.approx(0.0, abs=1e-6)
  assert float(losses.byol_loss(p, p, -p, -p)) == pytest.approx(8.0, abs=1e-6)
  # An all-zero row normalises to zero (cos 0 -> 2) with finite gradients (F.normalize eps); the other row
  # has cos 1 -> 0. Each term is mean(2, 0) = 1, two terms -> 2.
  z = jnp.array([[0.0, 0.0], [1.0, 1.0]])
  value, grad = jax.jit(jax.value_and_grad(losses.byol_loss))(z, z, z, z)
  assert float(value) == pytest.approx(2.0, abs=1e-6)
  assert np.all(np.isfinite(grad))


def test_simsiam_value_grad_and_stop_gradient():
  rng = np.random.default_rng(1)
  args = [randn(rng, 4, 7) for _ in range(4)]
  check_value_and_grads(losses.simsiam_loss, np_simsiam, args, grad_args=(0, 1), zero_grad_args=(2, 3))


@pytest.mark.parametrize('zero_diagonal', [False, True])
@pytest.mark.parametrize('temperature', [0.5, 0.07])
def test_nt_xent_value_and_grad(zero_diagonal, temperature):
  rng = np.random.default_rng(2)
  args = [randn(rng, 4, 5), randn(rng, 4, 5)]
  jfn = lambda z1, z2: losses.nt_xent(z1, z2, temperature, zero_diagonal=zero_diagonal)
  nfn = lambda z1, z2: np_nt_xent(z1, z2, temperature, zero_diagonal)
  check_value_and_grads(jfn, nfn, args, grad_args=(0, 1))


def test_nt_xent_quirk_hand_value():
  # B = 1, orthogonal views: sims off-diagonal 0. Masked: softmax over {positive} only -> loss 0.
  # Zero diagonal: denominator exp(0) + exp(0) -> loss log 2.
  z1, z2 = jnp.array([[1.0, 0.0]]), jnp.array([[0.0, 1.0]])
  assert float(losses.nt_xent(z1, z2, 0.1)) == pytest.approx(0.0, abs=1e-6)
  assert float(losses.nt_xent(z1, z2, 0.1, zero_diagonal=True)) == pytest.approx(np.log(2.0), abs=1e-6)


def test_norm_clip_numbers_and_grad():
  z = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [-6.0, 8.0]])
  out = correlation.norm_clip(jnp.asarray(z, jnp.float32), 2.0)
  np.testing.assert_allclose(out, [[1.2, 1.6], [0.3, 0.4], [0.0, 0.0], [-1.2, 1.6]], rtol=1e-6)
  rng = np.random.default_rng(3)
  w = randn(rng, 4, 2)
  zz = z + 0.1 * randn(rng, 4, 2)  # off the all-zero row so finite differences are smooth everywhere
  check_value_and_grads(lambda a, b: jnp.sum(correlation.norm_clip(a, 2.0) * b),
                        lambda a, b: np.sum(np_norm_clip(a, 2.0) * b), [zz, w], grad_args=(0,))
  assert np.all(np.isfinite(jax.grad(lambda a: jnp.sum(correlation.norm_clip(a, 2.0)))(jnp.zeros((2, 3)))))


@pytest.mark.parametrize('alpha,use_global,mu', [(1.0, False, None), (1.0, False, 1.5), (0.6, True, None),
                                                 (0.3, True, 2.0)])
def test_spectral_value_and_grad(alpha, use_global, mu):
  rng = np.random.default_rng(4)
  z0, z1 = randn(rng, 6, 3), randn(rng, 6, 3)
  r_global = randn(rng, 3, 3) * 0.5 if use_global else None  # non-symmetric, as a DP-noised matrix can be
  jfn = lambda a, b: losses.spectral_contrastive_loss(
      a, b, alpha=alpha, r_global=None if r_global is None else jnp.asarray(r_global, jnp.float32), mu=mu)
  nfn = lambda a, b: np_spectral(a, b, alpha, r_global, mu)
  if mu is not None:  # make sure the clip is active on some rows and not on others
    norms = np.linalg.norm(np.concatenate([z0, z1]), axis=1)
    assert (norms > np.sqrt(mu)).any() and (norms < np.sqrt(mu)).any()
  check_value_and_grads(jfn, nfn, [z0, z1], grad_args=(0, 1))


def test_spectral_r_global_is_stop_gradient():
  rng = np.random.default_rng(5)
  z0, z1, rg = (jnp.asarray(randn(rng, *s), jnp.float32) for s in [(5, 3), (5, 3), (3, 3)])
  g = jax.grad(lambda r: losses.spectral_contrastive_loss(z0, z1, alpha=0.5, r_global=r))(rg)
  assert np.all(np.asarray(g) == 0.0)


def test_spectral_equals_pairwise_form():
  """FedSC Eq. (1) identity on the batch estimator: -2 Tr R̂⁺ + ||R̂||_F² == pairwise (zᵀz⁻)² form."""
  rng = np.random.default_rng(6)
  z0, z1 = randn(rng, 7, 4), randn(rng, 7, 4)
  got = float(losses.spectral_contrastive_loss(jnp.asarray(z0, jnp.float32), jnp.asarray(z1, jnp.float32)))
  np.testing.assert_allclose(got, np_spectral_pairwise(z0, z1), rtol=RTOL, atol=ATOL)
  r_hat, r_plus = correlation.correlation_matrices(jnp.asarray(z0, jnp.float32), jnp.asarray(z1, jnp.float32))
  np.testing.assert_allclose(-2 * np.trace(r_plus) + np.sum(np.asarray(r_hat) ** 2),
                             np_spectral_pairwise(z0, z1), rtol=RTOL, atol=ATOL)
  # Entry-wise against sums over samples.
  np.testing.assert_allclose(r_plus, sum(np.outer(z0[b], z1[b]) + np.outer(z1[b], z0[b]) for b in range(7)) / 14,
                             rtol=RTOL, atol=ATOL)


def test_spectral_gradient_alignment_eq6():
  """FedSC paper Eq. (6) in the code scale: with alpha_j = q_j and r_global = R_{-j}, q_j x the local gradient
  equals the gradient of the SC loss of the union of the clients' batches (with respect to client j's z)."""
  rng = np.random.default_rng(7)
  sizes = [3, 5, 4]
  zs = [(randn(rng, b, 3), randn(rng, b, 3)) for b in sizes]
  q = np.array(sizes) / sum(sizes)
  r = [(a.T @ a + b.T @ b) / (2 * len(a)) for a, b in zs]
  cat = [jnp.asarray(np.concatenate([z[v] for z in zs]), jnp.float32) for v in (0, 1)]
  g0, g1 = jax.jit(jax.grad(losses.spectral_contrastive_loss, argnums=(0, 1)))(*cat)
  local_grad = jax.jit(jax.grad(
      lambda x0, x1, alpha, rg: losses.spectral_contrastive_loss(x0, x1, alpha=alpha, r_global=rg),
      argnums=(0, 1)))
  offset = 0
  for j, (a, b) in enumerate(zs):
    r_minus = sum(q[k] * r[k] for k in range(3) if k != j) / (1 - q[j])
    local = local_grad(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), jnp.float32(q[j]),
                       jnp.asarray(r_minus, jnp.float32))
    rows = slice(offset, offset + len(a))
    np.testing.assert_allclose(q[j] * np.asarray(local[0]), g0[rows], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(q[j] * np.asarray(local[1]), g1[rows], rtol=1e-4, atol=1e-6)
    offset += len(a)


@pytest.mark.parametrize('weights', [{}, dict(sim_coeff=1.0, std_coeff=3.0, cov_coeff=0.5)])
def test_vicreg_value_and_grad(weights):
  rng = np.random.default_rng(7)
  # Scales around 1 so that some dimensions' std is below 1 (the hinge active) and some above.
  args = [randn(rng, 6, 5) * np.linspace(0.3, 2.0, 5), randn(rng, 6, 5) * 0.8]
  names = {'sim_coeff': 'sim', 'std_coeff': 'std', 'cov_coeff': 'cov'}
  nkw = {names[k]: v for k, v in weights.items()}
  check_value_and_grads(lambda a, b: losses.vicreg(a, b, **weights),
                        lambda a, b: np_vicreg(a, b, **nkw), args, grad_args=(0, 1))


def test_vicreg_terms_by_hand():
  """Identical views: invariance 0. Rows ±1 in every dimension (B = 2): unbiased var 2, std
  sqrt(2 + 1e-4) > 1, so the hinge is 0; covariance of dims that move together is 2 each."""
  z = jnp.array([[1.0, 1.0], [-1.0, -1.0]])
  # covariance: C = [[2, 2], [2, 2]]: off-diagonal squares 2 * 4 = 8, / d = 4, two views -> 8.
  assert float(losses.vicreg(z, z)) == pytest.approx(8.0, rel=1e-6)
  # A constant dimension has std sqrt(1e-4) = 0.01: hinge 0.99, mean over 2 dims / 2 per view.
  c = jnp.array([[1.0, 0.0], [-1.0, 0.0]])
  assert float(losses.vicreg(c, c, cov_coeff=0.0)) == pytest.approx(25 * 2 * 0.99 / 2 / 2, rel=1e-5)
  with pytest.raises(ValueError, match='at least 2 rows'):
    losses.vicreg(z[:1], z[:1])


@pytest.mark.parametrize('lambd', [0.0051, 0.5])
def test_barlow_twins_value_and_grad(lambd):
  rng = np.random.default_rng(8)
  args = [randn(rng, 7, 4), randn(rng, 7, 4) + 0.5 * randn(rng, 7, 4)]
  check_value_and_grads(lambda a, b: losses.barlow_twins(a, b, off_diagonal_weight=lambd),
                        lambda a, b: np_barlow_twins(a, b, lambd), args, grad_args=(0, 1))


def test_barlow_twins_identical_decorrelated_views_are_0():
  """Two views equal, with dimensions standardised and uncorrelated over the batch: c = I (up to
  the 1e-5 of the BatchNorm), so the loss is ~0."""
  z = jnp.array([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])
  assert float(losses.barlow_twins(z, z)) == pytest.approx(2 * (1 - 1 / np.sqrt(1 + 1e-5) ** 2) ** 2,
                                                         abs=1e-9)


def test_ema_update_numbers():
  target = {'a': jnp.array([1.0, 2.0]), 'b': {'c': jnp.array(3.0)}}
  online = {'a': jnp.array([3.0, 4.0]), 'b': {'c': jnp.array(5.0)}}
  out = losses.ema_update(target, online, 0.99)
  np.testing.assert_allclose(out['a'], [1.02, 2.02], rtol=1e-6)
  np.testing.assert_allclose(out['b']['c'], 3.02, rtol=1e-6)
  np.testing.assert_allclose(losses.ema_update(target, online, 0.0)['a'], [3.0, 4.0])
  with pytest.raises(ValueError, match='tau'):
    losses.ema_update(target, online, 1.5)


def test_cross_entropy_value():
  rng = np.random.default_rng(8)
  logits, labels = randn(rng, 6, 4), rng.integers(0, 4, 6)
  ref = np.mean([np.log(np.sum(np.exp(l))) - l[y] for l, y in zip(logits, labels)])
  np.testing.assert_allclose(float(losses.cross_entropy_loss(jnp.asarray(logits, jnp.float32), labels)), ref,
                             rtol=RTOL)


def test_losses_jit_and_bad_inputs():
  rng = np.random.default_rng(9)
  z = jnp.asarray(randn(rng, 4, 3), jnp.float32)
  np.testing.assert_allclose(jax.jit(losses.nt_xent, static_argnums=3)(z, 2 * z, 0.2, True),
                             losses.nt_xent(z, 2 * z, 0.2, True), rtol=1e-6)
  with pytest.raises(ValueError, match='shapes'):
    losses.byol_loss(z, z, z, z[:3])
  with pytest.raises(ValueError, match='temperature'):
    losses.nt_xent(z, z, 0.0)
  with pytest.raises(ValueError, match='r_global'):
    losses.spectral_contrastive_loss(z, z, alpha=0.5, r_global=jnp.zeros((4, 4)))
  with pytest.raises(ValueError, match='mu'):
    losses.spectral_contrastive_loss(z, z, mu=-1.0)
  with pytest.raises(ValueError, match='labels'):
    losses.cross_entropy_loss(z, jnp.zeros((3,), jnp.int32))


def np_moco_infonce(q, k, queue, valid, temperature):
  """Per-query loops: -log softmax of [q̂·k̂, q̂·queue_j (valid j)] / T at the positive."""
  total = 0.0
  for qi, ki in zip(q, k):
    qn, kn = qi / np.linalg.norm(qi), ki / np.linalg.norm(ki)
    logits = [qn @ kn] + [qn @ queue[j] for j in range(len(queue)) if valid[j]]
    logits = np.asarray(logits) / temperature
    total += -(logits[0] - np.log(np.sum(np.exp(logits))))
  return total / len(q)


@pytest.mark.parametrize('count', [0, 3, 7])
def test_moco_infonce_value_grad_and_stop_gradient(count):
  rng = np.random.default_rng(11)
  queue = randn(rng, 7, 5)
  queue /= np.linalg.norm(queue, axis=1, keepdims=True)
  valid = np.arange(7) < count
  args = [randn(rng, 4, 5), randn(rng, 4, 5), queue]
  jfn = lambda q, k, qu: losses.moco_infonce(q, k, qu, jnp.asarray(valid), 0.2)
  nfn = lambda q, k, qu: np_moco_infonce(q, k, qu, valid, 0.2)
  check_value_and_grads(jfn, nfn, args, grad_args=(0,),
                        zero_grad_args=(1, 2) if count else ())
  if count == 0:  # no negatives: the positive alone, loss 0
    assert float(jfn(*[jnp.asarray(a, jnp.float32) for a in args])) == pytest.approx(0.0, abs=1e-6)


def test_moco_enqueue_is_a_ring_buffer():
  rng = np.random.default_rng(12)
  queue, ptr, count = jnp.zeros((5, 3)), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
  want = np.zeros((5, 3))
  slot, filled = 0, 0
  for n in (2, 2, 3):  # the third write wraps around: slots 4, 0, 1
    keys = randn(rng, n, 3)
    queue, ptr, count = losses.moco_enqueue(queue, ptr, count, jnp.asarray(keys, jnp.float32))
    for key in keys:
      want[slot] = key / np.linalg.norm(key)
      slot = (slot + 1) % 5
    filled = min(filled + n, 5)
    np.testing.assert_allclose(np.asarray(queue), want, rtol=1e-6, atol=1e-7)
    assert (int(ptr), int(count)) == (slot, filled)
  with pytest.raises(ValueError, match='a step enqueues 6 keys into a queue of 5'):
    losses.moco_enqueue(queue, ptr, count, jnp.zeros((6, 3)))


def np_swav_codes(scores, epsilon, iters):
  """The release's `distributed_sinkhorn` on one process, in float64 (without the max shift)."""
  q = np.exp(scores / epsilon).T
  q /= q.sum()
  k, b = q.shape
  for _ in range(iters):
    q /= q.sum(axis=1, keepdims=True)
    q /= k
    q /= q.sum(axis=0, keepdims=True)
    q /= b
  return (q * b).T


def np_swav(s_a, s_b, temperature, epsilon, iters):
  """The release's swapped-prediction loss over two crops, in float64 loops over the batch."""
  def log_softmax(row):
    m = row.max()
    return row - m - np.log(np.sum(np.exp(row - m)))
  total = 0.0
  for s_q, s_p in ((s_a, s_b), (s_b, s_a)):
    q = np_swav_codes(s_q, epsilon, iters)
    total -= np.mean([np.sum(q[i] * log_softmax(s_p[i] / temperature)) for i in range(len(q))])
  return total / 2


@pytest.mark.parametrize('b, k, iters', [(8, 5, 3), (32, 16, 1), (6, 30, 10)])
def test_swav_codes_and_loss_match_the_release_in_float64(b, k, iters):
  rng = np.random.default_rng(b + k)
  def scores():  # cosines, as the model gives: unit rows against unit prototypes
    z = rng.normal(size=(b, 12)); c = rng.normal(size=(k, 12))
    return (z / np.linalg.norm(z, axis=1, keepdims=True)) @ (c / np.linalg.norm(c, axis=1, keepdims=True)).T
  s_a, s_b = scores(), scores()
  with jax.enable_x64(True):
    codes = np.asarray(losses.swav_codes(jnp.asarray(s_a), epsilon=0.05, iters=iters))
    got = float(losses.swav(jnp.asarray(s_a), jnp.asarray(s_b), temperature=0.1, epsilon=0.05,
                            sinkhorn_iters=iters))
    grad = np.asarray(jax.grad(lambda s: losses.swav(s, jnp.asarray(s_b), sinkhorn_iters=iters))(
        jnp.asarray(s_a)))
  np.testing.assert_allclose(codes, np_swav_codes(s_a, 0.05, iters), rtol=1e-10)
  np.testing.assert_allclose(codes.sum(axis=1), 1.0, rtol=1e-12)  # each code a distribution
  assert got == pytest.approx(np_swav(s_a, s_b, 0.1, 0.05, iters), rel=1e-12)
  # The codes are constants: the gradient is central differences of the loss with them fixed.
  q_b = np_swav_codes(s_b, 0.05, iters)
  def fixed(s):
    z = s / 0.1
    logp = z - z.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    return -np.mean(np.sum(q_b * logp, axis=1)) / 2
  h = 1e-6
  num = np.zeros_like(s_a)
  for i in range(b):
    for j in range(k):
      e = np.zeros_like(s_a); e[i, j] = h
      num[i, j] = (fixed(s_a + e) - fixed(s_a - e)) / (2 * h)
  np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-9)


def test_swav_codes_in_float32_hold_the_extreme_cosines_at_the_release_epsilon():
  s = jnp.concatenate([jnp.ones((4, 3)), -jnp.ones((4, 3))])  # exp(+-1 / 0.05) = exp(+-20)
  codes = np.asarray(losses.swav_codes(s, epsilon=0.05))
  np.testing.assert_allclose(codes, np_swav_codes(np.asarray(s, np.float64), 0.05, 3), rtol=1e-5)
  with pytest.raises(ValueError, match='epsilon must be > 0'):
    losses.swav_codes(s, epsilon=0.0)
