"""Tests for fedjax_ssl.models: parameter counts against the papers' code and hand counts, the im2col
convolution against XLA and a float64 numpy loop, BatchNorm semantics, Fixup initialisation and
every registered encoder's output shape."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn

from fedjax_ssl import models
from fedjax_ssl.models import fixup, layers, repshare, resnet

# ----------------------------------------------------------------------------- references


def np_conv(x, kernel, bias, strides, pads):
  """Direct float64 cross-correlation: x [B,H,W,Ci], kernel [kh,kw,Ci,Co], pads ((t,b),(l,r))."""
  x = np.pad(np.asarray(x, np.float64), ((0, 0), pads[0], pads[1], (0, 0)))
  k = np.asarray(kernel, np.float64)
  kh, kw, _, co = k.shape
  sh, sw = strides
  ho = (x.shape[1] - kh) // sh + 1
  wo = (x.shape[2] - kw) // sw + 1
  out = np.zeros((x.shape[0], ho, wo, co))
  for oh in range(ho):
    for ow in range(wo):
      for i in range(kh):
        for j in range(kw):
          out[:, oh, ow, :] += x[:, oh * sh + i, ow * sw + j, :] @ k[i, j]
  if bias is not None:
    out += np.asarray(bias, np.float64)
  return out


def conv_count(k, cin, cout, bias=False):
  return k * k * cin * cout + (cout if bias else 0)


def bn_count(c):
  return 2 * c  # gamma + beta (PyTorch parameters(); running stats excluded)


def dense_count(din, dout):
  return din * dout + dout


def hand_cifar_resnet(stage_sizes, bottleneck):
  """Parameter count of a CIFAR ResNet backbone (no fc) summed over its layer list."""
  total = conv_count(3, 3, 64) + bn_count(64)
  cin = 64
  for i, (n, planes) in enumerate(zip(stage_sizes, (64, 128, 256, 512))):
    for j in range(n):
      stride = 2 if (i > 0 and j == 0) else 1
      if bottleneck:
        cout = 4 * planes
        total += conv_count(1, cin, planes) + bn_count(planes)
        total += conv_count(3, planes, planes) + bn_count(planes)
        total += conv_count(1, planes, cout) + bn_count(cout)
      else:
        cout = planes
        total += conv_count(3, cin, planes) + bn_count(planes)
        total += conv_count(3, planes, planes) + bn_count(planes)
      if stride != 1 or cin != cout:
        total += conv_count(1, cin, cout) + bn_count(cout)
      cin = cout
  return total


def random_variables(module, x, seed, **kwargs):
  """Variables with the module's structure filled by numpy draws (no jax.random: its per-shape
  compilation dominates test time on CPU). Kernels ~ N(0, 1/fan_in); BN scale ~ 1 + N(0, 0.1^2)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda k: module.init(k, x, **kwargs), jax.random.key(0))

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    if len(s.shape) >= 2:
      v = rng.normal(size=s.shape) / np.sqrt(np.prod(s.shape[:-1]))
    elif "'var'" in name:
      v = rng.uniform(0.5, 1.5, size=s.shape)
    elif "'scale'" in name:
      v = 1 + 0.1 * rng.normal(size=s.shape)
    else:
      v = 0.1 * rng.normal(size=s.shape)
    return jnp.asarray(v, jnp.float32)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def fast_key(seed):
  """PRNG key whose bit generator compiles quickly on CPU (threefry's per-shape compile is slow)."""
  return jax.random.key(seed, impl='rbg')


