"""What a training run survives: divergence, a stop signal, an unreadable checkpoint, a changed
config on resume and a second run on the same workdir. `experiments.train` composes these pieces;
each is small and tested alone (tests/test_run_guard.py) and end to end
(tests/experiments/test_train_faults.py).

Exit statuses of `experiments.train` (the one place they are defined):

  0                    the run finished; results.json has "status": "completed".
  1    EXIT_REFUSED    refused, before any training: a config error, a config that differs from the
                       workdir's run on resume, a workdir another live run holds, no intact
                       checkpoint left (one `error: ...` line naming the value and what is allowed).
  3    EXIT_DIVERGED   a round's loss or metrics, or the new server parameters, are not finite; the
                       run stopped at that round and results.json has "status": "diverged".
  128 + signal         stopped by SIGINT (130) or SIGTERM (143) after finishing the round and saving
                       its checkpoint; the same command resumes (`exit_status_for_signal`).
"""
from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import logging
import math
import os
import pathlib
import shlex
import signal
import socket
import sys
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from fedjax_ssl import checkpoint, run_identity
from fedjax_ssl import config_validation as cv
from fedjax_ssl.core import strategies
from fedjax_ssl.run_dir import RunDir

EXIT_REFUSED = 1  # config_validation.run's status for a ConfigError, which RunStateError is
EXIT_DIVERGED = 3

# Keys a resume may change freely (run_identity.NEUTRAL_KEYS); every other key the run depends on
# must match its stored config.json (the keys a config ignores never count: `run_identity.run_key`).
NEUTRAL_KEYS = run_identity.NEUTRAL_KEYS

_log = logging.getLogger('fedjax_ssl')


class RunStateError(cv.ConfigError):
  """The workdir's state refuses this run (reported as one `error:` line, exit status 1)."""


def report(line: str, echo: bool = True) -> None:
  """A fault line ('warning: ...', 'error: ...'): the run's log file always; stderr when `echo`,
  through tqdm so that a running bar is redrawn below it."""
  _log.info(line, stacklevel=2)
  if echo:
    sys.stdout.flush()
    tqdm.tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


def agree_max(value: int) -> int:
  """The largest `value` over every process (a collective all of them must reach; the value itself
  with one process). Used so that all processes refuse, stop, or move a checkpoint aside together."""
  if not strategies.multi_process():
    return int(value)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(np.max(multihost_utils.process_allgather(np.int32(value))))


# ----------------------------------------------------------------------------------------------
# One run per workdir
# ----------------------------------------------------------------------------------------------
def _holder_text(holder: Mapping[str, Any]) -> str:
  """'pid 1234 on host h, started <time>' from a lock file's record."""
  return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
          f"{holder.get('started', '?')}")


class WorkdirLock:
  """An exclusive lock on a workdir for as long as the run lasts: `flock` on a lock file holding the
  holder's host, pid and start time.

  The kernel drops a `flock` when its process dies, however it dies, so a lock left by a killed run
  is never mistaken for a live one and there is no race between two processes taking over a stale
  lock. The file is kept on release (emptied): unlinking a locked file lets a waiting process lock
  the unlinked inode while a third creates a new one. File systems without `flock` (some network
  mounts) get a warning and no lock.
  """

  def __init__(self, path: pathlib.Path):
    self.path = pathlib.Path(path)
    self._fd: Optional[int] = None

  def __enter__(self) -> 'WorkdirLock':
    return self

  def __exit__(self, *exc) -> None:
    self.release()

  def acquire(self) -> Optional[str]:
    """Takes the lock; returns a warning line when a dead run's lock was taken over (or locking is
    not supported), None otherwise. Raises RunStateError naming the holder when a live process
    holds it."""
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read_holder(fd)
      os.close(fd)
      raise RunStateError(
          f'workdir {self.path.parent} is in use by another run ({_holder_text(holder)}; lock file '
          f'{self.path.name}): wait for it to end, stop it, or use another --workdir') from None
    except OSError as e:
      os.close(fd)
      return (f'warning: cannot lock {self.path} ({e.strerror}): a second run on this workdir '
              'would not be detected')
    previous = _read_holder(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({
        'host': socket.gethostname(), 'pid': os.getpid(),
        'started': datetime.datetime.now().isoformat(timespec='seconds')}).encode(), 0)
    self._fd = fd
    if not previous:
      return None
    alive = previous.get('host') == socket.gethostname() and _pid_alive(previous.get('pid'))
    return (f'warning: took over the lock of a run that ended without releasing it '
            f'({_holder_text(previous)}{"" if alive else ", no longer running"})')

  def release(self) -> None:
    """Empties the lock file and unlocks it."""
    if self._fd is None:
      return
    os.ftruncate(self._fd, 0)
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None


