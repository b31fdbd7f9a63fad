r"""FedSC's privacy-utility evidence from a finished reproduce directory.

  python -m experiments.reproduce --table configs/fedsc/dp.py --out docs/results/fedsc/fmnist_quick
  python -m experiments.fedsc.evidence --out docs/results/fedsc/fmnist_quick

For every row of the table (each a method or a privacy level) it reads the runs' results.json and
metrics.jsonl and writes
  OUT/privacy.md         epsilon from the run's own ledger (dp-accounting RDP), sigma, shares, and
                         the protocol's linear probe and kNN at 100 % and 1 % of the labels as
                         mean +- std over seeds, with the random-init and raw-pixel rows;
  OUT/privacy_utility.png  probe and kNN accuracy against the ledger's epsilon (eps = inf at the
                         right edge), FedAvg + SC as a horizontal reference;
  OUT/knn_rounds.png     kNN accuracy against rounds per row, mean over seeds (the paper's Fig. 2).
"""
from __future__ import annotations

import json
import math
import pathlib

from absl import app, flags
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np

from fedjax_ssl import tables
from fedjax_ssl.runs import plotting
from fedjax_ssl.runs.run_dir import RunDir

# The columns of privacy.md: results.json keys of the evaluation protocol, and their headers.
METRICS = (('probe_acc', 'linear probe (%)'), ('probe_acc_1pct', 'probe, 1 % labels (%)'),
           ('knn_acc', 'kNN (%)'), ('knn_acc_1pct', 'kNN, 1 % labels (%)'))
# Reference rows: the results.json entry that holds them, and their label.
REFERENCES = (('random_init', 'random-init encoder'), ('raw_pixels', 'raw pixels'))


def collect(table: tables.Table, seeds, out: pathlib.Path) -> dict:
  """row -> list of per-seed dicts (final metrics, privacy summary, kNN curve) of finished runs."""
  rows = {}
  for run in tables.plan_runs(table, seeds):
    rundir = RunDir(run.workdir(out))
    results = rundir.read_results()
    if results is None:
      continue
    records = rundir.read_metrics()
    curve = [(r['round'], r['knn_acc']) for r in records if 'knn_acc' in r]
    for row, _ in run.cells:
      rows.setdefault(row, []).append({
          'seed': run.seed, 'final': results['final'], 'algorithm': results['algorithm'],
          # Rows without the mechanism (the reference rows) record privacy as null.
          'privacy': results.get('privacy') or {}, 'knn_curve': curve,
          **{key: results.get(key, {}) for key, _ in REFERENCES}})
  return rows


def _mean_std(values):
  values = [100.0 * v for v in values]
  std = float(np.std(values, ddof=1)) if len(values) > 1 else float('nan')
  return float(np.mean(values)), std


def _accuracies(entry: dict, per_seed: list) -> dict:
  """entry updated with METRICS' mean +- std (percent) over the per-seed dicts that hold them."""
  for metric, _ in METRICS:
    vals = [m[metric] for m in per_seed if metric in m]
    if vals:
      entry[metric] = _mean_std(vals)
  return entry


def summarize(rows: dict) -> list:
  """One dict per row: epsilon (max over seeds), sigma, accuracies mean +- std in percent."""
  out = []
  for row, runs in rows.items():
    # Only FedSC shares matrices; FedAvg + SC and the reference rows (centralized SC, supervised
    # FedAvg) never run the mechanism (epsilon None, shown as '–').
    shares_nothing = runs[0]['algorithm'] != 'fedsc'
    eps = [r['privacy'].get('epsilon', math.inf) for r in runs]
    entry = {'row': row, 'n': len(runs), 'epsilon': None if shares_nothing else max(eps),
             'sigma': runs[0]['privacy'].get('sigma', 0.0),
             'shares_max': runs[0]['final'].get('shares_max')}
    out.append(_accuracies(entry, [r['final'] for r in runs]))
  return out


def summarize_references(rows: dict) -> list:
  """One dict per reference row ('row', 'n' seeds, accuracies mean +- std in percent). Every row's
  runs read the same images, so each seed's reference is read once, from any of its runs."""
  by_seed = {r['seed']: r for runs in rows.values() for r in runs}
  out = []
  for key, label in REFERENCES:
    per_seed = [r[key] for r in by_seed.values() if r[key]]
    if per_seed:
      out.append(_accuracies({'row': label, 'n': len(per_seed)}, per_seed))
  return out


def _cells(entry: dict) -> str:
  """METRICS' 'mean ± std' cells of one summary entry, '–' where it has none."""
  return ' | '.join(f'{entry[m][0]:.2f} ± {entry[m][1]:.2f}' if m in entry else '–'
                    for m, _ in METRICS)


