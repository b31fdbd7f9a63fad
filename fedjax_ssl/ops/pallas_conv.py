"""Grouped implicit-GEMM 2-D convolution in Pallas (Triton on a GPU, `interpret=True` elsewhere):
forward, input gradient and weight gradient, for NHWC activations whose channels hold G groups
(the client-packed layout of core/packing.py: client g's channels at [g*C, (g+1)*C)).

  conv(x, w, groups, strides, pads)  x [N, H, W, G*C], w [kh, kw, C, G*O] -> [N, Ho, Wo, G*O]

is `lax.conv_general_dilated(x, w, strides, pads, dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
feature_group_count=G)`, with a custom VJP whose input gradient and weight gradient are Pallas
kernels too. Products are accumulated in float32 whatever the input dtype (float32, bfloat16,
float16); the output has the input dtype.

The implicit GEMM (docs/notes/performance.md#perf-68). No patch tensor is built. The padded input is
split into its s*s stride phases (phase (a, b) = x_pad[:, a::s, b::s]; stride 1: one phase, the
padded input itself), each flattened over (N, Hq, Wq) into rows. Output pixel (n, u, v) is computed
at row r = (n*Hq + u)*Wq + v of the same grid, and kernel tap (i, j) reads, for every row r, row
r + (i//s)*Wq + j//s of phase (i%s, j%s): a CONTIGUOUS slice of rows. So one output tile
[TILE_M rows, TILE_N channels] is a sum over the kh*kw taps and the C/TILE_K channel chunks of
[TILE_M, TILE_K] @ [TILE_K, TILE_N] dots of contiguous slices; the grid is (groups, row tiles,
output-channel tiles), and a group's weights and channels are selected by its BlockSpecs alone.
Rows whose (u, v) falls outside [0, Ho) x [0, Wo) (the padding's rows and columns) are computed
and cropped: the price of contiguous taps, (Hq*Wq) / (Ho*Wo) - 1 extra rows (PERF-68 lists it per
ResNet-18 layer).

  * input gradient: for stride 1 the forward kernel on the output gradient with the weights
    flipped and their channel axes swapped (a grouped implicit GEMM); for stride s, each of the s*s
    phases of the input gradient is such a stride-1 convolution with the sub-kernel of the taps
    that reach it (no zeros inserted into the output gradient, no wasted products);
  * weight gradient: its own kernel, dW[tap, c, o] = sum over rows of x_phase[row + offset(tap),
    c] * g[row, o], the rows split into `splits` parts summed in float32 afterwards (so that a
    layer with few channels still has enough programs), grid (groups, splits, taps, C tiles,
    O tiles).

Channel counts are padded to the tile multiples with zeros (ResNet-18's 64..512 need none; its
3-channel stem is padded to 16). Triton needs the loaded tiles' sizes to be powers of two and its
dot operands at least 16 on each side: the tiles below are.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Pads = Tuple[Tuple[int, int], Tuple[int, int]]

# Tiles (why: docs/notes/performance.md#perf-68). Rows of an output tile, output channels of a tile,
# input channels of one dot.
TILE_M = 64
TILE_N = 64
TILE_K = 32
# Weight gradient: rows of the reduction per dot; programs wanted at least (two per SM of an
# H100 / H200, 132 SMs) before the rows are split.
TILE_R = 64
MIN_PROGRAMS = 264
DTYPES = ('float32', 'bfloat16', 'float16')


def available() -> bool:
  """True where the kernels compile natively (Triton: a CUDA or ROCm GPU backend). Elsewhere they
  run only in interpret mode, orders of magnitude slower: never a candidate there."""
  return jax.default_backend() == 'gpu'


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _channel_tile(c: int, widest: int) -> int:
  """The tile of a channel count: the largest power of two from `widest` down to 16 that divides
  it (16 for counts that no such tile divides: they are zero-padded to a multiple of 16)."""
  t = widest
  while t > 16 and c % t:
    t //= 2
  return t


def _compiler_params(acc_elems: int):
  # Triton explicitly: a GPU backend may default pallas_call to Mosaic GPU (jax_pallas_use_mosaic_gpu).
  # 4 warps hold a 64 x 64 float32 accumulator in 32 registers a thread; a larger one gets 8.
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  return pltriton.CompilerParams(num_warps=4 if acc_elems <= 64 * 64 else 8, num_stages=3)


def set_tiles(m: int, n: int, k: int) -> None:
  """Sets TILE_M, TILE_N, TILE_K (for a tile sweep, before anything is traced): powers of two
  >= 16, Triton's smallest dot."""
  for name, t in (('TILE_M', m), ('TILE_N', n), ('TILE_K', k)):
    if t < 16 or t & (t - 1):
      raise ValueError(f'{name}={t}; allowed: a power of two >= 16')
  globals().update(TILE_M=m, TILE_N=n, TILE_K=k)