def randn(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def shape_params(module, input_shape, **kwargs):
  """Parameter shapes via eval_shape (nothing is computed)."""
  x = jnp.zeros((2,) + tuple(input_shape), jnp.float32)
  return jax.eval_shape(lambda k: module.init(k, x, train=False, **kwargs), jax.random.key(0))


# ----------------------------------------------------------------------------- parameter counts


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


@pytest.mark.parametrize('preset,expected_proj,expected_pred', [
    ('fedsc', 1_050_112, 1_050_112),                          # FedSC code: 512-1024-512 MLPs, no BN
    ('fedu2', 2_103_808, 2_103_808),                          # FedU2 code: 512-2048(BN)-512 MLPs
    ('easyfl', dense_count(512, 4096) + bn_count(4096) + dense_count(4096, 2048),
     dense_count(2048, 4096) + bn_count(4096) + dense_count(4096, 2048)),
])
def test_head_param_counts(preset, expected_proj, expected_pred):
  model = models.SSLModel(models.get_encoder('mlp', features=(512,)), *models.make_heads(preset))
  params = shape_params(model, (4, 4, 1))['params']
  assert set(params) == {'encoder', 'projector', 'predictor'}
  assert models.count_params(params['projector']) == expected_proj
  assert models.count_params(params['predictor']) == expected_pred


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


# ----------------------------------------------------------------------------- convolution

Z = ((0, 0), (0, 0))
CONV_CASES = [
    # (H, W, cin, cout, kernel, stride, padding, hand-derived ((top, bottom), (left, right)) pads)
    (7, 7, 3, 4, 3, 1, 'SAME', ((1, 1), (1, 1))),
    (8, 8, 3, 5, 3, 2, 'SAME', ((0, 1), (0, 1))),    # out 4: total 3*2+3-8 = 1, extra at the end
    (9, 7, 2, 3, 3, 2, 'VALID', Z),
    (8, 8, 3, 4, 3, 2, 1, ((1, 1), (1, 1))),         # PyTorch padding=1, stride 2 (differs from SAME)
    (6, 6, 4, 6, 1, 1, 'VALID', Z),
    (7, 6, 4, 6, 1, 2, 0, Z),                        # 1x1 strided shortcut, odd size
    (11, 9, 3, 2, 5, 1, 2, ((2, 2), (2, 2))),
    (11, 10, 2, 3, 5, 2, 'SAME', ((2, 2), (1, 2))),  # H: out 6, total 4; W: out 5, total 3
    (10, 10, 3, 2, 5, 1, 'VALID', Z),
    (7, 8, 2, 3, (3, 1), (1, 2), ((2, 0), (0, 1)), ((2, 0), (0, 1))),  # non-square, asymmetric
    (5, 5, 1, 3, 3, 1, ((0, 2), (1, 1)), ((0, 2), (1, 1))),
    (6, 5, 2, 2, 3, (2, 1), (1, 0), ((1, 1), (0, 0))),  # per-dimension symmetric ints
]


def _pads_of(case):
  s = case[5]
  return case[7], ((s, s) if isinstance(s, int) else s)


@pytest.mark.parametrize('case', CONV_CASES)
def test_conv_im2col_matches_xla_and_numpy(case):
  h, w, cin, cout, k, s, p, _ = case
  x = randn(1, (2, h, w, cin))
  conv = lambda impl: layers.Conv(cout, k, s, padding=p, conv_impl=impl)
  params = random_variables(conv('xla'), x, seed=2)
  y_xla = jax.jit(conv('xla').apply)(params, x)
  y_col = jax.jit(conv('im2col').apply)(params, x)
  pads, strides = _pads_of(case)
  ref = np_conv(x, params['params']['kernel'], params['params']['bias'], strides, pads)
  assert y_col.shape == y_xla.shape == ref.shape
  np.testing.assert_allclose(y_xla, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y_col, ref, rtol=1e-5, atol=1e-5)


def test_conv_params_interchangeable_with_flax():
  x = randn(0, (2, 9, 8, 3))
  for k, s, p in [(3, 2, 1), ((5, 3), (1, 2), 'SAME')]:
    ours = layers.Conv(4, k, s, padding=p, conv_impl='im2col')
    params = random_variables(ours, x, seed=1)
    ks = k if isinstance(k, tuple) else (k, k)
    ss = s if isinstance(s, tuple) else (s, s)
    theirs = nn.Conv(4, ks, ss, padding=p)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(
        jax.eval_shape(lambda key: theirs.init(key, x), jax.random.key(0)))
    y = jax.jit(ours.apply)(params, x)
    np.testing.assert_allclose(y, jax.jit(theirs.apply)(params, x), rtol=1e-5, atol=1e-5)
    # Like nn.Conv, any number of leading batch dimensions (including none) is accepted.
    np.testing.assert_allclose(jax.jit(ours.apply)(params, x[0]), y[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jit(ours.apply)(params, x[None]), y[None], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('case', [CONV_CASES[3], CONV_CASES[5], CONV_CASES[9]])
def test_conv_gradients_match(case):
  h, w, cin, cout, k, s, p, _ = case
  x = randn(3, (2, h, w, cin))
  conv = lambda impl: layers.Conv(cout, k, s, padding=p, conv_impl=impl)
  params = random_variables(conv('xla'), x, seed=4)
  pads, strides = _pads_of(case)
  ref_out = np_conv(x, params['params']['kernel'], params['params']['bias'], strides, pads)
  cot = randn(5, ref_out.shape)

  def grads(impl):
    f = lambda v, x: jnp.sum(conv(impl).apply(v, x) * cot)
    return jax.jit(jax.grad(f, argnums=(0, 1)))(params, x)

  g_xla, g_col = grads('xla'), grads('im2col')
  for a, b in zip(jax.tree_util.tree_leaves(g_xla), jax.tree_util.tree_leaves(g_col)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  # Independent float64 references: dL/dk[i,j] = sum_b,o patch_ij^T cot ; dL/dbias = sum cot.
  xp = np.pad(np.asarray(x, np.float64), ((0, 0), pads[0], pads[1], (0, 0)))
  g_kernel = g_col[0]['params']['kernel']
  kh, kw = g_kernel.shape[:2]
  ho, wo = cot.shape[1:3]
  ref = np.zeros((kh, kw, cin, cout))
  for i in range(kh):
    for j in range(kw):
      patch = xp[:, i:i + strides[0] * (ho - 1) + 1:strides[0], j:j + strides[1] * (wo - 1) + 1:strides[1]]
      ref[i, j] = np.einsum('bhwc,bhwo->co', patch, np.asarray(cot, np.float64))
  np.testing.assert_allclose(g_kernel, ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(g_col[0]['params']['bias'], np.asarray(cot, np.float64).sum((0, 1, 2)),
                             rtol=1e-4, atol=1e-4)


def test_conv_vmap_over_client_weights():
  num_clients, cin, cout = 3, 3, 4
  x = randn(6, (num_clients, 2, 8, 8, cin))
  conv = lambda impl: layers.Conv(cout, 3, 2, padding=1, conv_impl=impl)
  per_client = [random_variables(conv('xla'), x[0], seed=10 + c) for c in range(num_clients)]
  stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *per_client)
  outs = {impl: jax.jit(jax.vmap(conv(impl).apply))(stacked, x) for impl in ('xla', 'im2col')}
  for c in range(num_clients):
    p = per_client[c]['params']
    ref = np_conv(x[c], p['kernel'], p['bias'], (2, 2), ((1, 1), (1, 1)))
    np.testing.assert_allclose(outs['xla'][c], ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs['im2col'][c], ref, rtol=1e-5, atol=1e-5)
  # Gradients of per-client losses agree too.
  loss = lambda impl: lambda v, x: jnp.sum(jnp.sin(conv(impl).apply(v, x)))
  g = {impl: jax.jit(jax.vmap(jax.grad(loss(impl))))(stacked, x) for impl in ('xla', 'im2col')}
  for a, b in zip(jax.tree_util.tree_leaves(g['xla']), jax.tree_util.tree_leaves(g['im2col'])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_patch_matmul_gradient_is_the_matmul_gradient_as_plain_gemms():
  """patch_matmul's custom gradient equals d(cols @ k) exactly (float64 numpy), under vmap too, and
  its kernel gradient compiles to a GEMM on the materialised transpose, not to a dot contracting
  both operands' leading axis (XLA:CPU's slow path, docs/notes/performance.md#cross-device-round)."""
  with jax.enable_x64(True):
    cols = randn(1, (3, 40, 12)).astype(np.float64)
    kmat = randn(2, (3, 12, 5)).astype(np.float64)
    cot = randn(3, (3, 40, 5)).astype(np.float64)
    f = lambda c, k, g: jnp.sum(layers.patch_matmul(c, k) * g)
    dc, dk = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1))))(cols, kmat, cot)
    np.testing.assert_allclose(dc, np.einsum('bmn,bkn->bmk', cot, kmat), rtol=1e-12)
    np.testing.assert_allclose(dk, np.einsum('bmk,bmn->bkn', cols, cot), rtol=1e-12)
  hlo = jax.jit(jax.grad(lambda k, c: jnp.sum(layers.patch_matmul(c, k) ** 2))).lower(
      jnp.zeros((288, 64)), jnp.zeros((2560, 288))).compile().as_text()
  dots = [l for l in hlo.splitlines() if ' dot(' in l or '"__ynn_fusion"' in l]
  assert dots and not any('lhs_contracting_dims={0}' in l for l in dots), dots


def test_im2col_has_no_convolution_op():
  x = jnp.zeros((2, 8, 8, 3))
  conv = layers.Conv(4, 3, 2, padding=1, conv_impl='im2col')
  params = random_variables(conv, x, seed=0)
  f = lambda v, x: jnp.sum(conv.apply(v, x))
  jaxpr = str(jax.make_jaxpr(jax.vmap(jax.grad(f)))(
      jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), params), jnp.stack([x, x])))
  assert 'conv_general_dilated' not in jaxpr and 'dot_general' in jaxpr
  xla = layers.Conv(4, 3, 2, padding=1, conv_impl='xla')
  assert 'conv_general_dilated' in str(jax.make_jaxpr(lambda v, x: xla.apply(v, x))(params, x))


