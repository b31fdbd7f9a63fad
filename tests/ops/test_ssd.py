"""SSD's primitives (fedjax_ssl/ops/ssd.py) against the spec's numpy float64 references
(/work/shared/specs/ssd.md §6, written from the official code, not from our JAX), its hand-checked
values and its invariants: alpha = 1 gives DSR = 0 with a zero gradient, an embedding inside or
orthogonal to the client's block costs nothing, the rotation identity, no gradient through the
target (jax.grad against the closed form), PD's direction, sign and shift invariance, the
scaling vectors' disjoint blocks, and hard separation (HSD) against projection references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.ops import ssd


# --- The spec's references (§6), float64 numpy. ---
def l2n(x, eps=1e-12):
  return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), eps)


def dsr_code(z, q, d):
  zh = l2n(z)
  t = l2n(((zh @ q) * d) @ q.T)
  return np.linalg.norm(zh - t) / zh.shape[0]


def dsr_hard_code(z, u):
  """HSD in the code's form, z [B, D]: the target is the normalised projection onto span(u),
  u [D, m] with orthonormal columns."""
  zh = l2n(z)
  t = l2n(zh @ u @ u.T)
  return np.linalg.norm(zh - t) / zh.shape[0]


def dsr_hard_paper(z, u):
  """HSD in the paper's form, z [B, D], u [D, m]: mean squared distance to the projection."""
  zh = l2n(z)
  return np.mean(np.sum((zh - zh @ u @ u.T) ** 2, 1))


def dsr_paper(z, d):
  zh = l2n(z)
  return np.mean(np.sum((zh - zh * d) ** 2, 1))


def lsm(x):
  m = x.max(1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(1, keepdims=True))


def pd_code(h, z, tau=0.5):
  lh, lz = lsm(h / tau), lsm(z / tau)
  return np.mean(np.sum(np.exp(lz) * (lz - lh), 1))


def _x64(fn, *args, **kw):
  with jax.enable_x64(True):
    return float(fn(*[jnp.asarray(a, jnp.float64) for a in args], **kw))


def _problem(seed, b=12, dim=10, k=3, alpha=10.0):
  rs = np.random.default_rng(seed)
  z = rs.normal(size=(b, dim))
  q = ssd.orthogonal_basis(rs, dim)
  d = ssd.scaling_vectors(rs, k, dim, alpha)
  return z, q, d


def test_hand_checked_values():
  z, eye, d = np.array([[0.6, 0.8, 0, 0]]), np.eye(4), np.array([10.0, 1, 1, 1])
  assert _x64(ssd.dsr_loss, z, eye, d) == pytest.approx(0.773993, abs=1e-6)
  assert _x64(ssd.dsr_loss, z, eye, d, form='paper') == pytest.approx(29.16, abs=1e-12)
  h, z0 = np.array([[2.0, 0, 0]]), np.zeros((1, 3))
  assert _x64(ssd.distillation_loss, h, z0) == pytest.approx(1.604031, abs=1e-6)
  # The paper's direction is the reversed KL: a test on this example catches a swapped direction.
  assert _x64(ssd.distillation_loss, h, z0, direction='paper') == pytest.approx(0.921289, abs=1e-6)


@pytest.mark.parametrize('seed', [0, 1])
def test_dsr_and_pd_match_the_numpy_references(seed):
  z, q, d = _problem(seed)
  h = np.random.default_rng(seed + 10).normal(size=z.shape) * 3
  for k in range(d.shape[0]):
    # float64 through two normalisations and two D x D products: ~1e2 x 1.1e-16.
    assert _x64(ssd.dsr_loss, z, q, d[k]) == pytest.approx(dsr_code(z, q, d[k]), rel=1e-12)
    assert _x64(ssd.dsr_loss, z, np.eye(10), d[k], form='paper') == pytest.approx(
        dsr_paper(z, d[k]), rel=1e-12)
  assert _x64(ssd.distillation_loss, h, z) == pytest.approx(pd_code(h, z), rel=1e-12)
  assert _x64(ssd.distillation_loss, h, z, 0.2, direction='paper') == pytest.approx(
      pd_code(z, h, 0.2), rel=1e-12)
  # float32: a few ulps of terms of size ~1 (the squared distance of unit rows, softmax sums).
  got = float(ssd.dsr_loss(jnp.asarray(z, jnp.float32), jnp.asarray(q, jnp.float32),
                           jnp.asarray(d[0], jnp.float32)))
  assert got == pytest.approx(dsr_code(z, q, d[0]), rel=1e-5)
  got = float(ssd.distillation_loss(jnp.asarray(h, jnp.float32), jnp.asarray(z, jnp.float32)))
  assert got == pytest.approx(pd_code(h, z), rel=1e-5, abs=1e-6)


