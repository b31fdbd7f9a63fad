"""The persistent cache of a run's compiled programs, and how long a call spent compiling.

Every binary (`experiments.train`, `experiments.reproduce`) calls `enable_cache()` before anything
compiles, so that a second run or seed of a config loads its round step from disk instead of
compiling it again (a first ResNet-18 round on a GPU compiles for minutes:
docs/notes/performance.md#perf-45, #perf-52). One folder holds
everything a run may reuse across processes:

  CACHE_DIR/xla/            JAX's persistent compilation cache (keyed by JAX itself: the program,
                            the compile options and XLA flags, the jax/jaxlib version, the device)
  CACHE_DIR/strategy.json   the execution strategy `strategy='auto'` measured per program
                            (`fedjax_ssl.core.autotune`)
  CACHE_DIR/exports/        the round step serialised by `jax.export`, keyed by the program's
                            identity, so that a second run compiles it without tracing Python
                            (`fedjax_ssl.core.export_cache`)

CACHE_DIR is the binaries' `--cache_dir` flag, else $FEDJAX_SSL_CACHE_DIR, else
$XDG_CACHE_HOME/fedjax_ssl (~/.cache/fedjax_ssl). An empty value or 'none' turns the cache off.
Importing this module changes nothing: a program of your own calls `enable_cache()` to opt in.

A folder that cannot be written is refused before any compute (`CacheError`, one line); an entry
that cannot be read is ignored with a warning (JAX's own reads warn and compile instead,
jax_raise_persistent_cache_errors being False).
"""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import time
from typing import Dict, Iterator, Optional

import jax
from jax import monitoring

ENV_VAR = 'FEDJAX_SSL_CACHE_DIR'
OFF = ('', 'none')
# Programs that compile faster than this are not written: the round step and the evaluation's
# feature extractors pass, the many sub-second helpers would only fill the folder.
MIN_COMPILE_SECONDS = 0.5


class CacheError(ValueError):
  """A cache folder that cannot be used (one line: the path and why)."""


def default_cache_dir() -> str:
  """$FEDJAX_SSL_CACHE_DIR if set (possibly '' = off), else $XDG_CACHE_HOME/fedjax_ssl."""
  if ENV_VAR in os.environ:
    return os.environ[ENV_VAR]
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(base, 'fedjax_ssl')


def resolve_cache_dir(cache_dir: Optional[str]) -> Optional[pathlib.Path]:
  """The cache folder of `cache_dir` (None: `default_cache_dir()`), created and checked writable;
  None when the cache is off. Raises CacheError naming the folder when it cannot be written."""
  value = default_cache_dir() if cache_dir is None else cache_dir
  if value.strip().lower() in OFF:
    return None
  path = pathlib.Path(value).expanduser()
  probe = path / f'.write_probe.{os.getpid()}'
  try:
    (path / 'xla').mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b'')
    probe.unlink()
  except OSError as e:
    raise CacheError(f'cache_dir = {str(path)!r} cannot be written ({e.strerror or e}): give a '
                     "writable folder, or '' to run without the cache") from None
  return path


def enable_cache(cache_dir: Optional[str] = None) -> Optional[pathlib.Path]:
  """Points JAX's persistent compilation cache at CACHE_DIR/xla; returns CACHE_DIR (None: off).

  Process-wide (jax.config); call before the programs to cache are compiled. Raises CacheError
  before any compute when the folder cannot be written.
  """
  path = resolve_cache_dir(cache_dir)
  if path is None:
    return None
  # Imported here: it exists only to re-point a cache JAX may have opened already.
  from jax.experimental.compilation_cache import compilation_cache as cc  # pylint: disable=g-import-not-at-top
  current = jax.config.jax_compilation_cache_dir
  if current and current != str(path / 'xla'):  # JAX opens its cache once: re-point it
    cc.reset_cache()
  jax.config.update('jax_compilation_cache_dir', str(path / 'xla'))
  # JAX's own variable, when set, wins: a user (or a test on a fast machine, whose tiny programs
  # compile under the bar) may cache every program.
  if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', MIN_COMPILE_SECONDS)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  return path


