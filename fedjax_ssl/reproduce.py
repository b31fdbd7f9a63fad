"""Result tables: a grid of runs (rows x columns -> config overrides) over seeds, summarised next to
the paper's numbers.

A table file (configs/<paper>/<table>.py) defines `get_table(scale) -> Table`. `experiments.reproduce`
turns it into runs, one workdir per distinct config and seed, and this module turns the runs'
`results.json` into `table.csv`, `table.md` and `table.png`, and their `metrics.jsonl` into
`curves.png` (the kNN monitor against rounds):

  table = reproduce.load_table('configs/fedssl/fmnist.py', 'quick')
  runs = reproduce.plan_runs(table, seeds=(0, 1, 2))      # every config validated, nothing computed
  ... run each RunSpec through fedjax_ssl.training.train_and_evaluate(run.config, run.workdir(out))
  summary = reproduce.summarize(table, runs, out)
  reproduce.write_outputs(table, summary, out, seeds)
  reproduce.plot_curves(table, reproduce.curves(table, runs, out), out / 'curves.png')

Cells whose final configs are identical share one run (e.g. centralized training, which ignores the
partition column), so a table never trains the same thing twice.
"""
from __future__ import annotations

import csv
import dataclasses
import fnmatch
import importlib.util
import io
import json
import math
import pathlib
import re
import textwrap
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import ml_collections
import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl import configuration, experiment, files, plotting, run_identity

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
  return dataclasses.replace(table, overrides={**table.overrides, **overrides})


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


def _saved_config_matches(run: 'RunSpec', workdir: pathlib.Path) -> bool:
  """Whether the workdir's config.json (written by the training binary) is the run's config."""
  if not (workdir / 'config.json').exists():
    return False
  # Over today's defaults: a key added to the library since the run (at its default) is no change.
  return run_identity.run_key(experiment.load_run_config(workdir)) == run_identity.run_key(
      run.config)


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
  some cells or seeds rewrites the whole table rather than a table of those alone."""
  names = {r.name for r in current}
  seeds = {r.seed for r in current} | set(seeds_on_disk(out))
  others = [r for r in plan_runs(table, sorted(seeds))
            if r.name not in names and r.config is not None
            and run_status(r, out)[0] != 'missing']
  return sorted([*current, *others], key=lambda r: r.seed)  # seed-major, as plan_runs


def run_status(run: RunSpec, out: pathlib.Path) -> Tuple[str, Any]:
  """('done', results) | ('failed', error text) | ('stale', error text) | ('missing', None), read
  from the run's workdir. 'stale': the workdir holds a run of another config (the table file changed
  since it ran); it is neither counted nor overwritten."""
  if run.config_error is not None:
    return 'failed', run.config_error
  wd = run.workdir(out)
  results = wd / 'results.json'
  if (wd / 'config.json').exists() and not _saved_config_matches(run, wd):
    return 'stale', (f'{wd} holds a run of a different config (the table changed since it ran); '
                     'delete that directory to run the current config')
  if results.exists():
    return 'done', json.loads(results.read_text())
  error = wd / 'error.json'
  if error.exists():
    return 'failed', json.loads(error.read_text())['error']
  return 'missing', None


def run_metric(metric: str, payload: Dict[str, Any],
               config: Optional[ml_collections.ConfigDict]) -> str:
  """The key of `payload['final']` that holds table metric `metric` for one run: the metric itself,
  except that a per-architecture metric ('probe_acc_lenet5') of a run without cohorts whose every
  client is that architecture (`config.encoder == 'lenet5'`) is the run's own 'probe_acc', so a
  homogeneous reference row (supervised FedAvg on LeNet-5) fills the cohort's column."""
  split = cohort_metric(metric)
  if (metric in payload['final'] or split is None or 'cohorts' in payload or config is None
      or config.get('encoder') != split[1]):
    return metric
  return split[0]


