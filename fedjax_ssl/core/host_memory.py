"""Keep freed host memory in the process (glibc), so repeated XLA:CPU executions stop page-faulting.

XLA:CPU allocates each execution's temporary buffer afresh and frees it when the execution ends.
glibc serves a block above its mmap threshold (dynamic, at most 32 MiB) with a fresh `mmap` and
returns it with `munmap`, so every execution writes to pages the kernel has to fault in and zero
again: a FedBYOL small-CNN step of batch 64 (42.5 MiB of temporaries) took 11,000 minor page
faults, about 20 ms of its 52 ms, every call (BUILD_NOTES, "Scan vs top-level step"). Inside one
long program (the round step's loop over steps) the buffer is faulted in once, which is why a step
looked cheaper there. With mmap allocations off and heap trimming raised, a freed block stays
mapped and the next execution reuses it (all threads share glibc's main arena; see below). The cost: the process keeps its high-water mark of freed
heap memory (up to `_TRIM_THRESHOLD` at the top of the heap) instead of returning it to the system.

`fedjax_ssl` calls `keep_freed_memory()` on import; set FEDJAX_SSL_MALLOC=system before importing to
keep glibc's defaults. Elsewhere (not glibc, or malloc replaced by jemalloc/tcmalloc, which cache
freed blocks themselves) it changes nothing that matters.
"""
from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest value, 2 GiB

ENV_VAR = 'FEDJAX_SSL_MALLOC'


def keep_freed_memory() -> bool:
  """One malloc arena, no mmap allocations, heap trimming (almost) off: for later allocations.

  Returns:
    True if glibc accepted both settings; False on a non-glibc C library or with
    FEDJAX_SSL_MALLOC=system.
  """
  if os.environ.get(ENV_VAR, '') == 'system':
    return False
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # pylint: disable=pointless-statement  (glibc only)
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  # One arena: glibc's per-thread arenas live in heaps of at most 64 MiB that it shrinks with
  # MADV_DONTNEED (pages faulted in again) and that cannot hold a larger block (mmap again), and
  # XLA:CPU allocates from its worker threads. Measured: 2,319 faults per step with the two other
  # settings alone, 0 with this one too.
  return all(mallopt(option, value) for option, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)))
