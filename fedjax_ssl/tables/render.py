"""A table's outputs: table.csv (and reading it back), table.md with its verdicts, table.png and the
kNN curves against rounds (curves.png). The numbers come from `tables.stats`."""
from __future__ import annotations

import csv
import io
import math
import pathlib
import textwrap
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl import files
from fedjax_ssl.eval import per_client
from fedjax_ssl.runs import plotting
from fedjax_ssl.runs.run_dir import RunDir
from fedjax_ssl.tables.schema import RunSpec, Table, cell_id, metric_name, run_status
from fedjax_ssl.tables.stats import (COLLAPSE_MARGIN, REFERENCE_TOLERANCE, mark_collapsed,
                                     verdicts)

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
  lost = len(entry['errors']) + sum(len(entry.get(k, [])) for k in _LOST)
  if lost or entry['pending']:
    marks = [f'{len(entry[k])} {_LOST[k]}' for k in _LOST if entry.get(k)]
    text += (f' [{entry["n"]} of {entry["n"] + entry["pending"] + lost} seeds'
             + (f', {", ".join(marks)}]' if marks else ']'))
  return text


# The seeds a cell's value leaves out, and how its mark names them: diverged runs, collapsed
# encoders and single values at chance (`mark_collapsed`).
_LOST = {'diverged': 'diverged', 'collapsed': 'collapsed', 'at_chance': 'at chance'}


def _no_value(entry: Dict[str, Any]) -> str:
  """What a cell without a value shows: 'failed' (an error), 'diverged' (every finished seed
  diverged), 'collapsed (k of n seeds)' / 'at chance (k of n seeds)' (every finished seed collapsed
  or at chance on this metric, `mark_collapsed`) or 'pending'."""
  if entry['errors']:
    return 'failed'
  if entry['diverged']:
    return 'diverged'
  for key in ('collapsed', 'at_chance'):
    if entry.get(key):
      k = len(entry['collapsed']) + len(entry.get('at_chance', []))
      return f'{_LOST[key]} ({len(entry[key])} of {k + entry["pending"]} seeds)'
  return 'pending'


# table.csv's columns. The per-seed reference values (random-init encoder, raw pixels) pair each
# seed with its own reference in the 'learns' verdicts, also for a table rebuilt from the csv alone.
CSV_FIELDS = ('row', 'column', 'cell', 'metric', 'n', 'mean', 'std', 'paper', 'diff',
              'random_init_mean', 'raw_pixels_mean', 'seeds', 'values', 'random_init_values',
              'raw_pixels_values', 'pending', 'errors', 'diverged', 'collapsed', 'at_chance')
_LIST_FIELDS = ('seeds', 'values', 'random_init_values', 'raw_pixels_values', 'errors', 'diverged',
                'collapsed', 'at_chance')


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
                'collapsed': ' | '.join(e.get('collapsed', [])),
                'at_chance': ' | '.join(e.get('at_chance', []))})
  files.write_text(path, f.getvalue())


def read_csv(path: pathlib.Path) -> List[Dict[str, Any]]:
  """The summary entries of a table.csv (`write_csv`'s inverse, values to 4 decimals); [] when the
  file does not exist. A cell carried without its per-seed references has empty reference lists
  (its 'learns' verdicts then have no pairs until `--recompute_references` fills them). Every
  committed table.csv has all of CSV_FIELDS; an older layout is refused in one line."""
  path = pathlib.Path(path)
  if not path.exists():
    return []

  def number(text):
    return None if text in ('', None) else float(text)

  def floats(text):
    return [float(v) for v in text.split()]

  entries = []
  with open(path, newline='') as f:
    reader = csv.DictReader(f)
    if tuple(reader.fieldnames or ()) != CSV_FIELDS:
      raise cv.ConfigError(f'{path} has the columns {reader.fieldnames}: expected {list(CSV_FIELDS)} '
                       '(a table.csv of an older layout; re-render it with the harness of that '
                       'time, or delete it to run the table again)')
    for r in reader:
      entries.append({
          'row': r['row'], 'column': r['column'], 'cell': r['cell'], 'metric': r['metric'],
          'n': int(r['n']), 'mean': float(r['mean']), 'std': float(r['std']),
          'paper': number(r['paper']), 'diff': number(r['diff']),
          'random_init_mean': float(r['random_init_mean']),
          'raw_pixels_mean': float(r['raw_pixels_mean']),
          'seeds': [int(v) for v in r['seeds'].split()], 'values': floats(r['values']),
          'random_init_values': floats(r['random_init_values']),
          'raw_pixels_values': floats(r['raw_pixels_values']),
          'pending': int(r['pending']),
          'errors': r['errors'].split(' | ') if r['errors'] else [],
          'diverged': r['diverged'].split(' | ') if r['diverged'] else [],
          'collapsed': r['collapsed'].split(' | ') if r['collapsed'] else [],
          'at_chance': r['at_chance'].split(' | ') if r['at_chance'] else []})
  return entries



