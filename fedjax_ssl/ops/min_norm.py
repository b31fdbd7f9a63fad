"""Min-norm point of the convex hull of client vectors (MGDA weights, FedU2's aggregation).

FedU2 (Liao et al., CVPR 2024, Eq. 10) weights the clients by the solution of

    min_p  pᵀ G p   s.t.  p ≥ 0,  Σ_k p_k = 1,

where G [K, K] is the (PSD) Gram matrix of the K clients' vectors. At the optimum every client with
p_k > 0 has the same directional derivative (G p)_k = pᵀGp and no client has a smaller one (the paper's
Theorem 1, i.e. the KKT conditions). Three solvers, all jittable and dtype-generic (float32, or float64
under x64):

  'exact'        accelerated projected gradient; the reference solution.
  'admm'         ADMM for the paper's Eq. (11) with the simplex split into an affine block and a
                 nonnegative block; converges to the same optimum.
  'admm_literal' the update exactly as printed in the paper (Eq. 12); NOT the min-norm solution in
                 general (see `_admm_literal`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

METHODS = ('exact', 'admm', 'admm_literal')
DEFAULT_ITERS = {'exact': 2000, 'admm': 500, 'admm_literal': 500}


def project_simplex(v: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Euclidean projection onto the probability simplex (sort-based; Held et al. 1974, Duchi et al. 2008).

  Args:
    v: float [K].
    mask: optional bool [K] (at least one True): project onto the face of the simplex over the
      True coordinates; the others are 0.
  Returns:
    float [K], the point of {p ≥ 0, Σ p = 1} (p = 0 off the mask) closest to v.
  """
  if mask is not None:
    # Off-mask coordinates sort last and never enter the kept prefix (v - theta stays < 0 there).
    low = jnp.asarray(jnp.finfo(v.dtype).min / (4 * v.shape[0]), v.dtype)
    return jnp.where(mask, project_simplex(jnp.where(mask, v, low)), 0)
  u = jnp.sort(v)[::-1]
  css = jnp.cumsum(u)
  j = jnp.arange(1, v.shape[0] + 1, dtype=v.dtype)
  # The kept coordinates are a prefix of the sorted order; j = 1 always qualifies, so rho ≥ 1.
  rho = jnp.max(jnp.where(u - (css - 1) / j > 0, jnp.arange(1, v.shape[0] + 1), 0))
  theta = (css[rho - 1] - 1) / rho.astype(v.dtype)
  return jnp.maximum(v - theta, 0)


def _restrict(gram: jax.Array, mask: jax.Array | None):
  """(gram with the rows and columns off `mask` zeroed, the mask as 0/1 floats [K] (all ones when
  None), the number of coordinates on it)."""
  k = gram.shape[0]
  if mask is None:
    return gram, jnp.ones((k,), gram.dtype), k
  a = mask.astype(gram.dtype)
  return gram * a[:, None] * a[None, :], a, jnp.sum(a)


def _normalize(gram: jax.Array, count=None) -> jax.Array:
  """G / mean(diag G) [K, K]: clients' vectors rescaled to unit mean squared norm.

  The minimiser is scale-invariant, so this only fixes the units in which 'admm''s c/ρ act (their
  convergence speed then does not depend on the vectors' norms, nor much on K, as it would with a
  trace normalisation). G = 0 is returned unchanged.
  """
  m = jnp.trace(gram) / (gram.shape[0] if count is None else count)
  return gram / jnp.where(m > 0, m, 1)


def _lambda_max_bound(g: jax.Array, squarings: int = 6) -> jax.Array:
  """Upper bound on λ_max of a PSD g [K, K] -> scalar: trace(g^m)^(1/m) with m = 2^squarings.

  Unlike a power-iteration estimate (a lower bound, unsafe as FISTA's 1/L) this is guaranteed ≥ λ_max,
  yet overestimates by at most K^(1/m) (≤ 1.1 for K ≤ 400) instead of the factor up to K of trace(g),
  which would slow FISTA by up to √K. g^m is formed by repeated squaring, rescaled to unit trace at each
  step so it neither overflows nor underflows: trace(g^m)^(1/m) = Π_j trace(B_j²)^(1/2^(j+1)).
  """
  def body(_, carry):
    b, log_bound, w = carry
    b2 = b @ b
    t = jnp.trace(b2)
    safe_t = jnp.where(t > 0, t, 1)
    return b2 / safe_t, log_bound + w * jnp.log(safe_t), w / 2

  tr = jnp.trace(g)
  safe_tr = jnp.where(tr > 0, tr, 1)
  _, log_bound, _ = jax.lax.fori_loop(0, squarings, body,
                                      (g / safe_tr, jnp.zeros((), g.dtype), jnp.asarray(0.5, g.dtype)))
  return tr * jnp.exp(log_bound)


