"""The training binary end to end on the shipped Fashion-MNIST subset: a run stopped with SIGTERM
(exit 143 after saving the round it was in) and resumed from its workdir ends in exactly the state
(and log) of an uninterrupted run (SIGKILL anywhere: tests/experiments/test_kill_anywhere.py), and
experiments.reprobe reproduces its probe accuracies; the console shows only the lines meant for a
person (library logs go to WORKDIR/train.log); config errors are one `error: ...` line, exit status
1, before any data is loaded."""
import json
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from fedjax_ssl.runs import checkpoint
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
  # Every program cached: this tiny round compiles in about the 0.5 s below which the binaries
  # write nothing, so on a fast idle machine whether it is cached would depend on the load.
  env = dict(_env(), FEDJAX_SSL_CACHE_DIR=str(cache), FEDJAX_SSL_AUTOTUNE='map1,vmap',
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
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
