"""fedjax_ssl.tables.stats: verdicts, per-architecture metrics, carried cells, per-seed references
filled where they reproduce, seeds at chance and collapsed seeds kept out of means."""
import json

import numpy as np

from fedjax_ssl import tables
from fedjax_ssl.tables import stats
from tests.tables import make_table


def test_verdict_needs_an_effect_above_twice_the_seed_std():
  v = tables.verdict([80.0, 81.0, 82.0], [75.0, 75.5, 76.0])     # effect 5.5, spread 1.0
  assert v['verdict'] == 'confirmed' and v['n'] == 3
  np.testing.assert_allclose([v['effect'], v['spread']], [5.5, 1.0], rtol=1e-12)
  assert tables.verdict([80.0, 81.0, 82.0], [79.0, 79.5, 80.0])['verdict'] == 'not confirmed'
  assert tables.verdict([70.0, 71.0, 72.0], [79.0, 79.5, 80.0])['verdict'] == 'reversed'
  assert tables.verdict([80.0], [70.0])['verdict'] == 'too few seeds'
  # Exactly 2 x spread is not enough.
  assert tables.verdict([1.0, 3.0], [0.0, 0.0])['verdict'] == 'not confirmed'


def test_fill_references_pairs_carried_seeds_only_where_they_reproduce_the_stored_means():
  table = make_table(rows={'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol')},
                     columns={'IID': dict(partition='iid')},
                     claims=(tables.Claim('A learns', 'A', tables.RANDOM_INIT, 'probe_acc'),
                             tables.Claim('B learns', 'B', tables.RANDOM_INIT, 'probe_acc')))

  def entry(row, values, random_init_mean):  # as read_csv gives a csv without per-seed references
    return {'row': row, 'column': 'IID', 'cell': tables.cell_id(row, 'IID'),
            'metric': 'probe_acc', 'n': 3, 'mean': float(np.mean(values)),
            'std': float(np.std(values, ddof=1)), 'paper': None, 'diff': None,
            'random_init_mean': random_init_mean, 'raw_pixels_mean': 90.0, 'seeds': [0, 1, 2],
            'values': values, 'random_init_values': [], 'raw_pixels_values': [], 'pending': 0,
            'errors': [], 'diverged': [], 'carried': True}
  summary = [entry('A', [80.0, 81.0, 82.0], 70.01), entry('B', [70.0, 71.0, 72.0], 65.0)]
  assert tables.without_references(summary) == {'a.iid': [0, 1, 2], 'b.iid': [0, 1, 2]}
  # Each seed's round-0 evaluations, as fractions; A's reproduce its stored means (70.01 vs 70.00,
  # 90 vs 90), B's random init is 5 points off the 65.0 its csv stored.
  references = {(cell, s): ({'probe_acc': 0.69 + 0.01 * s}, {'probe_acc': 0.9})
                for cell in ('a.iid', 'b.iid') for s in range(3)}
  problems = tables.fill_references(summary, references)
  a, b = summary
  np.testing.assert_allclose(a['random_init_values'], [69.0, 70.0, 71.0], rtol=1e-12)
  np.testing.assert_allclose(a['raw_pixels_values'], [90.0] * 3, rtol=1e-12)
  np.testing.assert_allclose(a['random_init_mean'], 70.0, rtol=1e-12)
  assert b['random_init_values'] == [] and b['random_init_mean'] == 65.0
  assert problems == ['b.iid probe_acc: random_init 70.0000 recomputed, 65.0000 stored '
                      '(tolerance 0.05 points): left unpaired']
  assert tables.without_references(summary) == {'b.iid': [0, 1, 2]}
  found = {v['better']: v for v in tables.verdicts(table, summary)}
  np.testing.assert_allclose([found['A']['effect'], found['A']['spread']], [11.0, 1.0],
                             rtol=1e-9)
  assert found['A']['verdict'] == 'confirmed'
  assert found['B']['verdict'].startswith('no per-seed reference values')
  # A seed with no references at all is reported, not guessed.
  missing = [entry('A', [80.0, 81.0, 82.0], 70.0)]
  assert tables.fill_references(missing, {}) == [
      'a.iid probe_acc: no references for seeds [0, 1, 2]']