def test_conv_impl_resolution_and_errors():
  expected = 'im2col' if jax.default_backend() == 'cpu' else 'xla'
  assert layers.resolve_conv_impl('auto') == expected
  x = jnp.zeros((1, 5, 5, 2))
  with pytest.raises(ValueError, match='conv_impl'):
    layers.Conv(3, 3, conv_impl='cudnn').init(jax.random.key(0), x)
  if jax.default_backend() != 'gpu':  # the Pallas kernel compiles on a GPU only: one line, at trace
    with pytest.raises(ValueError, match=r"(?m)\Aconv_impl='pallas' needs a backend in \('gpu',\) \(its "
                                         rf"Triton kernel\); this one is '{jax.default_backend()}': "
                                         r"use 'packed', 'measured', 'xla' or 'im2col'$"):
      layers.Conv(3, 3, conv_impl='pallas').init(jax.random.key(0), x)
  with pytest.raises(ValueError, match='padding'):
    layers.Conv(3, 3, padding='CIRCULAR').init(jax.random.key(0), x)
  with pytest.raises(ValueError, match='negative'):
    layers.Conv(3, 3, padding=-1).init(jax.random.key(0), x)


def test_inference_convs_resolve_auto_to_xla_inside_and_only_inside():
  """Feature extraction traces under `inference_convs`: 'auto' becomes XLA's convolution there (the
  faster one without gradients), explicit choices are kept, and the setting ends with the block,
  also when it raises."""
  assert not layers._INFERENCE.get()
  with layers.inference_convs():
    assert layers.resolve_conv_impl('auto') == 'xla'
    assert layers.resolve_conv_impl('im2col') == 'im2col'
  expected = 'im2col' if jax.default_backend() == 'cpu' else 'xla'
  assert layers.resolve_conv_impl('auto') == expected
  with pytest.raises(RuntimeError):
    with layers.inference_convs():
      raise RuntimeError
  assert layers.resolve_conv_impl('auto') == expected
  x = jnp.zeros((2, 8, 8, 3))
  conv = layers.Conv(4, 3, 1, padding=1)
  params = random_variables(conv, x, seed=0)
  def inside(v, x):
    with layers.inference_convs():
      return conv.apply(v, x)
  assert 'conv_general_dilated' in str(jax.make_jaxpr(inside)(params, x))


