"""fedjax_ssl/models/repshare.py: LeNet-5, ResNet9 and ResNet-18 of representation sharing, their
parameter counts against the author's code and hand counts, and LeNet-5 against float64 numpy."""
import jax
import numpy as np
import pytest

from fedjax_ssl import models
from tests.models.references import (bn_count, conv_count, dense_count, np_conv, randn,
                                     random_variables, shape_params)


@pytest.mark.parametrize('name,expected_total,expected_phi', [
    ('lenet5', 30_986, 30_136),
    ('resnet9', 2_470_730, None),
    ('resnet18_repshare', 11_302_730, None),
])
def test_repshare_param_counts(name, expected_total, expected_phi):
  enc = models.get_encoder(name)
  variables = shape_params(models.Classifier(enc, 10), models.input_shape(name))
  assert models.count_params(variables['params']) == expected_total
  head = variables['params']['head']
  assert models.count_params(head) == dense_count(enc.feature_dim, 10)
  if expected_phi is not None:
    assert models.count_params(variables['params']['encoder']) == expected_phi


def test_repshare_hand_counts():
  # ResNet9 of representation sharing (arXiv:2211.10943), layers as in the author's code, which matches the
  # paper's "2,4M" (no conv bias, BN after every conv).
  def cbn(cin, cout):
    return conv_count(3, cin, cout) + bn_count(cout)
  resnet9 = (cbn(1, 64) + cbn(64, 128) + 2 * cbn(128, 128) + cbn(128, 256) + cbn(256, 256)
             + 2 * cbn(256, 256) + dense_count(256, 128) + dense_count(128, 10))
  assert resnet9 == 2_470_730
  lenet = (conv_count(5, 1, 6, True) + conv_count(5, 6, 16, True) + conv_count(3, 16, 120, True)
           + dense_count(120, 84) + dense_count(84, 10))
  assert lenet == 30_986


def test_lenet5_matches_numpy():
  enc = models.get_encoder('lenet5')
  x = randn(0, (2, 28, 28, 1))
  v = random_variables(enc, x, seed=1, train=False)
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), v['params'])

  def pool(a):
    b, h, w, c = a.shape
    return a[:, :h // 2 * 2, :w // 2 * 2].reshape(b, h // 2, 2, w // 2, 2, c).max((2, 4))

  conv = lambda a, q, pad: np.maximum(np_conv(a, q['kernel'], q['bias'], (1, 1), ((pad, pad),) * 2), 0)
  a = pool(conv(np.asarray(x, np.float64), p['conv1'], 2))
  a = pool(conv(a, p['conv2'], 2))
  a = conv(a, p['conv3'], 1).mean((1, 2))
  ref = np.tanh(a @ p['feature_layer']['kernel'] + p['feature_layer']['bias'])
  np.testing.assert_allclose(jax.jit(lambda v, x: enc.apply(v, x, train=False))(v, x), ref,
                             rtol=1e-4, atol=1e-5)