def _call(kernel, out_shape, grid, in_specs, out_specs, interpret: bool, acc_elems: int):
  kw = {} if interpret else {'compiler_params': _compiler_params(acc_elems)}
  return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                        out_specs=out_specs, interpret=interpret, **kw)


def _interpret(interpret: Optional[bool]) -> bool:
  return not available() if interpret is None else bool(interpret)


def _check(x, w, groups: int) -> Tuple[int, int, int, int, int]:
  """(kh, kw, C, O, G) of a grouped convolution's operands (arrays or ShapeDtypeStructs); one
  line naming the bad value."""
  if len(x.shape) != 4 or len(w.shape) != 4:
    raise ValueError(f'x {x.shape} and w {w.shape}: need x [N, H, W, G*C] and w [kh, kw, C, G*O]')
  kh, kw, c, go = w.shape
  if groups < 1 or x.shape[-1] != groups * c or go % groups:
    raise ValueError(f'groups={groups} does not fit x {x.shape} and w {w.shape}: need '
                     f'x channels = groups * w.shape[2] and w.shape[3] divisible by groups')
  if jnp.dtype(x.dtype).name not in DTYPES or x.dtype != w.dtype:
    raise ValueError(f'dtypes x {x.dtype}, w {w.dtype}; allowed: one of {DTYPES} for both')
  return kh, kw, c, go // groups, groups


def _pad_groups(a: jax.Array, groups: int, per: int, to: int) -> jax.Array:
  """a [..., groups*per] -> [..., groups*to], each group's channels zero-padded to `to`."""
  if per == to:
    return a
  a = a.reshape(a.shape[:-1] + (groups, per))
  a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, to - per)])
  return a.reshape(a.shape[:-2] + (groups * to,))


