"""XLA flags of the test session, and the environment of a binary a test starts.

The session (tests/conftest.py) adds four virtual CPU devices, so the 'shard' strategy runs on a
real mesh, and compiles fast (backend optimisation off, the loop fusion emitters): the suite's
programs are tiny and each is compiled once, so compiling dominates (docs/notes/testing.md#test-14,
#test-17). A binary a test starts gets the caller's own XLA_FLAGS (e.g. --xla_cpu_max_isa, so an
ISA check reaches it too) without the virtual devices, like a user's run.
"""
import atexit
import os
import pathlib
import shutil
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]

# The caller's XLA_FLAGS, kept across the xdist workers (which inherit the session's flags).
_CALLER_VAR = 'FEDJAX_SSL_TEST_CALLER_XLA_FLAGS'
_DEVICES = '--xla_force_host_platform_device_count=4'
# Backend optimisation off, and XLA:CPU's older loop emitters for fusions instead of its MLIR fusion
# emitters: the same programs compile 2-3x faster (a tiny FedAvg round 3.05 -> 1.08 s, FedU2 4.54 ->
# 2.12, Hetero-SSFL 8.71 -> 5.15) and run 2-15 % slower, which a suite that runs each program once
# wants (docs/notes/testing.md#test-17).
_FAST_COMPILE = '--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false'


def caller_flags() -> str:
  return os.environ.get(_CALLER_VAR, os.environ.get('XLA_FLAGS', ''))


def _fast_compile(flags: str) -> str:
  """`flags` with the fast compile added, unless they set an optimisation level themselves."""
  return flags if 'xla_backend_optimization_level' in flags else f'{flags} {_FAST_COMPILE}'


def set_session_flags() -> None:
  """Sets XLA_FLAGS for this process; call before anything imports jax (XLA reads them once).

  Also the binaries' cache folder (fedjax_ssl/core/compilation.py): one of this process's own
  instead of the user's ~/.cache/fedjax_ssl."""
  caller = caller_flags()
  os.environ[_CALLER_VAR] = caller
  os.environ['XLA_FLAGS'] = f'{_fast_compile(caller)} {_DEVICES}'.strip()
  cache = tempfile.mkdtemp(prefix='fedjax_ssl_test_cache_')  # one per xdist worker
  atexit.register(shutil.rmtree, cache, ignore_errors=True)
  os.environ['FEDJAX_SSL_CACHE_DIR'] = cache


def binary_env(optimized: bool = False) -> dict:
  """os.environ for a binary: PYTHONPATH at the repository, one CPU device, the caller's flags.

  optimized: False keeps the session's fast compile (binaries that only train and check numbers);
    True compiles as a user's run does (binaries whose output measures compiled code: timings,
    memory, throughput).
  """
  env = dict(os.environ, PYTHONPATH=str(REPO))
  env.pop(_CALLER_VAR, None)
  flags = caller_flags()
  env['XLA_FLAGS'] = (flags if optimized else _fast_compile(flags)).strip()
  return env