def test_a_classifier_random_init_at_chance_is_not_a_failure():
  # A supervised classifier's own test accuracy from random init is an untrained head: at chance by
  # construction, so it marks nothing; the same reference value on a fine-tune metric is a failure.
  entry = {'seeds': [0, 1], 'values': [80.0, 81.0], 'random_init_values': [10.0, 9.1],
           'raw_pixels_values': []}
  assert stats.at_chance_values(dict(entry, metric='test_acc'), 10) == {}
  assert sorted(stats.at_chance_values(dict(entry, metric='ft_acc_1pct'), 10)) == [0, 1]


def test_a_table_keeps_the_cells_and_seeds_this_invocation_did_not_run(tmp_path):
  rows = {'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol')}
  table = make_table(rows=rows, columns={'IID': dict(partition='iid')},
                     claims=(tables.Claim('A beats B', 'A', 'B', 'probe_acc'),
                             tables.Claim('A learns', 'A', tables.RANDOM_INIT, 'probe_acc')))
  runs = tables.plan_runs(table, seeds=[0, 1, 2])
  for run in runs:
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    a = run.cells[0][0] == 'A'
    (wd / 'results.json').write_text(json.dumps(
        {'final': {'probe_acc': (0.80 if a else 0.70) + 0.01 * run.seed},
         'random_init': {'probe_acc': 0.60 + 0.002 * run.seed}, 'raw_pixels': {'probe_acc': 0.9}}))
  summary = tables.summarize(table, runs, tmp_path)
  # table.csv holds everything a summary entry needs, the per-seed references included.
  tables.write_csv(summary, tmp_path / 'table.csv')
  back = tables.read_csv(tmp_path / 'table.csv')
  for e, b in zip(summary, back):
    assert b['seeds'] == e['seeds'] and (b['n'], b['pending'], b['errors']) == (e['n'], 0, [])
    for key in ('values', 'random_init_values', 'raw_pixels_values'):
      np.testing.assert_allclose(b[key], e[key], atol=5e-5)  # written to 4 decimals
  for b, e in zip(tables.verdicts(table, back), tables.verdicts(table, summary)):
    assert (b['claim'], b['verdict'], b['n']) == (e['claim'], e['verdict'], e['n'])
    np.testing.assert_allclose([b['effect'], b['spread']], [e['effect'], e['spread']], atol=1e-4)
  # Running A's seed 1 alone summarises every run on disk: both cells, all three seeds.
  assert {r.name for r in tables.table_runs(
      table, tables.plan_runs(table, [1], ['a.*']), tmp_path)} == (
      {r.name for r in runs})
  # A's seed 2 not finished while B's seed 1 runs alone: A's cell shows 2 of 3 seeds, marked.
  a2 = next(r for r in runs if r.name == 'a.iid/seed2')
  (a2.workdir(tmp_path) / 'results.json').rename(tmp_path / 'a2.json')
  partial = tables.summarize(table, tables.table_runs(
      table, tables.plan_runs(table, [1], ['b.*']), tmp_path), tmp_path)
  assert [(e['n'], e['pending']) for e in partial if e['cell'] == 'a.iid'] == [(2, 1)]
  assert '[2 of 3 seeds]' in tables.markdown(table, partial, [0, 1, 2])
  (tmp_path / 'a2.json').rename(a2.workdir(tmp_path) / 'results.json')
  # B's runs gone (a fresh clone): its entry is carried from the earlier csv, and the claim on it
  # is still judged; a csv without per-seed references cannot pair A with its random init.
  a_only = [r for r in runs if r.cells[0][0] == 'A']
  carried = tables.carry_over(table, tables.summarize(table, a_only, tmp_path), back)
  assert [(e['cell'], e.get('carried', False)) for e in carried] == [('a.iid', False),
                                                                      ('b.iid', True)]
  # So is a cell whose runs are all still pending (a full invocation that has not reached it).
  pending = [dict(e, n=0, values=[], seeds=[], pending=3) if e['cell'] == 'b.iid' else e
             for e in summary]
  assert [(e['n'], e.get('carried')) for e in tables.carry_over(table, pending, back)
          if e['cell'] == 'b.iid'] == [(3, True)]
  found = {v['worse']: v for v in tables.verdicts(table, carried)}
  np.testing.assert_allclose(found['B']['effect'], 10.0, atol=1e-3)
  assert found['B']['verdict'] == 'confirmed'
  old = [dict(e, random_init_values=[], raw_pixels_values=[]) for e in back]
  no_refs = {v['worse']: v['verdict'] for v in tables.verdicts(table, old)}
  assert no_refs[tables.RANDOM_INIT].startswith('no per-seed reference values')
  assert no_refs['B'] == 'confirmed'
  md = tables.markdown(table, carried, [0, 1, 2])
  assert ('Carried from the previous table.csv (no run of theirs under this output directory): '
          '`b.iid`.') in md
  # Cells the table no longer has are not carried.
  assert tables.carry_over(make_table(rows={'A': rows['A']}, columns={'IID': {}}), [], back) == [
      dict(e, carried=True) for e in back if e['cell'] == 'a.iid']


