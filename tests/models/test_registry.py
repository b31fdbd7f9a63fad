"""The encoder registry (fedjax_ssl/models/__init__.py): every encoder listed with its feature
dimension and output shape, im2col and XLA forwards equal in float64, and the one-line errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import models
from tests.models.references import randn, random_variables, shape_params


EXPECTED_DIMS = {'resnet18': 512, 'resnet34': 512, 'resnet50': 2048, 'lenet5': 84, 'resnet9': 128,
                 'resnet18_repshare': 256, 'fixup_resnet20': 512, 'small_cnn': 128, 'small_cnn_wide': 128,
                 'hetero_cnn': 128, 'mlp': 128, 'cross_device_cnn': 128}


def test_registry_lists_every_encoder():
  assert set(models.ENCODERS) == set(EXPECTED_DIMS)
  for name, d in EXPECTED_DIMS.items():
    assert models.feature_dim(name) == d


@pytest.mark.parametrize('name', sorted(EXPECTED_DIMS))
def test_encoder_output_shape(name):
  enc = models.get_encoder(name)
  shape = (3,) + models.input_shape(name)
  variables = shape_params(enc, models.input_shape(name))
  for train in (False, True):
    out = jax.eval_shape(lambda v, x: enc.apply(v, x, train=train, mutable=['batch_stats'])[0],
                         variables, jnp.zeros(shape))
    assert out.shape == (3, EXPECTED_DIMS[name]) and out.dtype == jnp.float32


@pytest.mark.parametrize('name', ['lenet5', 'resnet9', 'small_cnn'])
def test_encoder_forward_im2col_matches_xla(name):
  # Compared in float64 (the encoders keep the dtype of their inputs and variables): in float32 the train-mode
  # BatchNorm over a batch of 2 amplifies rounding: resnet9's two programs differed by ~1e-5 (by ISA: 1.1e-5 on
  # SSE4.2, 9.7e-6 on AVX2), under 10x below the former 1e-4 tolerance. In float64 they agree to ~1e-14.
  x = randn(0, (2,) + models.input_shape(name))
  enc = {impl: models.get_encoder(name, conv_impl=impl) for impl in ('xla', 'im2col')}
  v = random_variables(enc['xla'], x, seed=1, train=False)  # float32 values (init creates float32 params)
  with jax.enable_x64(True):
    x, v = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), (x, v))
    feats = {impl: jax.jit(lambda v, x, m=m: m.apply(v, x, train=True, mutable=['batch_stats'])[0])(v, x)
             for impl, m in enc.items()}
    assert feats['im2col'].shape == (2, EXPECTED_DIMS[name]) and feats['im2col'].dtype == jnp.float64
    assert bool(jnp.all(jnp.isfinite(feats['im2col'])))
    np.testing.assert_allclose(feats['im2col'], feats['xla'], rtol=1e-10, atol=1e-10)
    if name in ('lenet5', 'resnet9'):
      assert float(jnp.max(jnp.abs(feats['im2col']))) <= 1.0  # Tanh feature layer


def test_registry_errors():
  with pytest.raises(ValueError, match='allowed.*resnet18'):
    models.get_encoder('resnet101')
  with pytest.raises(ValueError, match='widen'):
    models.get_encoder('resnet18', widen=2)
  with pytest.raises(ValueError, match='conv_impl'):
    models.get_encoder('small_cnn', conv_impl='fast')
  with pytest.raises(ValueError, match='easyfl'):
    models.make_heads('simclr')
  with pytest.raises(ValueError, match='shape'):
    shape_params(models.get_encoder('small_cnn'), (28, 1))