def test_extracted_features_equal_the_training_forward():
  """eval.features runs LeNet-5 with XLA's convolutions; its features equal the im2col forward that
  training uses up to float32 summation order: each layer sums at most 16*3*3 = 144 products
  (|error| <= 144 * 2**-24 * sum|w x|, with sum|w x| = O(1) at PyTorch's init), through 3
  convolutions and a Tanh (Lipschitz 1): well under 1e-5."""
  from fedjax_ssl.eval import features  # pylint: disable=g-import-not-at-top
  images = np.random.RandomState(0).randint(0, 256, (40, 28, 28, 1)).astype(np.uint8)
  im2col = repshare.LeNet5(conv_impl='im2col')
  variables = random_variables(im2col, jnp.zeros((1, 28, 28, 1)), seed=1, train=False)
  apply_auto = lambda v, x: repshare.LeNet5().apply(v, x, train=False)
  got = features.extract_features(apply_auto, variables, images, [0.3], [0.35], batch_size=16)
  x = features.normalize_images(jnp.asarray(images), jnp.float32(0.3), jnp.float32(0.35))
  want = jax.jit(lambda v, x: im2col.apply(v, x, train=False))(variables, x)
  assert float(jnp.std(want)) > 0.05  # real, non-saturated features
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


def test_torch_default_init_bounds():
  x = jnp.zeros((1, 6, 6, 8))
  p = jax.jit(layers.Conv(64, 3).init)(fast_key(0), x)['params']
  bound = 1 / np.sqrt(3 * 3 * 8)
  for leaf in (p['kernel'], p['bias']):
    assert np.abs(leaf).max() <= bound and np.abs(leaf).max() > 0.9 * bound
  # U(-b, b) has std b / sqrt(3).
  np.testing.assert_allclose(np.std(p['kernel']), bound / np.sqrt(3), rtol=0.05)


def test_max_pool_matches_numpy():
  x = np.random.default_rng(0).normal(size=(2, 7, 6, 3)).astype(np.float32)
  ref = np.zeros((2, 3, 3, 3))
  for i in range(3):
    for j in range(3):
      ref[:, i, j] = x[:, 2 * i:2 * i + 2, 2 * j:2 * j + 2].max(axis=(1, 2))
  np.testing.assert_array_equal(layers.max_pool(jnp.asarray(x)), ref)


