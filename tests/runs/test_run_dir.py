"""run_dir.RunDir: the names of a run directory's files, and their reading and writing."""
import json

import pytest

from fedjax_ssl import experiment, files
from fedjax_ssl.runs.run_dir import RunDir


def test_the_files_of_a_run_directory(tmp_path):
  rundir = RunDir(str(tmp_path))  # a str is taken as a path
  assert rundir.path == tmp_path
  names = {'config_file': 'config.json', 'config_changes_file': 'config_changes.json',
           'strategy_file': 'strategy.json', 'random_init_file': 'random_init.json',
           'raw_pixels_file': 'raw_pixels.json', 'metrics_file': 'metrics.jsonl',
           'checkpoints': 'checkpoints', 'results_file': 'results.json',
           'plot_file': 'metrics.png', 'error_file': 'error.json'}
  for attr, name in names.items():
    assert getattr(rundir, attr) == tmp_path / name, attr
  assert rundir.log_file() == tmp_path / 'train.log'
  assert rundir.log_file(2) == tmp_path / 'train.process2.log'
  assert rundir.lock_file() == tmp_path / 'run.lock'
  assert rundir.lock_file(1) == tmp_path / 'run.process1.lock'


def test_config_round_trip_over_todays_defaults_with_moved_keys(tmp_path):
  rundir = RunDir(tmp_path)
  assert not rundir.has_config()
  with pytest.raises(FileNotFoundError, match='config.json not found'):
    rundir.read_config()
  config = experiment.default_config()
  config.rounds = 7
  rundir.write_config(config)
  as_json = lambda c: json.loads(json.dumps(c.to_dict()))  # tuples are stored as lists
  assert as_json(rundir.read_config()) == as_json(config)
  stored = json.loads(rundir.config_file.read_text())
  del stored['label_fractions']             # a key added since the run: today's default
  stored['byol'].pop('ema_tau')
  stored['ema_tau'] = 0.5                   # a key that moved into its block, as once stored
  rundir.config_file.write_text(json.dumps(stored))
  read = rundir.read_config()
  assert read.label_fractions == experiment.default_config().label_fractions
  assert read.byol.ema_tau == 0.5 and read.rounds == 7


def test_config_changes_are_recorded_with_their_round(tmp_path):
  rundir = RunDir(tmp_path)
  assert rundir.read_config_changes() == []
  rundir.record_config_changes(15, {'rounds': (60, 40)})
  history = rundir.record_config_changes(20, {'lr': (0.1, 0.2)})
  assert history == [{'round': 15, 'changes': {'rounds': [60, 40]}},
                     {'round': 20, 'changes': {'lr': [0.1, 0.2]}}]
  assert rundir.read_config_changes() == history
  rundir.clear_config_changes()
  assert rundir.read_config_changes() == []


def test_results_and_metrics_absent_then_read(tmp_path):
  rundir = RunDir(tmp_path)
  assert rundir.read_results() is None and rundir.read_metrics() == []
  rundir.write_results({'status': 'completed'})
  assert rundir.read_results() == {'status': 'completed'}
  with rundir.metrics_writer() as writer:
    writer.write(0, {'knn_acc': 0.5})
  assert [r['knn_acc'] for r in rundir.read_metrics()] == [0.5]


def test_a_write_without_room_names_the_file(tmp_path, monkeypatch):
  rundir = RunDir(tmp_path)

  def full(path, obj, **kw):
    raise OSError(28, 'No space left on device')
  monkeypatch.setattr(files, 'write_json', full)
  with pytest.raises(files.DiskFull, match='results.json'):
    rundir.write_results({'status': 'completed'})
