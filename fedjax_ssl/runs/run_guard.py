"""What a training run survives: divergence (`divergence`), a stop signal (`signals`), an unreadable
checkpoint and a changed config on resume (`resuming`) and a second run on the same workdir
(`lock`). `runs.training` composes these pieces; each is small and tested alone
(tests/runs/test_run_guard.py) and end to end (tests/experiments/test_train_faults.py). This module
holds what they share: the exit statuses, `RunStateError` and the agreement of every process
(`agree_max`); their fault lines go through the run's console (`logging_utils.Console.report`).

Exit statuses of `experiments.train` (the one place they are defined):

  0                    the run finished; results.json has "status": "completed".
  1    EXIT_REFUSED    refused, before any training: a config error, a config that differs from the
                       workdir's run on resume, a workdir another live run holds, no intact
                       checkpoint left (one `error: ...` line naming the value and what is allowed).
  3    EXIT_DIVERGED   a round's loss or metrics, or the new server parameters, are not finite; the
                       run stopped at that round and results.json has "status": "diverged".
  4    EXIT_PEER_LOST  several processes: a collective failed, most likely because another process
                       of the run stopped; one `error: ...` line naming the stopped process where
                       it can be told (`Peers.lost`), the error itself in train.log; the same
                       command on every process resumes from the last checkpoint.
  128 + signal         stopped by SIGINT (130) or SIGTERM (143) after finishing the round and saving
                       its checkpoint; the same command resumes (`exit_status_for_signal`).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import threading

import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl.core import strategies

EXIT_REFUSED = 1  # config_validation.run's status for a ConfigError, which RunStateError is
EXIT_DIVERGED = 3
EXIT_PEER_LOST = 4


class RunStateError(cv.ConfigError):
  """The workdir's state refuses this run (reported as one `error:` line, exit status 1)."""


class PeerLost(Exception):
  """A collective of a several-process run failed (`EXIT_PEER_LOST`); the message is one line."""


def agree_max(value: int) -> int:
  """The largest `value` over every process (a collective all of them must reach; the value itself
  with one process). Used so that all processes refuse, stop, or move a checkpoint aside together."""
  if not strategies.multi_process():
    return int(value)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(np.max(multihost_utils.process_allgather(np.int32(value))))


_HOST_BYTES = 64


@dataclasses.dataclass(frozen=True)
class Peers:
  """Each process's host name and pid, gathered once at the start of a several-process run, so
  that a process whose collective failed can say which process stopped: gloo's and NCCL's errors
  carry an address only, and the coordination service learns of a dead process only at its
  heartbeat timeout (docs/notes/engine.md#eng-88)."""
  hosts: tuple[str, ...]
  pids: tuple[int, ...]

  @classmethod
  def gather(cls) -> 'Peers':
    """Every process's (host, pid), by one all-gather that every process must reach."""
    host = socket.gethostname().encode()[:_HOST_BYTES]
    mine = np.zeros(8 + _HOST_BYTES, np.uint8)
    mine[:8] = np.frombuffer(np.int64(os.getpid()).tobytes(), np.uint8)
    mine[8:8 + len(host)] = np.frombuffer(host, np.uint8)
    if strategies.multi_process():
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      rows = np.asarray(multihost_utils.process_allgather(mine))
    else:
      rows = mine[None]
    return cls(hosts=tuple(bytes(r[8:]).rstrip(b'\0').decode(errors='replace') for r in rows),
               pids=tuple(int(np.frombuffer(bytes(r[:8]), np.int64)[0]) for r in rows))

  def lost(self, error: str) -> list[int]:
    """The processes that most likely stopped: those on this host whose pid no longer runs, and
    those on another host whose address `error` (the failed collective's text) names. [] when
    none can be told."""
    here = socket.gethostname()
    lost = []
    for p, (host, pid) in enumerate(zip(self.hosts, self.pids)):
      if host == here:
        if pid != os.getpid() and not _running(pid):
          lost.append(p)
      elif any(a in error for a in _addresses(host)):
        lost.append(p)
    return lost

  def describe(self, processes: list[int]) -> str:
    """'process 1 (pid 4242 on host h)', joined with ', '."""
    return ', '.join(f'process {p} (pid {self.pids[p]} on {self.hosts[p]})' for p in processes)


class PeerWatch:
  """Watches this host's other processes of the run from a daemon thread, every `interval`
  seconds: one that stopped calls `on_lost(processes)` (which ends this process with one line).

  A collective with a dead peer normally fails at once (gloo sees the closed connection), but one
  that never sees it waits until the coordination service's heartbeat timeout, which aborts the
  interpreter with a stack dump (docs/notes/engine.md#eng-88). Peers on other hosts are left to
  the collective. `stop()` once this process has reached its last collective: a peer that
  finished its run and exited is not lost."""

  def __init__(self, peers: Peers, on_lost, interval: float = 1.0):
    self._peers, self._on_lost, self._interval = peers, on_lost, interval
    self._stopped = threading.Event()
    self._ending = threading.Lock()  # held by whichever path ends this process for a lost peer
    self._thread = threading.Thread(target=self._loop, name='peer-watch', daemon=True)
    self._thread.start()

  def _loop(self) -> None:
    here = socket.gethostname()
    mine = [p for p, (host, pid) in enumerate(zip(self._peers.hosts, self._peers.pids))
            if host == here and pid != os.getpid()]
    while not self._stopped.wait(self._interval):
      lost = [p for p in mine if not _running(self._peers.pids[p])]
      if lost and not self._stopped.is_set() and self._ending.acquire(blocking=False):
        self._on_lost(lost)
        return

  def stop(self) -> None:
    self._stopped.set()

  def end_here(self) -> None:
    """Called by the main thread before it ends this process for a lost peer (a failed
    collective): if the watch's own end already began, waits for it (one line, not two)."""
    self.stop()
    if not self._ending.acquire(blocking=False):
      threading.Event().wait()  # the watch's `on_lost` exits the process


def _running(pid: int) -> bool:
  """Whether `pid` is a live process; a killed child its parent has not reaped yet (a zombie,
  state Z or X in /proc) counts as stopped."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] not in ('Z', 'X')
  except FileNotFoundError:
    return False
  except OSError:  # no /proc (not Linux): the signal-0 probe cannot see a zombie
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      pass
    return True


def _addresses(host: str) -> list[str]:
  """`host`'s IP addresses as a failed collective would print them ([] when it cannot be resolved)."""
  try:
    return [f'[{a}]' for a in socket.gethostbyname_ex(host)[2]]
  except OSError:
    return []
