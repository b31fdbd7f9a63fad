"""Simplex min-norm solvers (FedU2's aggregation weights) against independent numpy/scipy float64 references."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

from fedjax_ssl.ops import min_norm
from fedjax_ssl.ops.min_norm import project_simplex, simplex_min_norm

KS = (2, 3, 10, 50, 100)
KINDS = ('full', 'rank_deficient', 'origin_in_hull', 'vertex', 'interior')
OBJ_RTOL = 1e-6     # exact vs the reference, relative to f* ...
OBJ_ATOL = 1e-12    # ... plus this times mean(diag G) (f* = 0 when the origin is in the hull)
KKT_TOL = 1e-9      # Theorem 1 residuals, in units of mean(diag G)
ACTIVE = 1e-6       # p_k above this counts as an active client
F32_RTOL = 100 * float(np.finfo(np.float32).eps)   # float32 vs float64 objective (measured ≤ 2.2e-7)


# ----------------------------------------------------------------------------- numpy float64 references

def client_vectors(kind, k, seed):
  """Columns = the K clients' vectors, [d, K]; G = AᵀA."""
  rng = np.random.default_rng(seed)
  if kind == 'full':
    return rng.standard_normal((k + 5, k))
  if kind == 'rank_deficient':
    # rank ≤ K/4, with a shared offset so the hull misses the origin (f* > 0).
    r = max(k // 4, 1)
    return rng.standard_normal((r, k)) + 2 * rng.standard_normal((r, 1))
  if kind == 'origin_in_hull':
    # K zero-mean points in a space of dimension ≤ K/4: the origin is (almost surely, for K ≥ 10) inside.
    return rng.standard_normal((max(k // 4, 1), k))
  if kind == 'vertex':
    # Client j = unit vector v; all others are (1.5 + u) v + w with w ⟂ v, so G_jk > G_jj: optimum e_j.
    a = np.zeros((k + 5, k))
    a[0] = 1.5 + rng.random(k)
    a[1:] = rng.standard_normal((k + 4, k))
    j = rng.integers(k)
    a[:, j] = 0
    a[0, j] = 1
    return a
  if kind == 'interior':
    # Nearly orthogonal vectors of different norms: p ∝ ~1/‖x_k‖², every client active.
    return np.diag(0.5 + rng.random(k)) + 0.05 / np.sqrt(k) * rng.standard_normal((k, k))
  raise AssertionError(kind)


def gram(kind, k, seed):
  """G = AᵀA [K, K] of `client_vectors(kind, k, seed)`."""
  a = client_vectors(kind, k, seed)
  return a.T @ a


def sizes(kind, ks):
  """The K of `ks` a kind is used at: 'origin_in_hull' needs K ≥ 10 (see `client_vectors`)."""
  return [k for k in ks if not (kind == 'origin_in_hull' and k < 10)]


def reference_min_norm(a):
  """Exact min-norm weights by Lawson–Hanson NNLS (a finite active-set method, independent of ours).

  min_{w ≥ 0} ‖Aw‖² + (1ᵀw − 1)²: writing w = t·p with p on the simplex gives t²f(p) + (t − 1)², minimised
  at p = p*, t = 1/(1 + f*), so p* = w / Σw exactly (no penalty approximation).
  """
  k = a.shape[1]
  w, _ = scipy.optimize.nnls(np.vstack([a, np.ones((1, k))]), np.r_[np.zeros(a.shape[0]), 1.0],
                             maxiter=50 * k)
  return w / w.sum()


def kkt_residual(g, p):
  """Theorem 1 of FedU2 (the KKT conditions), in units of mean(diag G): with λ = pᵀGp, (Gp)_k = λ for the
  active clients and (Gp)_k ≥ λ for the others. Returns the largest violation."""
  grad = g @ p
  lam = p @ grad
  active = p > ACTIVE
  eq = np.max(np.abs(grad[active] - lam))
  ineq = np.max(lam - grad[~active], initial=0.0)
  return max(eq, ineq) / (np.trace(g) / len(g))


def duality_gap(g, p):
  """Certified bound on f(p) − f* for p on the simplex: f* ≥ f(p) + 2 min_k (Gp)_k − 2 pᵀGp (convexity)."""
  grad = g @ p
  return 2 * (p @ grad - grad.min())


def solve(g, method='exact', **kw):
  """simplex_min_norm in float64 on a numpy [K, K] -> numpy [K]."""
  with jax.enable_x64(True):
    return np.asarray(simplex_min_norm(jnp.asarray(g, jnp.float64), method, **kw))


def cases():
  return [(kind, k) for kind in KINDS for k in sizes(kind, KS)]


# ----------------------------------------------------------------------------- exact solver

@pytest.mark.parametrize('kind,k', cases())
def test_exact_matches_nnls_reference(kind, k):
  a = client_vectors(kind, k, seed=k)
  g = a.T @ a
  p = solve(g)
  ref = reference_min_norm(a)
  f, f_ref = p @ g @ p, ref @ g @ ref
  scale = np.trace(g) / k
  assert abs(f - f_ref) <= OBJ_RTOL * f_ref + OBJ_ATOL * scale, (f, f_ref)
  # Our own certificate, independent of the reference: f(p) − f* ≤ duality gap.
  assert duality_gap(g, p) <= OBJ_RTOL * f + OBJ_ATOL * scale
  if kind == 'vertex':
    np.testing.assert_allclose(p, ref, atol=1e-9)
    assert np.count_nonzero(p > ACTIVE) == 1
  if kind == 'interior':
    assert np.all(ref > ACTIVE) and np.all(p > ACTIVE)


def test_exact_matches_scipy_slsqp():
  """A second, generic reference (SLSQP) on small problems, where it converges to full precision."""
  for kind, k in [('full', 10), ('vertex', 10), ('rank_deficient', 10), ('interior', 3)]:
    g = gram(kind, k, seed=7)
    res = scipy.optimize.minimize(
        lambda p: p @ g @ p, np.full(k, 1 / k), jac=lambda p: 2 * g @ p, method='SLSQP',
        bounds=[(0, None)] * k, constraints=[{'type': 'eq', 'fun': lambda p: p.sum() - 1}],
        options={'ftol': 1e-14, 'maxiter': 500})
    p = solve(g)
    f_ref = res.x @ g @ res.x
    assert p @ g @ p <= f_ref * (1 + OBJ_RTOL) + OBJ_ATOL * np.trace(g) / k, kind
    assert abs(p @ g @ p - f_ref) <= 1e-6 * f_ref, kind


@pytest.mark.parametrize('kind', KINDS)
def test_theorem1_equal_directional_derivatives_of_active_clients(kind):
  for k in sizes(kind, (3, 50, 100)):
    g = gram(kind, k, seed=100 + k)
    assert kkt_residual(g, solve(g)) <= KKT_TOL, (kind, k)


def test_kkt_check_rejects_non_optimal_weights():
  g = gram('full', 10, seed=3)
  p = solve(g)
  assert kkt_residual(g, p) <= KKT_TOL
  moved = p.copy()
  i, j = np.argmax(p), np.argmin(p)
  moved[i] -= 0.01
  moved[j] += 0.01
  assert kkt_residual(g, moved) > 1e3 * KKT_TOL
  assert duality_gap(g, moved) > 1e3 * OBJ_RTOL * (moved @ g @ moved)


def test_project_simplex_matches_bisection_reference():
  project = jax.jit(project_simplex)
  rng = np.random.default_rng(0)
  for k in (1, 2, 7, 40):
    for scale in (0.1, 1.0, 10.0):
      v = scale * rng.standard_normal(k)
      # Reference: the projection is max(v − θ, 0) with θ the root of Σ max(v − θ, 0) = 1.
      theta = scipy.optimize.brentq(lambda t: np.maximum(v - t, 0).sum() - 1, v.min() - 1, v.max())
      with jax.enable_x64(True):
        p = np.asarray(project(jnp.asarray(v)))
      np.testing.assert_allclose(p, np.maximum(v - theta, 0), atol=1e-12)


# ----------------------------------------------------------------------------- ADMM variants

@pytest.mark.parametrize('kind', KINDS)
def test_admm_reaches_exact_optimum(kind):
  # Measured (5 kinds of G like these, K ∈ {50, 100}, 3 seeds; c = 10, ρ = 1): ≤ 300 iterations reach
  # 1e-5 relative, 500 (the default) ≤ 2e-6, 1000 ≤ 5e-9 (here: ≤ 1e-13). 1000 leaves a wide margin.
  for k in sizes(kind, (3, 10, 100)):
    g = gram(kind, k, seed=200 + k)
    p_exact, p_admm = solve(g), solve(g, 'admm', num_iters=1000, c=10.0, rho=1.0)
    f_exact, f_admm = p_exact @ g @ p_exact, p_admm @ g @ p_admm
    assert abs(f_admm - f_exact) <= 1e-5 * f_exact + OBJ_ATOL * np.trace(g) / k, (kind, k, f_admm, f_exact)


def test_admm_literal_is_a_clipped_ridge_solution():
  """The paper's printed update ends on max(0, (cG + ρI)⁻¹1) renormalised, or on uniform after a μ overshoot."""
  uniform = np.full(10, 0.1)
  # Interior optimum, large c: the ridge term vanishes and no clipping is needed, so it is near-exact
  # (measured: objective +1.5e-6 relative, weights 1.2e-3 apart in L1).
  g = gram('interior', 10, seed=0)
  p_exact = solve(g)
  p = solve(g, 'admm_literal', c=1e3)
  assert p @ g @ p <= (1 + 1e-5) * (p_exact @ g @ p_exact)
  assert np.abs(p - p_exact).sum() < 1e-2
  # Same G, c = 0.1: the ridge dominates and the μ iteration overshoots (gain ρ·1ᵀ(cG + ρI)⁻¹1 ≈ K),
  # ending near/at uniform (measured: exactly uniform — the last p was 0 — objective +58%).
  p = solve(g, 'admm_literal', c=0.1)
  assert np.abs(p - uniform).sum() < 0.1 * np.abs(p_exact - uniform).sum()
  assert p @ g @ p > 1.3 * (p_exact @ g @ p_exact)
  # Active nonnegativity constraints: clipping is not solving them, so even c = 1e3 is far from optimal
  # (measured: objective ×3.9), while the corrected ADMM is exact (at its default c).
  g = gram('full', 10, seed=0)
  p_exact = solve(g)
  assert np.count_nonzero(p_exact > ACTIVE) < 10
  p = solve(g, 'admm_literal', c=1e3)
  assert p @ g @ p > 2 * (p_exact @ g @ p_exact)
  p = solve(g, 'admm', num_iters=1000)
  assert p @ g @ p <= (1 + 1e-5) * (p_exact @ g @ p_exact)


# ----------------------------------------------------------------------------- all methods

@pytest.mark.parametrize('method', min_norm.METHODS)
def test_weights_are_a_distribution(method):
  grams = [np.zeros((4, 4)), np.zeros((1, 1)), np.array([[2.5]])]
  grams += [gram(kind, 10, seed=5) for kind in KINDS]
  for g in grams:
    p = solve(g, method)
    assert p.shape == (len(g),)
    assert np.all(p >= 0), (method, g.shape)
    assert abs(p.sum() - 1) <= 1e-6, (method, g.shape)
  # G = 0: every point is optimal; all methods keep the uniform weights they start from.
  np.testing.assert_allclose(solve(np.zeros((4, 4)), method), np.full(4, 0.25))
  np.testing.assert_allclose(solve(np.zeros((1, 1)), method), [1.0])


def test_float32_matches_float64_and_jits():
  g = gram('full', 50, seed=11)
  p64 = solve(g)
  p32 = simplex_min_norm(jnp.asarray(g, jnp.float32))
  assert p32.dtype == jnp.float32
  p32 = np.asarray(p32, np.float64)
  f32, f64 = p32 @ g @ p32, p64 @ g @ p64
  assert abs(f32 - f64) <= F32_RTOL * f64, (f32, f64)
  assert abs(p32.sum() - 1) <= 10 * np.finfo(np.float32).eps
  # c and ρ are traced, not static: one compiled program serves every value.
  fn = jax.jit(lambda gram, c: simplex_min_norm(gram, 'admm', c=c))
  for c in (10.0, 20.0):
    p = np.asarray(fn(jnp.asarray(g, jnp.float32), c), np.float64)
    assert abs(p @ g @ p - f64) <= F32_RTOL * f64, c
  # The G = 0 guards hold in float32 too.
  for method in min_norm.METHODS:
    np.testing.assert_array_equal(simplex_min_norm(jnp.zeros((3, 3), jnp.float32), method),
                                  np.full(3, 1 / 3, np.float32))


# ----------------------------------------------------------------------------- errors

def test_bad_method_raises():
  with pytest.raises(ValueError, match="'newton'.*exact.*admm.*admm_literal"):
    simplex_min_norm(jnp.eye(3), 'newton')


@pytest.mark.parametrize('shape', [(3,), (2, 3), (2, 2, 2)])
def test_bad_shape_raises(shape):
  with pytest.raises(ValueError, match=re.escape(str(shape))):
    simplex_min_norm(jnp.ones(shape))