def _marked_summary(table, tmp_path, probe, knn, knn_init):
  """`mark_collapsed` over seeds 0-2 of `table`, each run's results.json written from
  probe[row][seed] / knn[row][seed] (fractions), random-init probe 0.5 and kNN knn_init(seed)."""
  runs = tables.plan_runs(table, seeds=[0, 1, 2])
  for run in runs:
    row = run.cells[0][0]
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    (wd / 'results.json').write_text(json.dumps(
        {'final': {'probe_acc': probe[row][run.seed], 'knn_acc': knn[row][run.seed]},
         'random_init': {'probe_acc': 0.5, 'knn_acc': knn_init(run.seed)}}))
  return tables.mark_collapsed(table, tables.summarize(table, runs, tmp_path))


def test_a_reference_value_at_chance_takes_its_seed_out_of_the_metric(tmp_path):
  """A seed whose random-init reference fails on one metric (its fine-tune diverged: at chance)
  leaves that metric's entry, trained value included, so that the reference row's mean is never
  over failed and working evaluations and a 'learns' verdict pairs the same seeds; the seed's other
  metrics and the other seeds stay."""
  rows = {'A': dict(ssl_method='simclr')}
  table = make_table(rows=rows, columns={'IID': dict(partition='iid')}, metrics=('probe_acc', 'knn_acc'),
                     claims=(tables.Claim('A learns', 'A', tables.RANDOM_INIT, 'knn_acc'),))
  summary = _marked_summary(table, tmp_path, {'A': (0.80, 0.82, 0.84)}, {'A': (0.70, 0.72, 0.74)},
                            knn_init=lambda seed: (0.40, 0.1150, 0.44)[seed])
  by = {e['metric']: e for e in summary}
  assert by['probe_acc']['seeds'] == [0, 1, 2] and not by['probe_acc']['at_chance']
  a = by['knn_acc']
  assert a['seeds'] == [0, 2] and a['collapsed'] == []
  np.testing.assert_allclose([a['mean'], a['random_init_mean']], [72.0, 42.0], rtol=1e-12)
  assert a['at_chance'] == ["seed 1: its random-init encoder's kNN (%) 11.50, within 2 points of "
                           'chance (10.00); its other metrics keep it']
  md = tables.markdown(table, summary, [0, 1, 2])
  assert '| A learns | IID | kNN (%) | +30.00 |' in md


