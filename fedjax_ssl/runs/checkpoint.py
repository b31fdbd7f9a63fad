"""Checkpointing of the training state with orbax-checkpoint.

One checkpoint per saved round, in ``<directory>/<round>/``, holding two orbax
items:

* ``state``: the training-state pytree (any mix of dicts, lists, tuples,
  ``flax.struct`` dataclasses and arrays: float32 params, int32 counters,
  uint32 ``jax.random.PRNGKey`` arrays or typed ``jax.random.key`` arrays),
  written with ``ocp.args.StandardSave`` and read back with
  ``ocp.args.StandardRestore``, the API orbax 0.12 recommends for a pytree of
  arrays;
* ``metadata``: a JSON-serialisable dict (config, git revision, ...) written
  with ``ocp.args.JsonSave``.

Atomicity (verified against the orbax-checkpoint 0.12.8 source):
``CheckpointManager.save`` -> ``Checkpointer.save`` creates
``<directory>/<round>.orbax-checkpoint-tmp`` (``atomicity_types.TMP_DIR_SUFFIX``),
writes every item into it, writes ``commit_success.txt`` and only then renames
it to ``<directory>/<round>`` (``AtomicRenameTemporaryPath.finalize``, the
default temporary-path class for local and non-GCS paths; ``os.rename`` of a
directory is atomic on POSIX file systems). Step discovery
(``StandardNameFormat._build_metadata``) ignores any name that contains the
tmp suffix, so a process killed at any point of a save leaves either the
previous checkpoints only or a complete new one; ``cleanup_tmp_directories``
removes such leftovers when the next ``Checkpointer`` opens the directory.
Saves are synchronous (``enable_async_checkpointing=False``): ``maybe_save``
returns only once the rename is done, so the caller may donate/overwrite the
state buffers right after it returns and a kill after it returns never loses
that round. The deletion of rounds beyond ``max_to_keep`` is not atomic
(``rmtree``), but it only ever touches rounds older than the one just
committed, so the latest round is always complete.

Atomic saves do not protect against damage after the fact (a disk error, a
partial copy of the directory, a file overwritten): ``restore`` tells a
checkpoint that cannot be read back (``UnreadableCheckpoint``, naming the round,
the file when the error names one, and the error) from one of another state
layout (``ValueError``), and ``move_aside`` moves an unreadable one to
``<directory>/corrupt/<round>`` (step discovery only lists integer names, so
it is no longer a candidate). Orbax keeps no checksum of the array data: a
flipped bit inside a compressed chunk that still decodes is not detected. A
failed restore leaves residue that Python would print as tracebacks although
the restore has already raised: TensorStore reads pending on the asyncio loop
orbax has closed ("Event loop is closed", an unraisable error), orbax's read
coroutines that raise their read error again when they are closed unfinished
(also unraisable; seen when one process's block of a several-process
checkpoint is damaged), and the read tasks that failed after the first one
(asyncio's "Task exception was never retrieved", logged when the garbage
collector frees the task, so at no fixed time). All are dropped until
``close``.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import re
import sys
import traceback
from typing import Any

import orbax.checkpoint as ocp

_STATE = 'state'
_METADATA = 'metadata'
CORRUPT_DIR = 'corrupt'

# How orbax 0.12 words a template that does not match the saved tree (its structure:
# base_pytree_checkpoint_handler; a shape: serialization.py); a read error without these words is
# damage to the checkpoint's files.
_MISMATCH_MARKERS = ('structures do not match', 'is not compatible with the stored shape')
# Errors orbax and TensorStore raise for a damaged or missing file, searched for along the error's
# causes (orbax wraps some in a bare Exception): DATA_LOSS / FAILED_PRECONDITION (ValueError),
# undecodable JSON metadata (UnicodeDecodeError, JSONDecodeError: ValueErrors), a missing item
# directory (KeyError, FileNotFoundError). An error with none of them is a bug and propagates.
_READ_ERRORS = (ValueError, KeyError, OSError)


class UnreadableCheckpoint(Exception):
  """A checkpoint whose files cannot be read back (damaged, truncated or missing)."""

  def __init__(self, round_idx: int, path: str, file: str, error: str):
    self.round_idx, self.path, self.file, self.error = round_idx, path, file, error
    where = f'{file}: ' if file else ''
    super().__init__(f'checkpoint of round {round_idx} in {os.path.dirname(path)} is unreadable '
                     f'({where}{error})')


def _chain(error: BaseException) -> list:
  """The error and its causes, outermost first (orbax wraps TensorStore's error in a bare
  Exception)."""
  out = []
  while error is not None and error not in out:
    out.append(error)
    error = error.__cause__ or error.__context__
  return out


def _read_error(error: BaseException) -> BaseException | None:
  """The innermost error of the chain that is a read error (`_READ_ERRORS`), else None."""
  found = [e for e in _chain(error) if isinstance(e, _READ_ERRORS)]
  return found[-1] if found else None


def _reason(error: BaseException, step_dir: str) -> str:
  """One short line: the error's first line with paths relative to the checkpoint, from its last
  'Error ...' clause on (TensorStore nests 'Error opening ...: Error reading ...: <cause>'), without
  TensorStore's trailing [source locations] and spec."""
  message = error.args[0] if isinstance(error, KeyError) and error.args else error  # no repr quotes
  text = (str(message).strip().splitlines() or [type(error).__name__])[0]
  text = re.sub(r'\s*\[(source locations|tensorstore_spec)[^=]*=.*$', '', text)
  text = text.replace(step_dir + os.sep, '')
  if 'Error ' in text:
    text = text[text.rindex('Error '):]
  return text if len(text) <= 200 else text[:197] + '...'


