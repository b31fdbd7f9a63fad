"""fedjax_ssl.tables.render: table.md (summary, reference rows, claims and verdicts), curves.png, and
table.csv's layout."""
import json

import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import tables
from tests.tables import make_table


def test_summary_mean_std_and_markdown(tmp_path):
  table = make_table(rows={'A': dict(ssl_method='simclr')}, columns={'IID': dict(partition='iid')},
                     paper={('A', 'IID', 'probe_acc'): 70.0})
  runs = tables.plan_runs(table, seeds=[0, 1, 2])
  values = [0.61, 0.65, 0.72]
  for run, v in zip(runs, values):
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    (wd / 'results.json').write_text(json.dumps({'final': {'probe_acc': v},
                                                 'random_init': {'probe_acc': 0.5}}))
  (entry,) = tables.summarize(table, runs, tmp_path)
  ref = 100 * np.asarray(values)
  np.testing.assert_allclose(entry['mean'], ref.mean(), rtol=1e-12)
  np.testing.assert_allclose(entry['std'], ref.std(ddof=1), rtol=1e-12)
  np.testing.assert_allclose(entry['diff'], ref.mean() - 70.0, rtol=1e-12)
  assert entry['n'] == 3 and entry['seeds'] == [0, 1, 2] and entry['random_init_mean'] == 50.0
  md = tables.markdown(table, [entry], [0, 1, 2])
  assert f'| A | {ref.mean():.2f} ± {ref.std(ddof=1):.2f} (paper 70.00, {ref.mean() - 70:+.2f}) |' in md


def test_rows_of_different_random_init_encoders_get_one_reference_row_each(tmp_path):
  """table.md averages the random-init score over the rows that start from the same encoder (equal
  per-seed values up to the evaluator's drift between processes), never over unlike encoders, and
  tells encoders apart on every metric at once; one encoder keeps the single unlabelled row."""
  rows = {'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol'),
          'C': dict(ssl_method='simclr', encoder='lenet5'), 'D': dict(ssl_method='simsiam'),
          'E': dict(ssl_method='simclr', lr=0.5)}
  table = make_table(rows=rows, columns={'IID': dict(partition='iid')},
                     metrics=('probe_acc', 'knn_acc'))
  runs = tables.plan_runs(table, seeds=[0, 1])
  # (probe, kNN) of each row's random-init encoder per seed. B: A's encoder scored in another
  # process, 0.012 points off (as measured between a fresh run and carried cells); E: another
  # encoder level with A on the probe but not on kNN.
  init = {'A': ((0.70, 0.60), (0.72, 0.62)), 'B': ((0.70012, 0.59988), (0.72, 0.62)),
          'C': ((0.60, 0.50), (0.64, 0.54)), 'D': ((0.70, 0.60), (0.72, 0.62)),
          'E': ((0.70, 0.55), (0.72, 0.57))}
  for run in runs:
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    probe, knn = init[run.cells[0][0]][run.seed]
    (wd / 'results.json').write_text(json.dumps(
        {'final': {'probe_acc': 0.8, 'knn_acc': 0.7},
         'random_init': {'probe_acc': probe, 'knn_acc': knn}}))
  summary = tables.summarize(table, runs, tmp_path)
  md = tables.markdown(table, summary, [0, 1])
  assert '| *random-init encoder, of A; B; D* | 71.00 |' in md
  assert '| *random-init encoder, of C* | 62.00 |' in md
  assert '| *random-init encoder, of E* | 71.00 |' in md     # the probe grid, level with A
  assert '| *random-init encoder, of E* | 56.00 |' in md     # the kNN grid
  same = [e for e in summary if e['row'] in ('A', 'B')]
  assert '| *random-init encoder* | 71.00 |' in tables.markdown(table, same, [0, 1])


