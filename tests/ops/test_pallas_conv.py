"""ops/pallas_conv.py, in Pallas interpret mode on the CPU: the grouped implicit-GEMM convolution,
its input gradient and its weight gradient against XLA's grouped convolution
(`lax.conv_general_dilated(..., feature_group_count=G)` and its autodiff), float32 and bfloat16
inputs, stride 1 and 2, SAME / explicit / asymmetric padding, 3x3 and 1x1; bad input is one line.

Tolerance (per element, derived, not tuned). Each output is a dot of length L of products a*b:
L = kh*kw*C (forward), at most kh*kw*O (input gradient), N*Ho*Wo (weight gradient). Both sides
accumulate in float32 (u = 2**-24) in some order; the products are exact for bfloat16 inputs
(8-bit significands) and rounded once for float32 ones, so each side is within gamma_L * A of the
exact value, gamma_L = L*u / (1 - L*u), A = sum |a|*|b| (the same convolution of the absolute
values). Hence |ours - reference| <= 2 * gamma_L * A; a bfloat16 output adds its rounding,
u_bf16 = 2**-8 relative: + u_bf16 * (|reference| + 2 * gamma_L * A). The reference is XLA's
convolution at precision HIGHEST on the float32 values of the same (bfloat16-rounded) operands.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.ops import pallas_conv

U32, U_BF16 = 2.0 ** -24, 2.0 ** -8

# (N, H, W, G, C, O, k, strides, pads): ResNet-18's kinds of convolution at toy sizes (G = clients).
CASES = {
    '3x3_s1_same_stem': (2, 6, 6, 3, 3, 8, 3, (1, 1), ((1, 1), (1, 1))),
    '3x3_s2_pad1': (2, 7, 6, 2, 4, 5, 3, (2, 2), ((1, 1), (1, 1))),
    '3x3_s2_same_even': (2, 6, 6, 2, 4, 8, 3, (2, 2), ((0, 1), (0, 1))),
    '1x1_s2_shortcut': (2, 6, 6, 2, 4, 8, 1, (2, 2), ((0, 0), (0, 0))),
}


def _reference(x, w, groups, strides, pads):
  return jax.lax.conv_general_dilated(x, w, strides, pads, dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
                                      feature_group_count=groups,
                                      precision=jax.lax.Precision.HIGHEST)


def _all(conv, x, w, gy):
  """(y, dx, dw) of conv at (x, w) with output cotangent gy."""
  y, vjp = jax.vjp(conv, x, w)
  return (y,) + vjp(gy.astype(y.dtype))


def _bound(length, ref, a, dtype):
  gamma = length * U32 / (1 - length * U32)
  tol = 2 * gamma * a
  if dtype == jnp.bfloat16:
    tol = tol + U_BF16 * (np.abs(ref) + tol)
  return tol


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['float32', 'bfloat16'])
@pytest.mark.parametrize('case', list(CASES))
def test_forward_and_gradients_equal_xlas_grouped_convolution(case, dtype):
  n, h, w_, g, c, o, k, strides, pads = CASES[case]
  rs = np.random.RandomState(0)
  x = jnp.asarray(rs.standard_normal((n, h, w_, g * c)), dtype)
  w = jnp.asarray(rs.standard_normal((k, k, c, g * o)), dtype)
  ho = (h + sum(pads[0]) - k) // strides[0] + 1
  wo = (w_ + sum(pads[1]) - k) // strides[1] + 1
  gy = jnp.asarray(rs.standard_normal((n, ho, wo, g * o)), dtype)
  ours = jax.jit(functools.partial(
      _all, lambda x, w: pallas_conv.conv(x, w, g, strides, pads, True)))(x, w, gy)
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  ref_fn = lambda x, w: _reference(x, w, g, strides, pads)  # noqa: E731
  refs = _all(ref_fn, f32(x), f32(w), f32(gy))
  absolute = _all(ref_fn, jnp.abs(f32(x)), jnp.abs(f32(w)), jnp.abs(f32(gy)))
  lengths = (k * k * c, k * k * o, n * ho * wo)
  for name, got, ref, a, length in zip(('y', 'dx', 'dw'), ours, refs, absolute, lengths):
    assert got.dtype == dtype and got.shape == ref.shape, (name, got.dtype, got.shape, ref.shape)
    ref, a = np.asarray(ref), np.asarray(a)
    tol = _bound(length, ref, a, dtype)
    err = np.abs(np.asarray(got, np.float32) - ref)
    assert np.all(err <= tol), (name, float(np.max(err - tol)), float(np.max(err)))
    # The bound is not vacuous: far below the values compared.
    assert np.max(tol) < (1e-4 if dtype == jnp.float32 else 2e-2) * np.max(np.abs(ref)), name


def test_input_dilated_equations_as_in_a_differentiated_program():
  """conv_general with lhs_dilation (the input-gradient equation jax writes for a strided
  convolution), negative high padding included, against XLA's."""
  rs = np.random.RandomState(1)
  g, c, o = 2, 3, 4
  x = jnp.asarray(rs.standard_normal((2, 3, 4, g * c)), jnp.float32)
  w = jnp.asarray(rs.standard_normal((3, 3, c, g * o)), jnp.float32)
  for pads in (((1, -1), (2, 0)),):  # asymmetric, one side cropped
    got = pallas_conv.conv_general(x, w, g, (1, 1), pads, (2, 2), interpret=True)
    ref = jax.lax.conv_general_dilated(x, w, (1, 1), pads, lhs_dilation=(2, 2),
                                       dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
                                       feature_group_count=g, precision=jax.lax.Precision.HIGHEST)
    a = jax.lax.conv_general_dilated(jnp.abs(x), jnp.abs(w), (1, 1), pads, lhs_dilation=(2, 2),
                                     dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
                                     feature_group_count=g, precision=jax.lax.Precision.HIGHEST)
    assert got.shape == ref.shape
    np.testing.assert_array_less(np.abs(got - ref), _bound(9 * c, ref, a, jnp.float32) + 1e-30)