def _phases(xp: jax.Array, s: Tuple[int, int], rows: int) -> Tuple[jax.Array, int, int]:
  """Padded xp [N, Hp, Wp, Ch] -> its sh*sw stride phases as rows [sh*sw, rows, Ch] (zero rows
  appended up to `rows`), Hq, Wq."""
  n, hp, wp, ch = xp.shape
  sh, sw = s
  hq, wq = -(-hp // sh), -(-wp // sw)
  xp = jnp.pad(xp, ((0, 0), (0, hq * sh - hp), (0, wq * sw - wp), (0, 0)))
  ph = xp.reshape(n, hq, sh, wq, sw, ch).transpose(2, 4, 0, 1, 3, 5).reshape(sh * sw, n * hq * wq, ch)
  return jnp.pad(ph, ((0, 0), (0, rows - n * hq * wq), (0, 0))), hq, wq


def _taps(kh: int, kw: int, s: Tuple[int, int], wq: int) -> Tuple[Tuple[int, int], ...]:
  """(phase, row offset) of each tap (i, j), i-major (the order of w.reshape(kh*kw, ...))."""
  sh, sw = s
  return tuple(((i % sh) * sw + j % sw, (i // sh) * wq + j // sw)
               for i in range(kh) for j in range(kw))


def _forward_padded(xp: jax.Array, w: jax.Array, groups: int, s: Tuple[int, int],
                    interpret: bool) -> jax.Array:
  """Grouped convolution of the already padded xp [N, Hp, Wp, G*C] with w [kh, kw, C, G*O], strides
  s, no padding -> [N, Ho, Wo, G*O]: the Pallas forward kernel (module docstring)."""
  kh, kw, c, o, g = _check(xp, w, groups)
  n, hp, wp, _ = xp.shape
  ho, wo = (hp - kh) // s[0] + 1, (wp - kw) // s[1] + 1
  if ho < 1 or wo < 1:
    raise ValueError(f'padded input {hp}x{wp} is smaller than the kernel {kh}x{kw}')
  bk = _channel_tile(c, TILE_K)
  bn = _channel_tile(o, TILE_N)
  cp, op = _round_up(c, bk), _round_up(o, bn)
  xp = _pad_groups(xp, g, c, cp)
  wt = _pad_groups(jnp.pad(w.reshape(kh * kw, c, g * o), ((0, 0), (0, cp - c), (0, 0))), g, o, op)
  hq, wq = -(-hp // s[0]), -(-wp // s[1])
  m = n * hq * wq
  mp = _round_up(m, TILE_M)
  taps = _taps(kh, kw, s, wq)
  max_off = max(off for _, off in taps)
  ph, _, _ = _phases(xp, s, mp + max_off)
  nk, no = cp // bk, op // bn

  def kernel(x_ref, w_ref, o_ref):
    m0 = pl.multiple_of(pl.program_id(1) * TILE_M, TILE_M)
    acc = jnp.zeros((TILE_M, bn), jnp.float32)
    for t, (p, off) in enumerate(taps):  # static: kh*kw dots per channel chunk

      def chunk(kc, acc, t=t, p=p, off=off):
        c0 = pl.multiple_of(kc * bk, bk)
        a = x_ref[p, pl.ds(m0 + off, TILE_M), pl.ds(c0, bk)]
        b = w_ref[t, pl.ds(c0, bk), :]
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

      acc = jax.lax.fori_loop(0, nk, chunk, acc)
    o_ref[...] = acc.astype(o_ref.dtype)

  out = _call(
      kernel, jax.ShapeDtypeStruct((mp, g * op), xp.dtype), (g, mp // TILE_M, no),
      [pl.BlockSpec((ph.shape[0], ph.shape[1], cp), lambda gi, mi, oi: (0, 0, gi)),
       pl.BlockSpec((kh * kw, cp, bn), lambda gi, mi, oi: (0, 0, gi * no + oi))],
      pl.BlockSpec((TILE_M, bn), lambda gi, mi, oi: (mi, gi * no + oi)), interpret,
      TILE_M * bn)(ph, wt)
  out = out[:m].reshape(n, hq, wq, g, op)[:, :ho, :wo, :, :o]
  return out.reshape(n, ho, wo, g * o)


def _lax_pad(x: jax.Array, pads: Sequence[Tuple[int, int]]) -> jax.Array:
  """x [N, H, W, C] padded (negative: cropped) on H and W."""
  if all(p == (0, 0) for p in pads):
    return x
  zero = jnp.zeros((), x.dtype)
  return jax.lax.pad(x, zero, ((0, 0, 0), (pads[0][0], pads[0][1], 0), (pads[1][0], pads[1][1], 0),
                               (0, 0, 0)))


def _dilated_phase(size: int, k: int, d: int, lo: int, hi: int, r: int):
  """One axis of a convolution of an input dilated by d (lo, hi padding, kernel k): the taps
  reaching outputs y = d*u + r, the input pads (low, high) of their stride-1 convolution on the
  undilated input, and its output length (module docstring: input gradient)."""
  out = (size - 1) * d + 1 + lo + hi - k + 1
  taps = [i for i in range(k) if (r + i - lo) % d == 0]
  n_out = max(0, -(-(out - r) // d))
  if not taps or n_out == 0:
    return taps, (0, 0), n_out, out
  e0 = (r + taps[0] - lo) // d  # input index offset of the first tap; consecutive taps: +1
  low = -e0
  high = n_out + len(taps) - 1 - size - low
  return taps, (low, high), n_out, out


def conv_general(x: jax.Array, w: jax.Array, groups: int, strides: Tuple[int, int], pads: Pads,
                 lhs_dilation: Tuple[int, int] = (1, 1), interpret: Optional[bool] = None
                 ) -> jax.Array:
  """lax.conv_general_dilated(x, w, strides, pads, lhs_dilation, ('NHWC', 'HWIO', 'NHWC'),
  feature_group_count=groups) by the Pallas kernel, without a VJP of its own (the equations of an
  already differentiated program, core/packing.py). x [N, H, W, G*C], w [kh, kw, C, G*O]; pads may
  be negative (cropping); strides and lhs_dilation not both > 1. interpret None: natively on a
  GPU, interpreted elsewhere."""
  _check(x, w, groups)
  interpret = _interpret(interpret)
  strides, lhs_dilation = tuple(strides), tuple(lhs_dilation)
  if lhs_dilation == (1, 1):
    return _forward_padded(_lax_pad(x, pads), w, groups, strides, interpret)
  if strides != (1, 1):
    raise ValueError(f'strides={strides} with lhs_dilation={lhs_dilation}: one of them must be 1')
  kh, kw, _, o, g = _check(x, w, groups)
  n, h, wd, _ = x.shape
  rows, cols = [], []
  for r in range(lhs_dilation[0]):
    rows.append(_dilated_phase(h, kh, lhs_dilation[0], pads[0][0], pads[0][1], r))
  for r in range(lhs_dilation[1]):
    cols.append(_dilated_phase(wd, kw, lhs_dilation[1], pads[1][0], pads[1][1], r))
  ho, wo = rows[0][3], cols[0][3]
  hmax, wmax = -(-ho // lhs_dilation[0]), -(-wo // lhs_dilation[1])
  out = jnp.zeros((lhs_dilation[0], lhs_dilation[1], n, hmax, wmax, g * o), x.dtype)
  for a, (ti, pi, nh, _) in enumerate(rows):
    for b, (tj, pj, nw, _) in enumerate(cols):
      if not ti or not tj or not nh or not nw:
        continue  # no tap reaches this phase: its outputs are zeros
      sub = w[ti[0]:ti[-1] + 1:lhs_dilation[0], tj[0]:tj[-1] + 1:lhs_dilation[1]]
      y = _forward_padded(_lax_pad(x, (pi, pj)), sub, groups, (1, 1), interpret)
      out = out.at[a, b, :, :nh, :nw].set(y)
  out = out.transpose(2, 3, 0, 4, 1, 5).reshape(n, hmax * lhs_dilation[0], wmax * lhs_dilation[1],
                                                g * o)
  return out[:, :ho, :wo]


def weight_grad(x: jax.Array, gy: jax.Array, groups: int, strides: Tuple[int, int], pads: Pads,
                kernel_hw: Tuple[int, int], interpret: Optional[bool] = None) -> jax.Array:
  """The weight gradient of conv(x, w, groups, strides, pads): x [N, H, W, G*C], gy [N, Ho, Wo,
  G*O] -> dW [kh, kw, C, G*O], dW[i, j, c, g*O + o] = sum over n, p, q of x_pad[n, p*sh + i,
  q*sw + j, g*C + c] * gy[n, p, q, g*O + o] (pads may be negative), accumulated in float32, in
  x's dtype: the Pallas weight-gradient kernel (module docstring)."""
  interpret = _interpret(interpret)
  kh, kw = kernel_hw
  n, _, _, gc = x.shape
  if gy.ndim != 4 or gy.shape[0] != n or gy.shape[-1] % groups or gc % groups:
    raise ValueError(f'x {x.shape}, gy {gy.shape}, groups={groups}: need [N, H, W, G*C] and '
                     '[N, Ho, Wo, G*O] with the same N')
  c, o, g = gc // groups, gy.shape[-1] // groups, groups
  _check(x, jax.ShapeDtypeStruct((kh, kw, c, g * o), x.dtype), groups)
  s = tuple(strides)
  xp = _lax_pad(x, pads)
  _, hp, wp, _ = xp.shape
  ho, wo = gy.shape[1], gy.shape[2]
  if (hp - kh) // s[0] + 1 != ho or (wp - kw) // s[1] + 1 != wo:
    raise ValueError(f'gy {gy.shape} is not the output of x {x.shape} padded {pads} with a '
                     f'{kh}x{kw} kernel at strides {s}')
  bc = _channel_tile(c, TILE_K)
  bn = _channel_tile(o, TILE_N)
  cp, op = _round_up(c, bc), _round_up(o, bn)
  hq, wq = -(-hp // s[0]), -(-wp // s[1])
  m = n * hq * wq
  nc, no, t = cp // bc, op // bn, kh * kw
  splits = max(1, min(-(-m // TILE_R), -(-MIN_PROGRAMS // (g * t * nc * no))))
  per = _round_up(-(-m // splits), TILE_R)
  mp = per * splits
  taps = _taps(kh, kw, s, wq)
  max_off = max(off for _, off in taps)
  ph, _, _ = _phases(_pad_groups(xp, g, c, cp), s, mp + max_off)
  # gy on the same row grid, zero at the rows that are not outputs (they add nothing).
  gq = jnp.pad(_pad_groups(gy, g, o, op), ((0, 0), (0, hq - ho), (0, wq - wo), (0, 0)))
  gq = jnp.pad(gq.reshape(m, g * op), ((0, mp - m), (0, 0)))
  sw, wq_ = s[1], wq

  def kernel(x_ref, g_ref, o_ref):
    ti = pl.program_id(2)
    i, j = ti // kw, ti % kw
    p = (i % s[0]) * sw + j % sw
    off = (i // s[0]) * wq_ + j // sw
    r0 = pl.program_id(1) * per

    def chunk(rc, acc):
      r = r0 + rc * TILE_R
      a = x_ref[p, pl.ds(r + off, TILE_R), :]
      b = g_ref[pl.ds(r, TILE_R), :]
      return acc + jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, per // TILE_R, chunk, jnp.zeros((bc, bn), jnp.float32))
    o_ref[0, 0] = acc

  part = _call(
      kernel, jax.ShapeDtypeStruct((splits, t, cp, g * op), jnp.float32), (g, splits, t, nc, no),
      [pl.BlockSpec((ph.shape[0], ph.shape[1], bc), lambda gi, si, ti, ci, oi: (0, 0, gi * nc + ci)),
       pl.BlockSpec((mp, bn), lambda gi, si, ti, ci, oi: (0, gi * no + oi))],
      pl.BlockSpec((1, 1, bc, bn), lambda gi, si, ti, ci, oi: (si, ti, ci, gi * no + oi)),
      interpret, bc * bn)(ph, gq)
  dw = part.sum(0).reshape(t, cp, g, op)[:, :c, :, :o]
  return dw.reshape(kh, kw, c, g * o).astype(x.dtype)


def _flip_swap(w: jax.Array, groups: int) -> jax.Array:
  """w [kh, kw, C, G*O] -> the input gradient's weights [kh, kw, O, G*C]: taps reversed, each
  group's input and output channels swapped."""
  kh, kw, c, go = w.shape
  o = go // groups
  wt = w[::-1, ::-1].reshape(kh, kw, c, groups, o).transpose(0, 1, 4, 3, 2)
  return wt.reshape(kh, kw, o, groups * c)


def input_grad(gy: jax.Array, w: jax.Array, groups: int, strides: Tuple[int, int], pads: Pads,
               in_hw: Tuple[int, int], interpret: Optional[bool] = None) -> jax.Array:
  """The input gradient of conv(x, w, groups, strides, pads) for x of spatial size in_hw: gy
  [N, Ho, Wo, G*O] -> [N, H, W, G*C], as Pallas grouped implicit GEMMs (module docstring)."""
  kh, kw = w.shape[:2]
  ho, wo = gy.shape[1:3]
  tpads = tuple((k - 1 - lo, size - 1 - (out - 1) * st + lo)
                for k, (lo, _), size, out, st in zip((kh, kw), pads, in_hw, (ho, wo), strides))
  return conv_general(gy, _flip_swap(w, groups), groups, (1, 1), tpads, tuple(strides), interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def conv(x: jax.Array, w: jax.Array, groups: int, strides: Tuple[int, int], pads: Pads,
         interpret: Optional[bool] = None) -> jax.Array:
  """Grouped convolution x [N, H, W, G*C] * w [kh, kw, C, G*O] -> [N, Ho, Wo, G*O] (strides,
  non-negative explicit pads ((top, bottom), (left, right))), differentiable: its input and
  weight gradients are the Pallas kernels of `input_grad` and `weight_grad`."""
  _check(x, w, groups)
  if min(min(p) for p in pads) < 0:
    raise ValueError(f'pads={pads}: negative padding is not supported')
  return conv_general(x, w, groups, strides, pads, (1, 1), interpret)


def _conv_fwd(x, w, groups, strides, pads, interpret):
  return conv(x, w, groups, strides, pads, interpret), (x, w)


def _conv_bwd(groups, strides, pads, interpret, res, gy):
  x, w = res
  gy = gy.astype(x.dtype)
  dx = input_grad(gy, w, groups, strides, pads, x.shape[1:3], interpret)
  dw = weight_grad(x, gy, groups, strides, pads, w.shape[:2], interpret)
  return dx, dw


conv.defvjp(_conv_fwd, _conv_bwd)

__all__ = ['DTYPES', 'MIN_PROGRAMS', 'TILE_K', 'TILE_M', 'TILE_N', 'TILE_R', 'available', 'conv',
           'conv_general', 'input_grad', 'set_tiles', 'weight_grad']
