"""A result table's definition and the runs it plans: scales, metric names, claims, `Table` (rows x
columns -> config overrides, over seeds), loading a table file, each cell's config, and the run
directories under a table's output folder with their status. Statistics are `tables.stats`,
rendering `tables.render`; `fedjax_ssl.tables` is the API over the three."""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib.util
import math
import pathlib
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment, run_identity
from fedjax_ssl.eval import per_client
from fedjax_ssl.runs.run_dir import RunDir

SCALES = ('quick', 'evidence', 'paper')
# A table file lists the scales it defines in its own SCALES (these two when it does not).
DEFAULT_TABLE_SCALES = ('quick', 'paper')

# Metric key in a run's results.json 'final' dict -> how the table names it. Accuracies are stored
# as fractions and shown (and given by the papers) in percent.
METRICS = {
    'probe_acc': 'linear probe (%)',
    'knn_acc': 'kNN (%)',
    'knn_acc_best': 'kNN, best over the evaluated rounds (%)',
    'probe_std_acc': 'linear probe on standardised features (%)',
    'test_acc': 'test accuracy, client mean (%)',
    # config.probe = 'logistic' (eval/protocol.py): label fractions and a second kNN k.
    'probe_acc_10pct': 'linear probe, 10% of the labels (%)',
    'probe_acc_1pct': 'linear probe, 1% of the labels (%)',
    'knn_acc_k20': 'kNN, k = 20 (%)',
    'knn_acc_10pct': 'kNN, 10% of the labels (%)',
    'knn_acc_1pct': 'kNN, 1% of the labels (%)',
    'knn_acc_1pct_k20': 'kNN, 1% of the labels, k = 20 (%)',
    # config.finetune (eval/finetune.py): encoder + linear head fine-tuned on a stratified subset.
    'ft_acc_1pct': 'fine-tuned, 1% of the labels (%)',
    'ft_acc_10pct': 'fine-tuned, 10% of the labels (%)',
    # config.per_client_eval (eval/per_client.py): the spread over clients, '<score>_<model>_<data>_<stat>'.
    **per_client.metric_names(),
}


def cohort_metric(metric: str) -> Optional[Tuple[str, str]]:
  """(base metric, cohort) for a per-architecture metric such as 'probe_acc_resnet18' (the mean
  over that cohort's clients, experiment.evaluate), else None (also for a METRICS key such as
  'knn_acc_1pct', which is no cohort of 'knn_acc')."""
  if metric in METRICS:
    return None
  for base in sorted(METRICS, key=len, reverse=True):
    if (metric.startswith(base + '_') and len(metric) > len(base) + 1
        and metric != base + '_clients'):  # the per-client list, not a cohort
      return base, metric[len(base) + 1:]
  return None


def metric_name(metric: str) -> str:
  """How a table names `metric` (a METRICS key or a per-cohort metric)."""
  if metric in METRICS:
    return METRICS[metric]
  base, cohort = cohort_metric(metric)
  return f'{METRICS[base]}, {cohort} clients'


# Reference rows every table can add (`reference_rows`): supervised FedAvg with the same encoder and
# budget (the ceiling a label-free method is measured against) and centralized SSL (all data on one
# client: the ceiling of federating). The random-init encoder and raw pixels come with every run.
def reference_rows(ssl_method: str, **extra: Any) -> Dict[str, Dict[str, Any]]:
  """{row label: overrides} of the two trained reference rows for a table of `ssl_method` runs;
  `extra` is applied to both (e.g. the encoder of a per-architecture table)."""
  return {
      'FedAvg (supervised)': dict(algorithm='fedavg', ssl_method='supervised', **extra),
      f'Centralized {ssl_method}': dict(algorithm='centralized', ssl_method=ssl_method,
                                       num_clients=1, clients_per_round=1, partition='iid',
                                       **extra),
  }


# The two references every run evaluates besides its trained encoder, as `Claim.worse` may name them.
RANDOM_INIT, RAW_PIXELS = 'random-init encoder', 'raw pixels'


