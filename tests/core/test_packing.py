"""conv_impl='packed' (core/packing.py): a local step vmapped over clients in the client-packed
layout computes what jax.vmap computes — every encoder with convolutions, forward, BatchNorm
statistics and gradients, float64 / float32 / bfloat16 — with the client axis moved only at the
edges of the convolutional part; a whole FedBYOL round under strategy 'vmap' equals the default's;
bad input is one line before compute."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import models
from fedjax_ssl.core import packing
from fedjax_ssl.models import layers

K = 3  # clients

# Every encoder with convolutions, shrunk where its attributes allow (the layout does not depend
# on the width), at a small input that still passes every stride and pooling. Left out for time:
# resnet18_repshare (resnet9's RepShareBlock and resnet18's stages at fixed widths 64-512, 48 s)
# and resnet34 (resnet18's blocks, more of them); resnet9 (RepShareBlock, a BasicBlock) is
# ill-conditioned at a test's batch: at 16x16 and batch 2 its per-client loop, jax.vmap and the
# packed program disagree by O(1) in float64 under the suite's fast-compile flags (BatchNorm
# statistics of 8 values), and at 28x28 it takes a minute.
ENCODERS = {
    'resnet18': (dict(widths=(4, 8, 8, 8)), (8, 8, 3)),
    'resnet50': (dict(widths=(2, 2, 4, 4)), (8, 8, 3)),
    'lenet5': ({}, (8, 8, 1)),
    'fixup_resnet20': (dict(widen=1), (8, 8, 3)),
    'small_cnn': ({}, (8, 8, 1)),
    'small_cnn_wide': ({}, (8, 8, 1)),
    'cross_device_cnn': ({}, (8, 8, 3)),
    'hetero_cnn': ({}, (16, 16, 3)),
}


def _step(encoder):
  """One client: (variables, x [B, H, W, C]) -> (loss, params gradient, new batch_stats)."""
  def step(variables, x):
    def loss(params):
      out, new = encoder.apply({**variables, 'params': params}, x, train=True,
                               mutable=['batch_stats'])
      return jnp.sum(jnp.sin(out)), new  # out: float32 at least (layers.as_float)
    (value, new), grad = jax.value_and_grad(loss, has_aux=True)(variables['params'])
    return value, grad, new
  return step


def _both(name, dtype=None, float64=False):
  """(jax.vmap of the 'xla' step, packing.vmap of the 'packed' step) on K clients."""
  overrides, (h, w, c) = ENCODERS[name]
  ref = models.get_encoder(name, conv_impl='xla', dtype=dtype, **overrides)
  enc = models.get_encoder(name, conv_impl='packed', dtype=dtype, **overrides)
  ftype = jnp.float64 if float64 else jnp.float32
  x = jax.random.normal(jax.random.PRNGKey(0), (K, 2, h, w, c), ftype)
  keys = jax.random.split(jax.random.PRNGKey(1), K)
  variables = jax.vmap(lambda k, xx: ref.init(k, xx, train=True))(keys, x)
  variables = jax.tree_util.tree_map(lambda a: a.astype(ftype), variables)
  # Fixup's zero-initialised convolutions: random weights, so that every gradient is non-trivial.
  variables = jax.tree_util.tree_map(
      lambda a: a + 0.1 * jax.random.normal(jax.random.PRNGKey(a.size), a.shape, a.dtype), variables)
  want = jax.jit(jax.vmap(_step(ref)))(variables, x)
  got = jax.jit(packing.vmap(_step(enc)))(variables, x)
  return want, got


def _max_rel_err(want, got):
  """max over the outputs (loss, gradient, batch statistics) of max|got - want| / max|want| over
  all of that output's leaves. Per output, not per leaf: the gradient of a bias that feeds a
  BatchNorm is zero but for rounding, so its own scale is the rounding noise itself."""
  errs = []
  for w_out, g_out in zip(want, got):
    pairs = list(zip(jax.tree_util.tree_leaves(w_out), jax.tree_util.tree_leaves(g_out)))
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in pairs)
    if not pairs:  # no BatchNorm
      continue
    err = max(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))) for a, b in pairs)
    scale = max(np.max(np.abs(np.asarray(a, np.float64))) for a, _ in pairs)
    errs.append(err / max(scale, 1e-300))
  return max(errs)


@pytest.mark.parametrize('name', sorted(ENCODERS))
def test_every_conv_encoder_packed_equals_vmap_float64(name):
  # float64: the two programs differ only in summation order, so they agree to rounding (eps
  # 1.1e-16, grown by at most a few thousand terms and a dozen BatchNorm layers: < 1e-11), where a
  # wrong client, group or axis moves the numbers by O(1).
  with jax.enable_x64(True):
    want, got = _both(name, float64=True)
  assert _max_rel_err(want, got) < 1e-11


@pytest.mark.parametrize('name', ['resnet18', 'hetero_cnn'])
def test_packed_equals_vmap_float32(name):
  want, got = _both(name)
  # One rounding of a layer's output (float32 eps 1.2e-7) may land on the other side, amplified
  # through ~20 layers by the BatchNorms' 1/std: 1e4 eps allowed, where a wrong client, group or
  # axis is O(1).
  assert _max_rel_err(want, got) < 1e4 * 1.2e-7


@pytest.mark.parametrize('name', ['resnet18', 'hetero_cnn'])
def test_packed_bfloat16_is_as_close_to_float32_as_the_default(name):
  # Both bfloat16 programs round every layer's output to 8 bits, in a different summation order,
  # so they differ by bfloat16 rounding grown through the network (~0.07 of the gradient's scale
  # on ResNet-18): the fair bound is the default's own distance from the float32 program.
  want, got = _both(name, dtype=jnp.bfloat16)
  exact, _ = _both(name)
  # Per output (loss, gradient, batch statistics): the packed bfloat16 program is at most twice as
  # far from float32 as the default bfloat16 program, and not identical to float32 (it computed in
  # bfloat16).
  assert 0 < _max_rel_err(exact, got) <= 2 * _max_rel_err(exact, want)


def _hlo(fn, *args):
  return jax.jit(fn).lower(*args).as_text()


def test_the_client_axis_moves_only_at_the_edges():
  overrides, (h, w, c) = ENCODERS['resnet18']
  enc = models.get_encoder('resnet18', conv_impl='packed', **overrides)
  x = jnp.zeros((K, 2, h, w, c))
  variables = jax.vmap(lambda xx: enc.init(jax.random.PRNGKey(1), xx, train=True))(x)
  moved = []
  to_stacked = packing.stacked

  def spy(v, k):  # a packed activation [B=2, H, W, C] (not a kernel) turned into the stacked form
    if v.form == packing.PACKED and len(v.shape) == 4 and v.shape[0] == 2:
      moved.append(v.shape)
    return to_stacked(v, k)
  packing.stacked = spy
  try:
    jax.make_jaxpr(packing.vmap(_step(enc)))(variables, x)
  finally:
    packing.stacked = to_stacked
  # ResNet-18 has 20 convolutions, 20 BatchNorms and 8 residual adds; every activation, forward and
  # backward, stays packed: only the pooled features leave (their [B, C] is rank 2).
  assert moved == []


def test_a_program_without_packed_convolution_is_jax_vmap():
  enc = models.get_encoder('small_cnn', conv_impl='xla')
  x = jnp.zeros((K, 2, 8, 8, 1))
  variables = jax.vmap(lambda xx: enc.init(jax.random.PRNGKey(1), xx, train=True))(x)
  got = jax.make_jaxpr(packing.vmap(_step(enc)))(variables, x)
  want = jax.make_jaxpr(jax.vmap(_step(enc)))(variables, x)
  assert ([e.primitive.name for e in got.jaxpr.eqns] == [e.primitive.name for e in want.jaxpr.eqns]
          and 'fedjax_ssl' not in str(got))
  assert layers.fedjax_ssl_packed_conv.__name__ == packing.PACKED_CONV


def test_bad_input_is_one_line_before_compute():
  with pytest.raises(ValueError, match=r"^conv_impl='grouped'; allowed: \('auto', 'xla', 'im2col', "
                                       r"'packed', 'measured', 'pallas'\)$"):
    models.get_encoder('resnet18', conv_impl='grouped')
  for impl in ('packed', 'measured', 'pallas'):
    with pytest.raises(ValueError, match=rf"^conv_impl='{impl}' lays out convolutions, and encoder "
                                         r"'mlp' has none; allowed for it: 'auto', 'xla', 'im2col'$"):
      models.get_encoder('mlp', conv_impl=impl)
  with pytest.raises(ValueError, match=r"^in_axes=1; allowed entries: 0 or None$"):
    packing.vmap(lambda a: a, in_axes=1)(jnp.zeros((2, 3)))


def test_a_fedbyol_round_under_vmap_equals_the_default():
  """The engine's own vmap (core/local.py's batching rule, two phase widths) with the packed
  encoder: the round's new state equals the 'xla' round's to the float64 round-equivalence bound of
  tests/core/test_round_equivalence.py (RTOL 1e-6: rounding grown through a chaotic round of
  8-sample BatchNorm networks reaches ~1e-10, an algorithmic difference >= 1e-3)."""
  from fedjax_ssl.algorithms import fedavg, ssl_client
  from fedjax_ssl.core import optim
  from fedjax_ssl.core import round as rd
  from tests.core import test_round_equivalence as tre

  def algo(conv_impl):
    enc = models.get_encoder('small_cnn', conv_features=(4,), dense_features=(6,),
                             conv_impl=conv_impl)
    model = models.SSLModel(enc, models.MLPHead(8, 5), models.MLPHead(8, 5))
    spec = ssl_client.ClientSpec(
        objective='byol', model=model, tx=optim.make_optimizer('sgd', momentum=0.9),
        aug=tre.AUG, mean=(0.5,), std=(0.3,), input_shape=(8, 8, 1),
        hparams={'temperature': 0.5, 'ema_tau': 0.9, 'mu': None}, reset_optimizer=True)
    return fedavg.make(spec)

  data, cfg = tre._data(), tre._round_cfg('vmap', 3, vmap_shrink=2.0)
  states = {}
  with jax.enable_x64(True):
    for impl in ('xla', 'packed'):
      a = algo(impl)
      state = tre._float64(rd.init_state(a, jax.random.PRNGKey(3), tre.NUM_CLIENTS))
      states[impl] = rd.make_round_step(a, cfg, tre.NUM_CLIENTS, donate=False)(
          state, data, jax.random.PRNGKey(5))[0]
    tre._assert_tree_close(states['packed'], states['xla'], 'packed round')


class _Strided(layers.nn.Module):
  """ResNet-18's kinds of convolution in one small net: 3x3 stride 1 from a 3-channel input, 3x3
  stride 2 (padding 1), 1x1 stride 2 without padding, 3x3 stride 2 'SAME' on an even input."""
  conv_impl: str = 'packed'

  @layers.nn.compact
  def __call__(self, x, train=True):
    del train
    conv = lambda f, k, s, p: layers.Conv(f, k, s, padding=p, conv_impl=self.conv_impl)  # noqa: E731
    x = jnp.tanh(conv(4, 3, 1, 1)(x))
    y = jnp.tanh(conv(4, 3, 2, 1)(x))
    z = conv(4, 1, 2, 0)(x)
    return jnp.tanh(conv(4, 3, 2, 'SAME')(y + z))


def test_pallas_equations_equal_the_grouped_ones(monkeypatch):
  """conv_impl='pallas' (its backend check widened to this CPU, where it otherwise raises): the
  packed evaluation sends every convolution equation (forward, input gradient with lhs dilation,
  kernel gradient with rhs dilation) to ops/pallas_conv.py, interpreted here, and equals the
  conv_impl='packed' program (grouped convolutions) in float32."""
  monkeypatch.setattr(layers, 'PALLAS_BACKENDS', ('gpu', jax.default_backend()))
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 2, 8, 8, 3))
  params = jax.vmap(lambda k: _Strided().init(k, x[0])['params'])(
      jax.random.split(jax.random.PRNGKey(1), 2))
  seen = []

  def spy(eqn, vals, k, case, original=packing.choose_pallas):
    seen.append((case, original(eqn, vals, k, case)))
    return seen[-1][1]
  monkeypatch.setattr(packing, 'choose_pallas', spy)

  def run(conv_impl):
    enc = _Strided(conv_impl=conv_impl)

    def step(p, xx):
      return jax.value_and_grad(lambda p: jnp.sum(jnp.sin(enc.apply({'params': p}, xx) * 3.0)))(p)
    return jax.jit(packing.vmap(step))(params, x)
  got, want = run('pallas'), run('packed')
  # 4 forward convolutions, 3 input gradients (not the first: x is not differentiated), 4 kernel
  # gradients, every one by the kernel.
  assert sorted(seen) == sorted([('feature', 'pallas')] * 7 + [('batch', 'pallas')] * 4)
  assert layers.fedjax_ssl_pallas_conv.__name__ == packing.PALLAS_CONV
  # float32, at most a few hundred terms per value: summation order only.
  for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(a))))


@pytest.mark.slow
def test_the_resnet18_step_with_pallas_lowers_every_convolution_to_triton(monkeypatch):
  """Without a GPU: ResNet-18's bfloat16 local step under conv_impl='pallas', vmapped over 2
  clients, lowered for CUDA (the backend checks widened to this CPU so that the kernels are not
  interpreted): every convolution equation is a Triton kernel and none is left to XLA. 20
  forward, 20 kernel gradients, 19 input gradients (not the stem's): 13 stride-1 3x3 and 3 1x1
  shortcuts one kernel each, 3 stride-2 3x3 four each (one per phase) = 68."""
  monkeypatch.setattr(layers, 'PALLAS_BACKENDS', ('gpu', jax.default_backend()))
  monkeypatch.setattr(packing.pallas_conv, 'available', lambda: True)
  enc = models.get_encoder('resnet18', conv_impl='pallas', dtype=jnp.bfloat16)
  x = jax.ShapeDtypeStruct((2, 4, 32, 32, 3), jnp.float32)
  variables = jax.eval_shape(
      jax.vmap(lambda xx: enc.init(jax.random.PRNGKey(1), xx, train=True)), x)
  text = jax.jit(packing.vmap(_step(enc))).trace(variables, x).lower(
      lowering_platforms=('cuda',)).as_text()
  assert text.count('__gpu$xla.gpu.triton') == 68
  assert 'stablehlo.convolution' not in text
