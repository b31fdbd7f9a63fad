"""fedjax_ssl/models/fixup.py: the Fixup ResNet-20's parameter count, its initialisation (identity
blocks, scaled first convolutions) and a block with non-zero parameters against float64 numpy."""
import jax
import numpy as np
import pytest

from fedjax_ssl import models
from fedjax_ssl.models import fixup
from tests.models.references import (conv_count, fast_key, np_conv, randn, random_variables,
                                     shape_params)


def test_fixup_param_counts():
  params = shape_params(models.get_encoder('fixup_resnet20'), (32, 32, 3))['params']
  leaves = jax.tree_util.tree_leaves(params)
  n_conv = sum(int(np.prod(l.shape)) for l in leaves if len(l.shape) == 4)
  n_scalar = sum(1 for l in leaves if len(l.shape) == 0)
  # Hand count: stem 3->128, stages 128/256/512 x 3 blocks of two 3x3 convs (FedSC code `fixup_models.py`: ~17.1M + 47).
  hand = conv_count(3, 3, 128)
  cin = 128
  for planes in (128, 256, 512):
    for _ in range(3):
      hand += conv_count(3, cin, planes) + conv_count(3, planes, planes)
      cin = planes
  assert n_conv == hand == 17_108_352
  assert n_scalar == 47 == 9 * 5 + 2
  assert len(leaves) == 1 + 9 * 7 + 2


def test_fixup_init_and_identity_forward():
  # Registered depth (3 blocks per stage, L = 9) at widen 1 to keep the test small. The 'rbg' key
  # and the XLA convolution only make compilation cheaper (the initialisers are the same).
  enc = models.get_encoder('fixup_resnet20', widen=1, conv_impl='xla')
  x = randn(0, (2, 16, 16, 3))
  params = jax.jit(lambda k: enc.init(k, x, train=True))(fast_key(1))['params']
  blocks = [k for k in params if k.startswith('layer')]
  assert len(blocks) == 9
  for b in blocks:
    p = params[b]
    assert not np.any(p['conv2']['kernel'])
    assert float(p['scale']) == 1.0
    for s in ('bias1a', 'bias1b', 'bias2a', 'bias2b'):
      assert float(p[s]) == 0.0
  assert float(params['bias1']) == float(params['bias2']) == 0.0
  # conv1 ~ N(0, sqrt(2 / (cout * 9)) / sqrt(L)), L = 9; stage-3 kernels are [3, 3, 64, 64].
  k = np.concatenate([np.ravel(params[f'layer3_{j}']['conv1']['kernel']) for j in (1, 2)])
  np.testing.assert_allclose(np.std(k), np.sqrt(2 / (64 * 9)) / 3, rtol=0.02)
  assert abs(float(np.mean(k))) < 3 * np.std(k) / np.sqrt(k.size)
  # The stem keeps PyTorch's default U(+-1/sqrt(27)).
  assert np.abs(params['conv1']['kernel']).max() <= 1 / np.sqrt(27)
  # At init every block is relu(identity): features = [mean of relu(stem)[::4, ::4], zeros].
  stem = np.maximum(np_conv(x, params['conv1']['kernel'], None, (1, 1), ((1, 1), (1, 1))), 0)
  expected = np.concatenate([stem[:, ::4, ::4].mean((1, 2)), np.zeros((2, 48))], axis=-1)
  feats = jax.jit(lambda p, x: enc.apply({'params': p}, x, train=False))(params, x)
  assert feats.shape == (2, enc.feature_dim) == (2, 64)
  np.testing.assert_allclose(feats, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('strides,cin,planes', [(1, 4, 4), (2, 4, 8)])
def test_fixup_block_is_identity_path_at_init(strides, cin, planes):
  block = fixup.FixupBlock(planes, strides)
  x = np.random.default_rng(0).normal(size=(2, 5, 5, cin)).astype(np.float32)
  y = jax.jit(lambda x: block.apply(block.init(fast_key(1), x), x))(x)
  identity = x if strides == 1 else np.concatenate([x[:, ::2, ::2], np.zeros_like(x[:, ::2, ::2])], -1)
  np.testing.assert_allclose(y, np.maximum(identity, 0), atol=1e-6)
  with pytest.raises(ValueError, match='planes'):
    jax.eval_shape(lambda x: fixup.FixupBlock(2 * planes, strides).init(jax.random.key(1), x), x)


def test_fixup_forward_with_nonzero_params():
  # One downsampling block, all scalars non-zero: compare with a float64 numpy transcription.
  block = fixup.FixupBlock(6, 2, conv_impl='im2col')
  x = randn(0, (2, 5, 5, 3))
  v = random_variables(block, x, seed=3)
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), v['params'])
  xn = np.asarray(x, np.float64)
  out = np_conv(xn + p['bias1a'], p['conv1']['kernel'], None, (2, 2), ((1, 1), (1, 1)))
  out = np.maximum(out + p['bias1b'], 0)
  out = np_conv(out + p['bias2a'], p['conv2']['kernel'], None, (1, 1), ((1, 1), (1, 1)))
  out = out * p['scale'] + p['bias2b']
  ident = (xn + p['bias1a'])[:, ::2, ::2]
  ref = np.maximum(out + np.concatenate([ident, np.zeros_like(ident)], -1), 0)
  np.testing.assert_allclose(jax.jit(block.apply)(v, x), ref, rtol=1e-4, atol=1e-5)
