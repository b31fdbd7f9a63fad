"""Where a round's time goes on the device, read from a `jax.profiler` trace: for the benchmark's
`--profile_dir`, so that a 15-minute GPU lease brings back the numbers, not only a trace to open.

  python -m experiments.profile_summary TRACE_DIR_OR_perfetto_trace.json.gz

`trace(fn, log_dir)` runs fn() under `jax.profiler.trace(..., create_perfetto_trace=True)` and
returns the Perfetto JSON it wrote; `summarize(path)` reads it. Per device process (Perfetto
'/device:GPU:0', ...): the kernel streams' busy time (the union of their kernel intervals, so
overlapping streams count once), the window from the first kernel's start to the last one's end,
the idle gaps inside it (window - busy: launch latency, host work, synchronisation), the kernel
count and mean duration, the time by kernel class (matmul/convolution libraries, copies, XLA's own
fusions) and the top kernels by total time. A trace with no device process (XLA:CPU) reports the
host's threads only.
"""
from __future__ import annotations

import collections
import gzip
import json
import pathlib
import sys
from typing import Any, Callable, Dict, Iterable, List, Tuple

# Substrings of kernel names by class (lower-cased). cuDNN / cuBLAS / CUTLASS kernels (GEMMs and
# convolutions, 'xmma' / 'wgmma' on Hopper) are the work; copies and memsets move data; anything
# else is one of XLA's own generated kernels (fusions, reductions, transposes).
CLASSES = (('library_gemm_conv', ('gemm', 'xmma', 'wgmma', 'cutlass', 'cudnn', 'conv', 'implicit',
                                  'sm90_', 'sm80_', 'ampere_', 'hopper_')),
           ('copy', ('memcpy', 'memset', 'copy')))


def kernel_class(name: str) -> str:
  low = name.lower()
  for cls, keys in CLASSES:
    if any(k in low for k in keys):
      return cls
  return 'xla_fusion_other'


def union_length(intervals: Iterable[Tuple[float, float]]) -> float:
  """Total length covered by [start, end) intervals (overlaps counted once)."""
  total, cur_start, cur_end = 0.0, None, None
  for start, end in sorted(intervals):
    if cur_end is None or start > cur_end:
      if cur_end is not None:
        total += cur_end - cur_start
      cur_start, cur_end = start, end
    else:
      cur_end = max(cur_end, end)
  if cur_end is not None:
    total += cur_end - cur_start
  return total


def _load(path: str) -> List[dict]:
  p = pathlib.Path(path)
  if p.is_dir():
    found = sorted(p.rglob('perfetto_trace.json.gz'))
    if not found:
      raise FileNotFoundError(f'no perfetto_trace.json.gz under {p}')
    p = found[-1]
  opener = gzip.open if p.suffix == '.gz' else open
  with opener(p, 'rt') as f:
    data = json.load(f)
  return data['traceEvents'] if isinstance(data, dict) else data


def summarize(path: str, top: int = 15) -> Dict[str, Any]:
  """The trace's device-time summary (module docstring); times in milliseconds."""
  events = _load(path)
  process = {e['pid']: e['args']['name'] for e in events
             if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  thread = {(e['pid'], e['tid']): e['args']['name'] for e in events
            if e.get('ph') == 'M' and e.get('name') == 'thread_name'}
  spans = collections.defaultdict(list)
  for e in events:
    if e.get('ph') == 'X' and 'dur' in e:
      spans[e['pid']].append(e)
  out: Dict[str, Any] = {'devices': {}}
  for pid, name in sorted(process.items()):
    if not name.startswith('/device:'):
      continue
    kernels = spans.get(pid, [])
    streams = {t for (p, t), n in thread.items() if p == pid and 'stream' in n.lower()}
    if streams:  # XLA:GPU also writes op / module rows over the same time: count kernels only
      kernels = [e for e in kernels if e.get('tid') in streams]
    if not kernels:
      continue
    intervals = [(e['ts'], e['ts'] + e['dur']) for e in kernels]
    window = max(b for _, b in intervals) - min(a for a, _ in intervals)
    busy = union_length(intervals)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    by_class = collections.defaultdict(float)
    for e in kernels:
      by_name[e['name']][0] += e['dur']
      by_name[e['name']][1] += 1
      by_class[kernel_class(e['name'])] += e['dur']
    kernel_time = sum(e['dur'] for e in kernels)
    out['devices'][name] = {
        'window_ms': window / 1e3, 'busy_ms': busy / 1e3, 'idle_ms': (window - busy) / 1e3,
        'busy_fraction': busy / window if window else 0.0, 'kernels': len(kernels),
        'mean_kernel_us': kernel_time / len(kernels),
        'ms_by_class': {k: v / 1e3 for k, v in sorted(by_class.items())},
        'top_kernels': [{'name': n[:160], 'ms': t / 1e3, 'count': c,
                         'class': kernel_class(n)}
                        for n, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
    }
  host = [e for pid, es in spans.items() if not process.get(pid, '').startswith('/device:')
          for e in es]
  if host:
    out['host_threads'] = len({(e['pid'], e.get('tid')) for e in host})
  return out


def trace(fn: Callable[[], Any], log_dir: str) -> str:
  """Runs fn() under the JAX profiler; returns the path of the Perfetto JSON trace it wrote."""
  import jax  # pylint: disable=g-import-not-at-top
  before = set(pathlib.Path(log_dir).rglob('perfetto_trace.json.gz')) if pathlib.Path(
      log_dir).exists() else set()
  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    fn()
  new = sorted(set(pathlib.Path(log_dir).rglob('perfetto_trace.json.gz')) - before)
  return str(new[-1])


def format_summary(summary: Dict[str, Any]) -> str:
  lines = []
  for device, s in summary['devices'].items():
    lines.append(f'{device}: busy {s["busy_ms"]:.1f} of {s["window_ms"]:.1f} ms '
                 f'({100 * s["busy_fraction"]:.0f} %), {s["kernels"]} kernels, mean '
                 f'{s["mean_kernel_us"]:.1f} us; by class: ' +
                 ', '.join(f'{k} {v:.1f} ms' for k, v in s['ms_by_class'].items()))
    for k in s['top_kernels']:
      lines.append(f'  {k["ms"]:9.2f} ms  x{k["count"]:<5d} {k["class"]:17s} {k["name"][:90]}')
  if not summary['devices']:
    lines.append(f'no device in the trace (host threads: {summary.get("host_threads", 0)})')
  return '\n'.join(lines)


if __name__ == '__main__':
  print(format_summary(summarize(sys.argv[1])))
