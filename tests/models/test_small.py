"""fedjax_ssl/models/small.py: the small encoders' parameter counts by hand and the cross-device
CNN's ReLU features."""
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl import models
from tests.models.references import conv_count, dense_count, shape_params


def test_small_encoder_param_counts():
  cases = {
      'small_cnn': (conv_count(3, 1, 16, True) + conv_count(3, 16, 32, True)
                    + dense_count(7 * 7 * 32, 256) + dense_count(256, 128)),
      'small_cnn_wide': (conv_count(3, 1, 32, True) + conv_count(3, 32, 64, True)
                         + dense_count(7 * 7 * 64, 256) + dense_count(256, 128)),
      'hetero_cnn': (conv_count(5, 3, 64, True) + conv_count(5, 64, 128, True)
                     + dense_count(5 * 5 * 128, 256) + dense_count(256, 128)),
      'mlp': dense_count(3072, 512) + dense_count(512, 256) + dense_count(256, 128),
      'cross_device_cnn': (conv_count(3, 3, 32, True) + conv_count(3, 32, 64, True)
                           + dense_count(8 * 8 * 64, 128)),
  }
  for name, expected in cases.items():
    params = shape_params(models.get_encoder(name), models.input_shape(name))['params']
    assert models.count_params(params) == expected, name
  # The cross-device benchmark's classifier: 545,098 parameters with its Dense(10).
  assert cases['cross_device_cnn'] + dense_count(128, 10) == 545_098


def test_cross_device_cnn_features_are_relu_outputs():
  enc = models.get_encoder('cross_device_cnn')
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 32, 32, 3))
  variables = enc.init(jax.random.PRNGKey(1), x, train=False)
  feats = enc.apply(variables, x, train=False)
  linear = models.get_encoder('cross_device_cnn', relu_features=False).apply(variables, x,
                                                                              train=False)
  np.testing.assert_array_equal(feats, jnp.maximum(linear, 0.0))
  assert feats.shape == (4, 128) and float(jnp.min(linear)) < 0.0