def test_claims_are_checked_and_end_table_md_with_a_verdict(tmp_path):
  rows = {'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol')}
  claim = tables.Claim('A beats B', 'A', 'B', 'probe_acc')
  table = make_table(rows=rows, columns={'IID': dict(partition='iid')},
                     claims=(claim, tables.Claim('A learns', 'A', tables.RANDOM_INIT, 'probe_acc')))
  with pytest.raises(cv.ConfigError, match="compares 'A' with 'C'"):
    tables.check_table(make_table(rows=rows, claims=(tables.Claim('x', 'A', 'C', 'probe_acc'),)))
  with pytest.raises(cv.ConfigError, match="metric 'knn_acc'"):
    tables.check_table(make_table(rows=rows, metrics=('probe_acc',),
                                  claims=(tables.Claim('x', 'A', 'B', 'knn_acc'),)))
  runs = tables.plan_runs(table, seeds=[0, 1, 2])
  value = {('A', 0): 0.80, ('A', 1): 0.81, ('A', 2): 0.82, ('B', 0): 0.70, ('B', 1): 0.72,
           ('B', 2): 0.74}
  for run in runs:
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    (wd / 'results.json').write_text(json.dumps(
        {'final': {'probe_acc': value[(run.cells[0][0], run.seed)]},
         'random_init': {'probe_acc': 0.795 + 0.01 * run.seed}}))
  summary = tables.summarize(table, runs, tmp_path)
  found = {v['worse']: v for v in tables.verdicts(table, summary)}
  np.testing.assert_allclose(found['B']['effect'], 9.0, rtol=1e-9)     # 81 - 72
  np.testing.assert_allclose(found['B']['spread'], 2.0, rtol=1e-9)     # B's std
  assert found['B']['verdict'] == 'confirmed'
  # Against the run's own random-init encoder: 81 - 80.5 with spread 1.0.
  assert found[tables.RANDOM_INIT]['verdict'] == 'not confirmed'
  md = tables.markdown(table, summary, [0, 1, 2])
  assert '## Verdict' in md and '| A beats B | IID | linear probe (%) | +9.00 | 2.00 | 3 | **confirmed** |' in md


def test_curves_average_each_round_over_the_seeds_that_logged_it(tmp_path):
  table = make_table(rows={'A': dict(ssl_method='simclr')}, columns={'IID': dict(partition='iid')})
  runs = tables.plan_runs(table, seeds=[0, 1, 2])
  logs = [[(0, 0.50), (5, 0.60), (10, 0.70)],
          # Resumed after a kill: round 5 logged twice, the last record counts.
          [(0, 0.52), (5, 0.10), (5, 0.64), (10, 0.74)],
          [(0, 0.54), (5, 0.62)]]   # a run diverged at round 7: its curve is left out
  for run, log in zip(runs, logs):
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    (wd / 'metrics.jsonl').write_text(
        ''.join(json.dumps({'round': t, 'knn_acc': v, 'loss': 1.0}) + '\n' for t, v in log) +
        json.dumps({'round': 3, 'loss': 2.0}) + '\n')   # a training record without kNN
    diverged = run.seed == 2
    (wd / 'results.json').write_text(json.dumps(
        {'final': {'probe_acc': 0.6}, 'random_init': {}, 'raw_pixels': {'knn_acc': 0.8},
         **({'status': 'diverged', 'diverged': {'round': 7, 'quantity': 'loss'}} if diverged
            else {})}))
  found = tables.curves(table, runs, tmp_path)
  assert set(found) == {('A', 'IID')}
  got = found[('A', 'IID')]
  assert sorted(got['rounds']) == [0, 5, 10]
  np.testing.assert_allclose(got['rounds'][0], [50.0, 52.0], rtol=1e-12)
  np.testing.assert_allclose(got['rounds'][5], [60.0, 64.0], rtol=1e-12)
  np.testing.assert_allclose(got['rounds'][10], [70.0, 74.0], rtol=1e-12)
  np.testing.assert_allclose(got['raw_pixels'], [80.0, 80.0], rtol=1e-12)
  assert tables.plot_curves(table, found, tmp_path / 'curves.png')
  assert (tmp_path / 'curves.png').stat().st_size > 0
  # No run has two logged rounds: nothing to plot, no file.
  one_round = {('A', 'IID'): {'rounds': {0: [50.0]}, 'raw_pixels': []}}
  assert not tables.plot_curves(table, one_round, tmp_path / 'none.png')
  assert not (tmp_path / 'none.png').exists()


