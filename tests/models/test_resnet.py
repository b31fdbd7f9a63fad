"""fedjax_ssl/models/resnet.py: the CIFAR ResNets' parameter counts against hand counts and the
PyTorch codes', batch statistics updated only in training, and the residual blocks (the
representation-sharing block, a BasicBlock, included) against float64 numpy."""
import jax
import numpy as np
import pytest

from fedjax_ssl import models
from fedjax_ssl.models import repshare, resnet
from tests.models.references import (hand_cifar_resnet, np_conv, randn, random_variables,
                                     shape_params)


@pytest.mark.parametrize('name,stages,bottleneck,spec_count', [
    ('resnet18', (2, 2, 2, 2), False, 11_168_832),            # FedU2 code's CIFAR ResNet-18 without fc
    ('resnet34', (3, 4, 6, 3), False, 21_282_122 - 5_130),    # torch CIFAR ResNet34 with fc(512->10)
    ('resnet50', (3, 4, 6, 3), True, 23_520_842 - 20_490),    # torch CIFAR ResNet50 with fc(2048->10)
])
def test_cifar_resnet_param_counts(name, stages, bottleneck, spec_count):
  variables = shape_params(models.get_encoder(name), (32, 32, 3))
  n = models.count_params(variables['params'])
  assert n == hand_cifar_resnet(stages, bottleneck) == spec_count
  # Running statistics live in 'batch_stats' and are not parameters.
  assert 'batch_stats' in variables


def test_encoder_batch_stats_update_only_in_training():
  enc = resnet.CifarResNet(stage_sizes=(1, 1), widths=(8, 16))
  x = randn(0, (3, 8, 8, 3))
  v = random_variables(enc, x, seed=1, train=False)
  apply = jax.jit(lambda v, x, train: enc.apply(v, x, train=train, mutable=['batch_stats']),
                  static_argnums=2)
  _, eval_stats = apply(v, x, False)
  for s, t in zip(jax.tree_util.tree_leaves(eval_stats), jax.tree_util.tree_leaves(v['batch_stats'])):
    np.testing.assert_array_equal(s, t)
  _, train_stats = apply(v, x, True)
  stem = np_conv(x, v['params']['conv1']['kernel'], None, (1, 1), ((1, 1), (1, 1)))
  old, bn1 = v['batch_stats']['bn1'], train_stats['batch_stats']['bn1']
  np.testing.assert_allclose(bn1['mean'], 0.9 * old['mean'] + 0.1 * stem.mean((0, 1, 2)), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(bn1['var'], 0.9 * old['var'] + 0.1 * stem.var((0, 1, 2)), rtol=1e-4, atol=1e-6)
  changed = [not np.allclose(s, t) for s, t in zip(jax.tree_util.tree_leaves(train_stats),
                                                    jax.tree_util.tree_leaves(v['batch_stats']))]
  assert all(changed)


def _np_bn_eval(a, bn, stats):
  return (a - stats['mean']) / np.sqrt(stats['var'] + 1e-5) * bn['scale'] + bn['bias']


@pytest.mark.parametrize('kind', ['repshare', 'basic', 'bottleneck'])
def test_residual_blocks_match_numpy(kind):
  """Downsampling blocks in eval mode against float64 transcriptions of the reference layer orders."""
  x = randn(0, (2, 5, 5, 3))
  block = {'repshare': repshare.RepShareBlock(6, 2), 'basic': resnet.BasicBlock(6, 2),
           'bottleneck': resnet.Bottleneck(2, 2)}[kind]
  v = random_variables(block, x, seed=1, train=False)
  p, st = (jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), v[c]) for c in ('params', 'batch_stats'))
  xn = np.asarray(x, np.float64)

  def cbn(a, name, k, stride, bn_name):
    out = np_conv(a, p[name]['kernel'], None, (stride, stride), ((k // 2, k // 2),) * 2)
    return _np_bn_eval(out, p[bn_name], st[bn_name])

  relu = lambda a: np.maximum(a, 0)
  shortcut = cbn(xn, 'shortcut_conv', 1, 2, 'shortcut_bn')
  if kind == 'repshare':  # relu(BN2(conv2(relu(BN1(conv1 x))))) + shortcut, no ReLU after the add
    ref = relu(cbn(relu(cbn(xn, 'conv1', 3, 2, 'bn1')), 'conv2', 3, 1, 'bn2')) + shortcut
  elif kind == 'basic':
    ref = relu(cbn(relu(cbn(xn, 'conv1', 3, 2, 'bn1')), 'conv2', 3, 1, 'bn2') + shortcut)
  else:
    out = relu(cbn(relu(cbn(xn, 'conv1', 1, 1, 'bn1')), 'conv2', 3, 2, 'bn2'))
    ref = relu(cbn(out, 'conv3', 1, 1, 'bn3') + shortcut)
  y = jax.jit(lambda v, x: block.apply(v, x, train=False))(v, x)
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