@dataclasses.dataclass(frozen=True)
class Claim:
  """One claim a table tests: row `better` scores above row `worse` on `metric`.

  `worse` may also be RANDOM_INIT or RAW_PIXELS (the references of `better`'s own runs). The verdict
  (`verdict`) is taken per column, over the seeds both cells finished.
  """
  text: str
  better: str
  worse: str
  metric: str
  columns: Tuple[str, ...] = ()     # () = every column


@dataclasses.dataclass(frozen=True)
class Table:
  """A reproduction target.

  Attributes:
    name: file-system friendly name ('fedssl_fmnist').
    title: one line shown above the table.
    base: the config every cell starts from (scale already applied).
    rows: row label -> config overrides (e.g. the method).
    columns: column label -> config overrides (e.g. the partition). Row overrides are applied after
      column overrides, so a row may pin a key a column sets (centralized: one client).
    metrics: keys of METRICS reported for every cell.
    paper: (row, column, metric) -> the paper's number in percent; missing = not reported.
    scale: 'quick' | 'paper', the variant this Table was built for.
    notes: free text printed under the table (protocol, what differs from the paper).
    cell_overrides: (row, column) -> overrides applied after the row's, for settings that depend
      on both (FedSC's Table 6: each privacy level has its own noise and schedule per dataset).
    skip: (row, column) pairs that are not run (a level the paper does not report there).
    overrides: config key -> value applied to every cell after everything else (the command line's
      `--config.KEY=VALUE`, `with_overrides`); recorded in table.md.
    claims: what the table tests; table.md ends with a verdict per claim and column.
  """
  name: str
  title: str
  base: ml_collections.ConfigDict
  rows: Mapping[str, Mapping[str, Any]]
  columns: Mapping[str, Mapping[str, Any]]
  metrics: Tuple[str, ...]
  paper: Mapping[Tuple[str, str, str], float] = dataclasses.field(default_factory=dict)
  scale: str = 'quick'
  notes: str = ''
  cell_overrides: Mapping[Tuple[str, str], Mapping[str, Any]] = dataclasses.field(
      default_factory=dict)
  skip: frozenset = frozenset()
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  claims: Tuple[Claim, ...] = ()

  def cells(self) -> List[Tuple[str, str]]:
    """(row, column) pairs in display order, without the skipped ones."""
    return [(r, c) for r in self.rows for c in self.columns if (r, c) not in self.skip]


def slug(text: str) -> str:
  """Lower-case file-system name: runs of other characters than [a-z0-9] become '-'."""
  return re.sub(r'[^a-z0-9]+', '-', text.lower()).strip('-')


def cell_id(row: str, column: str) -> str:
  """Cell name used by --only and in workdir paths: '<row slug>.<column slug>'."""
  return f'{slug(row)}.{slug(column)}'


def check_table(table: Table) -> None:
  """Raises cv.ConfigError naming what is wrong with a table definition."""
  if table.scale not in SCALES:
    raise cv.ConfigError(f'scale = {table.scale!r} is invalid: must be one of {SCALES}')
  if not table.rows or not table.columns:
    raise cv.ConfigError(f'table {table.name!r} needs at least one row and one column')
  for metric in table.metrics:
    if metric not in METRICS and cohort_metric(metric) is None:
      raise cv.ConfigError(f'table {table.name!r}: metric {metric!r} is unknown; allowed: '
                           f'{tuple(METRICS)} or one of them + \'_<cohort name>\'')
  ids = [cell_id(r, c) for r, c in table.cells()]
  dup = sorted({i for i in ids if ids.count(i) > 1})
  if dup:
    raise cv.ConfigError(f'table {table.name!r}: cell names {dup} collide after slugging; '
                         'rename rows or columns')
  for r, c in list(table.cell_overrides) + list(table.skip):
    if r not in table.rows or c not in table.columns:
      raise cv.ConfigError(f'table {table.name!r}: cell {(r, c)!r} in cell_overrides/skip names no '
                           'row/column of the table')
  for (r, c, m), value in table.paper.items():
    if r not in table.rows or c not in table.columns or m not in table.metrics:
      raise cv.ConfigError(f'table {table.name!r}: paper entry {(r, c, m)!r} names no cell/metric '
                           'of the table')
    if not isinstance(value, (int, float)) or not math.isfinite(value):
      raise cv.ConfigError(f'table {table.name!r}: paper entry {(r, c, m)!r} = {value!r} is not a '
                           'finite number')
  for claim in table.claims:
    if claim.better not in table.rows or claim.worse not in (*table.rows, RANDOM_INIT, RAW_PIXELS):
      raise cv.ConfigError(f'table {table.name!r}: claim {claim.text!r} compares {claim.better!r} '
                           f'with {claim.worse!r}; allowed: rows {list(table.rows)}, or '
                           f'{RANDOM_INIT!r} / {RAW_PIXELS!r} as the lower one')
    if claim.metric not in table.metrics:
      raise cv.ConfigError(f'table {table.name!r}: claim {claim.text!r} uses metric '
                           f'{claim.metric!r}, not one of the table\'s {table.metrics}')
    unknown = [c for c in claim.columns if c not in table.columns]
    if unknown:
      raise cv.ConfigError(f'table {table.name!r}: claim {claim.text!r} names columns {unknown}; '
                           f'allowed: {list(table.columns)}')


