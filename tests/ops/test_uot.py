"""ops/uot.py: the quadratic-penalty UOT solver against POT, the zero-plan analysis, FUR's gradient
(envelope theorem) and its effect, the code's tangent-space SWD against a numpy loop; and
eval/geometry.py against numpy float64."""
import jax
import jax.numpy as jnp
import numpy as np
import ot
import pytest

from fedjax_ssl.eval import geometry
from fedjax_ssl.ops import uot
from fedjax_ssl.ssl.losses import l2_normalize


def _sphere(rng, n, d):
  x = rng.normal(size=(n, d))
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def _np_objective(plan, cost, a, b, ta, tb):
  return ((cost * plan).sum() + ta / 2 * ((plan.sum(1) - a) ** 2).sum()
          + tb / 2 * ((plan.sum(0) - b) ** 2).sum())


@pytest.mark.parametrize('n,m,tau,mass,cost_kind', [
    (6, 6, 0.8, 1.0, 'l2'), (12, 12, 0.8, 1.0, 'l2'), (9, 5, 2.0, 1.0, 'sq'),
    (8, 8, 0.8, 0.5, 'l2'), (10, 7, 5.0, 0.3, 'sq')])
def test_solve_l2_uot_matches_pot_and_satisfies_kkt(n, m, tau, mass, cost_kind):
  rng = np.random.default_rng(n * 100 + m)
  z, s = _sphere(rng, n, 4), _sphere(rng, m, 4)
  sq = ((z[:, None] - s[None]) ** 2).sum(-1)
  cost = np.sqrt(sq) if cost_kind == 'l2' else sq
  a, b = np.full(n, mass), np.full(m, mass) * rng.uniform(0.5, 1.5, m)
  # POT's majorisation-minimisation solver of the same objective ('l2' = half-squared l2).
  ref = ot.unbalanced.mm_unbalanced(a, b, cost, (tau, tau), div='l2', numItermax=200_000,
                                    stopThr=1e-15)
  with jax.enable_x64(True):
    plan, info = uot.solve_l2_uot(jnp.asarray(cost), jnp.asarray(a), jnp.asarray(b), tau, tau,
                                  num_iters=3000)
    plan = np.asarray(plan)
    assert plan.dtype == np.float64
  obj_ref = _np_objective(ref, cost, a, b, tau, tau)
  assert plan.min() >= 0.0
  assert float(info['objective']) == pytest.approx(_np_objective(plan, cost, a, b, tau, tau),
                                                   rel=1e-12)
  assert float(info['objective']) <= obj_ref + 1e-9 * abs(obj_ref)
  assert float(info['objective']) == pytest.approx(obj_ref, rel=1e-9, abs=1e-12)
  assert float(info['kkt_residual']) < 1e-9
  assert float(info['mass']) == pytest.approx(plan.sum(), rel=1e-12)
  # The objective is strictly convex in the marginals only, so compare plans through them.
  np.testing.assert_allclose(plan.sum(1), ref.sum(1), atol=1e-6)
  np.testing.assert_allclose(plan.sum(0), ref.sum(0), atol=1e-6)


def test_kkt_residual_detects_a_non_optimal_plan():
  rng = np.random.default_rng(0)
  cost = np.sqrt(((_sphere(rng, 6, 4)[:, None] - _sphere(rng, 6, 4)[None]) ** 2).sum(-1))
  ones = np.ones(6)
  with jax.enable_x64(True):
    plan, _ = uot.solve_l2_uot(jnp.asarray(cost), jnp.asarray(ones), jnp.asarray(ones), 0.8, 0.8,
                               3000)
    bumped = plan.at[0, 0].add(0.05)
    assert float(uot.kkt_residual(bumped, cost, ones, ones, 0.8, 0.8)) > 1e-3
    assert float(uot.uot_objective(bumped, cost, ones, ones, 0.8, 0.8)) > float(
        uot.uot_objective(plan, cost, ones, ones, 0.8, 0.8))


def test_plan_is_exactly_zero_with_probability_marginals_and_active_with_unit_mass():
  """d = 512, B = 128, tau = 0.8 (the paper's setting): with a = b = 1/B every cost exceeds
  tau_a a_i + tau_b b_j = 1.6 / B, so pi* = 0 and FUR has no gradient; with unit mass the
  non-squared cost (min ~1.3 < 1.6) is active and the squared one (min ~1.7 > 1.6) is not."""
  key = jax.random.PRNGKey(0)
  z = jax.random.normal(key, (128, 512))
  zn, s = l2_normalize(z), uot.sphere_prior(jax.random.PRNGKey(1), (128, 512))
  c_l2, c_sq = uot.transport_cost(zn, s, 'l2'), uot.transport_cost(zn, s, 'sq')
  assert float(c_l2.min()) < 1.6 < float(c_sq.min())
  for cost in uot.COSTS:
    loss, info = uot.fur_uot_loss(z, jax.random.PRNGKey(1), mass=1 / 128, cost=cost)
    assert float(info['mass']) == 0.0 and float(info['active']) == 0.0
    grad = jax.grad(lambda z: uot.fur_uot_loss(z, jax.random.PRNGKey(1), mass=1 / 128,
                                               cost=cost)[0])(z)
    assert float(jnp.max(jnp.abs(grad))) == 0.0
    # Constant = Omega = (tau_a |a|^2 + tau_b |b|^2) / 2 = 0.8 / B.
    assert float(loss) == pytest.approx(0.8 / 128, rel=1e-6)
  _, info = uot.fur_uot_loss(z, jax.random.PRNGKey(1), mass=1.0, cost='sq')
  assert float(info['mass']) == 0.0
  _, info = uot.fur_uot_loss(z, jax.random.PRNGKey(1), mass=1.0, cost='l2')
  assert 5.0 < float(info['mass']) < 60.0 and 0.01 < float(info['active']) < 0.5