def summarize(table: Table, runs: Sequence[RunSpec], out: pathlib.Path) -> List[Dict[str, Any]]:
  """One row per (cell, metric): seed values, mean and sample std (ddof=1) in percent, the paper's
  number and the difference, the random-init encoder's mean, and the errors of failed seeds."""
  per_cell: Dict[Tuple[str, str], List[Tuple[RunSpec, str, Any]]] = {}
  for run in runs:
    status = run_status(run, out)
    for cell in run.cells:
      per_cell.setdefault(cell, []).append((run, *status))
  rows = []
  for row, column in table.cells():
    if (row, column) not in per_cell:
      continue
    entries = per_cell[(row, column)]
    for metric in table.metrics:
      values, inits, pixels, errors, seeds, diverged = [], [], [], [], [], []
      for run, status, payload in entries:
        if status == 'done' and payload.get('status') == 'diverged':  # marked, never averaged
          diverged.append(f'seed {run.seed}: diverged at round {payload["diverged"]["round"]} '
                          f'({payload["diverged"]["quantity"]})')
        elif status == 'done':
          key = run_metric(metric, payload, run.config)
          if key not in payload['final']:
            # A per-architecture metric exists only for runs with cohorts and for runs of that one
            # architecture; a run with cohorts but without it has a misspelled cohort name.
            if cohort_metric(metric) is None or 'cohorts' in payload:
              errors.append(f'seed {run.seed}: results have no {metric!r}')
            continue
          values.append(100.0 * payload['final'][key])
          inits.append(100.0 * payload['random_init'].get(key, float('nan')))
          pixels.append(100.0 * payload.get('raw_pixels', {}).get(key, float('nan')))
          seeds.append(run.seed)
        elif status in ('failed', 'stale'):
          errors.append(f'seed {run.seed}: {payload}')
      if cohort_metric(metric) and not values and not errors and not diverged and all(
          status == 'done' for _, status, _ in entries):
        continue
      paper = table.paper.get((row, column, metric))
      mean = float(np.mean(values)) if values else float('nan')
      std = float(np.std(values, ddof=1)) if len(values) > 1 else float('nan')
      rows.append({
          'row': row, 'column': column, 'cell': cell_id(row, column), 'metric': metric,
          'n': len(values), 'mean': mean, 'std': std, 'paper': paper,
          'diff': mean - paper if paper is not None and values else None,
          'values': values, 'seeds': seeds,
          'random_init_mean': float(np.mean(inits)) if inits else float('nan'),
          'raw_pixels_mean': float(np.mean(pixels)) if pixels else float('nan'),
          'random_init_values': inits, 'raw_pixels_values': pixels,
          'pending': sum(status == 'missing' for _, status, _ in entries),
          'errors': errors, 'diverged': diverged})
  return rows


def _paired(summary: Sequence[Dict[str, Any]], claim: Claim, column: str
            ) -> Optional[Tuple[List[float], List[float]]]:
  """Per-seed values (better, worse) of `claim` in `column` over the seeds both cells have."""
  by_key = {(e['row'], e['column'], e['metric']): e for e in summary}
  hi = by_key.get((claim.better, column, claim.metric))
  if hi is None:
    return None
  if claim.worse in (RANDOM_INIT, RAW_PIXELS):
    key = 'random_init_values' if claim.worse == RANDOM_INIT else 'raw_pixels_values'
    if len(hi[key]) != len(hi['values']):  # carried from a csv without per-seed references
      return None
    pairs = [(a, b) for a, b in zip(hi['values'], hi[key]) if math.isfinite(b)]
  else:
    lo = by_key.get((claim.worse, column, claim.metric))
    if lo is None:
      return None
    lo_by_seed = dict(zip(lo['seeds'], lo['values']))
    pairs = [(a, lo_by_seed[s]) for s, a in zip(hi['seeds'], hi['values']) if s in lo_by_seed]
  return [a for a, _ in pairs], [b for _, b in pairs]


def verdict(better: Sequence[float], worse: Sequence[float]) -> Dict[str, Any]:
  """The verdict on 'better > worse' from per-seed values (percent).

  effect = mean(better) − mean(worse); spread = the larger of the two sample stds over seeds.
  'confirmed' needs effect > 2·spread, 'reversed' effect < −2·spread, else 'not confirmed'; fewer
  than 2 seeds give 'too few seeds' (no spread to compare with).
  """
  n = min(len(better), len(worse))
  if n == 0:
    return {'n': 0, 'effect': float('nan'), 'spread': float('nan'), 'verdict': 'no runs'}
  effect = float(np.mean(better) - np.mean(worse))
  if n < 2:
    return {'n': n, 'effect': effect, 'spread': float('nan'), 'verdict': 'too few seeds'}
  spread = float(max(np.std(better, ddof=1), np.std(worse, ddof=1)))
  word = ('confirmed' if effect > 2 * spread else 'reversed' if effect < -2 * spread
          else 'not confirmed')
  return {'n': n, 'effect': effect, 'spread': spread, 'verdict': word}