def test_isotropic_embeddings_give_the_papers_dsr_magnitude():
  """The L_DSR curve of the paper's figure runs at ~0.065-0.073: the code form gives that on
  isotropic unit embeddings (B = 128, D = 512), the squared form ~10x more (spec §2.2)."""
  rs = np.random.default_rng(0)
  z = rs.normal(size=(128, 512))
  q = ssd.orthogonal_basis(rs, 512)
  for k, want in ((50, 0.069), (10, 0.081)):
    d = ssd.scaling_vectors(rs, k, 512, 10.0)[0]
    assert _x64(ssd.dsr_loss, z, q, d) == pytest.approx(want, abs=0.004)


def test_alpha_1_gives_zero_loss_and_zero_gradient_exactly():
  z, q, _ = _problem(2)
  ones = np.ones(10)
  for dtype in (jnp.float32, jnp.float64):
    with jax.enable_x64(dtype == jnp.float64):
      args = [jnp.asarray(a, dtype) for a in (z, q, ones)]
      for form in ssd.DSR_FORMS:
        loss, grad = jax.value_and_grad(lambda x: ssd.dsr_loss(x, *args[1:], form=form))(args[0])
        assert float(loss) == 0.0
        assert np.all(np.asarray(grad) == 0.0)


def test_embeddings_inside_or_orthogonal_to_the_block_cost_nothing():
  rs = np.random.default_rng(3)
  q = ssd.orthogonal_basis(rs, 8)
  d = np.ones(8)
  d[[1, 4, 6]] = 10.0
  inside = rs.normal(size=(5, 3)) @ q[:, [1, 4, 6]].T
  outside = rs.normal(size=(5, 5)) @ q[:, [0, 2, 3, 5, 7]].T
  for z in (inside, outside):
    assert _x64(ssd.dsr_loss, z, q, d) < 1e-14
  mixed = inside + outside
  assert _x64(ssd.dsr_loss, mixed, q, d) > 0.05


def test_rotation_identity():
  z, q, d = _problem(4)
  assert _x64(ssd.dsr_loss, z, q, d[1]) == pytest.approx(
      _x64(ssd.dsr_loss, z @ q, np.eye(10), d[1]), rel=1e-12)


def test_no_gradient_through_the_target_closed_form():
  """d/dz of ||ẑ - sg(T)||_F / B: g_ẑ = (ẑ - T) / (B ||ẑ - T||_F), pulled back through ẑ = z/||z||:
  g_z = (g_ẑ - (g_ẑ · ẑ) ẑ) / ||z||. A gradient through T would differ at O(1)."""
  z, q, d = _problem(5)
  zh = l2n(z)
  t = l2n(((zh @ q) * d[0]) @ q.T)
  g_hat = (zh - t) / (z.shape[0] * np.linalg.norm(zh - t))
  want = (g_hat - np.sum(g_hat * zh, 1, keepdims=True) * zh) / np.linalg.norm(z, axis=1,
                                                                              keepdims=True)
  with jax.enable_x64(True):
    got = jax.grad(lambda x: ssd.dsr_loss(x, jnp.asarray(q), jnp.asarray(d[0])))(jnp.asarray(z))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-14)


def test_dsr_descent_moves_unit_vectors_into_the_block():
  """Gradient steps on free embeddings under DSR alone raise their mass on the client's block
  (spec invariant 7)."""
  z, q, d = _problem(6)
  block = d[0] > 1
  mass = lambda x: float(np.mean(np.sum((l2n(np.asarray(x)) @ q)[:, block] ** 2, 1)))
  with jax.enable_x64(True):
    x = jnp.asarray(z)
    grad = jax.jit(jax.grad(lambda x: ssd.dsr_loss(x, jnp.asarray(q), jnp.asarray(d[0]))))
    start = mass(x)
    for _ in range(50):
      x = x - 0.5 * grad(x)
  assert mass(x) > start + 0.05