def test_collapsed_seeds_are_marked_never_averaged_and_never_paired(tmp_path):
  """A seed at chance (10 classes: within 2 points of 10 %) leaves every metric of its cell; a cell
  with every seed collapsed prints 'collapsed (k of n seeds)' and its claims say so; table.csv keeps
  the marks; a weak but learning seed (13.9 %) stays."""
  rows = {'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol'),
          'C': dict(ssl_method='simsiam')}
  table = make_table(rows=rows, columns={'IID': dict(partition='iid')}, metrics=('probe_acc', 'knn_acc'),
                     claims=(tables.Claim('A beats B', 'A', 'B', 'probe_acc'),
                             tables.Claim('A beats C', 'A', 'C', 'probe_acc')))
  probe = {'A': (0.80, 0.10, 0.84), 'B': (0.10, 0.1001, 0.1199), 'C': (0.139, 0.70, 0.72)}
  knn = {'A': (0.70, 0.161, 0.72), 'B': (0.10, 0.10, 0.10), 'C': (0.13, 0.60, 0.61)}
  summary = _marked_summary(table, tmp_path, probe, knn, knn_init=lambda seed: 0.4 + 0.01 * seed)
  by = {(e['row'], e['metric']): e for e in summary}
  a = by[('A', 'knn_acc')]  # seed 1 collapsed on the probe: out of the kNN entry too
  assert a['seeds'] == [0, 2] and a['n'] == 2
  np.testing.assert_allclose(a['random_init_values'], [40.0, 42.0], rtol=1e-12)
  np.testing.assert_allclose(a['mean'], 71.0, rtol=1e-12)
  assert a['collapsed'] == ['seed 1: linear probe (%) 10.00, within 2 points of chance (10.00)']
  assert by[('B', 'probe_acc')]['n'] == 0 and len(by[('B', 'probe_acc')]['collapsed']) == 3
  assert by[('C', 'probe_acc')]['seeds'] == [0, 1, 2]  # 13.9 % is weak, not collapsed
  md = tables.markdown(table, summary, [0, 1, 2])
  assert '| A | 82.00 ± 2.83 [2 of 3 seeds, 1 collapsed] |' in md
  assert '| B | collapsed (3 of 3 seeds) |' in md
  assert '## Collapsed seeds' in md and '- `b.iid` seed 2: linear probe (%) 11.99' in md
  assert '| A beats B | IID | linear probe (%) | – | – | 0 | B collapsed (3 seeds) |' in md
  tables.write_csv(summary, tmp_path / 'table.csv')
  back = {(e['row'], e['metric']): e for e in tables.read_csv(tmp_path / 'table.csv')}
  assert back[('B', 'knn_acc')]['collapsed'] == by[('B', 'knn_acc')]['collapsed']
  assert back[('A', 'probe_acc')]['seeds'] == [0, 2]
  # Marking again (a table rebuilt from its csv) changes nothing.
  again = tables.mark_collapsed(table, list(back.values()))
  assert {(e['row'], e['metric']): (e['seeds'], e['collapsed']) for e in again} == {
      k: (e['seeds'], e['collapsed']) for k, e in back.items()}


