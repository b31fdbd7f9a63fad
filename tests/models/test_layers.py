"""fedjax_ssl/models/layers.py: the im2col convolution against XLA and a float64 numpy loop (outputs,
gradients, vmapped client weights), its GEMM-only program, the conv_impl resolution and
`inference_convs`, PyTorch's default init and max pooling."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn

from fedjax_ssl.models import layers, repshare
from tests.models.references import fast_key, np_conv, randn, random_variables


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
