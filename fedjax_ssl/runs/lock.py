"""One run per workdir: `WorkdirLock`, an exclusive `flock` on the workdir's lock file for as long
as the run lasts (a part of what a run survives, fedjax_ssl/runs/run_guard.py)."""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import pathlib
import socket
from typing import Any, Mapping, Optional

from fedjax_ssl.runs.run_guard import RunStateError


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
