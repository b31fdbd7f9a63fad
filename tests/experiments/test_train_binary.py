"""The training binary end to end on the shipped Fashion-MNIST subset: a run stopped with SIGTERM
(exit 143 after saving the round it was in) and resumed from its workdir ends in exactly the state
(and log) of an uninterrupted run (SIGKILL anywhere: tests/experiments/test_kill_anywhere.py), and
experiments.reprobe reproduces its probe accuracies; the console shows only the lines meant for a
person (library logs go to WORKDIR/train.log); config errors are one `error: ...` line, exit status
1, before any data is loaded."""
import dataclasses
import json
import logging
import pathlib
import re
import signal
import subprocess
import sys
import time

from absl import logging as absl_logging
import jax
import numpy as np
import pytest

from fedjax_ssl import checkpoint, experiment
from fedjax_ssl.config_validation import ConfigError
from fedjax_ssl.data import sources
from fedjax_ssl.run_dir import RunDir
from tests import subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[2]
ROUNDS = 6
OVERRIDES = [
    '--config.dataset=fashion_mnist_subset', '--config.train_size=400', '--config.num_clients=4',
    '--config.clients_per_round=3', '--config.partition=iid', '--config.batch_size=20',
    '--config.local_epochs=1', f'--config.rounds={ROUNDS}', '--config.checkpoint_every=2',
    '--config.probe=adam', '--config.probe_epochs=2', '--config.probe_std_epochs=0', '--config.eval_every=0',
    '--config.knn_k=20',
    # The MLP encoder and flip-only views: what these tests check (resume, logs, console) does not
    # depend on the model, and LeNet-5 with the crop augmentation doubled their compile time.
    '--config.encoder=mlp', '--config.augmentation=flip',
]


def _cmd(workdir):
  return [sys.executable, '-m', 'experiments.train', '--config=configs/quickstart.py',
          f'--workdir={workdir}'] + OVERRIDES


def _env():
  return subprocess_env.binary_env()


def _final_state(workdir):
  ckpt = checkpoint.Checkpointer(pathlib.Path(workdir) / 'checkpoints', save_every=1,
                                 read_only=True)
  assert ckpt.latest_round() == ROUNDS
  path = pathlib.Path(workdir) / 'checkpoints' / str(ROUNDS) / 'state'
  assert path.exists()
  # Restore without a template: orbax returns the saved tree as numpy arrays.
  import orbax.checkpoint as ocp
  return ocp.StandardCheckpointer().restore(path)