def verdicts(table: Table, summary: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """One entry per (claim, column) with results: claim, column, metric, n, effect, spread, verdict."""
  out = []
  by_key = {(e['row'], e['column'], e['metric']): e for e in summary}
  for claim in table.claims:
    for column in claim.columns or tuple(table.columns):
      pair = _paired(summary, claim, column)
      if pair is not None:
        found = verdict(*pair)
      elif (claim.better, column, claim.metric) in by_key and claim.worse in (RANDOM_INIT,
                                                                             RAW_PIXELS):
        found = {'n': 0, 'effect': float('nan'), 'spread': float('nan'),
                 'verdict': 'no per-seed reference values (carried from an older table.csv)'}
      else:
        continue
      if not found['n']:  # no seed pairs: say so where a side collapsed
        sides = [by_key.get((r, column, claim.metric)) for r in (claim.better, claim.worse)]
        gone = [f"{e['row']} collapsed ({len(e['collapsed'])} seeds)" for e in sides
                if e is not None and e.get('collapsed') and not e['n']]
        if gone:
          found = dict(found, verdict='; '.join(gone))
      out.append({'claim': claim.text, 'better': claim.better, 'worse': claim.worse,
                  'column': column, 'metric': claim.metric, **found})
  return out


# A seed is collapsed when its trained encoder carries no class information: its full-label score
# (the first of COLLAPSE_METRICS the cell has) lies within COLLAPSE_MARGIN points of chance,
# 100 / classes. 2 points on 10 classes: the committed collapsed runs score 10.00 to 10.02 (every
# feature the same vector: uniformity 0, effective rank 1, docs/results/fedu2/fmnist_quick/geometry.md);
# the nearest seed above them, FedU2-BYOL at alpha 0.1 seed 2 (probe 13.88, kNN 13.59, effective
# rank > 1), keeps some class information and is counted, as a weak seed, not a collapsed one.
COLLAPSE_MARGIN = 2.0
COLLAPSE_METRICS = ('probe_acc', 'knn_acc', 'test_acc')


def collapsed_seeds(entries: Sequence[Dict[str, Any]], num_classes: int
                    ) -> Dict[int, str]:
  """{seed: why} of one cell's seeds that collapsed (`COLLAPSE_MARGIN`), from its summary entries
  (one per metric)."""
  by_metric = {e['metric']: e for e in entries}
  chance = 100.0 / num_classes
  for metric in COLLAPSE_METRICS:
    e = by_metric.get(metric)
    if e is None or not e['n']:
      continue
    return {seed: (f'seed {seed}: {metric_name(metric)} {value:.2f}, within {COLLAPSE_MARGIN:g} '
                   f'points of chance ({chance:.2f})')
            for seed, value in zip(e['seeds'], e['values']) if value <= chance + COLLAPSE_MARGIN}
  return {}


def mark_collapsed(table: Table, summary: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """`summary` with each cell's collapsed seeds (`collapsed_seeds`) taken out of every metric
  entry of the cell, values and per-seed references alike, and listed in the entry's 'collapsed':
  a mean is never over collapsed and learning seeds together, and a verdict never pairs a
  collapsed seed. Cells of a dataset whose class count is unknown before loading are left as
  they are."""
  by_cell: Dict[str, List[Dict[str, Any]]] = {}
  for e in summary:
    by_cell.setdefault(e['cell'], []).append(e)
  classes = {}
  for row, column in table.cells():
    info = configuration.dataset_info(cell_config(table, row, column, 0))
    if info is not None:
      classes[cell_id(row, column)] = info.num_classes
  out = []
  for e in summary:
    found = (collapsed_seeds(by_cell[e['cell']], classes[e['cell']]) if e['cell'] in classes
             else {})
    keep = [i for i, s in enumerate(e['seeds']) if s not in found]
    if len(keep) == len(e['seeds']):
      out.append(dict(e, collapsed=list(e.get('collapsed', []))))
      continue
    new = dict(e, seeds=[e['seeds'][i] for i in keep],
               collapsed=list(e.get('collapsed', [])) + [found[s] for s in e['seeds'] if s in found])
    for key in ('values', 'random_init_values', 'raw_pixels_values'):
      if len(e[key]) == len(e['seeds']):
        new[key] = [e[key][i] for i in keep]
    values = new['values']
    new.update(n=len(values), mean=float(np.mean(values)) if values else float('nan'),
               std=float(np.std(values, ddof=1)) if len(values) > 1 else float('nan'))
    new['diff'] = new['mean'] - e['paper'] if e['paper'] is not None and values else None
    for key in ('random_init', 'raw_pixels'):
      if len(new[f'{key}_values']) == len(values) and values:
        new[f'{key}_mean'] = float(np.mean(new[f'{key}_values']))
    out.append(new)
  return out


def _fmt(x: Optional[float], digits: int = 2) -> str:
  return '–' if x is None or not math.isfinite(x) else f'{x:.{digits}f}'


def _md_cell(entry: Dict[str, Any]) -> str:
  if entry['n'] == 0:
    return _no_value(entry)
  text = _fmt(entry['mean'])
  if entry['n'] > 1:
    text += f' ± {_fmt(entry["std"])}'
  if entry['paper'] is not None:
    text += f' (paper {_fmt(entry["paper"])}, {entry["diff"]:+.2f})'
  collapsed = entry.get('collapsed', [])
  lost = len(entry['errors']) + len(entry['diverged']) + len(collapsed)
  if lost or entry['pending']:
    marks = [f'{len(entry[k])} {k}' for k in ('diverged', 'collapsed') if entry.get(k)]
    text += (f' [{entry["n"]} of {entry["n"] + entry["pending"] + lost} seeds'
             + (f', {", ".join(marks)}]' if marks else ']'))
  return text


def _no_value(entry: Dict[str, Any]) -> str:
  """What a cell without a value shows: 'failed' (an error), 'diverged' (every finished seed
  diverged), 'collapsed (k of n seeds)' (every finished seed collapsed, `mark_collapsed`) or
  'pending'."""
  if entry['errors']:
    return 'failed'
  if entry.get('collapsed') and not entry['diverged']:
    k = len(entry['collapsed'])
    return f'collapsed ({k} of {k + entry["pending"]} seeds)'
  return 'diverged' if entry['diverged'] else 'pending'


# table.csv's columns. The per-seed reference values (random-init encoder, raw pixels) pair each
# seed with its own reference in the 'learns' verdicts, also for a table rebuilt from the csv alone.
CSV_FIELDS = ('row', 'column', 'cell', 'metric', 'n', 'mean', 'std', 'paper', 'diff',
              'random_init_mean', 'raw_pixels_mean', 'seeds', 'values', 'random_init_values',
              'raw_pixels_values', 'pending', 'errors', 'diverged', 'collapsed')
_LIST_FIELDS = ('seeds', 'values', 'random_init_values', 'raw_pixels_values', 'errors', 'diverged',
                'collapsed')


def write_csv(summary: Sequence[Dict[str, Any]], path: pathlib.Path) -> None:
  f = io.StringIO(newline='')
  w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
  w.writeheader()
  for e in summary:
    w.writerow({**{k: e[k] for k in CSV_FIELDS if k not in _LIST_FIELDS},
                'seeds': ' '.join(str(s) for s in e['seeds']),
                **{k: ' '.join(f'{v:.4f}' for v in e[k])
                   for k in ('values', 'random_init_values', 'raw_pixels_values')},
                'errors': ' | '.join(e['errors']), 'diverged': ' | '.join(e['diverged']),
                'collapsed': ' | '.join(e.get('collapsed', []))})
  files.write_text(path, f.getvalue())


def read_csv(path: pathlib.Path) -> List[Dict[str, Any]]:
  """The summary entries of a table.csv (`write_csv`'s inverse, values to 4 decimals); [] when the
  file does not exist. A csv written before the per-seed reference columns existed gives empty
  reference lists (its 'learns' verdicts then have no pairs)."""
  path = pathlib.Path(path)
  if not path.exists():
    return []

  def number(text):
    return None if text in ('', None) else float(text)

  def floats(text):
    return [float(v) for v in (text or '').split()]

  entries = []
  with open(path, newline='') as f:
    for r in csv.DictReader(f):
      entries.append({
          'row': r['row'], 'column': r['column'], 'cell': r['cell'], 'metric': r['metric'],
          'n': int(r['n']), 'mean': float(r['mean']), 'std': float(r['std']),
          'paper': number(r['paper']), 'diff': number(r['diff']),
          'random_init_mean': float(r['random_init_mean']),
          'raw_pixels_mean': float(r['raw_pixels_mean']),
          'seeds': [int(v) for v in r['seeds'].split()], 'values': floats(r['values']),
          'random_init_values': floats(r.get('random_init_values')),
          'raw_pixels_values': floats(r.get('raw_pixels_values')),
          'pending': int(r['pending']),
          'errors': r['errors'].split(' | ') if r['errors'] else [],
          'diverged': r['diverged'].split(' | ') if r['diverged'] else [],
          'collapsed': r['collapsed'].split(' | ') if r.get('collapsed') else []})
  return entries


def carry_over(table: Table, summary: Sequence[Dict[str, Any]],
               previous: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """`summary` and, for the table's cells it has no result of, their entries in `previous` (an
  earlier table.csv of the same table, `read_csv`), marked 'carried': running some cells rewrites
  the table without losing the others, also where their runs are gone (a fresh clone keeps the
  tables, not the runs). A cell whose runs are all still to run (pending: no value, error or
  divergence yet) keeps its earlier entry until one finishes."""
  have = {e['cell'] for e in summary if e['n'] or e['errors'] or e['diverged']}
  cells = {cell_id(r, c) for r, c in table.cells()}
  kept = [e for e in summary if e['cell'] in have or e['cell'] not in {p['cell'] for p in previous}]
  return kept + [dict(e, carried=True) for e in previous
                 if e['cell'] not in have and e['cell'] in cells and e['metric'] in table.metrics]


# How far, in points, one reference measured twice may drift: a carried cell's recomputed mean
# against the mean its table.csv stored (`fill_references`; at most 0.0067 over the committed
# tables) and one encoder's per-seed score in two processes (`_reference_groups`; 0.012 seen). A
# wider gap means another evaluator, config or encoder, which must not be paired or grouped.
REFERENCE_TOLERANCE = 0.05


def without_references(summary: Sequence[Dict[str, Any]]) -> Dict[str, List[int]]:
  """{cell id: seeds} of the entries with values but no per-seed references: those carried from a
  table.csv written before the per-seed reference columns existed."""
  return {e['cell']: list(e['seeds']) for e in summary
          if e['n'] and len(e['random_init_values']) != len(e['values'])}


def fill_references(summary: Sequence[Dict[str, Any]],
                    references: Mapping[Tuple[str, int], Tuple[Mapping[str, Any],
                                                              Optional[Mapping[str, Any]]]],
                    tolerance: float = REFERENCE_TOLERANCE) -> List[str]:
  """Gives the entries `without_references` their per-seed references, in place.

  `references` maps (cell id, seed) to (random-init metrics, raw-pixel metrics or None), fractions
  as a run's results.json holds them. An entry takes its seeds' references, and the means become
  theirs, only when every recomputed mean is within `tolerance` points of the mean the entry
  stored; otherwise it stays unpaired. Returns one line per entry left unpaired, naming the gap.
  """
  problems = []
  for e in summary:
    if not e['n'] or len(e['random_init_values']) == len(e['values']):
      continue
    if any((e['cell'], s) not in references for s in e['seeds']):
      problems.append(f"{e['cell']} {e['metric']}: no references for seeds {e['seeds']}")
      continue
    found = {}
    for key, which in (('random_init', 0), ('raw_pixels', 1)):
      found[key] = [100.0 * float((references[(e['cell'], s)][which] or {}).get(e['metric'], 'nan'))
                    for s in e['seeds']]
    gaps = []
    for key, values in found.items():
      stored, mean = e[f'{key}_mean'], float(np.mean(values))
      if math.isfinite(stored) and not (math.isfinite(mean) and abs(mean - stored) <= tolerance):
        gaps.append(f'{key} {mean:.4f} recomputed, {stored:.4f} stored')
    if gaps:
      problems.append(f"{e['cell']} {e['metric']}: " + '; '.join(gaps) +
                      f' (tolerance {tolerance} points): left unpaired')
      continue
    for key, values in found.items():
      e[f'{key}_values'] = values
      e[f'{key}_mean'] = float(np.mean(values))
  return problems


def _reference_groups(rows: Sequence[str], columns: Sequence[str], metrics: Sequence[str],
                      by_key: Dict[Tuple[str, str, str], Dict[str, Any]]) -> List[List[str]]:
  """`rows` grouped by their random-init encoder, in first-row order: two rows share a group when
  their random-init scores agree to REFERENCE_TOLERANCE at every (metric, column, seed) both have.
  Rows of one encoder share one random-init row in table.md; a table whose rows start from
  different encoders (a mix and its single-architecture references) gets one per encoder rather
  than an average of unlike models. The tolerance, not equality: one encoder scored in two
  processes drifts in the last digits (0.012 points between a fresh run and the carried cells of
  the quick Hetero-SSFL table). Every metric at once, so that unlike encoders level on one metric
  still split. A row with no per-seed value joins the first group."""
  groups: List[Tuple[Dict[Tuple[str, str, int], float], List[str]]] = []
  unscored = []
  for r in rows:
    scores = {}
    for m in metrics:
      for c in columns:
        e = by_key.get((r, c, m))
        if e is not None:
          scores.update({(m, c, s): v for s, v in zip(e['seeds'], e.get('random_init_values') or ())
                         if math.isfinite(v)})
    if not scores:
      unscored.append(r)
      continue
    for seen, members in groups:
      if all(abs(seen[k] - v) < REFERENCE_TOLERANCE for k, v in scores.items() if k in seen):
        seen.update(scores)
        members.append(r)
        break
    else:
      groups.append((scores, [r]))
  found = [members for _, members in groups] or [[]]
  found[0] += unscored
  return found


def markdown(table: Table, summary: Sequence[Dict[str, Any]], seeds: Sequence[int],
             command: str = '') -> str:
  """table.md: one rows x columns grid per metric, 'mean ± std (paper P, diff)'."""
  by_key = {(e['row'], e['column'], e['metric']): e for e in summary}
  lines = [f'# {table.title}', '',
           f'Scale `{table.scale}`, seeds {list(seeds)}; mean ± sample std over seeds, in percent; '
           '"paper" is the number the paper reports for that cell and the signed difference '
           'follows it.']
  if command:
    lines += ['', f'Command: `{command}`']
  if table.overrides:
    shown = ', '.join(f'`{k}={v!r}`' for k, v in sorted(table.overrides.items()))
    lines += ['', f'Overrides applied to every cell: {shown}.']
  rows = [r for r in table.rows if any((r, c, m) in by_key for c in table.columns
                                       for m in table.metrics)]
  groups = _reference_groups(rows, table.columns, table.metrics, by_key)
  for metric in table.metrics:
    lines += ['', f'## {metric_name(metric)}', '',
              '| | ' + ' | '.join(table.columns) + ' |',
              '|---|' + '---|' * len(table.columns)]
    for r in rows:
      cells = [_md_cell(by_key[(r, c, metric)]) if (r, c, metric) in by_key else '–'
               for c in table.columns]
      lines.append(f'| {r} | ' + ' | '.join(cells) + ' |')
    def reference(key, group):  # per column: the mean of `key` over the group's finished cells
      done = [[by_key[(r, c, metric)][key] for r in group if by_key.get((r, c, metric), {}).get('n')
               and math.isfinite(by_key[(r, c, metric)][key])] for c in table.columns]
      return [float(np.mean(d)) if d else float('nan') for d in done]
    # The groups with a scored reference in this metric's grid (a per-architecture grid has none
    # of the other architecture's; fine-tuning metrics have none).
    present = [g for g in ([r for r in group if any(
        by_key.get((r, c, metric), {}).get('n')
        and math.isfinite(by_key[(r, c, metric)]['random_init_mean']) for c in table.columns)]
                           for group in groups) if g]
    for group in present or [[]]:
      label = '' if len(present) <= 1 else f', of {"; ".join(group)}'
      refs = reference('random_init_mean', group)
      lines.append(f'| *random-init encoder{label}* | ' + ' | '.join(map(_fmt, refs)) + ' |')
    pixels = reference('raw_pixels_mean', rows)
    if any(math.isfinite(v) for v in pixels):
      lines.append('| *raw pixels* | ' + ' | '.join(map(_fmt, pixels)) + ' |')
  failures = [(e['cell'], err) for e in summary for err in e['errors']]
  if failures:
    lines += ['', '## Failed runs', '']
    seen = set()
    for cell, err in failures:
      if (cell, err) not in seen:
        seen.add((cell, err))
        lines.append(f'- `{cell}` {err.splitlines()[0] if err else ""}')
  collapsed = sorted({(e['cell'], why) for e in summary for why in e.get('collapsed', [])})
  if collapsed:
    lines += ['', '## Collapsed seeds', '',
              f'Left out of every mean and verdict of their cell: a seed whose full-label score is '
              f'within {COLLAPSE_MARGIN:g} points of chance (`reproduce.COLLAPSE_MARGIN`).', '']
    lines += [f'- `{cell}` {why}' for cell, why in collapsed]
  carried = sorted({e['cell'] for e in summary if e.get('carried')})
  if carried:
    lines += ['', f'Carried from the previous table.csv (no run of theirs under this output '
              f'directory): {", ".join(f"`{c}`" for c in carried)}.']
  if table.notes:
    lines += ['', table.notes.strip()]
  found = verdicts(table, summary)
  if found:
    lines += ['', '## Verdict', '',
              'Effect = mean(higher row) − mean(lower row) over the seeds both finished, in points; '
              'spread = the larger seed std of the two. *Confirmed* needs effect > 2 × spread, '
              '*reversed* effect < −2 × spread.', '',
              '| claim | column | metric | effect | spread | seeds | verdict |',
              '|---|---|---|---|---|---|---|']
    for v in found:
      lines.append(f"| {v['claim']} | {v['column']} | {metric_name(v['metric'])} | "
                   f"{v['effect']:+.2f} | {_fmt(v['spread'])} | {v['n']} | **{v['verdict']}** |"
                   if math.isfinite(v['effect']) else
                   f"| {v['claim']} | {v['column']} | {metric_name(v['metric'])} | – | – | 0 | "
                   f"{v['verdict']} |")
  return '\n'.join(lines) + '\n'


def plot(table: Table, summary: Sequence[Dict[str, Any]], path: pathlib.Path) -> None:
  """table.png: per metric, rows on the x axis with one bar per column (mean over seeds), the seeds
  as dots, ± std as an error bar, the random-init encoder as a dashed segment and the paper's number
  as a red cross. Cells without a result are marked 'failed' or 'pending'."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.patches  # pylint: disable=g-import-not-at-top
  import matplotlib.pyplot as plt

  metrics, columns = list(table.metrics), list(table.columns)
  rows = [r for r in table.rows if any(e['row'] == r for e in summary)]
  width = 0.8 / len(columns)
  fig, axes = plt.subplots(len(metrics), 1, squeeze=False,
                           figsize=(max(6.0, 1.1 * len(rows) * len(columns) ** 0.5 + 2),
                                    3.8 * len(metrics) + 0.8))
  for ax, metric in zip(axes[:, 0], metrics):
    by_cell = {(e['row'], e['column']): e for e in summary if e['metric'] == metric}
    shown, missing = [], []
    for j, column in enumerate(columns):
      for i, row in enumerate(rows):
        e = by_cell.get((row, column))
        if e is None:
          continue
        x = i - 0.4 + width * (j + 0.5)
        if not e['n']:
          missing.append((x, _no_value(e)))
          continue
        ax.bar(x, e['mean'], width * 0.9, yerr=e['std'] if e['n'] > 1 else 0.0, capsize=2,
               color=f'C{j % 10}', alpha=0.8)
        ax.plot([x] * e['n'], e['values'], 'k.', markersize=3)
        shown += e['values']
        if math.isfinite(e['random_init_mean']):
          ax.plot([x - width / 2, x + width / 2], [e['random_init_mean']] * 2, 'k--', linewidth=1)
          shown.append(e['random_init_mean'])
        if e['paper'] is not None:
          ax.plot(x, e['paper'], 'rx', markersize=8, markeredgewidth=2)
          shown.append(e['paper'])
    lo, hi = (min(shown), max(shown)) if shown else (0.0, 100.0)
    pad = 0.15 * (hi - lo) + 1.0
    ax.set_ylim(max(0.0, lo - pad), min(100.0, hi + pad))
    for x, text in missing:
      ax.text(x, ax.get_ylim()[0], text, rotation=90, ha='center', va='bottom', fontsize=7)
    ax.set_xticks(np.arange(len(rows)))
    ax.set_xticklabels(rows, rotation=25, ha='right', fontsize=8)
    ax.set_ylabel(metric_name(metric))
    ax.grid(axis='y', alpha=0.3)
    ax.legend(handles=[matplotlib.patches.Patch(color=f'C{j % 10}', alpha=0.8, label=c)
                       for j, c in enumerate(columns)], fontsize=8, loc='best')
  fig.suptitle(f'{table.title} — scale {table.scale}\nbars: mean over seeds (dots) ± std; '
               'dashed: random-init encoder; red x: paper', fontsize=9)
  fig.tight_layout()
  plotting.save_figure(fig, path, dpi=110)
  plt.close(fig)


def curves(table: Table, runs: Sequence[RunSpec], out: pathlib.Path, metric: str = 'knn_acc'
           ) -> Dict[Tuple[str, str], Dict[str, Any]]:
  """(row, column) -> {'rounds': {round: [value per finished seed, %]}, 'raw_pixels': [%]} from the
  finished (not diverged) runs' metrics.jsonl: the training curve of `metric` (the kNN monitor,
  logged every config.eval_every rounds and at round 0 for the random-init encoder) and the
  raw-pixel reference of each seed. A resumed run that logged a round twice counts its last record.
  """
  # Imported here: table files import this module, and logging_utils pulls in tensorboardX.
  from fedjax_ssl import logging_utils  # pylint: disable=g-import-not-at-top
  found: Dict[Tuple[str, str], Dict[str, Any]] = {}
  for run in runs:
    status, results = run_status(run, out)
    path = run.workdir(out) / 'metrics.jsonl'
    if status != 'done' or results.get('status') == 'diverged' or not path.exists():
      continue
    by_round = {r['round']: r[metric] for r in logging_utils.read_metrics(str(path))
                if metric in r and 'round' in r}
    pixels = results.get('raw_pixels', {}).get(metric)
    for cell in run.cells:
      entry = found.setdefault(cell, {'rounds': {}, 'raw_pixels': []})
      for t, v in by_round.items():
        entry['rounds'].setdefault(int(t), []).append(100.0 * v)
      if pixels is not None:
        entry['raw_pixels'].append(100.0 * pixels)
  return found


def plot_curves(table: Table, found: Mapping[Tuple[str, str], Mapping[str, Any]],
                path: pathlib.Path, metric: str = 'knn_acc') -> bool:
  """curves.png: one panel per column, `metric` against rounds per row (mean over the seeds that
  logged the round, ± std shaded), raw pixels as a dotted line. Written only when some row has a
  curve (two or more rounds); returns whether it was."""
  if not any(len(e['rounds']) > 1 for e in found.values()):
    return False
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  columns = [c for c in table.columns if any(col == c for _, col in found)]
  fig, axes = plt.subplots(1, len(columns), squeeze=False, figsize=(6.5 * len(columns), 4.6))
  for ax, column in zip(axes[0], columns):
    pixels = []
    for i, row in enumerate(table.rows):
      entry = found.get((row, column))
      if entry is None or not entry['rounds']:
        continue
      rounds = sorted(entry['rounds'])
      values = [entry['rounds'][t] for t in rounds]
      mean = np.array([np.mean(v) for v in values])
      std = np.array([np.std(v, ddof=1) if len(v) > 1 else 0.0 for v in values])
      n = max(len(v) for v in values)
      ax.plot(rounds, mean, marker='.', color=f'C{i % 10}', label=f'{row} ({n} seed{"s" * (n > 1)})')
      ax.fill_between(rounds, mean - std, mean + std, color=f'C{i % 10}', alpha=0.15)
      pixels += entry['raw_pixels']
    if pixels:
      ax.axhline(np.mean(pixels), color='k', ls=':', label='raw pixels')
    ax.set_title(column, fontsize=9)
    ax.set_xlabel('round (0 = random-init encoder)')
    ax.set_ylabel(metric_name(metric))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  title = f'{table.title} — scale {table.scale}'
  fig.suptitle('\n'.join(textwrap.wrap(title, 60 * len(columns))) +
               f'\n{metric_name(metric)} against rounds (mean over seeds ± std)', fontsize=9)
  fig.tight_layout()
  plotting.save_figure(fig, path, dpi=110)
  plt.close(fig)
  return True


def write_outputs(table: Table, summary: Sequence[Dict[str, Any]], out: pathlib.Path,
                  seeds: Sequence[int], command: str = '') -> None:
  """table.csv, table.md and table.png in `out` (each written atomically)."""
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  summary = mark_collapsed(table, summary)
  write_csv(summary, out / 'table.csv')
  files.write_text(out / 'table.md', markdown(table, summary, seeds, command))
  plot(table, summary, out / 'table.png')
