"""Resuming means the same run: the config against the workdir's (`config_changes`, refused unless
allowed; DP-FedAvg's ledger keys never), and the newest checkpoint that reads back
(`restore_newest_intact`; unreadable ones moved aside). A part of what a run survives
(fedjax_ssl/runs/run_guard.py)."""
from __future__ import annotations

import json
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from fedjax_ssl import run_identity
from fedjax_ssl.runs import checkpoint, logging_utils
from fedjax_ssl.runs.run_dir import RunDir
from fedjax_ssl.runs.run_guard import RunStateError, agree_max

# Keys a resume may change freely (run_identity.NEUTRAL_KEYS); every other key the run depends on
# must match its stored config.json (the keys a config ignores never count: `run_identity.run_key`).
NEUTRAL_KEYS = run_identity.NEUTRAL_KEYS


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
# Unreadable checkpoints
# ----------------------------------------------------------------------------------------------
def restore_newest_intact(
    ckpt: checkpoint.Checkpointer, template: Any, *,
    console: Optional[logging_utils.Console] = None, moves: bool = True,
    check: Optional[Callable[[int, Any], Optional[str]]] = None
) -> Optional[Tuple[int, Any, dict]]:
  """The newest checkpoint that restores, as `Checkpointer.restore` returns it; None when none does.

  Each newer one that cannot be read back is reported in one line (round, file, error; on
  `console`, by default this process's) and moved aside to `<checkpoints>/corrupt/<round>` (by the
  process that `moves`, process 0; every process agrees first), never deleted. A checkpoint of
  another state layout (`ValueError`, e.g. a changed model) is not unreadable: it propagates.
  `check(round, restored_state)`: why a checkpoint that read back is still not to be trusted (a
  string, e.g. `run_setup.stale_block`), or None; such a checkpoint is reported and moved aside too.
  """
  console = console or logging_utils.Console()
  for round_idx in reversed(ckpt.all_rounds()):
    try:
      restored, failure = ckpt.restore(template, round_idx), None
    except checkpoint.UnreadableCheckpoint as e:
      restored, failure = None, e
    if restored is not None and check is not None:
      failure = check(round_idx, restored[1])
    if not agree_max(failure is not None):
      return restored
    where = f'moved to {ckpt.move_aside(round_idx)}' if moves else 'moved aside by process 0'
    agree_max(0)  # a barrier: process 0 has moved it before anyone lists the rounds again
    if not moves:
      ckpt.reload()
    cause = (str(failure) if failure else
             f'checkpoint of round {round_idx} is unreadable or stale on another process')
    console.report(f'warning: {cause}; {where}; trying the previous checkpoint')
  return None
