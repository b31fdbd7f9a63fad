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
"""

from __future__ import annotations

import json
import numbers
import os
from typing import Any

import orbax.checkpoint as ocp

_STATE = 'state'
_METADATA = 'metadata'


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
    due = force or (self.save_every > 0 and round_idx % self.save_every == 0)
    if not due or round_idx in self._manager.all_steps():
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
    try:
      restored = self._manager.restore(
          round_idx,
          args=ocp.args.Composite(**{
              _STATE: ocp.args.StandardRestore(template_state),
              _METADATA: ocp.args.JsonRestore(),
          }))
    except ValueError as e:
      raise ValueError(
          f'checkpoint {self.directory}/{round_idx} does not match the '
          f'template state: {e}') from e
    return round_idx, restored[_STATE], dict(restored[_METADATA])

  def close(self) -> None:
    """Waits for outstanding work and releases orbax resources."""
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
