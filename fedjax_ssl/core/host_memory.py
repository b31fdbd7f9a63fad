"""Keep freed host memory in the process (glibc), so repeated XLA:CPU executions page-fault less.

XLA:CPU allocates each execution's temporary buffer afresh and frees it when the execution ends.
glibc serves a block above its mmap threshold (dynamic, at most 32 MiB) with a fresh `mmap` and
returns it with `munmap`, so every execution writes to pages the kernel has to fault in and zero
again: a FedBYOL small-CNN step of batch 64 spent a large part of every call in minor page
faults (docs/notes/performance.md#perf-14). Inside one
long program (the round step's loop over steps) the buffer is faulted in once, which is why a step
looked cheaper there.

Nothing here runs on import: the binaries (experiments/train.py, benchmark/__main__.py,
reproduce.py) call `keep_freed_memory()` first thing at process start, before anything runs on JAX;
the settings govern later allocations only, and they are process-wide.

FEDJAX_SSL_MALLOC, read when `keep_freed_memory()` is called:
  * 'keep' (default): no mmap allocations, heap trimming at 2 GiB. Freed blocks of the main arena
    stay mapped. XLA also allocates from worker threads, whose per-thread arenas are 64 MiB heaps
    that glibc still unmaps once empty, so the gain depends on which thread allocates (the faults
    per step measured over processes: docs/notes/performance.md#perf-14); compile time unchanged.
  * 'one_arena': also a single arena for all threads: no faults per step, but compilation (LLVM
    allocates from many threads) ran slower (docs/notes/performance.md#perf-14).
  * 'system': glibc's defaults.
The cost of 'keep' and 'one_arena': the process keeps its freed heap memory instead of returning it
to the system. Where malloc is not glibc's (or is replaced by jemalloc/tcmalloc, which cache freed
blocks themselves) nothing that matters changes.
"""
from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest value, 2 GiB

ENV_VAR = 'FEDJAX_SSL_MALLOC'


MODES = ('keep', 'one_arena', 'system')


def keep_freed_memory() -> bool:
  """Applies FEDJAX_SSL_MALLOC (default 'keep') to glibc malloc, for later allocations.

  'keep': no mmap allocations and heap trimming (almost) off. 'one_arena': also a single malloc
  arena. 'system': glibc's defaults.
  Returns:
    True if glibc accepted the settings; False with 'system' or on a non-glibc C library.

  (The module docstring has the measurements behind the modes.)
  Raises:
    ValueError: FEDJAX_SSL_MALLOC is not one of MODES.
  """
  mode = os.environ.get(ENV_VAR, 'keep')
  if mode not in MODES:
    raise ValueError(f'{ENV_VAR} = {mode!r} is invalid: must be one of {MODES}')
  if mode == 'system':
    return False
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # pylint: disable=pointless-statement  (glibc only)
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  settings = [(_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)]
  if mode == 'one_arena':
    settings.append((_M_ARENA_MAX, 1))
  return all(mallopt(option, value) for option, value in settings)