def test_pd_is_nonnegative_shift_invariant_and_reaches_both_networks():
  rs = np.random.default_rng(7)
  h, z = rs.normal(size=(6, 5)), rs.normal(size=(6, 5))
  assert _x64(ssd.distillation_loss, h, z) > 0
  assert _x64(ssd.distillation_loss, z + 3.0, z) < 1e-14   # softmax is shift invariant
  with jax.enable_x64(True):
    gh, gz = jax.grad(ssd.distillation_loss, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(z))
    assert np.abs(np.asarray(gh)).max() > 1e-3 and np.abs(np.asarray(gz)).max() > 1e-3
    gz = jax.grad(lambda a, b: ssd.distillation_loss(a, b, stop_gradient_z=True), argnums=1)(
        jnp.asarray(h), jnp.asarray(z))
    assert np.all(np.asarray(gz) == 0)


def test_scaling_vectors_are_disjoint_blocks_of_floor_d_over_k():
  rs = np.random.default_rng(8)
  for k, dim in ((10, 512), (50, 512), (3, 10)):
    d = ssd.scaling_vectors(rs, k, dim, 10.0)
    blocks = d > 1
    assert np.all(blocks.sum(1) == dim // k)
    assert blocks.sum(0).max() == 1                        # pairwise disjoint
    assert set(np.unique(d)) == {1.0, 10.0}
  q = ssd.orthogonal_basis(rs, 16)
  np.testing.assert_allclose(q @ q.T, np.eye(16), atol=1e-13)
  assert np.array_equal(ssd.orthogonal_basis(rs, 4, 'identity'), np.eye(4))


def test_hard_separation_targets_the_projection_onto_the_soft_block():
  """HSD's vectors: 1 on the block the same draws give SSD, 0 elsewhere; its DSR equals the
  projection references in both forms, is the alpha -> infinity limit of SSD's in the code's
  form, costs nothing inside the block, and keeps the target's direction for an embedding with
  little mass in the block (`dsr_target` forms z U Uᵀ as z minus the other directions)."""
  soft = ssd.scaling_vectors(np.random.default_rng(11), 3, 10, 10.0)
  hard = ssd.scaling_vectors(np.random.default_rng(11), 3, 10, 10.0, separation='hard')
  assert set(np.unique(hard)) == {0.0, 1.0}
  assert np.array_equal(hard == 1, soft > 1)
  z, q, _ = _problem(12)
  u = q[:, hard[1] == 1]
  assert _x64(ssd.dsr_loss, z, q, hard[1]) == pytest.approx(dsr_hard_code(z, u), rel=1e-12)
  assert _x64(ssd.dsr_loss, z, q, hard[1], form='paper') == pytest.approx(dsr_hard_paper(z, u),
                                                                          rel=1e-12)
  # Soft at alpha = 1e6: the normalised target differs from the projection's by O(1 / alpha).
  limit = ssd.scaling_vectors(np.random.default_rng(11), 3, 10, 1e6)
  assert _x64(ssd.dsr_loss, z, q, limit[1]) == pytest.approx(dsr_hard_code(z, u), rel=1e-5)
  rs = np.random.default_rng(13)
  inside = rs.normal(size=(5, u.shape[1])) @ u.T
  outside = rs.normal(size=(5, 10 - u.shape[1])) @ q[:, hard[1] == 0].T
  assert _x64(ssd.dsr_loss, inside, q, hard[1]) < 1e-14
  mostly_outside = outside + 1e-3 * inside
  # The target's direction carries ~1e-16 / 1e-3 of cancellation error.
  assert _x64(ssd.dsr_loss, mostly_outside, q, hard[1]) == pytest.approx(
      dsr_hard_code(mostly_outside, u), rel=1e-10)


def test_bad_inputs_are_refused_in_one_line():
  rs = np.random.default_rng(9)
  with pytest.raises(ValueError, match=r'11 clients with 0 dimensions each do not fit in D = 10'):
    ssd.scaling_vectors(rs, 11, 10, 10.0)
  with pytest.raises(ValueError, match=r'alpha must be > 0, got 0.0'):
    ssd.scaling_vectors(rs, 2, 10, 0.0)
  with pytest.raises(ValueError, match=r"separation = 'medium' is invalid: must be one of"):
    ssd.scaling_vectors(rs, 2, 10, 10.0, separation='medium')
  with pytest.raises(ValueError, match=r'tau must be > 0, got -1'):
    ssd.distillation_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), -1)
  with pytest.raises(ValueError, match=r"form = 'squared' is invalid"):
    ssd.dsr_loss(jnp.ones((2, 3)), jnp.eye(3), jnp.ones(3), form='squared')
  with pytest.raises(ValueError, match=r'd \(4,\) must be \[D\]'):
    ssd.dsr_loss(jnp.ones((2, 3)), jnp.eye(3), jnp.ones(4))