def load_table(path: str, scale: str) -> Table:
  """Imports a table file and calls its `get_table(scale)`; the Table is checked."""
  if scale not in SCALES:
    raise cv.ConfigError(f'--scale = {scale!r} is invalid: must be one of {SCALES}')
  file = pathlib.Path(path)
  if not file.is_file():
    raise cv.ConfigError(f'--table = {path!r}: no such file')
  spec = importlib.util.spec_from_file_location(f'_table_{slug(file.parent.name)}_{slug(file.stem)}', file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'get_table'):
    raise cv.ConfigError(f'--table = {path!r} defines no get_table(scale)')
  defined = getattr(module, 'SCALES', DEFAULT_TABLE_SCALES)
  if scale not in defined:
    raise cv.ConfigError(f'--scale = {scale!r} is not defined by {path}: it defines {tuple(defined)}')
  table = module.get_table(scale)
  check_table(table)
  return table


def with_overrides(table: Table, overrides: Mapping[str, Any]) -> Table:
  """`table` with `overrides` (config key -> value, e.g. {'rounds': 40, 'fedu2.lambda_u': 0.0})
  applied to every cell, after the table's own settings."""
  table = dataclasses.replace(table, overrides={**table.overrides, **overrides})
  if overrides.get('per_client_eval'):  # per-client results (issue 69): their spread columns
    table = dataclasses.replace(table, metrics=table.metrics + tuple(
        m for m in per_client.table_metrics(per_client.SCORES) if m not in table.metrics))
  return table


def cell_config(table: Table, row: str, column: str, seed: int) -> ml_collections.ConfigDict:
  """base <- column overrides <- row overrides <- cell overrides <- table.overrides <- seed;
  unknown keys raise cv.ConfigError.

  A key may name a sub-config's entry with a dot ('fedu2.fur').
  """
  config = ml_collections.ConfigDict(table.base.to_dict())
  layers = (('column', table.columns[column]), ('row', table.rows[row]),
            ('cell', table.cell_overrides.get((row, column), {})),
            ('override', table.overrides))
  for what, overrides in layers:
    for key, value in overrides.items():
      name = {'column': repr(column), 'row': repr(row), 'cell': repr((row, column)),
              'override': '(every cell)'}[what]
      where = f'table {table.name!r}, {what} {name}'
      *parents, leaf = key.split('.')
      node = config
      for part in parents:
        node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
      if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
        raise cv.ConfigError(f'{where}: config key {key!r} does not exist')
      try:
        node[leaf] = value
      except (TypeError, ValueError) as e:
        raise cv.ConfigError(f'{where}: {key} = {value!r} is invalid: {e}') from None
  config.seed = seed
  return config


def _saved_config_matches(run: 'RunSpec', rundir: RunDir) -> bool:
  """Whether the run directory's config.json (written by the training loop) is the run's config."""
  if not rundir.has_config():
    return False
  # Over today's defaults: a key added to the library since the run (at its default) is no change.
  return run_identity.run_key(rundir.read_config()) == run_identity.run_key(run.config)


