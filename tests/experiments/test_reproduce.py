"""experiments.reproduce on a two-cell, one-seed, one-round table (plus a cell that fails): the three
outputs are written, a failing cell is recorded while the others finish, a rerun after deleting one
cell's result reruns only that cell, and the summary statistics are right; table.csv round-trips,
and a run of some cells or seeds keeps the rest of the table (runs on disk, else the earlier
csv)."""
import csv
import json
import pathlib
import shutil
import textwrap

import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import reproduce
from fedjax_ssl import table_stats

TABLE = textwrap.dedent('''
    from fedjax_ssl import experiment, reproduce

    def get_table(scale):
      c = experiment.default_config()
      c.dataset = 'fashion_mnist_subset'
      c.train_size = 300
      c.num_clients = 3
      c.clients_per_round = 3
      c.partition = 'iid'
      c.heads = 'custom'
      c.proj_hidden, c.proj_out, c.pred_hidden, c.pred_out = 16, 8, 16, 8
      c.batch_size = 25
      c.local_epochs = 1
      c.rounds = 1
      c.probe = 'adam'        # the tiny data has too few images for 1% labels
      c.probe_epochs = 2
      c.knn_k = 10
      c.checkpoint_every = 1
      rows = {'FedSimCLR': dict(ssl_method='simclr'),
              # Its runs raise (see `failing` below): recorded, the other cells go on.
              'Broken': dict(ssl_method='byol')}
      columns = {'IID': {}, 'Dir(1)': dict(partition='dirichlet', alpha=1.0)}
      return reproduce.Table(name='tiny', title='tiny table', base=c, rows=rows, columns=columns,
                             metrics=('probe_acc', 'knn_acc'), scale=scale,
                             paper={('FedSimCLR', 'IID', 'knn_acc'): 50.0})
''')


def _read_csv(path):
  with open(path) as f:
    return {(r['cell'], r['metric']): r for r in csv.DictReader(f)}


@pytest.mark.slow
def test_reproduce_writes_outputs_records_failures_and_reruns_only_missing(tmp_path, monkeypatch):
  from experiments import reproduce as binary
  from fedjax_ssl import training as train

  table_file = tmp_path / 'tiny.py'
  table_file.write_text(TABLE)
  out = tmp_path / 'out'
  calls = []
  real = train.train_and_evaluate

  def failing(config, workdir, **kw):
    name = pathlib.Path(workdir).relative_to(out / 'runs').as_posix()
    calls.append(name)
    if name.startswith('broken.'):
      raise RuntimeError('simulated failure in the middle of a run')
    return real(config, workdir, **kw)
  monkeypatch.setattr(train, 'train_and_evaluate', failing)

  binary.run_table(str(table_file), str(out), seeds=[0])
  assert sorted(calls) == ['broken.dir-1/seed0', 'broken.iid/seed0', 'fedsimclr.dir-1/seed0',
                           'fedsimclr.iid/seed0']
  for name in ('table.csv', 'table.md', 'table.png'):
    assert (out / name).stat().st_size > 0, name
  rows = _read_csv(out / 'table.csv')
  assert len(rows) == 8
  for cell in ('fedsimclr.iid', 'fedsimclr.dir-1'):
    for metric in ('probe_acc', 'knn_acc'):
      row = rows[(cell, metric)]
      result = json.loads((out / 'runs' / cell / 'seed0' / 'results.json').read_text())
      assert int(row['n']) == 1 and row['errors'] == ''
      np.testing.assert_allclose(float(row['mean']), 100 * result['final'][metric], rtol=1e-12)
  knn = rows[('fedsimclr.iid', 'knn_acc')]
  np.testing.assert_allclose(float(knn['diff']), float(knn['mean']) - 50.0, rtol=1e-12)
  broken = rows[('broken.iid', 'probe_acc')]
  assert int(broken['n']) == 0 and 'simulated failure' in broken['errors']
  assert (out / 'runs' / 'broken.iid' / 'seed0' / 'error.json').exists()
  md = (out / 'table.md').read_text()
  assert '| Broken | failed | failed |' in md and '(paper 50.00,' in md

  # A rerun after deleting one cell's result reruns that cell only (failed cells are retried too,
  # here left out by --only).
  kept = out / 'runs' / 'fedsimclr.iid' / 'seed0' / 'results.json'
  kept_mtime = kept.stat().st_mtime_ns
  (out / 'runs' / 'fedsimclr.dir-1' / 'seed0' / 'results.json').unlink()
  calls.clear()
  binary.run_table(str(table_file), str(out), seeds=[0], only=['fedsimclr.*'])
  assert calls == ['fedsimclr.dir-1/seed0']
  assert kept.stat().st_mtime_ns == kept_mtime
  assert int(_read_csv(out / 'table.csv')[('fedsimclr.dir-1', 'knn_acc')]['n']) == 1

  # Another seed of one cell: the table keeps every run on disk (both seeds, the other cells).
  calls.clear()
  binary.run_table(str(table_file), str(out), seeds=[1], only=['fedsimclr.iid'])
  assert calls == ['fedsimclr.iid/seed1']
  rows = _read_csv(out / 'table.csv')
  assert (rows[('fedsimclr.iid', 'knn_acc')]['seeds'], rows[('fedsimclr.dir-1', 'knn_acc')]['n'],
          rows[('broken.iid', 'knn_acc')]['n']) == ('0 1', '1', '0')
  assert 'seeds [0, 1]' in (out / 'table.md').read_text()
  # A cell whose runs are gone (a fresh clone has the tables, not the runs) is carried.
  shutil.rmtree(out / 'runs' / 'fedsimclr.dir-1')
  binary.run_table(str(table_file), str(out), seeds=[1], only=['fedsimclr.iid'])
  assert _read_csv(out / 'table.csv')[('fedsimclr.dir-1', 'knn_acc')] == (
      rows[('fedsimclr.dir-1', 'knn_acc')])
  assert 'this output directory): `fedsimclr.dir-1`.' in (out / 'table.md').read_text()

  # The table file changes under a finished cell: its result is reported stale, not reused or
  # overwritten.
  table_file.write_text(TABLE.replace('c.probe_epochs = 2', 'c.probe_epochs = 3'))
  calls.clear()
  binary.run_table(str(table_file), str(out), seeds=[0], only=['fedsimclr.iid'])
  assert calls == [] and kept.stat().st_mtime_ns == kept_mtime
  stale = _read_csv(out / 'table.csv')[('fedsimclr.iid', 'probe_acc')]
  assert int(stale['n']) == 0 and 'different config' in stale['errors']


