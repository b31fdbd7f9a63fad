"""Atomic file writes, the one helper for every file a run, a cache or a table writes: a temporary
file in the same folder (a unique name, so two processes never share it), flushed and fsync'ed,
then `os.replace`d over the target. A kill leaves the old file or the new one, never a torn one.
Imports nothing of fedjax_ssl: every layer may use it."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def write_text(path: os.PathLike | str, text: str) -> None:
  """Writes `text` (UTF-8) to `path` atomically (module docstring)."""
  path = os.fspath(path)
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + '.', suffix='.tmp')
  try:
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_json(path: os.PathLike | str, obj: Any, *, indent: int = 2, sort_keys: bool = True
               ) -> None:
  """`write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys))`."""
  write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys))