@dataclasses.dataclass
class RunSpec:
  """One training run: a distinct config at one seed, shared by the cells listed."""
  name: str                         # '<first cell id>/seed<k>', also its path under OUT/runs
  cells: List[Tuple[str, str]]
  seed: int
  config: Optional[ml_collections.ConfigDict]
  config_error: Optional[str] = None

  def workdir(self, out: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(out) / 'runs' / self.name


def select_cells(table: Table, only: Sequence[str]) -> List[Tuple[str, str]]:
  """Cells whose id matches one of the `only` patterns (fnmatch; all cells when empty)."""
  cells = table.cells()
  if not only:
    return cells
  chosen = [rc for rc in cells if any(fnmatch.fnmatchcase(cell_id(*rc), p) for p in only)]
  unmatched = [p for p in only if not any(fnmatch.fnmatchcase(cell_id(*rc), p) for rc in cells)]
  if unmatched:
    raise cv.ConfigError(f'--only {unmatched} matches no cell; cells: '
                         f'{[cell_id(*rc) for rc in cells]}')
  return chosen


def plan_runs(table: Table, seeds: Sequence[int], only: Sequence[str] = ()) -> List[RunSpec]:
  """The runs the selected cells need, each config validated (no data loaded, nothing compiled).

  A cell whose config is invalid becomes a RunSpec with `config_error` set: it is reported in the
  table and the other cells still run.
  """
  runs: Dict[Tuple[str, int], RunSpec] = {}
  # Seed-major order: the whole grid at the first seed comes first, so an interrupted table is a
  # complete table with fewer seeds rather than half a table.
  cells = select_cells(table, only)
  for seed in seeds:
    for row, column in cells:
      try:
        config = cell_config(table, row, column, seed)
        experiment.validate_config(config)
        key = (run_identity.run_key(config), seed)
        error = None
      except cv.ConfigError as e:
        config, error = None, str(e)
        key = (f'invalid:{cell_id(row, column)}', seed)
      if key in runs:
        runs[key].cells.append((row, column))
      else:
        runs[key] = RunSpec(name=f'{cell_id(row, column)}/seed{seed}', cells=[(row, column)],
                            seed=seed, config=config, config_error=error)
  return list(runs.values())


def seeds_on_disk(out: pathlib.Path) -> List[int]:
  """The seeds of the run directories under OUT/runs (`<cell>/seed<k>`)."""
  found = set()
  for d in (pathlib.Path(out) / 'runs').glob('*/seed*'):
    m = re.fullmatch(r'seed(\d+)', d.name)
    if m and d.is_dir():
      found.add(int(m.group(1)))
  return sorted(found)


def table_runs(table: Table, current: Sequence[RunSpec], out: pathlib.Path) -> List[RunSpec]:
  """The runs a table's outputs summarise: this invocation's (`current`, from `plan_runs`) and
  every other run of the table with a result or an error under `out`, at any seed, so that running
  some cells or seeds rewrites the whole table rather than a table of those alone; a cell with some
  seeds on disk keeps its missing ones too, as pending, so that its value is marked '[k of n seeds]'
  rather than passing for complete (cells never run stay out)."""
  names = {r.name for r in current}
  seeds = {r.seed for r in current} | set(seeds_on_disk(out))
  planned = [r for r in plan_runs(table, sorted(seeds)) if r.name not in names
             and r.config is not None]
  missing = {r.name for r in planned if run_status(r, out)[0] == 'missing'}
  started = {c for r in planned if r.name not in missing for c in r.cells}
  others = [r for r in planned if r.name not in missing or started & set(r.cells)]
  return sorted([*current, *others], key=lambda r: r.seed)  # seed-major, as plan_runs


def run_status(run: RunSpec, out: pathlib.Path) -> Tuple[str, Any]:
  """('done', results) | ('failed', error text) | ('stale', error text) | ('missing', None), read
  from the run's workdir. 'stale': the workdir holds a run of another config (the table file changed
  since it ran); it is neither counted nor overwritten."""
  if run.config_error is not None:
    return 'failed', run.config_error
  rundir = RunDir(run.workdir(out))
  if rundir.has_config() and not _saved_config_matches(run, rundir):
    return 'stale', (f'{rundir.path} holds a run of a different config (the table changed since it '
                     'ran); delete that directory to run the current config')
  results = rundir.read_results()
  if results is not None:
    return 'done', results
  error = rundir.read_json(rundir.error_file)
  if error is not None:
    return 'failed', error['error']
  return 'missing', None