def _exact(gram: jax.Array, num_iters: int, mask: jax.Array | None = None) -> jax.Array:
  """FISTA on ½ pᵀĜp over the simplex with adaptive (gradient-scheme) restarts, from uniform weights.

  Restarting (O'Donoghue & Candès 2015) recovers linear convergence on this QP, which plain FISTA's
  O(1/k²) momentum oscillations would otherwise hide.

  Args:
    gram: float [K, K], PSD.
    num_iters: number of iterations.
    mask: optional bool [K], the coordinates allowed to be nonzero (`simplex_min_norm`).
  Returns:
    float [K] on the simplex.
  """
  gram, a, count = _restrict(gram, mask)
  g = _normalize(gram, None if mask is None else count)
  lip = _lambda_max_bound(g)
  # Ĝ = 0 (bound 0): any step works, the gradient vanishes.
  step = 1 / jnp.where(lip > 0, lip, 1)
  k = gram.shape[0]
  x0 = jnp.full((k,), 1 / k, gram.dtype) if mask is None else a / count

  def body(_, carry):
    x, y, t = carry
    x_new = project_simplex(y - step * (g @ y), mask)
    # Restart the momentum when it points against the (generalised) gradient step just taken.
    restart = jnp.dot(y - x_new, x_new - x) > 0
    t_new = (1 + jnp.sqrt(1 + 4 * t * t)) / 2
    y_new = x_new + ((t - 1) / t_new) * (x_new - x)
    return (x_new, jnp.where(restart, x_new, y_new), jnp.where(restart, jnp.ones_like(t), t_new))

  x, _, _ = jax.lax.fori_loop(0, num_iters, body, (x0, x0, jnp.ones((), gram.dtype)))
  return x


def _renormalize(p: jax.Array, uniform=None) -> jax.Array:
  """p / Σp for p ≥ 0 [K]; `uniform` (default 1/K everywhere) when every entry is zero."""
  s = jnp.sum(p)
  return jnp.where(s > 0, p / jnp.where(s > 0, s, 1), 1 / p.shape[0] if uniform is None else uniform)


def _admm(gram: jax.Array, num_iters: int, c: jax.Array, rho: jax.Array,
          mask: jax.Array | None = None) -> jax.Array:
  """ADMM for min (c/2) pᵀĜp over the simplex, split as p ∈ {1ᵀp = 1}, q ≥ 0, p = q (scaled dual u).

    p ← argmin_{1ᵀp=1} (c/2) pᵀĜp + (ρ/2)‖p − q + u‖²,   q ← max(0, p + u),   u ← u + p − q.

  This is the standard two-block ADMM for the paper's Eq. (11) with the simplex split into an affine block
  and a nonnegative block. The paper's printed update (`_admm_literal`) instead handles p ≥ 0 by clipping
  after the solve, which moves its fixed point away from the optimum. Here both constraints are exact
  blocks, so the iterates converge to the min-norm solution for any c, ρ > 0; c/ρ only sets the speed
  (measured, K ≤ 100: c = 10, ρ = 1 reaches 1e-5 relative objective within 300 iterations, 2e-6 at the
  default 500; c = 1e3 can need well over 1000).

  Args:
    gram: float [K, K], PSD (divided by its mean diagonal first, so c/ρ are in those units).
    num_iters: number of iterations, from q = uniform, u = 0.
    c, rho: positive scalars.
    mask: optional bool [K]: the affine block becomes aᵀp = 1 with a the 0/1 mask and Ĝ's rows and
      columns off it are zero, so an off-mask coordinate starts at 0 and stays there (its p-step
      returns q - u = 0).
  Returns:
    float [K] on the simplex: q, renormalised since Σq = 1 holds only in the limit.
  """
  gram, a, count = _restrict(gram, mask)
  g = _normalize(gram, None if mask is None else count)
  k = gram.shape[0]
  # The p-step's KKT system (cĜ + ρI) p + ν1 = ρ(q − u), 1ᵀp = 1 has a fixed matrix: invert H = cĜ + ρI
  # (SPD, eigenvalues ≥ ρ) once, then each step is p = ρH⁻¹v − ν z with z = H⁻¹1 and ν fixed by 1ᵀp = 1.
  h_inv = jnp.linalg.inv(c * g + rho * jnp.eye(k, dtype=gram.dtype))
  z = h_inv @ a
  z_sum = jnp.sum(z)

  def body(_, carry):
    q, u = carry
    w = rho * (h_inv @ (q - u))
    p = w - ((jnp.sum(w) - 1) / z_sum) * z
    q_new = jnp.maximum(p + u, 0)
    return q_new, u + p - q_new

  q0 = jnp.full((k,), 1 / k, gram.dtype) if mask is None else a / count
  q, _ = jax.lax.fori_loop(0, num_iters, body, (q0, jnp.zeros_like(q0)))
  return _renormalize(q, None if mask is None else a / count)