def _losses(workdir):
  rows = [json.loads(l) for l in (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()]
  return [(r['round'], r['loss']) for r in rows if 'loss' in r]


@pytest.mark.slow
def test_stopped_run_resumes_to_the_uninterrupted_state(tmp_path):
  # SIGKILL at any moment (inside a round, an evaluation, a checkpoint write) and its resume are
  # tests/experiments/test_kill_anywhere.py's; this test keeps what only the binary does: the
  # SIGTERM handling, its console line and resume command, metrics.png, and experiments.reprobe.
  full = tmp_path / 'full'
  subprocess.run(_cmd(full), cwd=REPO, env=_env(), check=True, capture_output=True, timeout=900)
  leaves_a = jax.tree_util.tree_leaves(_final_state(full))
  assert len(leaves_a) > 10
  assert [r for r, _ in _losses(full)] == list(range(1, ROUNDS + 1))
  res = json.loads((full / 'results.json').read_text())
  assert 0.0 < res['final']['probe_acc'] <= 1.0
  assert (full / 'metrics.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'

  # experiments.reprobe with the run's own protocol reproduces both of the run's probe accuracies.
  out = subprocess.run([sys.executable, '-m', 'experiments.reprobe', f'--workdir={full}'],
                       cwd=REPO, env=_env(), check=True, capture_output=True, text=True, timeout=600)
  again = json.loads(out.stdout.strip().splitlines()[-1])
  assert again['round'] == ROUNDS
  np.testing.assert_allclose(again['trained_probe_acc'], res['final']['probe_acc'], atol=1e-6)
  np.testing.assert_allclose(again['random_init_probe_acc'], res['random_init']['probe_acc'],
                             atol=1e-6)

  # SIGTERM (a preemption notice) once round 2 is saved: the run finishes the round it is in, saves
  # that round although it is no multiple of checkpoint_every, prints how to resume and exits 143;
  # the same command then ends in the uninterrupted state.
  stopped = tmp_path / 'stopped'
  proc = subprocess.Popen(_cmd(stopped), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 600
  while not (stopped / 'checkpoints' / '2').exists():
    assert proc.poll() is None, 'run ended before it could be stopped'
    assert time.time() < deadline
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  err = proc.communicate(timeout=600)[1]
  assert proc.returncode == 143, err[-3000:]
  assert 'Traceback' not in err
  line = re.search(rf'^stopped by SIGTERM after round (\d)/{ROUNDS}; checkpoint '
                   rf'{re.escape(str(stopped))}/checkpoints/\1 saved; resume with the same command: '
                   r'(.*)$', err, re.M)
  assert line, err[-3000:]
  k = int(line.group(1))
  assert line.group(2).endswith(' '.join(_cmd(stopped)[1:]))
  assert (stopped / 'checkpoints' / str(k) / 'commit_success.txt').exists()
  assert [json.loads(l)['round'] for l in (stopped / 'metrics.jsonl').read_text().splitlines()
          ] == list(range(k + 1))
  out = subprocess.run(_cmd(stopped), cwd=REPO, env=_env(), check=True, capture_output=True,
                       text=True, timeout=900)
  assert 'linear probe accuracy' in out.stdout
  assert len(jax.tree_util.tree_leaves(_final_state(stopped))) == len(leaves_a)
  for x, y in zip(leaves_a, jax.tree_util.tree_leaves(_final_state(stopped))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert _losses(stopped) == _losses(full)
  rounds = [json.loads(l)['round'] for l in (stopped / 'metrics.jsonl').read_text().splitlines()]
  assert rounds == list(range(0, ROUNDS + 1))


@pytest.mark.slow
def test_a_second_run_loads_its_round_from_the_caches(tmp_path):
  """The binary's caches (--cache_dir, here through $FEDJAX_SSL_CACHE_DIR): the first run measures
  strategy='auto' and compiles; a second run of the same config reads the choice and loads its
  round step from the persistent compilation cache; damaged cache entries only cost a compile."""
  cache = tmp_path / 'cache'
  env = dict(_env(), FEDJAX_SSL_CACHE_DIR=str(cache), FEDJAX_SSL_AUTOTUNE='map1,vmap')
  cmd = lambda w: _cmd(tmp_path / w) + ['--config.rounds=2']  # noqa: E731
  results = {}
  for name in ('first', 'second'):
    subprocess.run(cmd(name), cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    results[name] = json.loads((tmp_path / name / 'results.json').read_text())
  first, second = results['first'], results['second']
  assert first['strategy']['source'] == 'measured'
  assert second['strategy']['source'] == 'cache'
  assert second['strategy']['strategy'] == first['strategy']['strategy']
  assert (tmp_path / 'first' / 'strategy.json').exists()
  compiled = first['strategy']['compile_seconds'][second['strategy']['strategy'] + '1'
                                                  if second['strategy']['strategy'] == 'map'
                                                  else 'vmap']
  assert second['first_round']['persistent_cache_hits'] >= 1
  assert second['first_round']['xla_seconds'] < 0.5 * compiled, (second['first_round'], compiled)
  assert second['final'] == first['final']
  for entry in (cache / 'xla').iterdir():
    entry.write_bytes(b'damaged')
  out = subprocess.run(cmd('third'), cwd=REPO, env=env, check=True, capture_output=True,
                       text=True, timeout=600)
  assert 'Traceback' not in out.stderr
  third = json.loads((tmp_path / 'third' / 'results.json').read_text())
  assert third['first_round']['persistent_cache_hits'] == 0 and third['final'] == first['final']


def test_a_bad_strategy_candidate_list_is_one_error_line(tmp_path):
  out = subprocess.run(_cmd(tmp_path / 'w'), cwd=REPO, env=dict(_env(), FEDJAX_SSL_AUTOTUNE='map0'),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and out.stdout == ''
  assert out.stderr.strip().splitlines() == [
      "error: FEDJAX_SSL_AUTOTUNE = 'map0' is invalid: 'map0' is not 'vmap' or 'map<chunk>' with a "
      "chunk >= 1 (e.g. 'map1,vmap,map4'), nor 0 / 1"], out.stderr[-2000:]
  assert not (tmp_path / 'w').exists()


@pytest.mark.parametrize('override, message', [
    ('--config.alpha=-1', 'error: config.alpha = -1.0 is invalid: must be a finite number > 0.0'),
    ('--config.algorithm=fedprox', "error: config.algorithm = 'fedprox' is invalid"),
    ('--config.clients_per_round=11', 'error: config.clients_per_round = 11 is invalid'),
    ('--config.strategy=pmap', "error: config.strategy = 'pmap' is invalid"),
    # ml_collections raises a bare AttributeError inside absl's flag parsing for these two.
    ('--config.bogus_key=3', "error: unknown config key 'config.bogus_key' in "
                             "--config.bogus_key=3; known keys at config: ['algorithm', 'align_uniform', 'alpha',"),
    ('--config.knn_kk=3', "error: unknown config key 'config.knn_kk' in --config.knn_kk=3 (did you "
                          "mean 'config.knn_k'?); known keys at config: ['algorithm',"),
    # Used to pass validation and fail at the random-init evaluation, after loading and compiling.
    ('--config.train_size=64', 'error: config.knn_k = 200 is invalid: must be <= 64, the number of '
                               'training examples in the kNN memory bank (config.train_size = 64)'),
    ('--config.rounds=abc', "error: flag --config.rounds=abc: invalid literal for int() with base "
                            "10: 'abc'"),
    ('--cache_dir=/dev/null/cache', "error: cache_dir = '/dev/null/cache' cannot be written (Not "
                                    "a directory): give a writable folder, or '' to run without "
                                    "the cache"),
])
def test_bad_config_is_one_error_line_before_compute(tmp_path, override, message):
  out = subprocess.run(_cmd(tmp_path / 'w')[:5] + [override],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-2000:]
  assert 'Traceback' not in out.stderr, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(message), out.stderr[-2000:]
  assert out.stdout == ''
  # train_and_evaluate creates the workdir right after validation, before loading any data.
  assert not (tmp_path / 'w').exists()


def _tiny_config(**overrides):
  from configs import quickstart  # pylint: disable=g-import-not-at-top
  config = quickstart.get_config()
  config.update(dict(dataset='fashion_mnist_subset', train_size=200, num_clients=2,
                     clients_per_round=2, partition='iid', batch_size=20, local_epochs=1, rounds=1,
                     checkpoint_every=1, probe='adam', probe_epochs=1, probe_std_epochs=0, eval_every=0,
                     knn_k=10, encoder='mlp', augmentation='flip'))
  config.update(overrides)
  return config


def test_config_error_in_process_loads_no_data(tmp_path, monkeypatch):
  from fedjax_ssl import training as train  # pylint: disable=g-import-not-at-top
  def fail(*args, **kwargs):
    raise AssertionError('data loaded before the config was validated')
  monkeypatch.setattr(experiment, 'load_data', fail)
  monkeypatch.setattr(sources, 'load_dataset', fail)
  with pytest.raises(ConfigError, match=re.escape('config.knn_k = 200 is invalid: must be <= 64')):
    train.train_and_evaluate(_tiny_config(train_size=64, knn_k=200), str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()


_ORBAX_INFO = ('checkpoint_manager.py', 'Saving checkpoint at step')


@pytest.mark.slow
def test_console_shows_progress_lines_and_library_logs_go_to_train_log(tmp_path):
  workdir = tmp_path / 'run'
  cmd = [sys.executable, '-m', 'experiments.train', '--config=configs/quickstart.py',
         f'--workdir={workdir}'] + [f'--config.{k}={v}' for k, v in dict(
             dataset='fashion_mnist_subset', train_size=200, num_clients=2, clients_per_round=2,
             partition='iid', batch_size=20, local_epochs=1, rounds=2, checkpoint_every=1,
             probe='adam', probe_epochs=1, probe_std_epochs=0, eval_every=1, knn_k=10, encoder='mlp',
             augmentation='flip').items()]
  out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600,
                       check=True)
  # stdout: the lines meant for a person, and only those.
  lines = out.stdout.splitlines()
  assert lines[0] == ('fashion_mnist_subset: 200 train / 1000 test images; 2 clients, iid '
                      'partition, 2 per round')
  assert lines[1].split() == ['client', 'n'] + [str(c) for c in range(10)]
  assert re.fullmatch(r' total  200( +\d+){10}', lines[6]), lines[6]
  assert lines[7].startswith('fedavg / simclr, mlp encoder, 2 rounds; jax on cpu')
  per = re.fullmatch(r'communication per participant and round: fedavg: up ([\d,]+) B, down '
                     r'\1 B', lines[8])
  assert per, lines[8]
  assert re.fullmatch(r'round 0/2  random-init encoder: knn_acc 0\.\d{4}  probe_acc 0\.\d{4}  '
                      r'\(\d+\.\ds\)', lines[9]), lines[9]
  assert re.fullmatch(r'round 1/2  loss \d+\.\d{4}  knn_acc 0\.\d{4}  \(\d+s elapsed\)',
                      lines[10]), lines[10]
  assert re.fullmatch(r'round 2/2  loss \d+\.\d{4}  knn_acc 0\.\d{4}  probe_acc 0\.\d{4}  '
                      r'\(\d+s elapsed\)', lines[11]), lines[11]
  # 2 rounds x 2 participants, FedAvg sends the model both ways.
  total = f'{4 * int(per.group(1).replace(",", "")):,}'
  assert lines[12] == f'communication: {total} B up, {total} B down in 2 rounds', lines[12]
  assert lines[13].startswith('linear probe accuracy: trained encoder')
  assert lines[14].startswith('kNN accuracy:          trained encoder')
  assert lines[15].startswith('results: ') and len(lines) == 16
  # stderr: no library INFO (orbax's checkpoint chatter, absl/jax INFO lines); the bar is off
  # because stderr is not a terminal.
  for marker in _ORBAX_INFO:
    assert marker not in out.stderr, out.stderr[-3000:]
  assert not re.search(r'^I\d{4} ', out.stderr, re.M), out.stderr[-3000:]
  log = (workdir / 'train.log').read_text()
  for marker in _ORBAX_INFO + ('linear probe accuracy', "Unable to initialize backend 'tpu'"):
    assert marker in log, marker


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
  from fedjax_ssl import training as train  # pylint: disable=g-import-not-at-top
  root = logging.getLogger()
  handlers = list(root.handlers)
  for run in ('a', 'b'):
    results = train.train_and_evaluate(_tiny_config(seed=len(run)), str(tmp_path / run),
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


def test_evaluate_reports_the_standardised_probe_when_asked():
  """probe_std_epochs > 0 adds 'probe_std_acc': the linear probe on z-scored features."""
  from fedjax_ssl import eval as fs_eval  # pylint: disable=g-import-not-at-top
  from fedjax_ssl.core import round as rd  # pylint: disable=g-import-not-at-top
  config = _tiny_config(probe_std_epochs=3, probe_epochs=2)
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  algo = experiment.build_algorithm(config, dataset)
  state = rd.init_state(algo, jax.random.PRNGKey(0), config.num_clients)
  got = experiment.evaluate(config, algo, state, dataset, knn=False)
  variables, per_client = algo.eval_variables(state)
  feats = [experiment.encoder_features(algo, variables, per_client, x, dataset)
           for x in (dataset.train_x, dataset.test_x)]
  for key, epochs, standardize in (('probe_acc', 2, False), ('probe_std_acc', 3, True)):
    ref = fs_eval.linear_probe(feats[0], dataset.train_y, feats[1], dataset.test_y,
                               dataset.num_classes, epochs=epochs,
                               batch_size=config.probe_batch_size, lr=config.probe_lr,
                               seed=config.seed, standardize=standardize)
    assert got[key] == ref['test_acc'], key
  assert experiment.evaluate(_tiny_config(), algo, state, dataset, knn=False).keys() == {'probe_acc'}


def test_best_over_rounds_skips_the_random_init_row_and_takes_the_first_best():
  from fedjax_ssl import training as train  # pylint: disable=g-import-not-at-top
  records = [{'round': 0, 'knn_acc': 0.9}, {'round': 1, 'loss': 2.0},
             {'round': 5, 'knn_acc': 0.61}, {'round': 10, 'knn_acc': 0.64},
             {'round': 15, 'knn_acc': 0.64}, {'round': 20, 'knn_acc': 0.62}]
  assert train.best_over_rounds(records, 'knn_acc') == {'knn_acc_best': 0.64,
                                                        'knn_acc_best_round': 10}
  assert train.best_over_rounds(records[:2], 'knn_acc') == {}


def test_the_raw_pixel_reference_is_shared_by_runs_that_read_the_same_pixels(tmp_path,
                                                                              monkeypatch):
  from fedjax_ssl import training as train
  config = experiment.default_config()
  config.update(dict(dataset='fashion_mnist_subset', train_size=300, probe='logistic',
                     label_fractions=(1.0, 0.1), label_draws=1, knn_k=20, knn_k_small=5))
  dataset = experiment.load_data(config)
  calls = []

  def evaluate(c, d):
    calls.append(c.seed)
    return {'probe_acc': 0.5 + c.seed, 'knn_acc': 0.25}
  monkeypatch.setattr(experiment, 'raw_pixel_metrics', evaluate)
  shared = tmp_path / 'references'

  def reference(c, name, reuse=True):
    (tmp_path / name).mkdir(exist_ok=True)
    return train.raw_pixel_reference(c, experiment.load_data(c), RunDir(tmp_path / name),
                                     reuse=reuse,
                                     shared_dir=shared)

  first, took = reference(config, 'a')
  assert calls == [0] and took.endswith('s)') and len(list(shared.iterdir())) == 1
  # Another row at the same seed (another method, another encoder): the shared file, no compute.
  other = experiment.default_config()
  other.update(config.to_dict())
  other.update(dict(ssl_method='byol', encoder='mlp', rounds=7))
  got, took = reference(other, 'b')
  assert calls == [0] and got == first and 'references' in took
  assert json.loads((tmp_path / 'b' / 'raw_pixels.json').read_text()) == first
  # What the metrics read differs: the seed (the label draws), a label fraction, the pixels.
  for change in (dict(seed=1), dict(label_fractions=(1.0, 0.2)), dict(train_size=200)):
    c = experiment.default_config()
    c.update(config.to_dict())
    c.update(change)
    reference(c, 'c', reuse=False)
  assert calls == [0, 1, 0, 0] and len(list(shared.iterdir())) == 4
  key = experiment.raw_pixel_key
  assert key(config, dataset) == key(other, experiment.load_data(other))
  flipped = dataclasses.replace(dataset, test_x=np.ascontiguousarray(dataset.test_x[::-1]))
  assert key(config, dataset) != key(config, flipped)
  # Fine-tuning's settings are read (and keyed) only when the row fine-tunes: without it a run
  # keeps the key it always had, whatever finetune_epochs says.
  variant = lambda **kw: dict(config.to_dict(), **kw)
  keys = {}
  for name, values in (('plain', {}), ('epochs', variant(finetune_epochs=3)),
                       ('fedu2', variant(finetune='fedu2')),
                       ('fedu2_3', variant(finetune='fedu2', finetune_epochs=3))):
    c = experiment.default_config()
    c.update(config.to_dict())
    c.update(values)
    keys[name] = key(c, dataset)
  assert keys['plain'] == keys['epochs'] and len({keys['plain'], keys['fedu2'],
                                                  keys['fedu2_3']}) == 3
  # The run's own file wins while its config is unchanged (a resume).
  (tmp_path / 'a' / 'raw_pixels.json').write_text(json.dumps({'probe_acc': 0.9}))
  assert reference(config, 'a')[0] == {'probe_acc': 0.9}
  # No run directory (`reference_evaluations`): the shared file, nothing written besides it.
  got, took = train.raw_pixel_reference(config, dataset, None, reuse=True, shared_dir=shared)
  assert got == first and 'references' in took and calls == [0, 1, 0, 0]
  assert len(list(shared.iterdir())) == 4


def test_a_finished_run_gets_the_raw_pixel_reference_it_lacks_and_nothing_else(tmp_path,
                                                                                monkeypatch):
  """`add_raw_pixel_reference` (reproduce --recompute_references): a fine-tuning run that finished
  before the fine-tuning metrics had a raw-pixel row gets it; its results are otherwise kept."""
  from fedjax_ssl import training as train
  config = experiment.default_config()
  config.update(dict(dataset='fashion_mnist_subset', train_size=300, probe='adam',
                     finetune='hetero_ssfl', finetune_fractions=(0.1,)))
  calls = []

  def evaluate(c, d):
    calls.append(len(d.train_x))
    return {'ft_acc_10pct': 0.375}
  monkeypatch.setattr(experiment, 'raw_pixel_metrics', evaluate)
  rundir = RunDir(tmp_path / 'run')
  rundir.path.mkdir()
  with pytest.raises(ValueError, match='holds no results.json: only a finished run'):
    train.add_raw_pixel_reference(config, rundir)
  results = {'status': 'completed', 'final': {'ft_acc_10pct': 0.5}, 'random_init': {}}
  rundir.write_results(results)
  assert train.add_raw_pixel_reference(config, rundir, str(tmp_path / 'refs')) == {
      'ft_acc_10pct': 0.375}
  assert rundir.read_results() == dict(results, raw_pixels={'ft_acc_10pct': 0.375})
  assert rundir.read_json(rundir.raw_pixels_file) == {'ft_acc_10pct': 0.375} and calls == [300]
  # Complete now: nothing evaluated, nothing written; nor for a run that records no such row.
  assert train.add_raw_pixel_reference(config, rundir) is None and calls == [300]
  config.finetune = 'none'
  assert train.add_raw_pixel_reference(config, rundir) is None and calls == [300]


def test_runs_share_the_random_init_evaluation_and_skip_raw_pixels_on_synthetic(tmp_path, capfd):
  """Through the cache folder's references/: a second run of the same initialisation on the same
  data (another workdir, another number of rounds) reads the first one's random-init evaluation;
  on the synthetic set the raw-pixel row is skipped in one line."""
  from fedjax_ssl import training as train  # pylint: disable=g-import-not-at-top
  config = _tiny_config(dataset='synthetic', train_size=120, probe='logistic',
                        label_fractions=(1.0,), label_draws=1, knn_k=10, knn_k_small=0)
  cache = tmp_path / 'cache'
  first = train.train_and_evaluate(config, str(tmp_path / 'a'), cache_dir=cache)
  out = capfd.readouterr().out
  assert 'raw pixels (reference): skipped on the synthetic set' in out
  assert 'raw_pixels' not in first and not (tmp_path / 'a' / 'raw_pixels.json').exists()
  (shared,) = (cache / 'references').iterdir()
  assert shared.name.startswith('random_init-')
  config.rounds = config.rounds + 1
  second = train.train_and_evaluate(config, str(tmp_path / 'b'), cache_dir=cache)
  capfd.readouterr()
  assert second['random_init'] == first['random_init']
  assert f'(from {shared})' in (tmp_path / 'b' / 'train.log').read_text()


def test_reference_evaluations_are_what_a_run_records_at_round_0(tmp_path):
  from fedjax_ssl import training as train
  config = experiment.default_config()
  config.update(dict(dataset='fashion_mnist_subset', train_size=300, num_clients=3,
                     clients_per_round=3, partition='iid', batch_size=25, local_epochs=1,
                     rounds=1, encoder='mlp', augmentation='flip', heads='custom',
                     proj_hidden=16, proj_out=8, pred_hidden=16, pred_out=8, probe='adam',
                     probe_epochs=2, probe_std_epochs=0, knn_k=20, eval_every=0,
                     checkpoint_every=1))
  train.train_and_evaluate(config, str(tmp_path / 'run'), verbose=False)
  memo = {}
  random_init, raw_pixels = train.reference_evaluations(config, None, memo)
  # The same config, seed and code: the run's round-0 file, to the last bit. (No raw-pixel row:
  # that is the logistic protocol's, `raw_pixel_reference`, tested above with workdir None too.)
  assert random_init == json.loads((tmp_path / 'run' / 'random_init.json').read_text())
  assert raw_pixels is None and len(memo) == 1
  # BYOL's, and FedU's, encoder starts from SimCLR's initialisation at one seed (the heads, not
  # evaluated, differ): the same evaluated variables, one evaluation for the three.
  for change in (dict(ssl_method='byol'), dict(algorithm='fedu', ssl_method='byol')):
    other = experiment.default_config()
    other.update(config.to_dict())
    other.update(change)
    assert train.reference_evaluations(other, None, memo)[0] == random_init
  assert len(memo) == 1
  # Another seed initialises other weights: its own evaluation.
  config.seed = 1
  assert train.reference_evaluations(config, None, memo)[0] != random_init
  assert len(memo) == 2
