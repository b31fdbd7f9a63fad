"""experiments.fedsc.evidence on hand-written results of the quick privacy table (no training):
each row's epsilon comes from its runs' ledgers, accuracies are mean ± sample std over seeds in
percent, and the reference rows are read once per seed."""
import json

import numpy as np

from experiments.fedsc import evidence
from fedjax_ssl import tables


def _final(base):
  """Protocol metrics of one run, all offset from `base`."""
  return {'probe_acc': base, 'probe_acc_1pct': base - 0.1, 'knn_acc': base - 0.2,
          'knn_acc_1pct': base - 0.3}


def test_privacy_table_from_finished_runs(tmp_path):
  table = tables.load_table('configs/fedsc/dp.py', 'quick')
  runs = tables.plan_runs(table, [0, 1])
  for i, run in enumerate(runs):
    workdir = run.workdir(tmp_path)
    workdir.mkdir(parents=True)
    row = run.cells[0][0]
    dp = 'eps=' in row and 'inf' not in row
    algorithm = {'FedAvg + SC': 'fedavg_sc', 'Centralized SC': 'centralized',
                 'FedAvg (supervised)': 'fedavg'}.get(row, 'fedsc')
    results = {
        'algorithm': algorithm,
        'final': dict(_final(0.70 + 0.01 * i), shares_max=10),
        # The training binary writes null where the algorithm has no mechanism.
        'privacy': ({'epsilon': float(row.split('eps=')[1][0]) - 1e-7 * run.seed, 'sigma': 0.01}
                    if dp else {} if algorithm == 'fedsc' else None),
        # The same reference in every run of a seed, as when they read the same images.
        'random_init': _final(0.60 + 0.02 * run.seed), 'raw_pixels': _final(0.80)}
    (workdir / 'results.json').write_text(json.dumps(results))
    (workdir / 'metrics.jsonl').write_text(
        ''.join(json.dumps({'round': t, 'knn_acc': 0.5 + 0.01 * t}) + '\n' for t in (0, 10, 20)))

  text = evidence.write_evidence(table, [0, 1], tmp_path)

  assert (tmp_path / 'privacy.md').read_text() == text
  saved = json.loads((tmp_path / 'privacy.json').read_text())
  rows = {e['row']: e for e in saved['rows']}
  assert list(rows) == list(table.rows)
  for name in ('FedAvg + SC', 'Centralized SC', 'FedAvg (supervised)'):
    assert rows[name]['epsilon'] is None                 # shares nothing: no mechanism
  assert rows['FedSC eps=inf (every round)']['epsilon'] == 'inf'
  assert rows['FedSC eps=6 (t>10)']['epsilon'] == 6.0    # the larger of the seeds' ledgers
  assert rows['FedSC eps=3 (t>10)']['sigma'] == 0.01
  # Runs are planned seed by seed, one per row: row r's runs are i = r and r + len(table.rows).
  for r, name in enumerate(table.rows):
    values = 100 * np.array([0.70 + 0.01 * r, 0.70 + 0.01 * (r + len(table.rows))])
    np.testing.assert_allclose(rows[name]['probe_acc'], [values.mean(), values.std(ddof=1)])
    np.testing.assert_allclose(rows[name]['knn_acc_1pct'][0], values.mean() - 30)
  refs = {e['row']: e for e in saved['references']}
  assert refs['random-init encoder']['n'] == 2           # one reference per seed, not per run
  np.testing.assert_allclose(refs['random-init encoder']['probe_acc'],
                             [61.0, np.std([60, 62], ddof=1)])
  np.testing.assert_allclose(refs['raw pixels']['knn_acc'], [60.0, 0.0], atol=1e-12)
  raw = ' | '.join(f'{v:.2f} ± 0.00' for v in (80, 70, 60, 50))
  assert f'| *raw pixels* | | | | {raw} | 2 |' in text
  assert '| FedSC eps=6 (t>10) | 6.000 | 0.01 | 10 |' in text
  assert (tmp_path / 'privacy_utility.png').stat().st_size > 0
  assert (tmp_path / 'knn_rounds.png').stat().st_size > 0
