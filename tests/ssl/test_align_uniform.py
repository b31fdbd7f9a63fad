"""Alignment + uniformity (`losses.align_uniform`, objective 'align_uniform'): against float64
numpy loops over the pairs (the SSD code's `align_loss` + `uniform_loss`: unique pairs, t = 2,
weight 1), the spec's hand value, gradients against central differences, and its config checks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import configuration, experiment, ssl
from fedjax_ssl import config_validation as cv
from fedjax_ssl.ssl import losses
from tests.algorithms import test_registry


def np_uniformity(z, t=2.0):
  a = z / np.linalg.norm(z, axis=1, keepdims=True)
  b = len(a)
  pairs = [np.exp(-t * np.sum((a[i] - a[j]) ** 2)) for i in range(b) for j in range(i + 1, b)]
  return np.log(np.mean(pairs))


def np_align_uniform(z1, z2, t=2.0, weight=1.0):
  n1 = z1 / np.linalg.norm(z1, axis=1, keepdims=True)
  n2 = z2 / np.linalg.norm(z2, axis=1, keepdims=True)
  align = np.mean([np.sum((n1[i] - n2[i]) ** 2) for i in range(len(n1))])
  return align + weight * (np_uniformity(z1, t) + np_uniformity(z2, t)) / 2


def test_hand_value_and_numpy_reference():
  with jax.enable_x64(True):
    assert float(losses.uniformity(jnp.asarray([[1.0, 0], [0, 1], [-1, 0]]))) == pytest.approx(
        -4.396349, abs=1e-6)
    rs = np.random.default_rng(0)
    z1, z2 = rs.normal(size=(7, 5)), rs.normal(size=(7, 5))
    for t, w in ((2.0, 1.0), (0.5, 3.0)):
      got = float(losses.align_uniform(jnp.asarray(z1), jnp.asarray(z2), t=t, uniform_weight=w))
      # float64 through the Gram form of the distances: cancellation of terms ~2, ~1e2 ulps.
      assert got == pytest.approx(np_align_uniform(z1, z2, t, w), rel=1e-12)
  got = float(losses.align_uniform(jnp.asarray(z1, jnp.float32), jnp.asarray(z2, jnp.float32)))
  # float32: the distances are differences of terms ~2 (a few ulps each) inside exp / log.
  assert got == pytest.approx(np_align_uniform(z1, z2), rel=1e-5)


def test_gradient_matches_central_differences():
  rs = np.random.default_rng(1)
  z1, z2 = rs.normal(size=(5, 4)), rs.normal(size=(5, 4))
  with jax.enable_x64(True):
    grad = np.asarray(jax.grad(losses.align_uniform)(jnp.asarray(z1), jnp.asarray(z2)))
  eps = 1e-6
  num = np.zeros_like(z1)
  for i in np.ndindex(z1.shape):
    up, down = z1.copy(), z1.copy()
    up[i] += eps
    down[i] -= eps
    num[i] = (np_align_uniform(up, z2) - np_align_uniform(down, z2)) / (2 * eps)
  # Central differences: O(eps²) truncation plus 1e-16 / eps rounding, ~1e-10.
  np.testing.assert_allclose(grad, num, rtol=1e-7, atol=1e-8)


def test_the_objective_and_its_checks():
  objective = ssl.get('align_uniform')
  assert objective.capabilities() == ('projector',)
  c = configuration.default_config()
  assert (c.align_uniform.t, c.align_uniform.uniform_weight) == (2.0, 1.0)
  config = test_registry._small_config('fedavg', ssl_method='align_uniform')
  config.align_uniform.t = 0.0
  with pytest.raises(cv.ConfigError, match=r'config.align_uniform.t = 0.0 is invalid: must be a '
                                           r'finite number > 0'):
    experiment.validate_config(config)
  config = test_registry._small_config('fedema', ssl_method='align_uniform')
  with pytest.raises(cv.ConfigError, match="it needs an objective with a predictor, which "
                                           "'align_uniform' has not"):
    experiment.validate_config(config)
  with pytest.raises(ValueError, match=r'uniformity needs z \[B, d\] with B >= 2'):
    losses.uniformity(jnp.ones((1, 3)))