def test_fur_gradient_is_the_derivative_of_the_optimal_value():
  """Envelope theorem: with the plan held constant, grad_z L_u equals the derivative of the
  optimal UOT value as a function of z (checked by central differences of re-solved problems)."""
  rng = np.random.default_rng(3)
  z0 = rng.normal(size=(5, 3))
  key = jax.random.PRNGKey(7)
  with jax.enable_x64(True):
    f = lambda z: uot.fur_uot_loss(z, key, num_iters=4000)[0]
    grad = np.asarray(jax.grad(f)(jnp.asarray(z0)))
    eps = 1e-6
    fd = np.zeros_like(z0)
    for i in range(z0.shape[0]):
      for j in range(z0.shape[1]):
        e = np.zeros_like(z0)
        e[i, j] = eps
        fd[i, j] = (float(f(jnp.asarray(z0 + e))) - float(f(jnp.asarray(z0 - e)))) / (2 * eps)
  assert np.abs(grad).max() > 1e-2
  np.testing.assert_allclose(grad, fd, atol=1e-6)


def test_fur_steps_spread_a_collapsed_batch():
  """Gradient steps on FUR alone (fresh prior every step) lower the Wang-Isola uniformity of a
  collapsed batch; the inactive probability-marginal variant leaves it unchanged."""
  key = jax.random.PRNGKey(0)
  z0 = l2_normalize(jnp.ones((32, 16)) + 0.01 * jax.random.normal(key, (32, 16)))

  def run(mass):
    g = jax.jit(jax.grad(lambda z, k: uot.fur_uot_loss(z, k, mass=mass)[0]))
    z = z0
    for t in range(50):
      z = z - 0.5 * g(z, jax.random.fold_in(key, t))
    return float(geometry.uniformity(l2_normalize(z)))

  u0 = float(geometry.uniformity(z0))
  assert u0 > -0.01
  assert run(1.0) < -2.0          # measured -3.33
  assert run(1 / 32) == pytest.approx(u0, abs=1e-6)


def _np_logmap(x, y):
  u = y - x
  u = u - (u @ x)[:, None] * x
  dist = np.arccos(np.clip(y @ x, -1 + 1e-7, 1 - 1e-7))
  return u * (dist / np.sqrt((u * u).sum(1) + 1e-12))[:, None]


def test_tangent_swd_matches_a_numpy_loop():
  rng = np.random.default_rng(0)
  z = rng.normal(size=(7, 5))
  key = jax.random.PRNGKey(4)
  with jax.enable_x64(True):
    got = float(uot.tangent_swd_loss(jnp.asarray(z), key, num_projections=3, normalize=True))
    kx, ks, kt = jax.random.split(key, 3)
    base = np.asarray(uot.sphere_prior(kx, (7, 5), jnp.float64))
    prior = np.asarray(uot.sphere_prior(ks, (7, 5), jnp.float64))
    theta = np.asarray(jax.random.normal(kt, (5, 3), jnp.float64))
  zn = z / np.linalg.norm(z, axis=1, keepdims=True)
  total = 0.0
  for x in base:
    for l in range(3):
      u = np.sort(_np_logmap(x, prior) @ theta[:, l])
      v = np.sort(_np_logmap(x, zn) @ theta[:, l])
      total += ((u - v) ** 2).mean() / 3
  assert got == pytest.approx(total / 3, rel=1e-10)


def test_solver_rejects_mismatched_shapes():
  with pytest.raises(ValueError, match=r'cost \(3, 4\), a \(4,\)'):
    uot.solve_l2_uot(jnp.zeros((3, 4)), jnp.ones(4), jnp.ones(4), 0.8, 0.8, 10)
  with pytest.raises(ValueError, match="fedu2.cost = 'cosine'"):
    uot.transport_cost(jnp.zeros((3, 4)), jnp.zeros((3, 4)), 'cosine')


def test_geometry_metrics_match_numpy_float64():
  rng = np.random.default_rng(1)
  z1, z2 = _sphere(rng, 20, 6), _sphere(rng, 20, 6)
  h = rng.normal(size=(50, 8)) @ np.diag([3, 2, 1, 0.5, 0.1, 0, 0, 0])
  with jax.enable_x64(True):
    assert float(geometry.alignment(jnp.asarray(z1), jnp.asarray(z2))) == pytest.approx(
        ((z1 - z2) ** 2).sum(1).mean(), rel=1e-12)
    sq = ((z1[:, None] - z1[None]) ** 2).sum(-1)
    iu = np.triu_indices(20, 1)
    assert float(geometry.uniformity(jnp.asarray(z1))) == pytest.approx(
        np.log(np.exp(-2 * sq[iu]).mean()), rel=1e-10)
    spec = np.asarray(geometry.covariance_spectrum(jnp.asarray(h)))
    ref = np.linalg.svd(np.cov(h.T, bias=True), compute_uv=False)
    np.testing.assert_allclose(spec, ref, atol=1e-10)
    p = ref / ref.sum()
    p = p[p > 1e-15]
    assert float(geometry.effective_rank(jnp.asarray(h))) == pytest.approx(
        np.exp(-(p * np.log(p)).sum()), rel=1e-6)
