"""One run directory (an `experiments.train` --workdir, a table's runs/<cell>/seed<S>): the one
object that names its files and reads and writes them, so that the loop, the run guard, the table
harness and the binaries that read a finished run agree on them.

  WORKDIR/
    config.json           the run's config (written at round 0; rewritten by --allow_config_change)
    config_changes.json   the changes resumes made under --allow_config_change, with their round
    strategy.json         the strategy the run resolved (autotune.Choice), which its resumes keep
    random_init.json      the random-init encoder's evaluation (round 0, a reference row)
    raw_pixels.json       the raw-pixel reference row (config.probe = 'logistic')
    metrics.jsonl, tb/    one record per round (logging_utils.MetricsWriter), TensorBoard events
    checkpoints/<round>/  orbax checkpoints (checkpoint.Checkpointer); unreadable ones in corrupt/
    results.json          the final results, or "status": "diverged"
    error.json            a table's run that raised: its error and traceback (experiments.reproduce)
    metrics.png           the curves, with the reference rows as dashed lines
    train.log             the library's log (train.process<i>.log for process i > 0)
    run.lock              the live run's lock (run.process<i>.lock; lock.WorkdirLock)

Every write is atomic (`files.write_json`); a write that finds no room raises `files.DiskFull`
naming the file.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, List, Mapping, Optional, Tuple

import ml_collections

from fedjax_ssl import configuration, files, run_identity
from fedjax_ssl.runs import checkpoint, logging_utils


@dataclasses.dataclass(frozen=True)
class RunDir:
  """The files of the run directory `path` (module docstring). `writes=False`: the view of a
  process that reads them but leaves every write to another (the other processes of a
  multi-process run, where process 0 writes): its writes do nothing."""
  path: pathlib.Path
  writes: bool = True

  def __post_init__(self):
    object.__setattr__(self, 'path', pathlib.Path(self.path))

  # -- names --------------------------------------------------------------------------------------
  @property
  def config_file(self) -> pathlib.Path:
    return self.path / 'config.json'

  @property
  def config_changes_file(self) -> pathlib.Path:
    return self.path / 'config_changes.json'

  @property
  def strategy_file(self) -> pathlib.Path:
    return self.path / 'strategy.json'

  @property
  def random_init_file(self) -> pathlib.Path:
    return self.path / 'random_init.json'

  @property
  def raw_pixels_file(self) -> pathlib.Path:
    return self.path / 'raw_pixels.json'

  @property
  def metrics_file(self) -> pathlib.Path:
    return self.path / logging_utils.METRICS_FILE

  @property
  def checkpoints(self) -> pathlib.Path:
    return self.path / 'checkpoints'

  @property
  def results_file(self) -> pathlib.Path:
    return self.path / 'results.json'

  @property
  def plot_file(self) -> pathlib.Path:
    return self.path / 'metrics.png'

  @property
  def error_file(self) -> pathlib.Path:
    """A run of a table that failed: its error line and traceback (experiments.reproduce)."""
    return self.path / 'error.json'

  def log_file(self, process: int = 0) -> pathlib.Path:
    return self.path / ('train.log' if process == 0 else f'train.process{process}.log')

  def lock_file(self, process: int = 0) -> pathlib.Path:
    """Each process of a multi-process run locks its own file, so that a second multi-process run
    on the directory is refused in every process."""
    return self.path / ('run.lock' if process == 0 else f'run.process{process}.lock')

  # -- reading and writing ------------------------------------------------------------------------
  def read_json(self, path: pathlib.Path) -> Any:
    """The JSON file `path` of this directory, None when absent (ValueError when it does not
    parse: each caller says what that means for it)."""
    return json.loads(path.read_text()) if path.exists() else None

  def write_json(self, path: pathlib.Path, obj: Any) -> None:
    """Writes `obj` to `path` atomically; DiskFull(path) for lack of space."""
    if not self.writes:
      return
    with files.writing(path):
      files.write_json(path, obj)

  def has_config(self) -> bool:
    return self.config_file.exists()

  def read_config(self) -> ml_collections.ConfigDict:
    """The run's config.json over today's defaults (keys added since the run get their defaults;
    moved keys migrate into their blocks, `run_identity.migrate`). FileNotFoundError when there is
    none."""
    if not self.has_config():
      raise FileNotFoundError(f'{self.config_file} not found: --workdir must be an '
                              'experiments.train workdir')
    config = configuration.default_config()
    config.update(run_identity.migrate(json.loads(self.config_file.read_text())))
    return config

  def write_config(self, config: ml_collections.ConfigDict) -> None:
    self.write_json(self.config_file, config.to_dict())

  def read_config_changes(self) -> List[dict]:
    """The run's recorded config changes ([] when none)."""
    return self.read_json(self.config_changes_file) or []

  def record_config_changes(self, round_idx: int, changes: Mapping[str, Tuple[Any, Any]]
                            ) -> List[dict]:
    """Appends {round, changes: {key: [old, new]}} to config_changes.json; returns the list.

    A file of its own rather than a key of config.json: config.json holds config keys only, which
    `read_config`'s callers (reprobe, export_features) validate."""
    if not self.writes:
      return []
    history = self.read_config_changes()
    history.append({'round': int(round_idx),
                    'changes': {k: [old, new] for k, (old, new) in changes.items()}})
    self.write_json(self.config_changes_file, history)
    return history

  def clear_config_changes(self) -> None:
    """Forgets the recorded changes (a run that starts over from round 0 has none)."""
    if self.writes:
      self.config_changes_file.unlink(missing_ok=True)

  def read_results(self) -> Optional[dict]:
    return self.read_json(self.results_file)

  def write_results(self, results: dict) -> None:
    self.write_json(self.results_file, results)

  def read_metrics(self) -> List[dict]:
    """The per-round records of metrics.jsonl ([] when none)."""
    if not self.metrics_file.exists():
      return []
    return logging_utils.read_metrics(str(self.metrics_file))

  def metrics_writer(self) -> logging_utils.MetricsWriter:
    return logging_utils.MetricsWriter(str(self.path), writes=self.writes)

  def checkpointer(self, save_every: int = 0, *, read_only: bool = False
                   ) -> checkpoint.Checkpointer:
    """The run's checkpoints (read_only: a finished run's, for reading)."""
    return checkpoint.Checkpointer(self.checkpoints, save_every=save_every, read_only=read_only)
