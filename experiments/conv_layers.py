r"""Per-layer CPU convolution benchmark (issue 30): each convolution layer of the CPU benchmark models,
forward + input gradient + kernel gradient inside a `lax.scan` of steps (as a client trains),
under candidate implementations, beside the same layer's three GEMMs alone, in one process.

  python -m experiments.benchmark --setting=conv_layers --out conv_layers.json
  taskset -c 0 python -m experiments.benchmark --setting=conv_layers --out conv_layers_one_core.json

Candidates (stride 1, explicit padding: the layers measured here; every one computes
`lax.conv_general_dilated`, tests/experiments/test_conv_layers.py in float64):
  * `xla`: `lax.conv_general_dilated` (conv_impl='xla');
  * `im2col`: the library's `layers.im2col_conv` (conv_impl='im2col', the CPU default), one GEMM
    on the kh*kw shifted views concatenated on channels, its custom VJP materialising the patches'
    transpose for the kernel gradient (PERF-23);
  * `im2col_autodiff`: the same patches and GEMM differentiated by JAX;
  * `shifted`: kh*kw GEMMs on the shifted views, accumulated; no patch tensor;
  * `rows`: the kw horizontal shifts concatenated on channels, then kh GEMMs on contiguous row
    ranges of the flattened result (a patch tensor kw times the input instead of kh*kw times; the
    kh - 1 extra rows per image are computed and cropped);
  * `chunk16`: `im2col` over chunks of 16 images in a `lax.map`, so each chunk's patches stay in
    cache (batch 128 layers only);
  * `kernel_grad_gt`: `im2col` with the kernel gradient as (g^T cols)^T, the transposed operand
    being the output gradient (cout columns) rather than the patches;
  * `pallas`: ops/pallas_conv.py's implicit GEMM with one group, its two gradients Pallas kernels
    too (float32 / bfloat16 only; a default variant only on a GPU: elsewhere it runs interpreted,
    docs/notes/performance.md#perf-68).

The client-grouped form (issue 65 item 3): `python -m experiments.conv_layers --out F.json` times,
for each distinct convolution of ResNet-18 (CIFAR stem, 32x32 input) with K clients packed in the
channels, forward + input gradient + weight gradient under GROUPED_IMPLS (`run_grouped`); the
prepared GPU check runs it (`scripts/gpu_check.sh pallas`).

`gemms`: the layer's three GEMMs (cols @ K, g @ K^T, cols^T @ g) in the standard layout on
precomputed, cache-warm operands, the same ReLU mask: the speed the layer would have if building
and moving patches cost nothing. Reported per layer: GFLOP/s of each (2 * M * K * N per GEMM, three
GEMMs per step) and `ratio_to_gemms`. The ReLU mask on the output gradient keeps the forward
product live, as in a network.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from fedjax_ssl.models import layers
from fedjax_ssl.ops import pallas_conv

Pads = Tuple[Tuple[int, int], Tuple[int, int]]
STEPS = 25  # steps per timed scan

# name -> (batch, H, W, cin, cout, k, padding): the convolutions of the CPU benchmark models.
LAYERS: Dict[str, Tuple[int, ...]] = {
    # the cross-device round's CNN: batch 10
    'cross_device_cnn/conv1': (10, 32, 32, 3, 32, 3, 1),
    'cross_device_cnn/conv2': (10, 16, 16, 32, 64, 3, 1),
    # the FedBYOL benchmark's small CNN: batch 64 per view, both views in one batch
    'small_cnn/conv1': (128, 28, 28, 1, 16, 3, 1),
    'small_cnn/conv2': (128, 14, 14, 16, 32, 3, 1),
}


def _padded(x: jax.Array, pads: Pads) -> jax.Array:
  return jnp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))


def conv_xla(x: jax.Array, k: jax.Array, pads: Pads) -> jax.Array:
  """x [B, H, W, cin], k [kh, kw, cin, cout] -> [B, Ho, Wo, cout], stride 1."""
  return jax.lax.conv_general_dilated(x, k, (1, 1), pads,
                                      dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def conv_im2col(x: jax.Array, k: jax.Array, pads: Pads) -> jax.Array:
  """The library's implementation (layers.im2col_conv), stride 1."""
  return layers.im2col_conv(x, k, (1, 1), pads)


