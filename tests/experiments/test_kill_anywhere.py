"""Kill anywhere, lose nothing (issue 50 item 3): a FedSC run with its DP privacy ledger is killed
with SIGKILL inside a round's training, inside an evaluation and inside a checkpoint write, at
rounds drawn at random (seeded), and resumed after each kill; it ends with the final state, the
metrics rows (losses, the ledger's epsilon, the kNN monitor) and results.json of the run that was
never interrupted, bit for bit.

Each leg is its own process (`python -c`, below) that runs `training.train_and_evaluate` with one
trigger installed: the process sends itself SIGKILL (no cleanup runs, as under the OOM killer)
  * 'train':      after round k's step has computed, before its metrics row is written;
  * 'evaluate':   inside the kNN monitor's evaluation after round k;
  * 'checkpoint': inside the save of round k, once orbax has written every item into the
                  temporary step folder and before it renames it (the last moment of a write).
"""
import json
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests import subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[2]
ROUNDS = 6
CONFIG = dict(algorithm='fedsc', ssl_method='sc', dataset='synthetic', train_size=120,
              num_clients=3, clients_per_round=2, partition='iid', batch_size=20, local_epochs=1,
              rounds=ROUNDS, checkpoint_every=2, eval_every=2, probe='adam', probe_epochs=1,
              probe_std_epochs=0, knn_k=10, encoder='mlp', augmentation='flip')
FEDSC = {'dp': True, 'sigma': 0.5, 'calr_views': 2}

_CHILD = textwrap.dedent('''
    import json, os, signal, sys
    from configs import quickstart
    from fedjax_ssl import experiment
    from fedjax_ssl.runs import training
    from fedjax_ssl.core import compilation
    from fedjax_ssl.core import round as rd

    workdir, trigger, at, cache = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    config = quickstart.get_config()
    spec = json.loads(sys.argv[5])
    config.update(spec['config'])
    config.fedsc.update(spec['fedsc'])

    def die():
      os.kill(os.getpid(), signal.SIGKILL)

    if trigger == 'train':
      make = rd.make_round_step
      def make_killing(*args, **kwargs):
        step = make(*args, **kwargs)
        def killing(state, data, key):
          out = step(state, data, key)
          if int(out[0].round) == at:
            die()
          return out
        return killing
      rd.make_round_step = make_killing
    elif trigger == 'evaluate':
      evaluate = experiment.evaluate
      def killing(config, algo, state, *args, **kwargs):
        if int(state.round) == at and kwargs.get('probe', True) is False:
          die()
        return evaluate(config, algo, state, *args, **kwargs)
      experiment.evaluate = killing
    elif trigger == 'checkpoint':
      from orbax.checkpoint._src.path import atomicity
      finalize = atomicity.AtomicRenameTemporaryPath.finalize
      async def killing(self):
        if self.get_final().name == str(at):
          die()
        await finalize(self)
      atomicity.AtomicRenameTemporaryPath.finalize = killing
    # The binary's caches, as experiments.train sets them: later legs load the compiled programs
    # (the same executables, so the bit-for-bit comparison stands) instead of compiling again.
    cache = compilation.enable_cache(cache)
    results = training.train_and_evaluate(config, workdir, verbose=False, cache_dir=cache)
    print(json.dumps({'status': results['status']}))
''')


def _leg(workdir, cache, trigger='none', at=0):
  spec = json.dumps({'config': CONFIG, 'fedsc': FEDSC})
  # No exported round (core/export_cache.py): a leg that loaded the first leg's export would run
  # the stored program, not the killing step the 'train' trigger patches in.
  env = dict(subprocess_env.binary_env(), FEDJAX_SSL_EXPORT='0')
  return subprocess.run([sys.executable, '-c', _CHILD, str(workdir), trigger, str(at), str(cache),
                         spec], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _rows(workdir):
  return (workdir / 'metrics.jsonl').read_text().splitlines()


def _state(workdir):
  with ocp.StandardCheckpointer() as c:
    return c.restore(workdir / 'checkpoints' / str(ROUNDS) / 'state')


@pytest.mark.slow
def test_sigkill_in_training_evaluation_and_a_checkpoint_write_loses_nothing(tmp_path):
  cache = tmp_path / 'cache'
  full = tmp_path / 'full'
  out = _leg(full, cache)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [json.loads(l) for l in _rows(full)]
  assert 'epsilon' in rows[-1] and rows[-1]['epsilon'] > rows[1]['epsilon'] > 0  # the ledger spends

  # Moments drawn at random (seeded, so a failure reproduces): a round of each kind, in a chain
  # that resumes after every kill. Evaluations run after even rounds (eval_every = 2, the last
  # round's is the final one); checkpoints are written at even rounds too.
  rng = np.random.default_rng(50)
  kills = [('train', int(rng.integers(1, 3))), ('evaluate', int(rng.choice([2, 4]))),
           ('checkpoint', int(rng.choice([4, ROUNDS])))]
  killed = tmp_path / 'killed'
  for trigger, at in kills:
    out = _leg(killed, cache, trigger, at)
    assert out.returncode == -9, (trigger, at, out.returncode, out.stderr[-3000:])
    assert not (killed / 'results.json').exists()
  out = _leg(killed, cache)
  assert out.returncode == 0, out.stderr[-3000:]

  a, b = jax.tree_util.tree_leaves(_state(full)), jax.tree_util.tree_leaves(_state(killed))
  assert len(a) == len(b) > 5
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert _rows(killed) == _rows(full)  # every row once, the same bytes: losses, epsilon, kNN
  want = json.loads((full / 'results.json').read_text())
  got = json.loads((killed / 'results.json').read_text())
  assert got['final'] == want['final'] and got['privacy'] == want['privacy']