# ----------------------------------------------------------------------------- BatchNorm


def test_mlp_head_batchnorm_train_and_eval():
  head = models.MLPHead(hidden=5, out=3, use_bn=True)
  x = np.random.default_rng(0).normal(size=(6, 4))
  xj = jnp.asarray(x, jnp.float32)
  v = random_variables(head, xj, seed=1, train=False)
  v['batch_stats'] = {'bn': {'mean': jnp.zeros(5), 'var': jnp.ones(5)}}  # fresh-init statistics
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), v['params'])
  a = x @ p['fc1']['kernel'] + p['fc1']['bias']

  def tail(n):
    return np.maximum(n * p['bn']['scale'] + p['bn']['bias'], 0) @ p['fc2']['kernel'] + p['fc2']['bias']

  # Train: normalise with the (biased) batch statistics, update running stats with momentum 0.9.
  y, upd = head.apply(v, xj, train=True, mutable=['batch_stats'])
  mu, var = a.mean(0), a.var(0)
  np.testing.assert_allclose(y, tail((a - mu) / np.sqrt(var + 1e-5)), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(upd['batch_stats']['bn']['mean'], 0.1 * mu, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(upd['batch_stats']['bn']['var'], 0.9 + 0.1 * var, rtol=1e-5, atol=1e-6)
  # Eval: running statistics are used and left unchanged.
  v2 = {'params': v['params'], 'batch_stats': upd['batch_stats']}
  y2, upd2 = head.apply(v2, xj, train=False, mutable=['batch_stats'])
  rm, rv = 0.1 * mu, 0.9 + 0.1 * var
  np.testing.assert_allclose(y2, tail((a - rm) / np.sqrt(rv + 1e-5)), rtol=1e-4, atol=1e-4)
  for s, t in zip(jax.tree_util.tree_leaves(upd2), jax.tree_util.tree_leaves(upd)):
    np.testing.assert_array_equal(s, t)


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


# ----------------------------------------------------------------------------- Fixup


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


# ----------------------------------------------------------------------------- encoders / registry

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


def test_ssl_model_and_classifier_wiring():
  model = models.build_ssl_model('mlp', 'fedsc', features=(6,))
  x = randn(0, (4, 3, 3, 1))
  v = random_variables(model, x, seed=1, train=True)
  assert set(v['params']) == {'encoder', 'projector', 'predictor'}
  out = jax.jit(lambda v, x: model.apply(v, x, train=False))(v, x)
  assert set(out) == {'h', 'z', 'p'}
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), v['params'])
  flat = np.asarray(x, np.float64).reshape(4, -1)
  h = np.maximum(flat @ p['encoder']['fc1']['kernel'] + p['encoder']['fc1']['bias'], 0)
  mlp = lambda q, u: np.maximum(u @ q['fc1']['kernel'] + q['fc1']['bias'], 0) @ q['fc2']['kernel'] + q['fc2']['bias']
  np.testing.assert_allclose(out['h'], h, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out['z'], mlp(p['projector'], h), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out['p'], mlp(p['predictor'], mlp(p['projector'], h)), rtol=1e-4, atol=1e-5)
  # BYOL target: the {'encoder', 'projector'} subtree applied without the predictor.
  target = {'params': {k: v['params'][k] for k in ('encoder', 'projector')}}
  t = jax.jit(lambda v, x: model.apply(v, x, train=False, with_predictor=False))(target, x)
  assert set(t) == {'h', 'z'}
  np.testing.assert_allclose(t['z'], out['z'], rtol=1e-6)
  # No projector: z is h.
  bare = models.SSLModel(models.get_encoder('mlp', features=(6,)))
  o = bare.apply({'params': {'encoder': v['params']['encoder']}}, x, train=False)
  np.testing.assert_array_equal(o['z'], o['h'])
  clf = models.Classifier(models.get_encoder('mlp', features=(6,)), 5)
  cv = random_variables(clf, x, seed=2, train=False)
  assert set(cv['params']) == {'encoder', 'head'}
  q = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), cv['params'])
  hc = np.maximum(flat @ q['encoder']['fc1']['kernel'] + q['encoder']['fc1']['bias'], 0)
  np.testing.assert_allclose(clf.apply(cv, x, train=False), hc @ q['head']['kernel'] + q['head']['bias'],
                             rtol=1e-5, atol=1e-5)