# JAX's monitoring events of one jit compilation (jax/_src/dispatch.py): tracing to a jaxpr,
# lowering to StableHLO, and XLA's compile, which includes a persistent-cache look-up and load.
_EVENTS = {'/jax/core/compile/jaxpr_trace_duration': 'trace',
           '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower',
           '/jax/core/compile/backend_compile_duration': 'xla'}
_CACHE_HIT = '/jax/compilation_cache/cache_hits'
_ACTIVE: list = []  # CompileTimes being filled (listeners are registered once per process)
_REGISTERED = False


class CompileTimes:
  """Seconds spent compiling while a `compile_timer()` block ran, by phase, and cache hits."""

  def __init__(self):
    self.seconds: Dict[str, float] = {'trace': 0.0, 'lower': 0.0, 'xla': 0.0}
    self.cache_hits = 0
    self.wall = 0.0

  @property
  def total(self) -> float:
    return sum(self.seconds.values())

  def to_json(self) -> dict:
    return {'compile_seconds': self.total, **{f'{k}_seconds': v for k, v in self.seconds.items()},
            'persistent_cache_hits': self.cache_hits, 'wall_seconds': self.wall}

  def text(self) -> str:
    hits = f', {self.cache_hits} from the persistent cache' if self.cache_hits else ''
    return (f'{self.total:.1f}s compiling (trace {self.seconds["trace"]:.1f}, lower '
            f'{self.seconds["lower"]:.1f}, XLA {self.seconds["xla"]:.1f}{hits})')


def _on_duration(event: str, duration: float, **_) -> None:
  phase = _EVENTS.get(event)
  if phase is not None:
    for times in _ACTIVE:
      times.seconds[phase] += duration


def _on_event(event: str, **_) -> None:
  if event == _CACHE_HIT:
    for times in _ACTIVE:
      times.cache_hits += 1


@contextlib.contextmanager
def compile_timer() -> Iterator[CompileTimes]:
  """Collects the compile time of every jit compilation inside the block (this process, all
  threads) apart from the run time around it: `times.total`, `times.seconds[phase]`."""
  global _REGISTERED
  if not _REGISTERED:
    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)
    _REGISTERED = True
  times = CompileTimes()
  _ACTIVE.append(times)
  t0 = time.perf_counter()
  try:
    yield times
  finally:
    times.wall = time.perf_counter() - t0
    _ACTIVE.remove(times)


def process_age() -> Optional[float]:
  """Seconds since this process started (Linux /proc), None where that cannot be read: the clock
  of a second run's "process start to first round" (docs/notes/performance.md#perf-60)."""
  try:
    with open('/proc/self/stat') as f:  # field 22, starttime, in clock ticks after boot
      start_ticks = int(f.read().rsplit(')', 1)[1].split()[19])
    with open('/proc/uptime') as f:
      uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError):
    return None


def compiled_flops(compiled) -> float:
  """XLA's FLOP count of a compiled program (its cost analysis)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get('flops', 0.0))


def xla_flops(fn, *args) -> float:
  """XLA's FLOP count of `jax.jit(fn)(*args)`, compiled for the CPU whatever this machine's backend.

  Why the CPU: XLA:GPU hands convolutions to cuDNN as custom calls, which its cost analysis counts
  as nothing: on an H100 it counted 12.9 GFLOP for a ResNet-18 BYOL step that XLA:CPU counts at
  1.00 TFLOP (docs/notes/performance.md#perf-44). The inputs are made abstract, so the compile runs
  on the default device, set here to the CPU."""
  abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  try:
    cpu = jax.local_devices(backend='cpu')[0]
  except RuntimeError:  # JAX_PLATFORMS without 'cpu': count on the default backend
    logging.warning('no CPU backend (JAX_PLATFORMS=%s): FLOPs counted by %s, which may leave out '
                    'convolutions; add cpu to JAX_PLATFORMS for the full count',
                    jax.config.jax_platforms, jax.default_backend())
    return compiled_flops(jax.jit(fn).lower(*abstract).compile())
  with jax.default_device(cpu):
    return compiled_flops(jax.jit(fn).lower(*abstract).compile())
