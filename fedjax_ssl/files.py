"""Atomic file writes, the one helper for every file a run, a cache or a table writes: a temporary
file in the same folder (a unique name, so two processes never share it), flushed and fsync'ed,
then `os.replace`d over the target. A kill leaves the old file or the new one, never a torn one.
Imports nothing of fedjax_ssl: every layer may use it."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from typing import Any, Iterator, Optional

# The errors of a write that found no room: a full device, a full quota, a file over its size limit.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskFull(Exception):
  """A write failed for lack of space; `path` names what was being written."""

  def __init__(self, path: str, cause: OSError):
    super().__init__(f'no space left writing {path} ({cause.strerror or os.strerror(cause.errno)})')
    self.path = path
    self.cause = cause


def no_room(error: BaseException) -> Optional[OSError]:
  """The OSError of `error`'s chain (itself, its cause or context, recursively) that reports no
  room (ENOSPC, EDQUOT, EFBIG), or None. Libraries that write in threads (orbax) re-raise such an
  error wrapped in their own."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in _NO_ROOM:
      return error
    error = error.__cause__ or error.__context__
  return None


@contextlib.contextmanager
def writing(path: os.PathLike | str) -> Iterator[None]:
  """Turns a failure for lack of space inside the block into `DiskFull(path)`; any other error
  passes unchanged."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  (classified: only no-room is converted)
    cause = no_room(e)
    if cause is None:
      raise
    raise DiskFull(os.fspath(path), cause) from e


def write_bytes(path: os.PathLike | str, data: bytes) -> None:
  """Writes `data` to `path` atomically (module docstring)."""
  write_stream(path, lambda f: f.write(data))


def write_text(path: os.PathLike | str, text: str) -> None:
  """Writes `text` (UTF-8) to `path` atomically (module docstring)."""
  write_bytes(path, text.encode('utf-8'))


def write_json(path: os.PathLike | str, obj: Any, *, indent: int = 2, sort_keys: bool = True
               ) -> None:
  """`write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys))`."""
  write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys))


def write_stream(path: os.PathLike | str, write: Any) -> None:
  """Calls `write(f)` on a binary file that becomes `path` atomically (module docstring): large
  arrays (np.savez) go to disk without a second copy in memory."""
  path = os.fspath(path)
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + '.', suffix='.tmp')
  try:
    with os.fdopen(fd, 'wb') as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