def _table(**kw):
  from fedjax_ssl import experiment
  args = dict(name='t', title='t', base=experiment.default_config(),
              rows={'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol')},
              columns={'IID': dict(partition='iid'), 'Dir': dict(partition='dirichlet', alpha=0.1)},
              metrics=('probe_acc',))
  args.update(kw)
  return reproduce.Table(**args)


def test_plan_shares_runs_between_identical_configs_and_validates_each_cell():
  table = _table(rows={'A': dict(ssl_method='simclr'),
                       'CL': dict(algorithm='centralized', num_clients=1, clients_per_round=1,
                                  partition='iid'),
                       'Bad': dict(algorithm='fedu', ssl_method='simclr')})
  runs = reproduce.plan_runs(table, seeds=[0, 1])
  by_name = {r.name: r for r in runs}
  # Centralized ignores the partition column (alpha is unused under 'iid'): one run per seed.
  assert by_name['cl.iid/seed0'].cells == [('CL', 'IID'), ('CL', 'Dir')]
  assert 'cl.dir/seed0' not in by_name
  assert by_name['a.dir/seed1'].config.alpha == 0.1 and by_name['a.dir/seed1'].config.seed == 1
  assert "'fedu'" in by_name['bad.iid/seed0'].config_error and by_name['bad.iid/seed0'].config is None
  assert len(runs) == 2 * (2 + 1 + 2)
  assert [r.name for r in reproduce.plan_runs(table, [0], only=['a.*'])] == ['a.iid/seed0',
                                                                              'a.dir/seed0']


def test_bad_tables_raise_with_the_reason(tmp_path):
  with pytest.raises(cv.ConfigError, match="metric 'top5'"):
    reproduce.check_table(_table(metrics=('top5',)))
  with pytest.raises(cv.ConfigError, match='collide'):
    reproduce.check_table(_table(rows={'A b': {}, 'a-b': {}}))
  with pytest.raises(cv.ConfigError, match='names no cell'):
    reproduce.check_table(_table(paper={('A', 'Nope', 'probe_acc'): 1.0}))
  # A cell with a bad override is recorded as failed (the other cells still run).
  bad = reproduce.plan_runs(_table(rows={'A': dict(lr_max=1.0), 'B': dict(seed='x')}), [0])
  assert [r.config for r in bad] == [None] * 4
  assert "config key 'lr_max' does not exist" in bad[0].config_error
  assert "seed = 'x' is invalid" in bad[2].config_error
  with pytest.raises(cv.ConfigError, match=r"--only \['z\*'\] matches no cell"):
    reproduce.plan_runs(_table(), [0], only=['z*'])
  with pytest.raises(cv.ConfigError, match="--scale = 'huge'"):
    reproduce.load_table(str(tmp_path / 'x.py'), 'huge')
  with pytest.raises(cv.ConfigError, match='no such file'):
    reproduce.load_table(str(tmp_path / 'x.py'), 'quick')


