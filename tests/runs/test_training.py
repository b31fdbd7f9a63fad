"""fedjax_ssl.runs.training in process: the config checked before any data, several runs in one
process. The binary around it: tests/experiments/test_train_binary.py."""
import json
import logging
import re

from absl import logging as absl_logging
import pytest

from fedjax_ssl import experiment
from fedjax_ssl.config_validation import ConfigError
from fedjax_ssl.data import sources
from tests.runs import tiny_config

_ORBAX_INFO = ('checkpoint_manager.py', 'Saving checkpoint at step')


def test_config_error_in_process_loads_no_data(tmp_path, monkeypatch):
  from fedjax_ssl.runs import training as train  # pylint: disable=g-import-not-at-top
  def fail(*args, **kwargs):
    raise AssertionError('data loaded before the config was validated')
  monkeypatch.setattr(experiment, 'load_data', fail)
  monkeypatch.setattr(sources, 'load_dataset', fail)
  with pytest.raises(ConfigError, match=re.escape('config.knn_k = 200 is invalid: must be <= 64')):
    train.train_and_evaluate(tiny_config(train_size=64, knn_k=200), str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()


@pytest.fixture
def absl_app_logging():
  """The root logger as absl's app.run leaves it: absl's handler (to stderr) at INFO verbosity."""
  root = logging.getLogger()
  saved_handlers, saved_level = list(root.handlers), root.level
  root.addHandler(absl_logging.get_absl_handler())
  root.setLevel(logging.INFO)
  yield
  root.handlers[:] = saved_handlers
  root.setLevel(saved_level)


@pytest.mark.slow
def test_runs_in_one_process_print_only_their_bar_and_keep_their_own_logs(tmp_path, capfd,
                                                                          absl_app_logging):
  from fedjax_ssl.runs import training as train  # pylint: disable=g-import-not-at-top
  root = logging.getLogger()
  handlers = list(root.handlers)
  for run in ('a', 'b'):
    results = train.train_and_evaluate(tiny_config(seed=len(run)), str(tmp_path / run),
                                       verbose=False, bar_position=1)
    assert 0.0 <= results['final']['probe_acc'] <= 1.0
    assert root.handlers == handlers
  out, err = capfd.readouterr()
  assert out == ''  # verbose=False: no line per run (the bar is off: not a terminal)
  for marker in _ORBAX_INFO:
    assert marker not in err, err[-3000:]
  for run, other in (('a', 'b'), ('b', 'a')):
    log = (tmp_path / run / 'train.log').read_text()
    assert f'workdir {tmp_path / run};' in log and str(tmp_path / other) not in log
    assert all(marker in log for marker in _ORBAX_INFO)


def test_a_measured_run_records_each_convolutions_choice(tmp_path, monkeypatch):
  """conv_impl='measured' (core/conv_choice.py): results.json carries every convolution's choice
  and its candidates' times, as the process recorded them."""
  from fedjax_ssl.core import conv_choice  # pylint: disable=g-import-not-at-top
  from fedjax_ssl.runs import training as train  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(conv_choice, 'cache_dir', lambda: tmp_path / 'cache')
  monkeypatch.setattr(conv_choice, 'REPEATS', 1)
  conv_choice.reset()
  try:
    results = train.train_and_evaluate(
        tiny_config(encoder='small_cnn', conv_impl='measured', strategy='vmap'),
        str(tmp_path / 'w'), verbose=False)
    assert results['conv_choice'] == conv_choice.recorded() and results['conv_choice']
  finally:
    conv_choice.reset()
  for entry in results['conv_choice'].values():
    assert entry['impl'] in entry['seconds'] and entry['source'] == 'measured'


def test_personal_models_in_cohorts_divided_score_as_replicated_and_resume(tmp_path):
  """placement 'divided' with one model per client in two cohorts (Hetero-SSFL with alignment,
  a small CNN and an MLP, device-resident): each process holds its block of each cohort's models
  (`round.state_blocks`), computes round 0's representations of the public set from them
  (`round.absorb_summaries`), scores them, one gather bringing every client's scores
  (evaluation.evaluate(client_blocks=)), and checkpoints each cohort's block (two processes:
  tests/core/test_placement.py). With one process, the same records as 'replicated' with
  host-resident state (the same device programs), and its checkpoint resumes exactly."""
  import shutil  # pylint: disable=g-import-not-at-top
  from fedjax_ssl.runs import training as train  # pylint: disable=g-import-not-at-top
  records = {}
  for placement_, client_state in (('replicated', 'host'), ('divided', 'device')):
    config = tiny_config(algorithm='hetero_ssfl', ssl_method='simclr', num_clients=4,
                         clients_per_round=3, rounds=2, placement=placement_,
                         client_state=client_state, public_size=16)
    config.hetero_ssfl.update(mix='small_cnn:2,mlp:2', mu=0.5, rad_batch=8)
    workdir = tmp_path / placement_
    final = train.train_and_evaluate(config, str(workdir), verbose=False)['final']
    records[placement_] = (_records(workdir), final)
  assert records['divided'] == records['replicated']
  assert 'knn_acc_small_cnn' in records['divided'][1]
  shutil.rmtree(tmp_path / 'divided' / 'checkpoints' / '2')
  final = train.train_and_evaluate(config, str(tmp_path / 'divided'), verbose=False)['final']
  assert (_records(tmp_path / 'divided'), final) == records['replicated']


def _records(workdir):
  return [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]


@pytest.mark.parametrize('overrides,message', [
    (dict(algorithm='hetero_ssfl', ssl_method='simclr', per_client_eval=True, num_clients=4,
          clients_per_round=3),
     "config.per_client_eval = True is invalid for algorithm 'hetero_ssfl' under placement "
     "'divided': a client's model is held by its cohort's block, its rows by its id's block; use "
     "'replicated'"),
])
def test_divided_placement_refuses_what_it_cannot_divide_before_training(tmp_path, overrides,
                                                                          message):
  from fedjax_ssl.runs import training as train  # pylint: disable=g-import-not-at-top
  config = tiny_config(placement='divided', **overrides)
  if overrides['algorithm'] == 'hetero_ssfl':
    config.hetero_ssfl.update(mix='small_cnn:2,mlp:2', mu=0.0)
  with pytest.raises(ConfigError, match=re.escape(message)):
    train.train_and_evaluate(config, str(tmp_path / 'w'), verbose=False)
  assert not (tmp_path / 'w' / 'metrics.jsonl').exists()
