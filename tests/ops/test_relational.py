"""ops/relational.py: FedX's relational loss against a float64 numpy loop over its definition,
its zero at equal temperatures and equal views, float32 with an underflowing target, and refused
shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.ops import relational


def np_relational_js(x1, x2, anchors, tau, tau_target):
  """The authors' js_loss written out in float64: cosine similarities to the anchors, the mean of
  the two views' sharp softmaxes as target, batch-mean KL(target || view softmax), averaged."""
  x1, x2, a = (np.asarray(v, np.float64) for v in (x1, x2, anchors))
  norm = lambda v: v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)

  def softmax(row, t):
    e = np.exp((row - row.max()) / t)
    return e / e.sum()
  s1, s2 = norm(x1) @ norm(a).T, norm(x2) @ norm(a).T
  total = 0.0
  for s in (s1, s2):
    kl = 0.0
    for i in range(s.shape[0]):
      m = (softmax(s1[i], tau_target) + softmax(s2[i], tau_target)) / 2
      q = softmax(s[i], tau)
      kl += sum(m[k] * (np.log(m[k]) - np.log(q[k])) for k in range(len(m)) if m[k] > 0)
    total += kl / s.shape[0]
  return total / 2


@pytest.mark.parametrize('b,k,d,tau,tt', [(5, 7, 4, 0.1, 0.01), (3, 3, 6, 0.5, 0.2),
                                          (1, 4, 3, 0.1, 0.1)])
def test_relational_js_matches_numpy_float64(b, k, d, tau, tt):
  rng = np.random.RandomState(b * 100 + k)
  x1, x2, a = rng.normal(size=(b, d)), rng.normal(size=(b, d)), rng.normal(size=(k, d))
  want = np_relational_js(x1, x2, a, tau, tt)
  with jax.enable_x64(True):
    got = relational.relational_js(jnp.asarray(x1), jnp.asarray(x2), jnp.asarray(a), tau, tt)
    assert got.dtype == jnp.float64
  assert float(got) == pytest.approx(want, rel=1e-12, abs=1e-13)
  got32 = jax.jit(relational.relational_js, static_argnums=(3, 4))(
      jnp.asarray(x1, jnp.float32), jnp.asarray(x2, jnp.float32), jnp.asarray(a, jnp.float32),
      tau, tt)
  assert float(got32) == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_equal_views_at_equal_temperatures_give_zero():
  x = np.random.RandomState(0).normal(size=(4, 5))
  a = np.random.RandomState(1).normal(size=(6, 5))
  assert float(relational.relational_js(x, x, a, 0.3, 0.3)) == pytest.approx(0.0, abs=1e-6)


def test_float32_gradient_is_finite_where_the_sharp_target_underflows():
  # Similarities spanning [-1, 1] at tau_target 0.01: exp(-200) underflows float32's softmax.
  rng = np.random.RandomState(2)
  x1, x2 = jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)
  a = jnp.concatenate([x1, -x1], axis=0)
  loss, grads = jax.value_and_grad(relational.relational_js, argnums=(0, 1, 2))(x1, x2, a, 0.1, 0.01)
  assert np.isfinite(float(loss)) and float(loss) >= -1e-6
  assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
  want = np_relational_js(x1, x2, a, 0.1, 0.01)
  assert float(loss) == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_bad_shapes_and_temperatures_are_refused():
  x = jnp.ones((2, 3))
  with pytest.raises(ValueError, match='anchors'):
    relational.relational_js(x, x, jnp.ones((4, 2)))
  with pytest.raises(ValueError, match='tau'):
    relational.relational_js(x, x, x, 0.0, 0.01)
