"""A table's statistics: the runs' results summarised per (cell, metric) over seeds, the verdicts
of its claims, collapsed seeds (and single values at chance) taken out of every mean, cells carried from an earlier table.csv, and
the per-seed references filled in. Definitions are `tables.schema`; rendering is `tables.render`."""
from __future__ import annotations

import math
import pathlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import ml_collections
import numpy as np

from fedjax_ssl import configuration
from fedjax_ssl.eval import per_client
from fedjax_ssl.tables.schema import (RANDOM_INIT, RAW_PIXELS, Claim, RunSpec, Table, cell_config,
                                      cell_id, cohort_metric, metric_name, run_status)

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
      privacy = []  # DP-FedAvg's spent budget per finished seed (results.json 'dp')
      for run, status, payload in entries:
        if status == 'done' and isinstance(payload.get('dp'), dict):
          privacy.append(dict(payload['dp'], seed=run.seed))
        if status == 'done' and payload.get('status') == 'diverged':  # marked, never averaged
          diverged.append(f'seed {run.seed}: diverged at round {payload["diverged"]["round"]} '
                          f'({payload["diverged"]["quantity"]})')
        elif status == 'done':
          key = run_metric(metric, payload, run.config)
          if key not in payload['final']:
            if per_client.parse_key(metric):  # per-client: a run has only the models it keeps
              continue
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
      if ((cohort_metric(metric) or per_client.parse_key(metric)) and not values and not errors
          and not diverged and all(status == 'done' for _, status, _ in entries)):
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
          'pending': sum(status == 'missing' for _, status, _ in entries), 'privacy': privacy,
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
        gone = [f"{e['row']} {why} ({len(e[key])} seeds)" for e in sides
                if e is not None and not e['n']
                for key, why in (('collapsed', 'collapsed'), ('at_chance', 'at chance'))
                if e.get(key)]
        if gone:
          found = dict(found, verdict='; '.join(gone))
      out.append({'claim': claim.text, 'better': claim.better, 'worse': claim.worse,
                  'column': column, 'metric': claim.metric, **found})
  return out


# A seed is collapsed when its trained encoder carries no class information: its full-label score
# (the first of COLLAPSE_METRICS the cell has) lies within COLLAPSE_MARGIN points of chance,
# 100 / classes. The margin sits between the committed collapsed runs (every feature the same
# vector) and the nearest seed above them, which keeps some class information and is counted as a
# weak seed; their scores: docs/notes/harness.md#harn-19.
COLLAPSE_MARGIN = 2.0
COLLAPSE_METRICS = ('probe_acc', 'knn_acc', 'test_acc')
# Metrics whose random-init reference is at chance by construction, not by failure: a supervised
# classifier's own test accuracy, whose random init is an untrained head.
UNTRAINED_REFERENCE_METRICS = ('test_acc',)


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


def at_chance_values(entry: Dict[str, Any], num_classes: int) -> Dict[int, str]:
  """{seed: why} of one metric entry's seeds whose value, or whose random-init or raw-pixel
  reference value, lies within COLLAPSE_MARGIN points of chance: after `collapsed_seeds` took out
  the seeds whose encoder collapsed, such a value is an evaluation that failed for that seed and
  metric alone (a fine-tune diverged at 1 % of the labels, a kNN vote of one class), and a mean
  over it and learning seeds would describe neither. A failed reference takes its seed's trained
  value out with it, so that a row and its reference stay paired over the same seeds."""
  if per_client.parse_key(entry['metric']):  # a spread over clients (a std, a worst tail) is no
    return {}                                # failed evaluation when it is low
  chance = 100.0 / num_classes
  name = metric_name(entry['metric'])
  split = cohort_metric(entry['metric'])
  metric = split[0] if split else entry['metric']
  found = {}
  # The trained value is checked last, so that where it failed too its own reason is the one kept.
  for key, what in (('random_init_values', 'its random-init encoder\'s '),
                    ('raw_pixels_values', 'its raw-pixel reference\'s '), ('values', '')):
    if (len(entry.get(key) or ()) != len(entry['seeds'])
        or (key != 'values' and metric in UNTRAINED_REFERENCE_METRICS)):
      continue
    for seed, value in zip(entry['seeds'], entry[key]):
      if value <= chance + COLLAPSE_MARGIN:
        found[seed] = (f'seed {seed}: {what}{name} {value:.2f}, within {COLLAPSE_MARGIN:g} points '
                       f'of chance ({chance:.2f}); its other metrics keep it')
  return found


def _without_seeds(e: Dict[str, Any], found: Mapping[int, str], field: str) -> Dict[str, Any]:
  """Entry `e` with the seeds of `found` taken out of its values and per-seed references and their
  reasons appended to e[field]; mean, std, diff and the reference means recomputed."""
  keep = [i for i, s in enumerate(e['seeds']) if s not in found]
  new = dict(e, seeds=[e['seeds'][i] for i in keep],
             **{field: list(e.get(field, [])) + [found[s] for s in e['seeds'] if s in found]})
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
  return new


def mark_collapsed(table: Table, summary: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """`summary` with each cell's collapsed seeds (`collapsed_seeds`) taken out of every metric
  entry of the cell, values and per-seed references alike, and listed in the entry's 'collapsed';
  then, per entry, the seeds still at chance on that metric (`at_chance_values`) taken out of that
  entry alone and listed in its 'at_chance': a mean is never over collapsed (or failed) and
  learning seeds together, and a verdict never pairs such a seed. Cells of a dataset whose class
  count is unknown before loading are left as they are."""
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
    e = dict(e, collapsed=list(e.get('collapsed', [])), at_chance=list(e.get('at_chance', [])))
    if e['cell'] in classes:
      found = collapsed_seeds(by_cell[e['cell']], classes[e['cell']])
      if any(s in found for s in e['seeds']):
        e = _without_seeds(e, found, 'collapsed')
      failed = at_chance_values(e, classes[e['cell']])
      if failed:
        e = _without_seeds(e, failed, 'at_chance')
    out.append(e)
  return out


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
# against the mean its table.csv stored (`fill_references`; docs/notes/harness.md#harn-16) and one
# encoder's per-seed score in two processes (`_reference_groups`; docs/notes/harness.md#harn-18),
# with room to spare. A wider gap means another evaluator, config or encoder, which must not be
# paired or grouped.
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