def _is_failed_restore_residue(unraisable) -> bool:
  """Whether an unraisable error is what a failed restore leaves behind, harmless because the
  restore has already raised, and printed a traceback per pending read: TensorStore completing a
  read after orbax closed that restore's asyncio loop (`call_soon_threadsafe` on a closed loop), or
  one of orbax's read coroutines raising its read error again as it is closed unfinished."""
  exc = unraisable.exc_value
  if (isinstance(exc, RuntimeError) and str(exc) == 'Event loop is closed' and
      any(f.name == 'call_soon_threadsafe'
          for f in traceback.extract_tb(unraisable.exc_traceback))):
    return True
  code = getattr(unraisable.object, 'cr_code', None)
  return code is not None and f'{os.sep}orbax{os.sep}checkpoint{os.sep}' in code.co_filename


class _DropUnretrievedReadErrors(logging.Filter):
  """Drops asyncio's "... exception was never retrieved" records of a read error
  (`_READ_ERRORS`): orbax gathers one task per array and raises the first failure, so every other
  damaged array's task is logged, with a traceback, when it is garbage-collected."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (str(record.msg).startswith(('Task exception was never retrieved',
                                            'Future exception was never retrieved'))
                and _read_error(exc) is not None)


_residue_dropped = False  # whether `_drop_failed_restore_residue` is installed in this process


def _drop_failed_restore_residue() -> None:
  """Keeps a failed restore's residue (`_is_failed_restore_residue`, `_DropUnretrievedReadErrors`)
  off the console for the rest of the process, once: the abandoned reads finish, and are collected,
  whenever TensorStore's threads and the garbage collector get to them, which can be after the
  checkpointer is closed (a closing hook let them through: 'Future exception was never retrieved'
  dumps after `close`). Everything else reaches the previous hook and handlers unchanged."""
  global _residue_dropped
  if _residue_dropped:
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    if not _is_failed_restore_residue(unraisable):
      previous(unraisable)

  sys.unraisablehook = hook
  logging.getLogger('asyncio').addFilter(_DropUnretrievedReadErrors())
  _residue_dropped = True


def _damaged_file(step_dir: str, error: BaseException) -> str:
  """The file of `step_dir` the error is about, relative to it ('' when none is found).

  TensorStore names the file it failed on; orbax's JSON metadata files (every file but the
  ``*.ocdbt`` manifests, the array data under ``d/`` and the commit markers) are read to find one
  that does not parse, since a decode error names none.
  """
  for path in re.findall(r'local file "([^"]+)"', ' '.join(str(e) for e in _chain(error))):
    if os.path.abspath(path).startswith(step_dir + os.sep) and os.path.isfile(path):
      return os.path.relpath(path, step_dir)
  for root, _, files in sorted(os.walk(step_dir)):
    if os.path.basename(root) == 'd':
      continue
    for name in sorted(files):
      if name.endswith('.ocdbt') or name == 'commit_success.txt':
        continue
      path = os.path.join(root, name)
      try:
        with open(path, encoding='utf-8') as f:
          json.load(f)
      except ValueError:
        return os.path.relpath(path, step_dir)
  return ''


class Checkpointer:
  """Saves every ``save_every``-th round and restores the latest (or a given) one.

  ``round_idx`` is whatever round counter the caller uses; the natural choice
  is the number of completed rounds, so that a restored ``round_idx`` is the
  next round to run. Every process of a multi-host job must call
  ``maybe_save``/``restore`` (orbax synchronises the hosts internally).
  """

  def __init__(self, directory: str, save_every: int, max_to_keep: int = 2,
               read_only: bool = False):
    """Opens (creating if needed) a checkpoint directory.

    Args:
      directory: where the ``<round>/`` sub-directories live.
      save_every: periodic saves happen when ``round_idx % save_every == 0``;
        0 disables periodic saves (only ``force=True`` saves).
      max_to_keep: how many of the most recent rounds are kept on disk (>= 1).
      read_only: for readers (evaluation) of a directory a training job may
        still be writing: never saves, deletes or cleans up (a writer's
        cleanup would delete the other job's in-progress save), and re-lists
        the directory on every query.
    """
    if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 0:
      raise ValueError(
          f'save_every = {save_every!r} is invalid: must be an int >= 0 '
          '(0 = only forced saves)')
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
      raise ValueError(f'max_to_keep = {max_to_keep!r} is invalid: must be an int >= 1')
    self.directory = os.path.abspath(os.fspath(directory))
    self.save_every = save_every
    self.read_only = read_only
    if read_only:
      # The options orbax would otherwise reset (with a warning) for read_only.
      options = ocp.CheckpointManagerOptions(
          read_only=True, save_interval_steps=0, create=False,
          enable_async_checkpointing=False)
    else:
      options = ocp.CheckpointManagerOptions(
          max_to_keep=max_to_keep,
          create=True,
          # Synchronous: see the module docstring (atomicity and donation).
          enable_async_checkpointing=False,
          # Removes `<round>.orbax-checkpoint-tmp` left by a killed save.
          cleanup_tmp_directories=True,
      )
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=(_STATE, _METADATA))

  def all_rounds(self) -> list[int]:
    """Rounds with a complete checkpoint on disk, ascending."""
    if self.read_only:  # another process may have saved since the last query
      self._manager.reload()
    return sorted(self._manager.all_steps())

  def latest_round(self) -> int | None:
    """The newest complete checkpoint's round, or None when there is none."""
    rounds = self.all_rounds()
    return rounds[-1] if rounds else None

  def due(self, round_idx: int, force: bool = False) -> bool:
    """Whether `maybe_save(round_idx, ..., force)` would write: a caller whose state must be
    brought into its saved form first (a copy) asks before building it."""
    return ((force or (self.save_every > 0 and round_idx % self.save_every == 0))
            and round_idx not in self._manager.all_steps())

  def maybe_save(self, round_idx: int, state: Any, metadata: dict | None = None,
                 force: bool = False) -> bool:
    """Saves ``state`` (and ``metadata``) as round ``round_idx`` when it is due.

    Due means ``force`` or ``save_every > 0 and round_idx % save_every == 0``.
    A round that already has a checkpoint is not rewritten (the state at a
    given round of a deterministic run is the same), so a final forced save
    that coincides with a periodic one is a no-op. Blocks until the
    checkpoint is committed.

    Args:
      round_idx: integer >= 0 (python or numpy), the checkpoint's name.
      state: the training-state pytree.
      metadata: JSON-serialisable dict stored next to the state (None -> {}).
      force: save even if the round is not a multiple of ``save_every``.

    Returns:
      True if a checkpoint was written.
    """
    if self.read_only:
      raise ValueError(f'Checkpointer({self.directory!r}) was opened with read_only=True')
    if (isinstance(round_idx, bool) or not isinstance(round_idx, numbers.Integral)
        or round_idx < 0):
      raise ValueError(f'round_idx = {round_idx!r} is invalid: must be an int >= 0')
    round_idx = int(round_idx)  # numpy integers are accepted
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
      raise ValueError(f'metadata must be a dict, got {type(metadata).__name__}')
    try:
      json.dumps(metadata)  # Fail before any file is created.
    except (TypeError, ValueError) as e:
      raise ValueError(f'metadata is not JSON-serialisable: {e}') from e
    if not self.due(round_idx, force):
      return False
    # force=True: the due-decision is ours, not orbax's save_interval_steps.
    return self._manager.save(
        round_idx,
        args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(state),
            _METADATA: ocp.args.JsonSave(metadata),
        }),
        force=True)

  def restore(self, template_state: Any, round_idx: int | None = None
              ) -> tuple[int, Any, dict]:
    """Restores a checkpoint into the structure of ``template_state``.

    Args:
      template_state: a pytree with the saved state's structure: real arrays
        or ``jax.ShapeDtypeStruct`` leaves (e.g. ``jax.eval_shape(init_fn)``).
        Restored leaves take the template's dtype and sharding (a
        ``ShapeDtypeStruct`` without sharding -> default device); a shape or
        tree-structure mismatch raises ValueError.
      round_idx: which round; None -> the latest.

    Returns:
      (round_idx, state, metadata dict).

    Raises:
      UnreadableCheckpoint: the checkpoint's files cannot be read back.
      ValueError: the checkpoint holds another tree structure or shapes than the template.
    """
    rounds = self.all_rounds()
    if not rounds:
      raise FileNotFoundError(f'no complete checkpoint in {self.directory}')
    if round_idx is None:
      round_idx = rounds[-1]
    elif round_idx not in rounds:
      raise ValueError(
          f'round_idx = {round_idx!r} has no checkpoint in {self.directory}; '
          f'available rounds: {rounds}')
    _drop_failed_restore_residue()
    try:
      restored = self._manager.restore(
          round_idx,
          args=ocp.args.Composite(**{
              _STATE: ocp.args.StandardRestore(template_state),
              _METADATA: ocp.args.JsonRestore(),
          }))
    except Exception as e:  # pylint: disable=broad-except  (classified below)
      step_dir = os.path.join(self.directory, str(round_idx))
      cause = _read_error(e)
      if cause is None:  # not a file problem: a bug, propagated as it is
        raise
      mismatch = [x for x in _chain(e) if any(m in str(x) for m in _MISMATCH_MARKERS)]
      if mismatch:
        raise ValueError(
            f'checkpoint {step_dir} does not match the template state: {mismatch[0]}') from e
      raise UnreadableCheckpoint(round_idx, step_dir, _damaged_file(step_dir, e),
                                 _reason(cause, step_dir)) from e
    return round_idx, restored[_STATE], dict(restored[_METADATA])

  def move_aside(self, round_idx: int) -> str:
    """Moves the checkpoint of ``round_idx`` to ``<directory>/corrupt/<round>`` (``<round>.1``,
    ... when taken) and returns that path; kept, never deleted, so it can be inspected or moved
    back. With several processes only process 0 calls it (the others ``reload``)."""
    if self.read_only:
      raise ValueError(f'Checkpointer({self.directory!r}) was opened with read_only=True')
    corrupt = os.path.join(self.directory, CORRUPT_DIR)
    os.makedirs(corrupt, exist_ok=True)
    dest, n = os.path.join(corrupt, str(round_idx)), 0
    while os.path.exists(dest):
      n += 1
      dest = os.path.join(corrupt, f'{round_idx}.{n}')
    os.rename(os.path.join(self.directory, str(round_idx)), dest)
    self.reload()
    return dest

  def moved_aside(self) -> list[str]:
    """The names under ``<directory>/corrupt/`` (checkpoints ``move_aside`` kept), sorted."""
    corrupt = os.path.join(self.directory, CORRUPT_DIR)
    return sorted(os.listdir(corrupt)) if os.path.isdir(corrupt) else []

  def reload(self) -> None:
    """Lists the rounds on disk again (after another process moved or saved one)."""
    self._manager.reload()

  def close(self) -> None:
    """Waits for outstanding work and releases orbax resources."""
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