def test_bad_input_is_one_line_before_compute():
  x = jnp.zeros((1, 4, 4, 6), jnp.float32)
  with pytest.raises(ValueError, match=r'^groups=4 does not fit x \(1, 4, 4, 6\) and w '
                                       r'\(3, 3, 3, 8\): need x channels = groups \* w.shape\[2\]'):
    pallas_conv.conv(x, jnp.zeros((3, 3, 3, 8)), 4, (1, 1), ((1, 1), (1, 1)), True)
  with pytest.raises(ValueError, match=r"^dtypes x int32, w int32; allowed: one of \('float32', "):
    pallas_conv.conv(x.astype(jnp.int32), jnp.zeros((3, 3, 3, 8), jnp.int32), 2, (1, 1),
                     ((1, 1), (1, 1)), True)
  with pytest.raises(ValueError, match=r'^pads=\(\(-1, 1\), \(1, 1\)\): negative padding'):
    pallas_conv.conv(x, jnp.zeros((3, 3, 3, 8)), 2, (1, 1), ((-1, 1), (1, 1)), True)


def test_tiles_are_powers_of_two_of_at_least_16(monkeypatch):
  for name in ('TILE_M', 'TILE_N', 'TILE_K'):  # restored after the test
    monkeypatch.setattr(pallas_conv, name, getattr(pallas_conv, name))
  pallas_conv.set_tiles(128, 64, 16)
  assert (pallas_conv.TILE_M, pallas_conv.TILE_N, pallas_conv.TILE_K) == (128, 64, 16)
  with pytest.raises(ValueError, match=r'^TILE_N=48; allowed: a power of two >= 16$'):
    pallas_conv.set_tiles(64, 48, 32)


def test_native_only_on_a_gpu():
  # This CPU: the kernels run interpreted, and nothing may choose them (core/packing.candidates).
  assert pallas_conv.available() == (jax.default_backend() == 'gpu')


# (H, W, C, O, k, stride, pad) of one client: ResNet-18's distinct convolutions at 32x32
# (experiments/conv_layers.py RESNET18_LAYERS, repeated here so that ops' tests import no experiment).
RESNET18 = {
    'stem': (32, 32, 3, 64, 3, 1, 1), 'layer1': (32, 32, 64, 64, 3, 1, 1),
    'layer2.down': (32, 32, 64, 128, 3, 2, 1), 'layer2.shortcut': (32, 32, 64, 128, 1, 2, 0),
    'layer2': (16, 16, 128, 128, 3, 1, 1), 'layer3.down': (16, 16, 128, 256, 3, 2, 1),
    'layer3.shortcut': (16, 16, 128, 256, 1, 2, 0), 'layer3': (8, 8, 256, 256, 3, 1, 1),
    'layer4.down': (8, 8, 256, 512, 3, 2, 1), 'layer4.shortcut': (8, 8, 256, 512, 1, 2, 0),
    'layer4': (4, 4, 512, 512, 3, 1, 1),
}


@pytest.mark.parametrize('dtype,tiles', [(jnp.bfloat16, None), (jnp.float32, None),
                                         (jnp.bfloat16, (128, 128, 32))],
                         ids=['bfloat16', 'float32', 'bfloat16_tiles128'])
def test_every_resnet18_layer_lowers_to_triton(dtype, tiles, monkeypatch):
  """Without a GPU: jax's Triton lowering (its checks included: power-of-two loaded tiles, dot
  operands) accepts the forward, input-gradient and weight-gradient kernels of every ResNet-18
  convolution at K = 10 clients x batch 128, lowered for CUDA on this CPU, at the default tiles and
  at the 128 x 128 ones of the GPU check's second stage. What it cannot show: Triton's own compile
  to PTX and the speed (docs/notes/performance.md#perf-69)."""
  if tiles:
    for name, t in zip(('TILE_M', 'TILE_N', 'TILE_K'), tiles):
      monkeypatch.setattr(pallas_conv, name, t)
  k, n = 10, 128
  names = list(RESNET18) if dtype == jnp.bfloat16 else ['stem', 'layer2.down', 'layer4']
  assert pallas_conv.TILE_M == (tiles or (64,))[0]
  for name in names:
    h, w_, c, o, kk, s, p = RESNET18[name]

    def f(x, w, s=s, p=p):
      y, vjp = jax.vjp(lambda x, w: pallas_conv.conv(x, w, k, (s, s), ((p, p), (p, p)), False),
                       x, w)
      return (y,) + vjp(y)
    x = jax.ShapeDtypeStruct((n, h, w_, k * c), dtype)
    w = jax.ShapeDtypeStruct((kk, kk, c, k * o), dtype)
    text = jax.jit(f).trace(x, w).lower(lowering_platforms=('cuda',)).as_text()
    # forward, weight gradient, and the input gradient: one call, or one per stride phase a tap
    # reaches (3x3 stride 2: four; 1x1 stride 2: one).
    want = 6 if (kk, s) == (3, 2) else 3
    assert text.count('__gpu$xla.gpu.triton') == want, name