def _patches(x: jax.Array, kh: int, kw: int) -> Tuple[jax.Array, int, int]:
  """Padded x [B, Hp, Wp, c] -> patches [B * Ho * Wo, kh * kw * c] ((i, j, c) order), Ho, Wo."""
  b, hp, wp, c = x.shape
  ho, wo = hp - kh + 1, wp - kw + 1
  cols = jnp.concatenate([x[:, i:i + ho, j:j + wo, :] for i in range(kh) for j in range(kw)], -1)
  return cols.reshape(b * ho * wo, kh * kw * c), ho, wo


def conv_im2col_autodiff(x: jax.Array, k: jax.Array, pads: Pads) -> jax.Array:
  kh, kw, _, cout = k.shape
  cols, ho, wo = _patches(_padded(x, pads), kh, kw)
  return jnp.dot(cols, k.reshape(-1, cout)).reshape(x.shape[0], ho, wo, cout)


@jax.custom_vjp
def _matmul_gt(cols: jax.Array, kmat: jax.Array) -> jax.Array:
  return jnp.dot(cols, kmat)


def _matmul_gt_fwd(cols, kmat):
  return jnp.dot(cols, kmat), (cols, kmat)


def _matmul_gt_bwd(res, g):
  cols, kmat = res
  g_t = jax.lax.optimization_barrier(g.T)  # keep the transpose: a plain [N, M] @ [M, K] GEMM
  return jnp.dot(g, kmat.T), jnp.dot(g_t, cols).T


_matmul_gt.defvjp(_matmul_gt_fwd, _matmul_gt_bwd)


def conv_kernel_grad_gt(x: jax.Array, k: jax.Array, pads: Pads) -> jax.Array:
  kh, kw, _, cout = k.shape
  cols, ho, wo = _patches(_padded(x, pads), kh, kw)
  return _matmul_gt(cols, k.reshape(-1, cout)).reshape(x.shape[0], ho, wo, cout)


def conv_shifted(x: jax.Array, k: jax.Array, pads: Pads) -> jax.Array:
  kh, kw, cin, cout = k.shape
  x = _padded(x, pads)
  b, ho, wo = x.shape[0], x.shape[1] - kh + 1, x.shape[2] - kw + 1
  y = sum(jnp.dot(x[:, i:i + ho, j:j + wo, :].reshape(-1, cin), k[i, j])
          for i in range(kh) for j in range(kw))
  return y.reshape(b, ho, wo, cout)


def conv_rows(x: jax.Array, k: jax.Array, pads: Pads) -> jax.Array:
  kh, kw, cin, cout = k.shape
  x = _padded(x, pads)
  b, hp, wp, _ = x.shape
  ho, wo = hp - kh + 1, wp - kw + 1
  z = jnp.concatenate([x[:, :, j:j + wo, :] for j in range(kw)], -1)   # [B, Hp, Wo, kw * cin]
  n = b * hp * wo
  # Row r of image b at offset i is flat row (b * Hp + r + i) * Wo: a contiguous range per i. The
  # zero rows appended let the last image's ranges run past its end (those outputs are cropped).
  zf = jnp.pad(z.reshape(n, kw * cin), ((0, (kh - 1) * wo), (0, 0)))
  y = sum(jnp.dot(zf[i * wo:i * wo + n], k[i].reshape(kw * cin, cout)) for i in range(kh))
  return y.reshape(b, hp, wo, cout)[:, :ho]


