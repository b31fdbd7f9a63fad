"""What besides the config sets a run's float rounding, recorded in WORKDIR/strategy.json so that a
resume keeps it or says it cannot: the strategy the run resolved (`stored_strategy`,
`strategy_record`) and the host it started on (`numerics_host`, `host_change`)."""
from __future__ import annotations

import functools
import os
import pathlib
import platform

import jax

from fedjax_ssl.core import autotune, strategies
from fedjax_ssl.runs import checkpoint, logging_utils
from fedjax_ssl.runs.run_dir import RunDir


def stored_strategy(rundir: RunDir, ckpt: checkpoint.Checkpointer, chunk: int,
                    console: logging_utils.Console) -> dict | None:
  """The strategy of the run a resume continues (WORKDIR/strategy.json), None for a fresh start.
  A workdir with checkpoints but no record ran before strategies were measured: the static default
  of this backend, which is what 'auto' was then."""
  if not (ckpt.all_rounds() or ckpt.moved_aside()):
    return None
  path = rundir.strategy_file
  if path.exists():
    try:
      return rundir.read_json(path)
    except ValueError as e:
      console.report(f'warning: {path} cannot be read ({e}): resuming under the static default '
                     'strategy; the result may differ from the run\'s at float rounding')
  return {'strategy': strategies.default_strategy(), 'map_chunk_size': chunk, 'source': 'workdir'}


def strategy_record(choice: autotune.Choice, host: dict) -> dict:
  """strategy.json (and results.json's 'strategy'): the resolved strategy and the host it ran on."""
  return {**choice.to_json(), 'host': host}


# The widest vector instruction set in /proc/cpuinfo's flags, widest first.
_ISAS = (('avx512f', 'avx512'), ('avx2', 'avx2'), ('avx', 'avx'), ('sse4_2', 'sse4.2'))


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
  """The host CPU as /proc/cpuinfo's first processor names it: model name, family / model /
  stepping, cache size and widest vector instruction set, e.g. 'AMD EPYC (family 25, model 17,
  stepping 1, 512 KB cache, avx512)' (a virtual machine's model name alone can be generic);
  platform.processor() where there is no /proc/cpuinfo."""
  try:
    first = pathlib.Path('/proc/cpuinfo').read_text().split('\n\n', 1)[0]
  except OSError:
    return platform.processor() or 'unknown'
  fields = {k.strip(): v.strip()
            for k, _, v in (line.partition(':') for line in first.splitlines())}
  flags = set(fields.get('flags', '').split())
  isa = next((name for flag, name in _ISAS if flag in flags), 'unknown')
  detail = ', '.join(f'{name} {fields[key]}' for key, name in
                     (('cpu family', 'family'), ('model', 'model'), ('stepping', 'stepping'))
                     if key in fields)
  cache = f"{fields['cache size']} cache, " if 'cache size' in fields else ''
  name = fields.get('model name') or platform.processor() or 'unknown'
  return f'{name} ({detail + ", " if detail else ""}{cache}{isa})'


def numerics_host() -> dict:
  """What besides the config and the strategy sets a run's float rounding: the backend, its device,
  jax's version and, on CPU, the threads XLA may use (the CPUs this process may run on) and the
  CPU (`cpu_model`). XLA:CPU splits the sums of matrix products and convolutions across its
  threads, so the same run on 1 and on 2 threads rounds differently from the first round on
  (docs/notes/testing.md#test-18); so did two runs whose records were otherwise equal, on the
  machines of two sessions (TEST-24)."""
  backend = jax.default_backend()
  return {'backend': backend, 'device_kind': jax.local_devices()[0].device_kind,
          'jax': jax.__version__,
          'cpu_threads': len(os.sched_getaffinity(0)) if backend == 'cpu' else None,
          'cpu': cpu_model() if backend == 'cpu' else None}


def host_change(stored: dict | None, current: dict) -> str | None:
  """The warning for a resume on another numerics host than the run started on (`numerics_host`;
  None when the same, or when the workdir predates the record). Only the keys the stored record
  holds are compared: a record from before a key was added says nothing about it."""
  host = (stored or {}).get('host')
  if host is None:
    return None
  changed = ', '.join(f'{k} {host[k]!r} -> {v!r}' for k, v in current.items()
                      if k in host and host[k] != v)
  if not changed:
    return None
  return (f'warning: this run started on another host ({changed}): the rounds from here may round '
          'floats differently, so they may not be bit-identical to an uninterrupted run on the '
          'first one (the numbers stay valid; docs/notes/testing.md#test-18)')