def test_summary_mean_std_and_markdown(tmp_path):
  table = _table(rows={'A': dict(ssl_method='simclr')}, columns={'IID': dict(partition='iid')},
                 paper={('A', 'IID', 'probe_acc'): 70.0})
  runs = reproduce.plan_runs(table, seeds=[0, 1, 2])
  values = [0.61, 0.65, 0.72]
  for run, v in zip(runs, values):
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    (wd / 'results.json').write_text(json.dumps({'final': {'probe_acc': v},
                                                 'random_init': {'probe_acc': 0.5}}))
  (entry,) = reproduce.summarize(table, runs, tmp_path)
  ref = 100 * np.asarray(values)
  np.testing.assert_allclose(entry['mean'], ref.mean(), rtol=1e-12)
  np.testing.assert_allclose(entry['std'], ref.std(ddof=1), rtol=1e-12)
  np.testing.assert_allclose(entry['diff'], ref.mean() - 70.0, rtol=1e-12)
  assert entry['n'] == 3 and entry['seeds'] == [0, 1, 2] and entry['random_init_mean'] == 50.0
  md = reproduce.markdown(table, [entry], [0, 1, 2])
  assert f'| A | {ref.mean():.2f} ± {ref.std(ddof=1):.2f} (paper 70.00, {ref.mean() - 70:+.2f}) |' in md


def test_a_run_of_one_architecture_fills_that_cohorts_metrics_and_no_other(tmp_path):
  """A homogeneous reference row (supervised FedAvg on LeNet-5) is read as the LeNet-5 cohort: its
  'probe_acc' is the table's 'probe_acc_lenet5'; it has no entry for another cohort, and a run with
  cohorts still reads its own per-cohort values."""
  table = _table(rows={'mix': dict(ssl_method='simclr'),
                       'sup, lenet5': dict(ssl_method='supervised', encoder='lenet5')},
                 columns={'IID': dict(partition='iid')},
                 metrics=('probe_acc', 'probe_acc_lenet5', 'probe_acc_small_cnn'))
  runs = reproduce.plan_runs(table, seeds=[0])
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
         for e in reproduce.summarize(table, runs, tmp_path)}
  assert got == {('mix', 'probe_acc'): (80.0, 70.0), ('mix', 'probe_acc_lenet5'): (78.0, 68.0),
                 ('mix', 'probe_acc_small_cnn'): (81.0, 71.0),
                 ('sup, lenet5', 'probe_acc'): (85.0, 66.0),
                 ('sup, lenet5', 'probe_acc_lenet5'): (85.0, 66.0)}


def test_rows_of_different_random_init_encoders_get_one_reference_row_each(tmp_path):
  """table.md averages the random-init score over the rows that start from the same encoder (equal
  per-seed values up to the evaluator's drift between processes), never over unlike encoders, and
  tells encoders apart on every metric at once; one encoder keeps the single unlabelled row."""
  rows = {'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol'),
          'C': dict(ssl_method='simclr', encoder='lenet5'), 'D': dict(ssl_method='simsiam'),
          'E': dict(ssl_method='simclr', lr=0.5)}
  table = _table(rows=rows, columns={'IID': dict(partition='iid')},
                 metrics=('probe_acc', 'knn_acc'))
  runs = reproduce.plan_runs(table, seeds=[0, 1])
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
  summary = reproduce.summarize(table, runs, tmp_path)
  md = reproduce.markdown(table, summary, [0, 1])
  assert '| *random-init encoder, of A; B; D* | 71.00 |' in md
  assert '| *random-init encoder, of C* | 62.00 |' in md
  assert '| *random-init encoder, of E* | 71.00 |' in md     # the probe grid, level with A
  assert '| *random-init encoder, of E* | 56.00 |' in md     # the kNN grid
  same = [e for e in summary if e['row'] in ('A', 'B')]
  assert '| *random-init encoder* | 71.00 |' in reproduce.markdown(table, same, [0, 1])


def test_command_line_overrides_apply_to_every_cell_and_are_recorded(tmp_path):
  from experiments import reproduce as binary  # pylint: disable=g-import-not-at-top
  argv, overrides = binary.split_overrides(
      ['reproduce', '--table', 't.py', '--config.rounds=4', '--config.fedu2.lambda_u=0.5',
       '--noconfig.drop_last', '--config.ssl_method=simclr', '--out', 'o'])
  assert argv == ['reproduce', '--table', 't.py', '--out', 'o']
  assert overrides == {'rounds': 4, 'fedu2.lambda_u': 0.5, 'drop_last': False,
                       'ssl_method': 'simclr'}
  with pytest.raises(cv.ConfigError, match=r"unknown config key 'config.roundz'.*'config.rounds'"):
    binary.split_overrides(['reproduce', '--config.roundz=4'])
  with pytest.raises(cv.ConfigError, match=r'--config.rounds=four is invalid: must be a int'):
    binary.split_overrides(['reproduce', '--config.rounds=four'])
  path = tmp_path / 'tiny.py'
  path.write_text(TABLE)
  table = reproduce.with_overrides(reproduce.load_table(str(path), 'quick'),
                                   {'rounds': 4, 'ssl_method': 'simsiam'})
  for row, column in table.cells():  # after the row's own ssl_method
    config = reproduce.cell_config(table, row, column, seed=0)
    assert (config.rounds, config.ssl_method) == (4, 'simsiam')
  assert "Overrides applied to every cell: `rounds=4`, `ssl_method='simsiam'`." in (
      reproduce.markdown(table, [], [0]))
  with pytest.raises(cv.ConfigError, match=r"override \(every cell\): config key 'nope' does not"):
    reproduce.cell_config(reproduce.with_overrides(table, {'nope': 1}), 'FedSimCLR', 'IID', 0)


