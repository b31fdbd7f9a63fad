"""Stop signals (preemption): SIGTERM / SIGINT stop the run after the current round and its
checkpoint (`StopSignals`, `Preempted`, exit status 128 + signal). A part of what a run survives
(fedjax_ssl/runs/run_guard.py)."""
from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from typing import Any, Dict

from fedjax_ssl.runs.run_guard import agree_max


def exit_status_for_signal(signum: int) -> int:
  """The shell's convention: 128 + the signal number (SIGINT 130, SIGTERM 143)."""
  return 128 + signum


class Preempted(SystemExit):
  """Raised after a stop signal once the round is finished and its checkpoint saved. A SystemExit,
  so that a caller's `except Exception` (the reproduction harness's per-run handler) does not go
  on to the next run; the process exits with `exit_status_for_signal`."""

  def __init__(self, signum: int):
    super().__init__(exit_status_for_signal(signum))
    self.signum = signum


def resume_command() -> str:
  """The command line this process was started with (what resumes it)."""
  return shlex.join(getattr(sys, 'orig_argv', sys.argv))


class StopSignals:
  """Within the context, SIGTERM and SIGINT ask the run to stop at the next round boundary; a
  second one does what it would have done without us (SIGINT raises KeyboardInterrupt, SIGTERM
  ends the process) for a run that must stop at once.

  A Python handler only sets a flag (it runs between bytecodes, never inside XLA); `agreed()` is
  read between rounds. Handlers are installed only from the main thread (Python's rule); the
  previous ones come back on exit. SA_RESTART is kept so that a signal landing in a native thread's
  system call does not fail that call. Under `jax.distributed` this replaces JAX's own SIGTERM
  notifier (its preemption sync point is not used): `agreed()` is a collective on the flag, so every
  process stops after the same round even when only one received the signal.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signum = 0
    self._previous: Dict[int, Any] = {}

  def __enter__(self) -> 'StopSignals':
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
        signal.siginterrupt(sig, False)
    return self

  def _handle(self, signum, frame) -> None:
    if self.signum:  # the second signal: stop at once
      previous = self._previous[signum]
      signal.signal(signum, previous)
      if callable(previous):
        previous(signum, frame)
      elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signum)
      return
    self.signum = signum
    name = signal.Signals(signum).name
    # os.write: async-signal-safe, and no lock a logging call in progress may hold.
    os.write(2, (f'{name} received: the run stops after the current round and saves a checkpoint '
                 f'({name} again stops at once, losing the rounds since the last checkpoint)\n'
                 ).encode())

  def agreed(self) -> int:
    """The signal that stops the run (0 = none), the same on every process (a collective)."""
    return agree_max(self.signum)

  def __exit__(self, *exc) -> None:
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous = {}