def markdown(summary: list, references: list, title: str) -> str:
  header = ' | '.join(label for _, label in METRICS)
  lines = [f'# {title}', '',
           f'| row | epsilon (ledger) | sigma | shares / client | {header} | seeds |',
           '|---' * (5 + len(METRICS)) + '|']
  for e in summary:
    eps = ('– (shares nothing)' if e['epsilon'] is None else
           '∞' if math.isinf(e['epsilon']) else f'{e["epsilon"]:.3f}')
    sigma = f'{e["sigma"]:.4g}' if e['sigma'] else '0'
    shares = '–' if e['shares_max'] is None else f'{int(e["shares_max"])}'
    lines.append(f'| {e["row"]} | {eps} | {sigma} | {shares} | {_cells(e)} | {e["n"]} |')
  lines += [f'| *{e["row"]}* | | | | {_cells(e)} | {e["n"]} |' for e in references]
  return '\n'.join(lines) + '\n'


def plot_privacy_utility(summary: list, references: list, path: pathlib.Path) -> None:
  """Accuracy against epsilon; eps = inf drawn at 2x the largest finite epsilon; FedAvg + SC
  dashed, the reference rows dotted."""
  finite = [e['epsilon'] for e in summary
            if e['epsilon'] is not None and math.isfinite(e['epsilon'])]
  inf_x = 2 * max(finite) if finite else 1.0
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, metric, label in zip(axes, ('probe_acc', 'knn_acc'), ('linear probe (%)', 'kNN (%)')):
    for e in summary:
      if metric not in e:
        continue
      mean, std = e[metric]
      if e['epsilon'] is None:  # FedAvg + SC: the reference line
        ax.axhline(mean, color='gray', ls='--', label=e['row'])
        continue
      x = e['epsilon'] if math.isfinite(e['epsilon']) else inf_x
      ax.errorbar([x], [mean], yerr=[0 if math.isnan(std) else std], fmt='o', capsize=4,
                  label=e['row'])
    for e, color in zip(references, ('black', 'tab:brown')):
      if metric in e:
        ax.axhline(e[metric][0], color=color, ls=':', label=e['row'])
    ax.set_xscale('log')
    ax.set_xlabel(f'epsilon (ledger; inf drawn at {inf_x:.3g})')
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7)
  fig.suptitle('FedSC privacy-utility (mean ± std over seeds)')
  fig.tight_layout()
  plotting.save_figure(fig, path, dpi=120)
  plt.close(fig)


def plot_knn_rounds(rows: dict, path: pathlib.Path) -> None:
  fig, ax = plt.subplots(figsize=(6, 4))
  for row, runs in rows.items():
    curves = [dict(r['knn_curve']) for r in runs]
    rounds = sorted(set.intersection(*(set(c) for c in curves)))
    mean = [100 * np.mean([c[t] for c in curves]) for t in rounds]
    ax.plot(rounds, mean, marker='o', label=row)
  ax.set_xlabel('round')
  ax.set_ylabel('kNN accuracy (%)')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  ax.set_title('kNN against rounds (mean over seeds; round 0 = random init)')
  fig.tight_layout()
  plotting.save_figure(fig, path, dpi=120)
  plt.close(fig)


def write_evidence(table: tables.Table, seeds, out: pathlib.Path) -> str:
  """Writes privacy.md, privacy.json and the two plots from out's finished runs; returns the
  markdown."""
  rows = collect(table, seeds, out)
  if not rows:
    raise app.UsageError(f'no finished runs of {table.name} under {out}/runs')
  summary, references = summarize(rows), summarize_references(rows)
  text = markdown(summary, references, table.title)
  (out / 'privacy.md').write_text(text)
  # Strict JSON has no Infinity: 'inf' for FedSC without DP, null for FedAvg + SC (no matrices).
  (out / 'privacy.json').write_text(json.dumps({
      'rows': [dict(e, epsilon=e['epsilon'] if e['epsilon'] is not None and
                    math.isfinite(e['epsilon']) else None if e['epsilon'] is None else 'inf')
               for e in summary],
      'references': references}, indent=2))
  plot_privacy_utility(summary, references, out / 'privacy_utility.png')
  plot_knn_rounds(rows, out / 'knn_rounds.png')
  return text


def define_flags() -> None:
  """The binary's flags; defined only when it runs, so that tests can import this module beside
  `experiments.reproduce`, whose --table and --out would clash."""
  flags.DEFINE_string('out', None, 'An experiments.reproduce output directory.', required=True)
  flags.DEFINE_string('table', 'configs/fedsc/dp.py', 'The table that made OUT.')
  flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds to read.')
  flags.DEFINE_enum('scale', 'quick', list(tables.SCALES), 'Scale of the table.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  f = flags.FLAGS
  table = tables.load_table(f.table, f.scale)
  print(write_evidence(table, [int(s) for s in f.seeds], pathlib.Path(f.out)))


if __name__ == '__main__':
  define_flags()
  app.run(main)