def _admm_literal(gram: jax.Array, num_iters: int, c: jax.Array, rho: jax.Array,
                  mask: jax.Array | None = None) -> jax.Array:
  """The paper's Eq. (12) as printed: p ← max(0, (cG + ρI)⁻¹(ρ − μ)1), μ ← μ + ρ(1ᵀp − 1), from μ = 0.

  (The exact minimiser of the paper's augmented Lagrangian over p would solve (cG + ρ11ᵀ)p = (ρ − μ)1;
  the printed ρI is kept.) Not the min-norm solution: (cG + ρI)⁻¹1 is the minimiser of the
  *ridge-regularised* (c/2)pᵀGp + (ρ/2)‖p‖² under 1ᵀp = 1 only, and μ merely rescales it, so the fixed
  point is max(0, (cG + ρI)⁻¹1) renormalised — clipping rather than solving the nonnegativity. For small
  c·‖G‖/ρ it collapses toward uniform weights; and since 1ᵀp responds to μ with gain ρ·1ᵀ(cG + ρI)⁻¹1
  (up to K), the μ iteration can oscillate, ending on p = 0 (then uniform). G is used unnormalised, as
  printed, so the result depends on G's scale. Kept to reproduce the paper's update, not as a solver.

  Args:
    gram: float [K, K], PSD.
    num_iters: number of iterations.
    c, rho: positive scalars.
    mask: optional bool [K]: the printed update on the masked coordinates only (the solve with
      the mask as right-hand side and G's off-mask rows and columns zeroed gives them z = 0).
  Returns:
    float [K] on the simplex: the last p renormalised (uniform if it is all zero).
  """
  gram, a, count = _restrict(gram, mask)
  k = gram.shape[0]
  z = jnp.linalg.solve(c * gram + rho * jnp.eye(k, dtype=gram.dtype), a)

  def body(_, carry):
    _, mu = carry
    p = jnp.maximum((rho - mu) * z, 0)
    return p, mu + rho * (jnp.sum(p) - 1)

  p, _ = jax.lax.fori_loop(0, num_iters, body, (jnp.zeros((k,), gram.dtype), jnp.zeros((), gram.dtype)))
  return _renormalize(p, None if mask is None else a / count)


@functools.partial(jax.jit, static_argnames=('method', 'num_iters'))
def simplex_min_norm(gram: jax.Array, method: str = 'exact', *, num_iters: int | None = None,
                     c: float = 10.0, rho: float = 1.0, mask: jax.Array | None = None
                     ) -> jax.Array:
  """Weights of the min-norm point of the convex hull: argmin_{p ≥ 0, Σp = 1} pᵀGp.

  Args:
    gram: float [K, K] PSD Gram matrix (float32, or float64 under x64); K ≥ 1.
    method: 'exact' | 'admm' | 'admm_literal' (module docstring). Static.
    num_iters: iterations; None for DEFAULT_ITERS[method]. Static.
    c, rho: the ADMM's objective scale (paper: c = η_g²/φ) and penalty; unused by 'exact'.
    mask: optional bool [K] with at least one True: solve over the clients on the mask only (the
      others get weight 0), as if the off-mask rows and columns of G were not there (FedU2's
      aggregate without its absent participants, core/faults.py). None: every client.
  Returns:
    float [K] (gram's dtype), ≥ 0 and summing to 1.
  Raises:
    ValueError: unknown method, or gram not a square matrix (at trace time).
  """
  if method not in METHODS:
    raise ValueError(f'simplex_min_norm: unknown method {method!r}; expected one of {METHODS}')
  if gram.ndim != 2 or gram.shape[0] != gram.shape[1]:
    raise ValueError(f'simplex_min_norm: gram must be a square [K, K] matrix, got shape {gram.shape}')
  iters = DEFAULT_ITERS[method] if num_iters is None else num_iters
  if method == 'exact':
    return _exact(gram, iters, mask)
  c = jnp.asarray(c, gram.dtype)
  rho = jnp.asarray(rho, gram.dtype)
  if method == 'admm':
    return _admm(gram, iters, c, rho, mask)
  return _admm_literal(gram, iters, c, rho, mask)