def conv_chunked(x: jax.Array, k: jax.Array, pads: Pads, chunk: int = 16) -> jax.Array:
  b = x.shape[0]
  if b % chunk:
    raise ValueError(f'batch {b} is not a multiple of the chunk {chunk}')
  y = jax.lax.map(lambda xc: conv_im2col(xc, k, pads), x.reshape((b // chunk, chunk) + x.shape[1:]))
  return y.reshape((b,) + y.shape[2:])


def conv_pallas(x: jax.Array, k: jax.Array, pads: Pads) -> jax.Array:
  """ops/pallas_conv.py with one group, stride 1 (interpreted off a GPU)."""
  return pallas_conv.conv(x, k, 1, (1, 1), pads)


CANDIDATES: Dict[str, Callable[[jax.Array, jax.Array, Pads], jax.Array]] = {
    'xla': conv_xla,
    'im2col': conv_im2col,
    'im2col_autodiff': conv_im2col_autodiff,
    'shifted': conv_shifted,
    'rows': conv_rows,
    'chunk16': conv_chunked,
    'kernel_grad_gt': conv_kernel_grad_gt,
    'pallas': conv_pallas,
}


def default_variants() -> List[str]:
  """The candidates timed by default: all, less 'pallas' where it would run interpreted."""
  return [v for v in CANDIDATES if v != 'pallas' or pallas_conv.available()]


def _conv_loop(conv, pads: Pads):
  """Per step: y = conv(x, k); a ReLU's backward on g; dx, dk; k updated. Returns the dx's."""
  def body(k, xg):
    x, g = xg
    y, vjp = jax.vjp(lambda x, k: conv(x, k, pads), x, k)
    dx, dk = vjp(jnp.where(y > 0, g, 0.0))
    return k - 1e-4 * dk, dx
  return jax.jit(lambda k, xs, gs: jax.lax.scan(body, k, (xs, gs)))


def _gemm_loop():
  """The three GEMMs of the layer on fixed operands (cols, cols^T), the input gradient carried
  (no per-step output buffer)."""
  def body(cols, cols_t, carry, g):
    w, _ = carry
    g = jnp.where(jnp.dot(cols, w) > 0, g, 0.0)
    return (w - 1e-4 * jnp.dot(cols_t, g), jnp.dot(g, w.T)), None
  return jax.jit(lambda w, c, ct, gs: jax.lax.scan(functools.partial(body, c, ct),
                                                   (w, jnp.zeros_like(c)), gs)[0])


def _median_seconds(f, args, repeats: int) -> float:
  jax.block_until_ready(f(*args))  # compile + warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure_layer(name: str, variants: Sequence[str], repeats: int) -> Dict:
  """GFLOP/s of each variant and of the GEMMs alone for LAYERS[name], and the ratios."""
  b, h, w, cin, cout, kh, pad = LAYERS[name]
  pads = ((pad, pad), (pad, pad))
  ho, wo = h + 2 * pad - kh + 1, w + 2 * pad - kh + 1
  kx, kk, kg = jax.random.split(jax.random.PRNGKey(0), 3)
  xs = jax.random.normal(kx, (STEPS, b, h, w, cin))
  kernel = jax.random.normal(kk, (kh, kh, cin, cout)) * 0.05
  gs = jax.random.normal(kg, (STEPS, b, ho, wo, cout))
  m, k = b * ho * wo, kh * kh * cin
  flops = 3 * 2 * m * k * cout * STEPS
  cols, _, _ = _patches(_padded(xs[0], pads), kh, kh)
  gemm = flops / _median_seconds(_gemm_loop(), (kernel.reshape(k, cout), cols, cols.T,
                                                gs.reshape(STEPS, m, cout)), repeats) / 1e9
  row = {'layer': name, 'batch_h_w_cin_cout_k_pad': [b, h, w, cin, cout, kh, pad],
         'mflop_per_gemm': 2 * m * k * cout / 1e6, 'gemms_gflops': gemm,
         'library_conv_impl': layers.resolve_conv_impl('auto'), 'gflops': {}, 'ratio_to_gemms': {}}
  for v in variants:
    if v == 'chunk16' and b % 16:
      continue
    rate = flops / _median_seconds(_conv_loop(CANDIDATES[v], pads), (kernel, xs, gs),
                                   repeats) / 1e9
    row['gflops'][v] = rate
    row['ratio_to_gemms'][v] = rate / gemm
  return row


def run(variants: Sequence[str], repeats: int, layer_names: Sequence[str] = tuple(LAYERS)
        ) -> List[Dict]:
  """One row per layer (measure_layer), printed as it completes."""
  rows = []
  for name in layer_names:
    row = measure_layer(name, variants, repeats)
    best = max(row['gflops'], key=row['gflops'].get)
    print(f'{name:24s} gemms {row["gemms_gflops"]:6.1f} GFLOP/s | ' + ' '.join(
        f'{v} {g:5.1f} ({row["ratio_to_gemms"][v]:.2f}x)' for v, g in row['gflops'].items())
          + f' | best {best}', flush=True)
    rows.append(row)
  return rows


# --- client-grouped layers (issue 65 item 3) ------------------------------------------------------

# name -> (H, W, cin, cout, k, stride, padding) of one client: the distinct convolutions of
# ResNet-18 (models/resnet.py: 3x3 stride-1 stem, BasicBlocks, 1x1 stride-2 shortcuts) at 32x32.
RESNET18_LAYERS: Dict[str, Tuple[int, ...]] = {
    'stem': (32, 32, 3, 64, 3, 1, 1),
    'layer1': (32, 32, 64, 64, 3, 1, 1),
    'layer2.down': (32, 32, 64, 128, 3, 2, 1),
    'layer2.shortcut': (32, 32, 64, 128, 1, 2, 0),
    'layer2': (16, 16, 128, 128, 3, 1, 1),
    'layer3.down': (16, 16, 128, 256, 3, 2, 1),
    'layer3.shortcut': (16, 16, 128, 256, 1, 2, 0),
    'layer3': (8, 8, 256, 256, 3, 1, 1),
    'layer4.down': (8, 8, 256, 512, 3, 2, 1),
    'layer4.shortcut': (8, 8, 256, 512, 1, 2, 0),
    'layer4': (4, 4, 512, 512, 3, 1, 1),
}
# How the K clients' convolution runs: `pallas` (ops/pallas_conv.py on the packed layout [N, H, W,
# K*C]), `grouped` (XLA's grouped convolution on the packed layout, feature_group_count = K: what
# conv_impl='packed' runs; cuDNN on a GPU), `vmap` (jax.vmap of the per-client convolution over
# stacked [K, N, H, W, C] operands: the default program's, JAX's batching rule with its transposes).
GROUPED_IMPLS = ('pallas', 'grouped', 'vmap')


def _grouped_fn(impl: str, k: int, strides: Tuple[int, int], pads: Pads) -> Callable:
  """(x, w, g) -> (y, dx, dw) of the K clients' convolution under `impl`; x packed [N, H, W, K*C]
  (stacked [K, N, H, W, C] for vmap), w [kh, kw, C, K*O] ([K, kh, kw, C, O])."""
  dn = ('NHWC', 'HWIO', 'NHWC')
  if impl == 'pallas':
    conv = lambda x, w: pallas_conv.conv(x, w, k, strides, pads)  # noqa: E731
  elif impl == 'grouped':
    conv = lambda x, w: jax.lax.conv_general_dilated(  # noqa: E731
        x, w, strides, pads, dimension_numbers=dn, feature_group_count=k)
  elif impl == 'vmap':
    conv = jax.vmap(lambda x, w: jax.lax.conv_general_dilated(x, w, strides, pads,
                                                              dimension_numbers=dn))
  else:
    raise ValueError(f'impl={impl!r}; allowed: {GROUPED_IMPLS}')

  def step(x, w, g):
    y, vjp = jax.vjp(conv, x, w)
    return (y,) + vjp(g)
  return jax.jit(step)


def measure_grouped_layer(name: str, shape: Sequence[int], impls: Sequence[str], k: int, batch: int,
                          dtype, repeats: int) -> Dict:
  """Median seconds of forward + input gradient + weight gradient of one layer for K clients under
  each impl, and TFLOP/s (3 * 2 * batch * Ho * Wo * kh * kw * cin * cout * K)."""
  h, w, cin, cout, kk, s, p = shape
  pads = ((p, p), (p, p))
  ho, wo = (h + 2 * p - kk) // s + 1, (w + 2 * p - kk) // s + 1
  flops = 3 * 2 * batch * ho * wo * kk * kk * cin * cout * k
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  xs = jax.random.normal(keys[0], (k, batch, h, w, cin), dtype)
  ws = (jax.random.normal(keys[1], (k, kk, kk, cin, cout)) * 0.05).astype(dtype)
  gs = jax.random.normal(keys[2], (k, batch, ho, wo, cout), dtype)
  packed = lambda a: jnp.moveaxis(a, 0, -2).reshape(a.shape[1:-1] + (k * a.shape[-1],))  # noqa: E731
  row = {'layer': name, 'h_w_cin_cout_k_stride_pad': list(shape), 'clients': k, 'batch': batch,
         'dtype': jnp.dtype(dtype).name, 'gflop': flops / 1e9, 'seconds': {}, 'tflops': {}}
  for impl in impls:
    args = (xs, ws, gs) if impl == 'vmap' else (packed(xs), packed(ws), packed(gs))
    sec = _median_seconds(_grouped_fn(impl, k, (s, s), pads), args, repeats)
    row['seconds'][impl], row['tflops'][impl] = sec, flops / sec / 1e12
  return row


def run_grouped(impls: Sequence[str], k: int, batch: int, dtype, repeats: int,
                layer_names: Sequence[str] = tuple(RESNET18_LAYERS),
                shapes: Dict[str, Tuple[int, ...]] = RESNET18_LAYERS) -> List[Dict]:
  """One row per layer (measure_grouped_layer), printed as it completes."""
  rows = []
  for name in layer_names:
    row = measure_grouped_layer(name, shapes[name], impls, k, batch, dtype, repeats)
    ref = row['seconds'].get('grouped')
    print(f'{name:16s} {row["gflop"]:7.1f} GFLOP | ' + ' '.join(
        f'{i} {sec * 1e3:8.3f} ms ({row["tflops"][i]:6.1f} TFLOP/s'
        + (f', {sec / ref:.2f}x grouped)' if ref else ')') for i, sec in row['seconds'].items()),
          flush=True)
    rows.append(row)
  return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
  """python -m experiments.conv_layers: the client-grouped ResNet-18 layers (run_grouped) to JSON."""
  import argparse  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  ap = argparse.ArgumentParser(description=main.__doc__)
  ap.add_argument('--impls', default=','.join(GROUPED_IMPLS))
  ap.add_argument('--clients', type=int, default=10)
  ap.add_argument('--batch', type=int, default=128, help='images per client (both views of 64)')
  ap.add_argument('--dtype', default='bfloat16', choices=('float32', 'bfloat16'))
  ap.add_argument('--repeats', type=int, default=5)
  ap.add_argument('--layers', default='', help='comma-separated names of RESNET18_LAYERS (all)')
  ap.add_argument('--tiles', default='',
                  help='M,N,K: the Pallas kernels\' tiles (pallas_conv.set_tiles; default theirs)')
  ap.add_argument('--smoke', action='store_true',
                  help='two tiny layers (stride 1 and 2) for a CPU test of this program')
  ap.add_argument('--out', required=True)
  a = ap.parse_args(argv)
  impls = [i for i in a.impls.split(',') if i]
  shapes = ({'tiny': (6, 6, 3, 8, 3, 1, 1), 'tiny.down': (6, 6, 8, 16, 3, 2, 1)} if a.smoke
            else RESNET18_LAYERS)
  names = [n for n in a.layers.split(',') if n] or list(shapes)
  bad = [i for i in impls if i not in GROUPED_IMPLS] + [n for n in names if n not in shapes]
  if bad:
    raise SystemExit(f'error: {bad[0]!r} is not an impl {GROUPED_IMPLS} nor a layer {tuple(shapes)}')
  if a.tiles:
    try:
      pallas_conv.set_tiles(*(int(t) for t in a.tiles.split(',')))
    except (ValueError, TypeError) as e:
      raise SystemExit(f'error: --tiles={a.tiles!r}: {e} (need M,N,K)') from None
  info = {'backend': jax.default_backend(), 'device': jax.devices()[0].device_kind,
          'jax': jax.__version__, 'pallas_native': pallas_conv.available(), 'clients': a.clients,
          'batch': a.batch, 'dtype': a.dtype, 'repeats': a.repeats,
          'tiles': {'M': pallas_conv.TILE_M, 'N': pallas_conv.TILE_N, 'K': pallas_conv.TILE_K,
                    'R': pallas_conv.TILE_R}}
  print(json.dumps(info), flush=True)
  # The check's stage limit sends SIGTERM: exit through the `finally` below, keeping the rows.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
  rows = []
  try:
    rows = run_grouped(impls, a.clients, a.batch, jnp.dtype(a.dtype), a.repeats, names, shapes)
  finally:  # what was measured before a time limit or a failure still comes back
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, 'w') as f:
      json.dump([info] + rows, f, indent=1)


if __name__ == '__main__':
  main()
