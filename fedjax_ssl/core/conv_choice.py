"""conv_impl='measured' (issue 65): each convolution of a client-packed program computed by the
implementation that measured fastest for its shape.

Under `core.packing.vmap` every packable convolution equation of the local step (the forward
convolution, its input gradient and its kernel gradient are three equations, each decided on its
own) has candidates `packing.candidates` (of packing.IMPLS):
  grouped  one grouped convolution on the packed operands (feature or batch groups = clients);
  loop     one dense convolution per client on its slice of the packed operands, concatenated;
  vmap     jax.vmap's batching rule on the stacked operands (what conv_impl='xla' runs);
  pallas   ops/pallas_conv.py's grouped implicit GEMM (groups = clients), only on a GPU backend
           (elsewhere Pallas runs interpreted, orders of magnitude slower: never timed, never
           chosen, and a stored 'pallas' choice is measured again) and for the equations
           `packing.pallas_applies` accepts.
The first time a (device kind, jax version, client count, convolution) key is seen, each candidate
is compiled alone and timed (median of REPEATS calls on random operands of the equation's shapes),
the fastest is kept in CACHE_DIR/conv_impl.json beside strategy.json (core/compilation.py), and
later traces and runs read it. `recorded()` is this process's choices, for the run's record and the
benchmark's output. A choice file that is not the JSON this module writes raises one line naming
it before any compute; one that cannot be read (permissions, I/O) is ignored with a warning.
"""
from __future__ import annotations

import json
import logging
import pathlib
import statistics
import time
from typing import Dict, List, Optional

import jax
import numpy as np

from fedjax_ssl import files
from fedjax_ssl.core import compilation, packing

FILE = 'conv_impl.json'
VERSION = 1
REPEATS = 5

# key -> {'impl', 'seconds': {impl: median seconds}, 'source': 'measured' | 'cache'} of this process.
_RECORD: Dict[str, dict] = {}


def recorded() -> Dict[str, dict]:
  """The choices this process made or read so far (a copy), keyed like the file."""
  return {k: dict(v) for k, v in _RECORD.items()}


def reset() -> None:
  """Forgets this process's choices (the file is kept)."""
  _RECORD.clear()


def cache_dir() -> Optional[pathlib.Path]:
  """CACHE_DIR: the folder of JAX's compilation cache when a binary enabled it (CACHE_DIR/xla),
  else compilation.default_cache_dir(); None when the cache is off."""
  xla = jax.config.jax_compilation_cache_dir
  if xla and pathlib.Path(xla).name == 'xla':
    return pathlib.Path(xla).parent
  value = compilation.default_cache_dir()
  return None if value.strip().lower() in compilation.OFF else pathlib.Path(value).expanduser()


def read(path: pathlib.Path) -> Dict[str, dict]:
  """The choices stored at `path` ({} if absent or unreadable, with a warning); a damaged file
  raises ValueError naming it and the bad value."""
  try:
    text = path.read_text()
  except FileNotFoundError:
    return {}
  except OSError as e:
    logging.warning('conv_impl choices %s cannot be read (%s): ignored, measuring', path, e)
    return {}
  try:
    data = json.loads(text)
  except ValueError as e:
    raise ValueError(f'{path} is not JSON ({e}); delete it to measure again') from None
  if not isinstance(data, dict):
    raise ValueError(f'{path} holds {type(data).__name__}, not an object of choices; delete it '
                     'to measure again')
  for key, entry in data.items():
    impl = entry.get('impl') if isinstance(entry, dict) else entry
    if impl not in packing.IMPLS:
      raise ValueError(f'{path}: entry {key!r} has impl={impl!r}; allowed: {packing.IMPLS} '
                       '(delete the file to measure again)')
  return data


def choice_key(eqn, vals, k: int) -> str:
  """The key of a convolution equation of K clients on this device and jax version."""
  return f'{jax.devices()[0].device_kind}|jax {jax.__version__}|K={k}|{packing.conv_key(eqn, vals)}'


def time_candidates(eqn, vals: List[packing.Value], k: int, case: str,
                    repeats: int = REPEATS) -> Dict[str, float]:
  """{impl: median seconds} of the equation under every candidate, on random operands."""
  rs = np.random.RandomState(0)
  arrays = [np.asarray(rs.standard_normal(v.array.shape), v.array.dtype) for v in vals]
  seconds = {}
  for impl in packing.candidates(eqn, vals, case):
    fn = packing.conv_impl_fn(impl)

    def run(*arrs, fn=fn):
      values = [packing.Value(a, v.form, v.shape) for a, v in zip(arrs, vals)]
      out = fn(eqn, values, k, case)
      return packing.packed(out, k) if out.form != packing.SHARED else out.array

    f = jax.jit(run)
    # Called while the round is traced: without ensure_compile_time_eval the calls would be staged
    # into that program (and the timing would measure staging), not run.
    with jax.ensure_compile_time_eval():
      jax.block_until_ready(f(*arrays))  # compile and warm up
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*arrays))
        times.append(time.perf_counter() - start)
    seconds[impl] = statistics.median(times)
  return seconds


def choose(eqn, vals: List[packing.Value], k: int, case: str) -> str:
  """The implementation of a packable convolution equation: this process's choice, else the
  file's, else measured now (and stored). Called by packing.vmap at trace time."""
  key = choice_key(eqn, vals, k)
  if key not in _RECORD:
    folder = cache_dir()
    path = folder / FILE if folder else None
    stored = read(path) if path else {}
    usable = packing.candidates(eqn, vals, case)
    entry = stored.get(key)
    if isinstance(entry, dict) and entry['impl'] not in usable:
      logging.warning('conv_impl choices %s: %r for %s cannot run here (candidates %s): measuring',
                      path, entry['impl'], key, usable)
      entry = None
    if isinstance(entry, dict):
      _RECORD[key] = {'impl': entry['impl'], 'seconds': entry.get('seconds', {}),
                      'source': 'cache'}
    else:
      seconds = time_candidates(eqn, vals, k, case)
      impl = min(seconds, key=seconds.get)
      _RECORD[key] = {'impl': impl, 'seconds': seconds, 'source': 'measured'}
      if path:
        stored = read(path)  # again: another process may have added entries meanwhile
        stored[key] = {'version': VERSION, 'impl': impl, 'seconds': seconds, 'case': case,
                       'measured_at': time.strftime('%Y-%m-%dT%H:%M:%S')}
        try:
          path.parent.mkdir(parents=True, exist_ok=True)
          files.write_json(path, stored, indent=1)
        except OSError as e:
          logging.warning('conv_impl choices %s cannot be written (%s): kept for this process',
                          path, e)
    entry = _RECORD[key]
    logging.info('conv %s (%s): %s [%s] %s', case, key, entry['impl'], entry['source'],
                 ' '.join(f'{i} {s * 1e3:.3f} ms' for i, s in entry['seconds'].items()))
  return _RECORD[key]['impl']


def text() -> List[str]:
  """One line per recorded choice: the candidates' times (ms) and the choice."""
  return [f'{key.split("|", 3)[-1]}: ' + ' '.join(
      f'{i} {s * 1e3:.3f} ms' for i, s in e['seconds'].items()) + f' -> {e["impl"]} ({e["source"]})'
          for key, e in _RECORD.items()]


__all__ = ['FILE', 'REPEATS', 'cache_dir', 'choice_key', 'choose', 'read', 'recorded', 'reset',
           'text', 'time_candidates']
