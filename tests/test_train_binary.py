"""The training binary end to end on the shipped Fashion-MNIST subset: a run killed with SIGKILL
and resumed from its workdir ends in exactly the state (and log) of an uninterrupted run, and
experiments.reprobe reproduces its probe accuracies; config errors are reported before any compute."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from fedjax_ssl import checkpoint

REPO = pathlib.Path(__file__).resolve().parents[1]
ROUNDS = 6
OVERRIDES = [
    '--config.dataset=fashion_mnist_subset', '--config.train_size=400', '--config.num_clients=4',
    '--config.clients_per_round=3', '--config.partition=iid', '--config.batch_size=20',
    '--config.local_epochs=1', f'--config.rounds={ROUNDS}', '--config.checkpoint_every=2',
    '--config.probe_epochs=2', '--config.eval_every=0', '--config.knn_k=20',
]


def _cmd(workdir):
  return [sys.executable, '-m', 'experiments.train', '--config=configs/quickstart.py',
          f'--workdir={workdir}'] + OVERRIDES


def _env():
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)  # one CPU device, like a user's run
  env['PYTHONPATH'] = str(REPO)
  return env


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
def test_killed_run_resumes_to_the_uninterrupted_state(tmp_path):
  full, killed = tmp_path / 'full', tmp_path / 'killed'
  subprocess.run(_cmd(full), cwd=REPO, env=_env(), check=True, capture_output=True, timeout=900)

  proc = subprocess.Popen(_cmd(killed), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + 600
  while not (killed / 'checkpoints' / '4').exists():
    assert proc.poll() is None, 'run ended before it could be killed'
    assert time.time() < deadline
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (killed / 'results.json').exists()
  out = subprocess.run(_cmd(killed), cwd=REPO, env=_env(), check=True, capture_output=True,
                       text=True, timeout=900)
  assert 'linear probe accuracy' in out.stdout

  a, b = _final_state(full), _final_state(killed)
  leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(leaves_a) == len(leaves_b) > 10
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert _losses(full) == _losses(killed)
  assert [r for r, _ in _losses(full)] == list(range(1, ROUNDS + 1))
  rounds = [json.loads(l)['round'] for l in (killed / 'metrics.jsonl').read_text().splitlines()]
  assert rounds == list(range(0, ROUNDS + 1))   # round 0 = random init; no duplicates
  res = json.loads((killed / 'results.json').read_text())
  assert 0.0 < res['final']['probe_acc'] <= 1.0
  assert (killed / 'metrics.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'

  # experiments.reprobe with the run's own protocol reproduces both of the run's probe accuracies.
  out = subprocess.run([sys.executable, '-m', 'experiments.reprobe', f'--workdir={killed}'],
                       cwd=REPO, env=_env(), check=True, capture_output=True, text=True, timeout=600)
  again = json.loads(out.stdout.strip().splitlines()[-1])
  assert again['round'] == ROUNDS
  np.testing.assert_allclose(again['trained_probe_acc'], res['final']['probe_acc'], atol=1e-6)
  np.testing.assert_allclose(again['random_init_probe_acc'], res['random_init']['probe_acc'],
                             atol=1e-6)


@pytest.mark.parametrize('override, message', [
    ('--config.alpha=-1', 'config.alpha = -1'),
    ('--config.algorithm=fedprox', "config.algorithm = 'fedprox'"),
    ('--config.clients_per_round=11', 'config.clients_per_round = 11'),
    ('--config.strategy=pmap', "config.strategy = 'pmap'"),
])
def test_bad_config_fails_before_compute(tmp_path, override, message):
  out = subprocess.run(_cmd(tmp_path / 'w')[:5] + [override],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode != 0
  assert message in out.stderr, out.stderr[-2000:]
  assert not (tmp_path / 'w' / 'checkpoints').exists()