def test_read_csv_refuses_a_table_csv_of_another_layout(tmp_path):
  # Every committed table.csv has CSV_FIELDS; one without the per-seed reference and collapse
  # columns (the layout before them) is refused in one line, not read with silent blanks.
  path = tmp_path / 'table.csv'
  old = [f for f in tables.CSV_FIELDS
         if f not in ('random_init_values', 'raw_pixels_values', 'collapsed')]
  path.write_text(','.join(old) + '\n')
  with pytest.raises(cv.ConfigError) as e:
    tables.read_csv(path)
  assert str(e.value) == (f'{path} has the columns {old}: expected {list(tables.CSV_FIELDS)} (a '
                          'table.csv of an older layout; re-render it with the harness of that '
                          'time, or delete it to run the table again)')


def test_per_client_results_become_spread_columns_and_absent_models_are_skipped(tmp_path):
  """--config.per_client_eval=true adds the spread metrics (eval/per_client.py); a run reports only
  the models it keeps (FedAvg: global; independent: own) without a failure; table.md shows them as
  mean / std / worst-10 % / best-10 % columns; a low std is no value 'at chance'."""
  table = tables.with_overrides(
      make_table(rows={'IL': dict(algorithm='independent'), 'FL': dict(algorithm='fedavg')},
                 columns={'IID': dict(partition='iid')}), {'per_client_eval': True})
  assert 'knn_acc_own_split_worst10' in table.metrics and 'probe_acc' in table.metrics
  runs = tables.plan_runs(table, seeds=[0, 1])
  stats = {'mean': 0.7, 'std': 0.01, 'worst10': 0.5, 'best10': 0.9}
  for run in runs:
    model = 'own' if run.cells[0][0] == 'IL' else 'global'
    final = {'probe_acc': 0.8, **{f'knn_acc_{model}_split_{s}': v + 0.01 * run.seed
                                  for s, v in stats.items()}}
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    (wd / 'results.json').write_text(json.dumps({'final': final, 'random_init': {}}))
  summary = tables.mark_collapsed(table, tables.summarize(table, runs, tmp_path))
  assert not [e for e in summary if e['errors'] or e.get('at_chance')]
  by = {(e['row'], e['metric']): e for e in summary}
  assert ('FL', 'knn_acc_own_split_mean') not in by and ('IL', 'knn_acc_global_split_mean') not in by
  np.testing.assert_allclose(by[('IL', 'knn_acc_own_split_std')]['mean'], 1.5, rtol=1e-12)
  md = tables.markdown(table, summary, [0, 1])
  assert '## Per-client results' in md
  assert '| | mean | std | worst-10 % | best-10 % |' in md
  assert '| IL | 70.50 ± 0.71 | 1.50 ± 0.71 | 50.50 ± 0.71 | 90.50 ± 0.71 |' in md
  assert '| FL | 70.50 ± 0.71 |' in md
  assert 'Failed runs' not in md and '\n## kNN on the client' not in md   # no per-metric grid


def test_a_dp_cell_reports_the_epsilon_its_runs_spent(tmp_path):
  # results.json's 'dp' block (registry.dp_plan) of each seed goes to table.md's privacy section;
  # a cell without DP has none.
  table = make_table(rows={'DP': {'dp.enabled': True, 'dp.target_epsilon': 4.0},
                           'plain': {}}, columns={'IID': dict(partition='iid')})
  runs = tables.plan_runs(table, seeds=[0, 1])
  for run in runs:
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    payload = {'final': {'probe_acc': 0.6}, 'random_init': {'probe_acc': 0.5}}
    if run.cells[0][0] == 'DP':
      payload['dp'] = {'noise_multiplier': 5.024, 'clip_norm': 0.5, 'per_layer': False,
                       'delta': 1e-5, 'rounds': 100, 'accountant': 'rdp', 'planned_epsilon': 3.9999,
                       'adjacency': 'replace_one (user level)',
                       'sampling': '50 of 500 without replacement', 'epsilon': 3.9999 - run.seed}
    (wd / 'results.json').write_text(json.dumps(payload))
  summary = tables.summarize(table, runs, tmp_path)
  md = tables.markdown(table, summary, [0, 1])
  assert '## Privacy spent (DP-FedAvg, user level)' in md
  assert ('| DP, IID | 4.000 | 1e-05 | 5.024 | 0.5 | 50 of 500 without replacement | 100 | rdp, '
          'replace_one (user level) | 0,1 |') in md
  assert '| plain, IID |' not in md
  assert 'Privacy spent' not in tables.markdown(table, [e for e in summary if e['row'] == 'plain'],
                                                [0, 1])