def _reference_groups(rows: Sequence[str], columns: Sequence[str], metrics: Sequence[str],
                      by_key: Dict[Tuple[str, str, str], Dict[str, Any]]) -> List[List[str]]:
  """`rows` grouped by their random-init encoder, in first-row order: two rows share a group when
  their random-init scores agree to REFERENCE_TOLERANCE at every (metric, column, seed) both have.
  Rows of one encoder share one random-init row in table.md; a table whose rows start from
  different encoders (a mix and its single-architecture references) gets one per encoder rather
  than an average of unlike models. The tolerance, not equality: one encoder scored in two
  processes drifts in the last digits (docs/notes/harness.md#harn-18). Every metric at once, so that unlike encoders level on one metric
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
             command: str = '', command_note: str = '') -> str:
  """table.md: one rows x columns grid per metric, 'mean ± std (paper P, diff)'; `command_note`
  follows the command on its line (how the runs were split, say)."""
  by_key = {(e['row'], e['column'], e['metric']): e for e in summary}
  lines = [f'# {table.title}', '',
           f'Scale `{table.scale}`, seeds {list(seeds)}; mean ± sample std over seeds, in percent; '
           '"paper" is the number the paper reports for that cell and the signed difference '
           'follows it.']
  if command:
    lines += ['', f'Command: `{command}`' + (f' {command_note}' if command_note else '')]
  if table.overrides:
    shown = ', '.join(f'`{k}={v!r}`' for k, v in sorted(table.overrides.items()))
    lines += ['', f'Overrides applied to every cell: {shown}.']
  rows = [r for r in table.rows if any((r, c, m) in by_key for c in table.columns
                                       for m in table.metrics)]
  groups = _reference_groups(rows, table.columns, table.metrics, by_key)
  for metric in table.metrics:
    if per_client.parse_key(metric):  # per-client results: their own section, below
      continue
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
  lines += per_client.markdown_lines(table.metrics, rows, table.columns, by_key, _md_cell)
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
              f'within {COLLAPSE_MARGIN:g} points of chance (`tables.COLLAPSE_MARGIN`).', '']
    lines += [f'- `{cell}` {why}' for cell, why in collapsed]
  at_chance = sorted({(e['cell'], why) for e in summary for why in e.get('at_chance', [])})
  if at_chance:
    lines += ['', '## Values at chance', '',
              f'Left out of their metric\'s mean and verdicts only: a seed whose encoder did not '
              f'collapse but whose score on one metric, or its random-init or raw-pixel '
              f'reference\'s, is within {COLLAPSE_MARGIN:g} points of chance (an evaluation that '
              f'failed for that seed, e.g. a diverged fine-tune; a failed reference takes the '
              f'seed\'s trained value out with it, so that both stay paired).', '']
    lines += [f'- `{cell}` {why}' for cell, why in at_chance]
  carried = sorted({e['cell'] for e in summary if e.get('carried')})
  if carried:
    lines += ['', f'Carried from the previous table.csv (no run of theirs under this output '
              f'directory): {", ".join(f"`{c}`" for c in carried)}.']
  lines += privacy_lines(table, summary)
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


def privacy_lines(table: Table, summary: Sequence[Dict[str, Any]]) -> List[str]:
  """The '## Privacy spent' section of table.md: per DP-FedAvg cell (results.json's 'dp' block of
  its finished seeds), the epsilon the ledger spent (the largest over seeds; seeds of one cell share
  the schedule), the noise multiplier, clip norm, delta, sampling and accountant. [] when no cell
  ran with config.dp."""
  cells = {}
  for e in summary:
    if e.get('privacy') and e['cell'] not in cells:
      cells[e['cell']] = e
  if not cells:
    return []
  lines = ['', '## Privacy spent (DP-FedAvg, user level)', '',
           '| cell | epsilon spent | delta | noise multiplier | clip norm | sampling per round | '
           'rounds | accountant | seeds |', '|---|---|---|---|---|---|---|---|---|']
  for row, column in table.cells():
    e = cells.get(cell_id(row, column))
    if e is None:
      continue
    p = e['privacy']
    eps = max(float(x.get('epsilon', x.get('planned_epsilon', float('nan')))) for x in p)
    first = p[0]
    lines.append(f"| {row}, {column} | {eps:.3f} | {first['delta']:g} | "
                 f"{first['noise_multiplier']:.4g} | {first['clip_norm']:g}"
                 f"{' per layer' if first.get('per_layer') else ''} | {first['sampling']} | "
                 f"{first['rounds']} | {first['accountant']}, {first['adjacency']} | "
                 f"{','.join(str(x['seed']) for x in p)} |")
  return lines


def plot(table: Table, summary: Sequence[Dict[str, Any]], path: pathlib.Path) -> None:
  """table.png: per metric, rows on the x axis with one bar per column (mean over seeds), the seeds
  as dots, ± std as an error bar, the random-init encoder as a dashed segment and the paper's number
  as a red cross. Cells without a result are marked 'failed' or 'pending'."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.patches  # pylint: disable=g-import-not-at-top
  import matplotlib.pyplot as plt

  metrics = [m for m in table.metrics if not per_client.parse_key(m)]  # per-client: table.md only
  columns = list(table.columns)
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
  found: Dict[Tuple[str, str], Dict[str, Any]] = {}
  for run in runs:
    status, results = run_status(run, out)
    if status != 'done' or results.get('status') == 'diverged':
      continue
    records = RunDir(run.workdir(out)).read_metrics()
    if not records:
      continue
    by_round = {r['round']: r[metric] for r in records if metric in r and 'round' in r}
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
                  seeds: Sequence[int], command: str = '', command_note: str = '') -> None:
  """table.csv, table.md and table.png in `out` (each written atomically)."""
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  summary = mark_collapsed(table, summary)
  write_csv(summary, out / 'table.csv')
  files.write_text(out / 'table.md', markdown(table, summary, seeds, command, command_note))
  plot(table, summary, out / 'table.png')
