"""experiments.reproduce on a two-cell, one-seed, one-round table (plus a cell that fails): the three
outputs are written, a failing cell is recorded while the others finish, a rerun after deleting one
cell's result reruns only that cell; command-line overrides reach every cell and the command is
recorded; --recompute_references fills finished runs. The library under it (fedjax_ssl.tables):
tests/tables/."""
import json
import pathlib
import shutil

import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import tables
from tests.tables import TINY_TABLE, read_csv_rows


@pytest.mark.slow
def test_reproduce_writes_outputs_records_failures_and_reruns_only_missing(tmp_path, monkeypatch):
  from experiments import reproduce as binary
  from fedjax_ssl.runs import training as train

  table_file = tmp_path / 'tiny.py'
  table_file.write_text(TINY_TABLE)
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
  rows = read_csv_rows(out / 'table.csv')
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
  assert int(read_csv_rows(out / 'table.csv')[('fedsimclr.dir-1', 'knn_acc')]['n']) == 1

  # Another seed of one cell: the table keeps every run on disk (both seeds, the other cells).
  calls.clear()
  binary.run_table(str(table_file), str(out), seeds=[1], only=['fedsimclr.iid'])
  assert calls == ['fedsimclr.iid/seed1']
  rows = read_csv_rows(out / 'table.csv')
  assert (rows[('fedsimclr.iid', 'knn_acc')]['seeds'], rows[('fedsimclr.dir-1', 'knn_acc')]['n'],
          rows[('broken.iid', 'knn_acc')]['n']) == ('0 1', '1', '0')
  assert 'seeds [0, 1]' in (out / 'table.md').read_text()
  # A cell whose runs are gone (a fresh clone has the tables, not the runs) is carried.
  shutil.rmtree(out / 'runs' / 'fedsimclr.dir-1')
  binary.run_table(str(table_file), str(out), seeds=[1], only=['fedsimclr.iid'])
  assert read_csv_rows(out / 'table.csv')[('fedsimclr.dir-1', 'knn_acc')] == (
      rows[('fedsimclr.dir-1', 'knn_acc')])
  assert 'this output directory): `fedsimclr.dir-1`.' in (out / 'table.md').read_text()

  # The table file changes under a finished cell: its result is reported stale, not reused or
  # overwritten.
  table_file.write_text(TINY_TABLE.replace('c.probe_epochs = 2', 'c.probe_epochs = 3'))
  calls.clear()
  binary.run_table(str(table_file), str(out), seeds=[0], only=['fedsimclr.iid'])
  assert calls == [] and kept.stat().st_mtime_ns == kept_mtime
  stale = read_csv_rows(out / 'table.csv')[('fedsimclr.iid', 'probe_acc')]
  assert int(stale['n']) == 0 and 'different config' in stale['errors']


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
  path.write_text(TINY_TABLE)
  table = tables.with_overrides(tables.load_table(str(path), 'quick'),
                                {'rounds': 4, 'ssl_method': 'simsiam'})
  for row, column in table.cells():  # after the row's own ssl_method
    config = tables.cell_config(table, row, column, seed=0)
    assert (config.rounds, config.ssl_method) == (4, 'simsiam')
  assert "Overrides applied to every cell: `rounds=4`, `ssl_method='simsiam'`." in (
      tables.markdown(table, [], [0]))
  with pytest.raises(cv.ConfigError, match=r"override \(every cell\): config key 'nope' does not"):
    tables.cell_config(tables.with_overrides(table, {'nope': 1}), 'FedSimCLR', 'IID', 0)


def test_table_md_records_the_command_as_typed_with_its_overrides(tmp_path):
  """The binary strips `--config.KEY=VALUE` before absl parses its flags; the command table.md
  records keeps them, so that copying it reproduces the table (a rewrite that trains nothing:
  --recompute_references over an empty table.csv)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from tests import subprocess_env  # pylint: disable=g-import-not-at-top
  path = tmp_path / 'tiny.py'
  path.write_text(TINY_TABLE)
  out = tmp_path / 'out'
  out.mkdir()
  (out / 'table.csv').write_text(','.join(tables.CSV_FIELDS) + '\n')
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
  from fedjax_ssl.runs.run_dir import RunDir
  path = tmp_path / 'tiny.py'
  path.write_text(TINY_TABLE.replace("c.probe_epochs = 2", "c.probe_epochs = 2\n  c.finetune = "
                                     "'hetero_ssfl'\n  c.finetune_fractions = (0.1,)").replace(
                                    "metrics=('probe_acc', 'knn_acc')", "metrics=('ft_acc_10pct',)").replace(
                                    "'knn_acc'): 50.0", "'ft_acc_10pct'): 50.0"))
  out = tmp_path / 'out'
  table = tables.load_table(str(path), 'quick')
  runs = [r for r in tables.plan_runs(table, [0, 1], ['fedsimclr.iid'])]
  assert len(runs) == 2
  for run in runs:   # finished runs of the old code: no 'raw_pixels' in results.json
    rundir = RunDir(run.workdir(out))
    rundir.path.mkdir(parents=True)
    rundir.write_config(run.config)
    rundir.write_results({'status': 'completed', 'final': {'ft_acc_10pct': 0.5 + run.seed / 10},
                          'random_init': {'ft_acc_10pct': 0.25}})
  (out / 'table.csv').write_text(','.join(tables.CSV_FIELDS) + '\n')
  calls = []

  def pixels(config, dataset):
    calls.append(config.seed)
    return {'ft_acc_10pct': 0.375 + config.seed / 100}
  monkeypatch.setattr(experiment, 'raw_pixel_metrics', pixels)
  monkeypatch.setenv('FEDJAX_SSL_CACHE_DIR', str(tmp_path / 'cache'))
  binary.recompute_references(str(path), str(out), references=True)
  assert sorted(calls) == [0, 1]
  row = read_csv_rows(out / 'table.csv')[('fedsimclr.iid', 'ft_acc_10pct')]
  assert (row['values'], row['raw_pixels_values']) == ('50.0000 60.0000', '37.5000 38.5000')
  # Done once: a second pass evaluates nothing and the table is unchanged.
  # A command line with a note after it (how the runs were split) survives a re-render.
  noted = 'Command: `python -m experiments.reproduce --table T --out O` (two processes, `--only a`)'
  md = (out / 'table.md').read_text()
  assert 'Command: ' not in md
  (out / 'table.md').write_text(md + '\n' + noted + '\n')
  binary.recompute_references(str(path), str(out), references=True)
  assert sorted(calls) == [0, 1]
  assert read_csv_rows(out / 'table.csv')[('fedsimclr.iid', 'ft_acc_10pct')] == row
  assert noted in (out / 'table.md').read_text()