def _read_holder(fd: int) -> dict:
  """The lock file's holder record ({} when empty or unreadable: a lock is never refused over its
  text)."""
  try:
    holder = json.loads(os.pread(fd, 4096, 0).decode() or '{}')
  except (ValueError, UnicodeDecodeError):
    return {}
  return holder if isinstance(holder, dict) else {}


def _pid_alive(pid: Any) -> bool:
  """Whether a process with this pid exists on this host."""
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by another user
    return True
  return True


# ----------------------------------------------------------------------------------------------
# Resuming means the same run
# ----------------------------------------------------------------------------------------------
def _flat(d: Mapping[str, Any], prefix: str = '') -> Dict[str, Any]:
  """Nested dicts as one dict of dotted keys ({'fedu2': {'fur': 1}} -> {'fedu2.fur': 1})."""
  out = {}
  for k, v in d.items():
    if isinstance(v, Mapping):
      out.update(_flat(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


_ABSENT = '(absent)'


def stored_config(rundir: RunDir):
  """The config of the run in `rundir` (its config.json over today's defaults), None when there is
  none. A config.json that does not parse is a RunStateError."""
  if not rundir.has_config():
    return None
  try:
    return rundir.read_config()
  except (ValueError, TypeError) as e:  # not JSON; a value of another type than the key's
    raise RunStateError(f'{rundir.config_file} is unreadable ({e}): restore it, or move it '
                        'away to run this workdir without the check of its config') from None


def config_changes(stored, current) -> Dict[str, Tuple[Any, Any]]:
  """{key: (stored value, current value)} over the keys a run depends on, `NEUTRAL_KEYS` left out.

  Both are ConfigDicts; `run_identity.run_key` decides which keys a run depends on (it leaves out the
  keys the config ignores and the blocks of the algorithms not configured). Values are compared as
  JSON (a tuple equals the list config.json stores)."""
  old, new = (_flat(json.loads(run_identity.run_key(c))) for c in (stored, current))
  return {k: (old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in sorted(old.keys() | new.keys())
          if k not in NEUTRAL_KEYS and old.get(k, _ABSENT) != new.get(k, _ABSENT)}


# What DP-FedAvg's ledger assumes of every round (ops/dp_fedavg.py): epsilon is computed from the
# round count under the current settings, so a resume may not change them.
_DP_LEDGER_KEYS = ('rounds', 'clients_per_round', 'num_clients')


def refuse_dp_changes(changes: Mapping[str, Tuple[Any, Any]], dp_enabled: bool) -> None:
  """RunStateError for a resume (even with --allow_config_change) that changes config.dp, or the
  rounds / sampling of a DP run (`dp_enabled`: the current config's): the ledger would count the
  earlier rounds under settings they did not run with, and could under-report epsilon."""
  keys = [k for k in changes if k.startswith('dp.')]
  if keys or dp_enabled:
    keys += [k for k in changes if k in _DP_LEDGER_KEYS]
  if keys:
    raise RunStateError(f'a resume cannot change {format_changes({k: changes[k] for k in keys})} '
                        'of a DP-FedAvg run: its ledger counts every round under the current '
                        'settings; start a new --workdir')


def format_changes(changes: Mapping[str, Tuple[Any, Any]], limit: int = 8) -> str:
  """'rounds 60 -> 40, lr 0.1 -> 0.2' (at most `limit` keys, then how many more)."""
  items = [f'{k} {old!r} -> {new!r}' for k, (old, new) in changes.items()]
  more = f' and {len(items) - limit} more' if len(items) > limit else ''
  return ', '.join(items[:limit]) + more


def refuse_changed_config(rundir: RunDir, changes: Mapping[str, Tuple[Any, Any]]) -> None:
  """Raises the RunStateError of a resume whose config differs from the run's config.json."""
  raise RunStateError(
      f'the config differs from the run in {rundir.path} ({rundir.config_file.name}): '
      f'{format_changes(changes)}; a resume continues that run: rerun with its values, use another '
      '--workdir, or pass --allow_config_change to continue under the new values (recorded in '
      f'{rundir.config_changes_file.name})')



# ----------------------------------------------------------------------------------------------
# Divergence
# ----------------------------------------------------------------------------------------------
def _is_float(x) -> bool:
  """Whether an array leaf holds floating (or complex) numbers: what can become NaN / Inf."""
  return jnp.issubdtype(x.dtype, jnp.inexact)


def make_finite_check(tree: Any) -> Tuple[List[str], Callable[[Any], jax.Array]]:
  """(names, check): `check(tree)` returns on the device one bool per floating leaf of `tree`,
  True where every entry is finite; `names` are those leaves' paths.

  A program of its own, run on the round's output right after it, rather than an extra output of
  the jitted round: the round's program stays byte-identical (an extra consumer of the new
  parameters could change XLA's fusion of the round, and with it the bits of a floating-point
  result), and it needs no change to the round. It reads the parameters once and returns a few
  bytes; the round's metrics are read on the host anyway.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  names = [jax.tree_util.keystr(path) for path, leaf in flat if _is_float(leaf)]

  def check(tree):
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if _is_float(x)]
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]) if leaves else jnp.ones((0,), bool)
  return names, strategies.jit_replicated(check)


@dataclasses.dataclass(frozen=True)
class Divergence:
  """Where a run stopped being finite: the round, the quantity ('loss', another round metric, or
  'server parameter <path>'), its value (None for a parameter), and the quantity's last finite
  value and round (None when there was none)."""
  round: int
  rounds: int
  quantity: str
  value: Optional[float]
  last_finite_round: Optional[int]
  last_finite_value: Optional[float]
  detail: Optional[str] = None

  def message(self, hint: str) -> str:
    """One line: round, quantity, value, last finite value, the hint."""
    if self.detail is not None:
      return f'error: diverged at round {self.round}/{self.rounds}: {self.detail}; {hint}'
    if self.value is None:
      what = f'{self.quantity} is not finite'
      last = (f' (finite through round {self.last_finite_round})'
              if self.last_finite_round is not None else '')
    else:
      what = f'{self.quantity} = {self.value}'
      last = (f' (last finite: {self.last_finite_value:.6g} at round {self.last_finite_round})'
              if self.last_finite_round is not None else ' (never finite)')
    return f'error: diverged at round {self.round}/{self.rounds}: {what}{last}; {hint}'

  def to_json(self) -> dict:
    """results.json's 'diverged' entry (the value as text: JSON has no NaN)."""
    return {'round': self.round, 'quantity': self.quantity,
            'value': None if self.value is None else repr(self.value),
            'last_finite_round': self.last_finite_round,
            'last_finite_value': self.last_finite_value,
            **({'detail': self.detail} if self.detail is not None else {})}


def too_many_failed(round_idx: int, rounds: int, failed: Sequence[int], participants: int,
                    max_fraction: float) -> Optional[Divergence]:
  """The divergence of a round in which more than `max_fraction` of its `participants` failed
  (their uploads were not finite, core/faults.py), or None."""
  if len(failed) <= max_fraction * participants:
    return None
  return Divergence(round_idx, rounds, 'failed clients', float(len(failed)), None, None,
                    detail=f'{len(failed)} of {participants} participants sent a non-finite update '
                    f'(clients {list(failed)}), more than max_failed_fraction = {max_fraction:g}')


def divergence_hint(lr: float, grad_clip_norm: float) -> str:
  """What to try after a divergence, from the config's learning rate and clipping."""
  clip = ('clip gradients (config.grad_clip_norm, now 0 = off)' if not grad_clip_norm else
          f'lower config.grad_clip_norm (now {grad_clip_norm:g})')
  return (f'lower config.lr (now {lr:g}) or {clip}; in reduced precision (bfloat16/float16) try '
          'float32')


class DivergenceWatch:
  """Checks each round's metrics and parameter flags; remembers the last finite value of each
  metric (seeded from metrics.jsonl on resume) for the message."""

  def __init__(self, rounds: int, param_names: Sequence[str], history: Sequence[dict] = ()):
    self.rounds = rounds
    self.param_names = list(param_names)
    self._last: Dict[str, Tuple[int, float]] = {}
    self._params_finite_through: Optional[int] = None
    for record in history:
      self._remember(record['round'], record)

  def _remember(self, round_idx: int, metrics: Mapping[str, float]) -> None:
    for key, value in metrics.items():
      if key != 'round' and isinstance(value, (int, float)) and math.isfinite(value):
        self._last[key] = (round_idx, float(value))
    self._params_finite_through = round_idx

  def check(self, round_idx: int, metrics: Mapping[str, float], params_finite: np.ndarray
            ) -> Optional[Divergence]:
    """The divergence of round `round_idx` (the loss first, then the other metrics, then the
    parameters), or None when everything is finite."""
    bad = sorted((k for k, v in metrics.items() if not math.isfinite(v)),
                 key=lambda k: (k != 'loss', k))
    if bad:
      last = self._last.get(bad[0])
      return Divergence(round_idx, self.rounds, bad[0], float(metrics[bad[0]]),
                        last[0] if last else None, last[1] if last else None)
    params_finite = np.asarray(params_finite)
    if not params_finite.all():
      name = self.param_names[int(np.argmin(params_finite))]
      return Divergence(round_idx, self.rounds, f'server parameter {name}', None,
                        self._params_finite_through, None)
    self._remember(round_idx, metrics)
    return None


# ----------------------------------------------------------------------------------------------
# Stop signals (preemption)
# ----------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------
# Unreadable checkpoints
# ----------------------------------------------------------------------------------------------
def restore_newest_intact(ckpt: checkpoint.Checkpointer, template: Any, *, echo: bool,
                          primary: bool) -> Optional[Tuple[int, Any, dict]]:
  """The newest checkpoint that restores, as `Checkpointer.restore` returns it; None when none does.

  Each newer one that cannot be read back is reported in one line (round, file, error) and moved
  aside to `<checkpoints>/corrupt/<round>` (by process 0; every process agrees first), never
  deleted. A checkpoint of another state layout (`ValueError`, e.g. a changed model) is not
  unreadable: it propagates.
  """
  for round_idx in reversed(ckpt.all_rounds()):
    try:
      restored, failure = ckpt.restore(template, round_idx), None
    except checkpoint.UnreadableCheckpoint as e:
      restored, failure = None, e
    if not agree_max(failure is not None):
      return restored
    where = f'moved to {ckpt.move_aside(round_idx)}' if primary else 'moved aside by process 0'
    agree_max(0)  # a barrier: process 0 has moved it before anyone lists the rounds again
    if not primary:
      ckpt.reload()
    cause = str(failure) if failure else f'checkpoint of round {round_idx} is unreadable on another process'
    report(f'warning: {cause}; {where}; trying the previous checkpoint', echo=echo)
  return None