def test_table_md_records_the_command_as_typed_with_its_overrides(tmp_path):
  """The binary strips `--config.KEY=VALUE` before absl parses its flags; the command table.md
  records keeps them, so that copying it reproduces the table (a rewrite that trains nothing:
  --recompute_references over an empty table.csv)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from tests import subprocess_env  # pylint: disable=g-import-not-at-top
  path = tmp_path / 'tiny.py'
  path.write_text(TABLE)
  out = tmp_path / 'out'
  out.mkdir()
  (out / 'table.csv').write_text(','.join(reproduce.CSV_FIELDS) + '\n')
  args = ['--table', str(path), '--out', str(out), '--config.grad_clip_norm=1.0',
          '--recompute_references']
  proc = subprocess.run([sys.executable, '-m', 'experiments.reproduce', *args],
                        env=subprocess_env.binary_env(), capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  md = (out / 'table.md').read_text()
  assert ('Command: `python -m experiments.reproduce ' + ' '.join(args) + '`') in md
  assert 'Overrides applied to every cell: `grad_clip_norm=1.0`.' in md


def test_recompute_references_adds_the_fine_tuning_raw_pixel_row_to_finished_runs(tmp_path,
                                                                                   monkeypatch):
  """Runs of a fine-tuning table that finished before the fine-tuning metrics had a raw-pixel row
  get it from `--recompute_references` (nothing trained), and the table shows it per seed."""
  from experiments import reproduce as binary
  from fedjax_ssl import experiment
  from fedjax_ssl.run_dir import RunDir
  path = tmp_path / 'tiny.py'
  path.write_text(TABLE.replace("c.probe_epochs = 2", "c.probe_epochs = 2\n  c.finetune = "
                                "'hetero_ssfl'\n  c.finetune_fractions = (0.1,)").replace(
                                    "metrics=('probe_acc', 'knn_acc')", "metrics=('ft_acc_10pct',)").replace(
                                    "'knn_acc'): 50.0", "'ft_acc_10pct'): 50.0"))
  out = tmp_path / 'out'
  table = reproduce.load_table(str(path), 'quick')
  runs = [r for r in reproduce.plan_runs(table, [0, 1], ['fedsimclr.iid'])]
  assert len(runs) == 2
  for run in runs:   # finished runs of the old code: no 'raw_pixels' in results.json
    rundir = RunDir(run.workdir(out))
    rundir.path.mkdir(parents=True)
    rundir.write_config(run.config)
    rundir.write_results({'status': 'completed', 'final': {'ft_acc_10pct': 0.5 + run.seed / 10},
                          'random_init': {'ft_acc_10pct': 0.25}})
  (out / 'table.csv').write_text(','.join(reproduce.CSV_FIELDS) + '\n')
  calls = []

  def pixels(config, dataset):
    calls.append(config.seed)
    return {'ft_acc_10pct': 0.375 + config.seed / 100}
  monkeypatch.setattr(experiment, 'raw_pixel_metrics', pixels)
  monkeypatch.setenv('FEDJAX_SSL_CACHE_DIR', str(tmp_path / 'cache'))
  binary.recompute_references(str(path), str(out), references=True)
  assert sorted(calls) == [0, 1]
  row = _read_csv(out / 'table.csv')[('fedsimclr.iid', 'ft_acc_10pct')]
  assert (row['values'], row['raw_pixels_values']) == ('50.0000 60.0000', '37.5000 38.5000')
  # Done once: a second pass evaluates nothing and the table is unchanged.
  binary.recompute_references(str(path), str(out), references=True)
  assert sorted(calls) == [0, 1]
  assert _read_csv(out / 'table.csv')[('fedsimclr.iid', 'ft_acc_10pct')] == row


def test_verdict_needs_an_effect_above_twice_the_seed_std():
  v = reproduce.verdict([80.0, 81.0, 82.0], [75.0, 75.5, 76.0])     # effect 5.5, spread 1.0
  assert v['verdict'] == 'confirmed' and v['n'] == 3
  np.testing.assert_allclose([v['effect'], v['spread']], [5.5, 1.0], rtol=1e-12)
  assert reproduce.verdict([80.0, 81.0, 82.0], [79.0, 79.5, 80.0])['verdict'] == 'not confirmed'
  assert reproduce.verdict([70.0, 71.0, 72.0], [79.0, 79.5, 80.0])['verdict'] == 'reversed'
  assert reproduce.verdict([80.0], [70.0])['verdict'] == 'too few seeds'
  # Exactly 2 x spread is not enough.
  assert reproduce.verdict([1.0, 3.0], [0.0, 0.0])['verdict'] == 'not confirmed'


def test_claims_are_checked_and_end_table_md_with_a_verdict(tmp_path):
  rows = {'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol')}
  claim = reproduce.Claim('A beats B', 'A', 'B', 'probe_acc')
  table = _table(rows=rows, columns={'IID': dict(partition='iid')},
                 claims=(claim, reproduce.Claim('A learns', 'A', reproduce.RANDOM_INIT, 'probe_acc')))
  with pytest.raises(cv.ConfigError, match="compares 'A' with 'C'"):
    reproduce.check_table(_table(rows=rows, claims=(reproduce.Claim('x', 'A', 'C', 'probe_acc'),)))
  with pytest.raises(cv.ConfigError, match="metric 'knn_acc'"):
    reproduce.check_table(_table(rows=rows, metrics=('probe_acc',),
                                 claims=(reproduce.Claim('x', 'A', 'B', 'knn_acc'),)))
  runs = reproduce.plan_runs(table, seeds=[0, 1, 2])
  value = {('A', 0): 0.80, ('A', 1): 0.81, ('A', 2): 0.82, ('B', 0): 0.70, ('B', 1): 0.72,
           ('B', 2): 0.74}
  for run in runs:
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    (wd / 'results.json').write_text(json.dumps(
        {'final': {'probe_acc': value[(run.cells[0][0], run.seed)]},
         'random_init': {'probe_acc': 0.795 + 0.01 * run.seed}}))
  summary = reproduce.summarize(table, runs, tmp_path)
  found = {v['worse']: v for v in reproduce.verdicts(table, summary)}
  np.testing.assert_allclose(found['B']['effect'], 9.0, rtol=1e-9)     # 81 - 72
  np.testing.assert_allclose(found['B']['spread'], 2.0, rtol=1e-9)     # B's std
  assert found['B']['verdict'] == 'confirmed'
  # Against the run's own random-init encoder: 81 - 80.5 with spread 1.0.
  assert found[reproduce.RANDOM_INIT]['verdict'] == 'not confirmed'
  md = reproduce.markdown(table, summary, [0, 1, 2])
  assert '## Verdict' in md and '| A beats B | IID | linear probe (%) | +9.00 | 2.00 | 3 | **confirmed** |' in md


def test_a_table_keeps_the_cells_and_seeds_this_invocation_did_not_run(tmp_path):
  rows = {'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol')}
  table = _table(rows=rows, columns={'IID': dict(partition='iid')},
                 claims=(reproduce.Claim('A beats B', 'A', 'B', 'probe_acc'),
                         reproduce.Claim('A learns', 'A', reproduce.RANDOM_INIT, 'probe_acc')))
  runs = reproduce.plan_runs(table, seeds=[0, 1, 2])
  for run in runs:
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    a = run.cells[0][0] == 'A'
    (wd / 'results.json').write_text(json.dumps(
        {'final': {'probe_acc': (0.80 if a else 0.70) + 0.01 * run.seed},
         'random_init': {'probe_acc': 0.60 + 0.002 * run.seed}, 'raw_pixels': {'probe_acc': 0.9}}))
  summary = reproduce.summarize(table, runs, tmp_path)
  # table.csv holds everything a summary entry needs, the per-seed references included.
  reproduce.write_csv(summary, tmp_path / 'table.csv')
  back = reproduce.read_csv(tmp_path / 'table.csv')
  for e, b in zip(summary, back):
    assert b['seeds'] == e['seeds'] and (b['n'], b['pending'], b['errors']) == (e['n'], 0, [])
    for key in ('values', 'random_init_values', 'raw_pixels_values'):
      np.testing.assert_allclose(b[key], e[key], atol=5e-5)  # written to 4 decimals
  for b, e in zip(reproduce.verdicts(table, back), reproduce.verdicts(table, summary)):
    assert (b['claim'], b['verdict'], b['n']) == (e['claim'], e['verdict'], e['n'])
    np.testing.assert_allclose([b['effect'], b['spread']], [e['effect'], e['spread']], atol=1e-4)
  # Running A's seed 1 alone summarises every run on disk: both cells, all three seeds.
  assert {r.name for r in reproduce.table_runs(
      table, reproduce.plan_runs(table, [1], ['a.*']), tmp_path)} == (
      {r.name for r in runs})
  # B's runs gone (a fresh clone): its entry is carried from the earlier csv, and the claim on it
  # is still judged; a csv without per-seed references cannot pair A with its random init.
  a_only = [r for r in runs if r.cells[0][0] == 'A']
  carried = reproduce.carry_over(table, reproduce.summarize(table, a_only, tmp_path), back)
  assert [(e['cell'], e.get('carried', False)) for e in carried] == [('a.iid', False),
                                                                      ('b.iid', True)]
  # So is a cell whose runs are all still pending (a full invocation that has not reached it).
  pending = [dict(e, n=0, values=[], seeds=[], pending=3) if e['cell'] == 'b.iid' else e
             for e in summary]
  assert [(e['n'], e.get('carried')) for e in reproduce.carry_over(table, pending, back)
          if e['cell'] == 'b.iid'] == [(3, True)]
  found = {v['worse']: v for v in reproduce.verdicts(table, carried)}
  np.testing.assert_allclose(found['B']['effect'], 10.0, atol=1e-3)
  assert found['B']['verdict'] == 'confirmed'
  old = [dict(e, random_init_values=[], raw_pixels_values=[]) for e in back]
  no_refs = {v['worse']: v['verdict'] for v in reproduce.verdicts(table, old)}
  assert no_refs[reproduce.RANDOM_INIT].startswith('no per-seed reference values')
  assert no_refs['B'] == 'confirmed'
  md = reproduce.markdown(table, carried, [0, 1, 2])
  assert ('Carried from the previous table.csv (no run of theirs under this output directory): '
          '`b.iid`.') in md
  # Cells the table no longer has are not carried.
  assert reproduce.carry_over(_table(rows={'A': rows['A']}, columns={'IID': {}}), [], back) == [
      dict(e, carried=True) for e in back if e['cell'] == 'a.iid']


def test_a_table_refuses_a_scale_it_does_not_define(tmp_path):
  path = tmp_path / 'two_scales.py'
  path.write_text(TABLE)
  with pytest.raises(cv.ConfigError, match="--scale = 'evidence' is not defined by .*: it defines "
                     r"\('quick', 'paper'\)"):
    reproduce.load_table(str(path), 'evidence')
  path.write_text("SCALES = ('quick', 'evidence')\n" + TABLE)
  assert reproduce.load_table(str(path), 'evidence').scale == 'evidence'


def test_curves_average_each_round_over_the_seeds_that_logged_it(tmp_path):
  table = _table(rows={'A': dict(ssl_method='simclr')}, columns={'IID': dict(partition='iid')})
  runs = reproduce.plan_runs(table, seeds=[0, 1, 2])
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
  found = reproduce.curves(table, runs, tmp_path)
  assert set(found) == {('A', 'IID')}
  got = found[('A', 'IID')]
  assert sorted(got['rounds']) == [0, 5, 10]
  np.testing.assert_allclose(got['rounds'][0], [50.0, 52.0], rtol=1e-12)
  np.testing.assert_allclose(got['rounds'][5], [60.0, 64.0], rtol=1e-12)
  np.testing.assert_allclose(got['rounds'][10], [70.0, 74.0], rtol=1e-12)
  np.testing.assert_allclose(got['raw_pixels'], [80.0, 80.0], rtol=1e-12)
  assert reproduce.plot_curves(table, found, tmp_path / 'curves.png')
  assert (tmp_path / 'curves.png').stat().st_size > 0
  # No run has two logged rounds: nothing to plot, no file.
  one_round = {('A', 'IID'): {'rounds': {0: [50.0]}, 'raw_pixels': []}}
  assert not reproduce.plot_curves(table, one_round, tmp_path / 'none.png')
  assert not (tmp_path / 'none.png').exists()


def test_fill_references_pairs_carried_seeds_only_where_they_reproduce_the_stored_means():
  table = _table(rows={'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol')},
                 columns={'IID': dict(partition='iid')},
                 claims=(reproduce.Claim('A learns', 'A', reproduce.RANDOM_INIT, 'probe_acc'),
                         reproduce.Claim('B learns', 'B', reproduce.RANDOM_INIT, 'probe_acc')))

  def entry(row, values, random_init_mean):  # as read_csv gives a csv without per-seed references
    return {'row': row, 'column': 'IID', 'cell': reproduce.cell_id(row, 'IID'),
            'metric': 'probe_acc', 'n': 3, 'mean': float(np.mean(values)),
            'std': float(np.std(values, ddof=1)), 'paper': None, 'diff': None,
            'random_init_mean': random_init_mean, 'raw_pixels_mean': 90.0, 'seeds': [0, 1, 2],
            'values': values, 'random_init_values': [], 'raw_pixels_values': [], 'pending': 0,
            'errors': [], 'diverged': [], 'carried': True}
  summary = [entry('A', [80.0, 81.0, 82.0], 70.01), entry('B', [70.0, 71.0, 72.0], 65.0)]
  assert reproduce.without_references(summary) == {'a.iid': [0, 1, 2], 'b.iid': [0, 1, 2]}
  # Each seed's round-0 evaluations, as fractions; A's reproduce its stored means (70.01 vs 70.00,
  # 90 vs 90), B's random init is 5 points off the 65.0 its csv stored.
  references = {(cell, s): ({'probe_acc': 0.69 + 0.01 * s}, {'probe_acc': 0.9})
                for cell in ('a.iid', 'b.iid') for s in range(3)}
  problems = reproduce.fill_references(summary, references)
  a, b = summary
  np.testing.assert_allclose(a['random_init_values'], [69.0, 70.0, 71.0], rtol=1e-12)
  np.testing.assert_allclose(a['raw_pixels_values'], [90.0] * 3, rtol=1e-12)
  np.testing.assert_allclose(a['random_init_mean'], 70.0, rtol=1e-12)
  assert b['random_init_values'] == [] and b['random_init_mean'] == 65.0
  assert problems == ['b.iid probe_acc: random_init 70.0000 recomputed, 65.0000 stored '
                      '(tolerance 0.05 points): left unpaired']
  assert reproduce.without_references(summary) == {'b.iid': [0, 1, 2]}
  found = {v['better']: v for v in reproduce.verdicts(table, summary)}
  np.testing.assert_allclose([found['A']['effect'], found['A']['spread']], [11.0, 1.0],
                             rtol=1e-9)
  assert found['A']['verdict'] == 'confirmed'
  assert found['B']['verdict'].startswith('no per-seed reference values')
  # A seed with no references at all is reported, not guessed.
  missing = [entry('A', [80.0, 81.0, 82.0], 70.0)]
  assert reproduce.fill_references(missing, {}) == [
      'a.iid probe_acc: no references for seeds [0, 1, 2]']


def _marked_summary(table, tmp_path, probe, knn, knn_init):
  """`mark_collapsed` over seeds 0-2 of `table`, each run's results.json written from
  probe[row][seed] / knn[row][seed] (fractions), random-init probe 0.5 and kNN knn_init(seed)."""
  runs = reproduce.plan_runs(table, seeds=[0, 1, 2])
  for run in runs:
    row = run.cells[0][0]
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    (wd / 'results.json').write_text(json.dumps(
        {'final': {'probe_acc': probe[row][run.seed], 'knn_acc': knn[row][run.seed]},
         'random_init': {'probe_acc': 0.5, 'knn_acc': knn_init(run.seed)}}))
  return reproduce.mark_collapsed(table, reproduce.summarize(table, runs, tmp_path))


def test_a_reference_value_at_chance_takes_its_seed_out_of_the_metric(tmp_path):
  """A seed whose random-init reference fails on one metric (its fine-tune diverged: at chance)
  leaves that metric's entry, trained value included, so that the reference row's mean is never
  over failed and working evaluations and a 'learns' verdict pairs the same seeds; the seed's other
  metrics and the other seeds stay."""
  rows = {'A': dict(ssl_method='simclr')}
  table = _table(rows=rows, columns={'IID': dict(partition='iid')}, metrics=('probe_acc', 'knn_acc'),
                 claims=(reproduce.Claim('A learns', 'A', reproduce.RANDOM_INIT, 'knn_acc'),))
  summary = _marked_summary(table, tmp_path, {'A': (0.80, 0.82, 0.84)}, {'A': (0.70, 0.72, 0.74)},
                            knn_init=lambda seed: (0.40, 0.1150, 0.44)[seed])
  by = {e['metric']: e for e in summary}
  assert by['probe_acc']['seeds'] == [0, 1, 2] and not by['probe_acc']['at_chance']
  a = by['knn_acc']
  assert a['seeds'] == [0, 2] and a['collapsed'] == []
  np.testing.assert_allclose([a['mean'], a['random_init_mean']], [72.0, 42.0], rtol=1e-12)
  assert a['at_chance'] == ["seed 1: its random-init encoder's kNN (%) 11.50, within 2 points of "
                           'chance (10.00); its other metrics keep it']
  md = reproduce.markdown(table, summary, [0, 1, 2])
  assert '| A learns | IID | kNN (%) | +30.00 |' in md


def test_a_classifier_random_init_at_chance_is_not_a_failure():
  # A supervised classifier's own test accuracy from random init is an untrained head: at chance by
  # construction, so it marks nothing; the same reference value on a fine-tune metric is a failure.
  entry = {'seeds': [0, 1], 'values': [80.0, 81.0], 'random_init_values': [10.0, 9.1],
           'raw_pixels_values': []}
  assert table_stats.at_chance_values(dict(entry, metric='test_acc'), 10) == {}
  assert sorted(table_stats.at_chance_values(dict(entry, metric='ft_acc_1pct'), 10)) == [0, 1]


def test_collapsed_seeds_are_marked_never_averaged_and_never_paired(tmp_path):
  """A seed at chance (10 classes: within 2 points of 10 %) leaves every metric of its cell; a cell
  with every seed collapsed prints 'collapsed (k of n seeds)' and its claims say so; table.csv keeps
  the marks; a weak but learning seed (13.9 %) stays."""
  rows = {'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol'),
          'C': dict(ssl_method='simsiam')}
  table = _table(rows=rows, columns={'IID': dict(partition='iid')}, metrics=('probe_acc', 'knn_acc'),
                 claims=(reproduce.Claim('A beats B', 'A', 'B', 'probe_acc'),
                         reproduce.Claim('A beats C', 'A', 'C', 'probe_acc')))
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
  md = reproduce.markdown(table, summary, [0, 1, 2])
  assert '| A | 82.00 ± 2.83 [2 of 3 seeds, 1 collapsed] |' in md
  assert '| B | collapsed (3 of 3 seeds) |' in md
  assert '## Collapsed seeds' in md and '- `b.iid` seed 2: linear probe (%) 11.99' in md
  assert '| A beats B | IID | linear probe (%) | – | – | 0 | B collapsed (3 seeds) |' in md
  reproduce.write_csv(summary, tmp_path / 'table.csv')
  back = {(e['row'], e['metric']): e for e in reproduce.read_csv(tmp_path / 'table.csv')}
  assert back[('B', 'knn_acc')]['collapsed'] == by[('B', 'knn_acc')]['collapsed']
  assert back[('A', 'probe_acc')]['seeds'] == [0, 2]
  # Marking again (a table rebuilt from its csv) changes nothing.
  again = reproduce.mark_collapsed(table, list(back.values()))
  assert {(e['row'], e['metric']): (e['seeds'], e['collapsed']) for e in again} == {
      k: (e['seeds'], e['collapsed']) for k, e in back.items()}


def test_a_single_value_at_chance_leaves_only_its_metric(tmp_path):
  """A seed whose encoder learned (probe far above chance) but whose score on one metric is at
  chance (a diverged fine-tune) leaves that metric's mean and verdicts only, marked 'at chance';
  every seed at chance on a metric prints 'at chance (k of n seeds)'; the csv keeps the marks and
  marking again changes nothing."""
  rows = {'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol')}
  table = _table(rows=rows, columns={'IID': dict(partition='iid')}, metrics=('probe_acc', 'knn_acc'),
                 claims=(reproduce.Claim('A beats B', 'A', 'B', 'knn_acc'),))
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
  md = reproduce.markdown(table, summary, [0, 1, 2])
  assert '| A | 71.00 ± 1.41 [2 of 3 seeds, 1 at chance] |' in md
  assert '| B | at chance (3 of 3 seeds) |' in md
  assert '## Values at chance' in md and '- `a.iid` seed 2: kNN (%) 11.50' in md
  assert '## Collapsed seeds' not in md
  assert '| A beats B | IID | kNN (%) | – | – | 0 | B at chance (3 seeds) |' in md
  reproduce.write_csv(summary, tmp_path / 'table.csv')
  back = {(e['row'], e['metric']): e for e in reproduce.read_csv(tmp_path / 'table.csv')}
  assert back[('A', 'knn_acc')]['at_chance'] == a['at_chance']
  again = reproduce.mark_collapsed(table, list(back.values()))
  assert {(e['row'], e['metric']): (e['seeds'], e['at_chance']) for e in again} == {
      k: (e['seeds'], e['at_chance']) for k, e in back.items()}


def test_read_csv_refuses_a_table_csv_of_another_layout(tmp_path):
  # Every committed table.csv has CSV_FIELDS; one without the per-seed reference and collapse
  # columns (the layout before them) is refused in one line, not read with silent blanks.
  path = tmp_path / 'table.csv'
  old = [f for f in reproduce.CSV_FIELDS
         if f not in ('random_init_values', 'raw_pixels_values', 'collapsed')]
  path.write_text(','.join(old) + '\n')
  with pytest.raises(cv.ConfigError) as e:
    reproduce.read_csv(path)
  assert str(e.value) == (f'{path} has the columns {old}: expected {list(reproduce.CSV_FIELDS)} (a '
                          'table.csv of an older layout; re-render it with the harness of that '
                          'time, or delete it to run the table again)')


def test_a_dp_cell_reports_the_epsilon_its_runs_spent(tmp_path):
  # results.json's 'dp' block (registry.dp_plan) of each seed goes to table.md's privacy section;
  # a cell without DP has none.
  table = _table(rows={'DP': {'dp.enabled': True, 'dp.target_epsilon': 4.0},
                       'plain': {}}, columns={'IID': dict(partition='iid')})
  runs = reproduce.plan_runs(table, seeds=[0, 1])
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
  summary = reproduce.summarize(table, runs, tmp_path)
  md = reproduce.markdown(table, summary, [0, 1])
  assert '## Privacy spent (DP-FedAvg, user level)' in md
  assert ('| DP, IID | 4.000 | 1e-05 | 5.024 | 0.5 | 50 of 500 without replacement | 100 | rdp, '
          'replace_one (user level) | 0,1 |') in md
  assert '| plain, IID |' not in md
  assert 'Privacy spent' not in reproduce.markdown(table, [e for e in summary if e['row'] == 'plain'],
                                                   [0, 1])