def test_a_single_value_at_chance_leaves_only_its_metric(tmp_path):
  """A seed whose encoder learned (probe far above chance) but whose score on one metric is at
  chance (a diverged fine-tune) leaves that metric's mean and verdicts only, marked 'at chance';
  every seed at chance on a metric prints 'at chance (k of n seeds)'; the csv keeps the marks and
  marking again changes nothing."""
  rows = {'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol')}
  table = make_table(rows=rows, columns={'IID': dict(partition='iid')}, metrics=('probe_acc', 'knn_acc'),
                     claims=(tables.Claim('A beats B', 'A', 'B', 'knn_acc'),))
  probe = {'A': (0.80, 0.82, 0.84), 'B': (0.70, 0.71, 0.72)}
  knn = {'A': (0.70, 0.72, 0.1150), 'B': (0.10, 0.11, 0.1199)}
  summary = _marked_summary(table, tmp_path, probe, knn, knn_init=lambda seed: 0.4)
  by = {(e['row'], e['metric']): e for e in summary}
  assert by[('A', 'probe_acc')]['seeds'] == [0, 1, 2] and not by[('A', 'probe_acc')]['at_chance']
  a = by[('A', 'knn_acc')]
  assert a['seeds'] == [0, 1] and a['collapsed'] == [] and a['random_init_values'] == [40.0, 40.0]
  np.testing.assert_allclose(a['mean'], 71.0, rtol=1e-12)
  assert a['at_chance'] == ['seed 2: kNN (%) 11.50, within 2 points of chance (10.00); its other '
                            'metrics keep it']
  assert by[('B', 'knn_acc')]['n'] == 0 and len(by[('B', 'knn_acc')]['at_chance']) == 3
  md = tables.markdown(table, summary, [0, 1, 2])
  assert '| A | 71.00 ± 1.41 [2 of 3 seeds, 1 at chance] |' in md
  assert '| B | at chance (3 of 3 seeds) |' in md
  assert '## Values at chance' in md and '- `a.iid` seed 2: kNN (%) 11.50' in md
  assert '## Collapsed seeds' not in md
  assert '| A beats B | IID | kNN (%) | – | – | 0 | B at chance (3 seeds) |' in md
  tables.write_csv(summary, tmp_path / 'table.csv')
  back = {(e['row'], e['metric']): e for e in tables.read_csv(tmp_path / 'table.csv')}
  assert back[('A', 'knn_acc')]['at_chance'] == a['at_chance']
  again = tables.mark_collapsed(table, list(back.values()))
  assert {(e['row'], e['metric']): (e['seeds'], e['at_chance']) for e in again} == {
      k: (e['seeds'], e['at_chance']) for k, e in back.items()}


def test_a_run_of_one_architecture_fills_that_cohorts_metrics_and_no_other(tmp_path):
  """A homogeneous reference row (supervised FedAvg on LeNet-5) is read as the LeNet-5 cohort: its
  'probe_acc' is the table's 'probe_acc_lenet5'; it has no entry for another cohort, and a run with
  cohorts still reads its own per-cohort values."""
  table = make_table(rows={'mix': dict(ssl_method='simclr'),
                           'sup, lenet5': dict(ssl_method='supervised', encoder='lenet5')},
                     columns={'IID': dict(partition='iid')},
                     metrics=('probe_acc', 'probe_acc_lenet5', 'probe_acc_small_cnn'))
  runs = tables.plan_runs(table, seeds=[0])
  payloads = {
      'mix': {'final': {'probe_acc': 0.80, 'probe_acc_lenet5': 0.78, 'probe_acc_small_cnn': 0.81},
              'random_init': {'probe_acc': 0.70, 'probe_acc_lenet5': 0.68,
                              'probe_acc_small_cnn': 0.71},
              'cohorts': {'lenet5': [1], 'small_cnn': [0]}},
      'sup, lenet5': {'final': {'probe_acc': 0.85}, 'random_init': {'probe_acc': 0.66}}}
  for run in runs:
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    (wd / 'results.json').write_text(json.dumps(payloads[run.cells[0][0]]))
  got = {(e['row'], e['metric']): (e['mean'], e['random_init_mean'])
         for e in tables.summarize(table, runs, tmp_path)}
  assert got == {('mix', 'probe_acc'): (80.0, 70.0), ('mix', 'probe_acc_lenet5'): (78.0, 68.0),
                 ('mix', 'probe_acc_small_cnn'): (81.0, 71.0),
                 ('sup, lenet5', 'probe_acc'): (85.0, 66.0),
                 ('sup, lenet5', 'probe_acc_lenet5'): (85.0, 66.0)}
