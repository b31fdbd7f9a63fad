"""experiments.export_features on a tiny synthetic run: the files, their shapes and labels, the
trained features against `experiment.encoder_features` on the restored state, the random-init
features against the run's own init, and the refusal of personalised algorithms."""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from fedjax_ssl import core, experiment
from fedjax_ssl.runs import checkpoint
from fedjax_ssl.config_validation import ConfigError
from fedjax_ssl.runs.run_dir import RunDir
from tests import subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[2]


def _tiny_config(**overrides):
  from configs import quickstart  # pylint: disable=g-import-not-at-top
  config = quickstart.get_config()
  config.update(dict(dataset='synthetic', train_size=200, num_clients=2, clients_per_round=2,
                     partition='iid', batch_size=20, local_epochs=1, rounds=2, checkpoint_every=1,
                     probe='adam', probe_epochs=1, probe_std_epochs=0, eval_every=0, knn_k=10, encoder='mlp',
                     augmentation='flip'))
  config.update(overrides)
  return config


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  from fedjax_ssl.runs import training as train  # pylint: disable=g-import-not-at-top
  workdir = tmp_path_factory.mktemp('run')
  train.train_and_evaluate(_tiny_config(), str(workdir), verbose=False)
  return workdir


def _env():
  return subprocess_env.binary_env()


def test_export_writes_the_trained_and_random_init_features(run, tmp_path):
  out = tmp_path / 'features'
  proc = subprocess.run([sys.executable, '-m', 'experiments.export_features', f'--workdir={run}',
                         f'--out={out}'], cwd=REPO, env=_env(), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  from experiments import export_features  # pylint: disable=g-import-not-at-top
  assert sorted(p.name for p in out.iterdir()) == sorted(export_features.FILES)
  meta = json.loads((out / 'meta.json').read_text())
  assert json.loads(proc.stdout.strip().splitlines()[-1]) == meta
  config = RunDir(run).read_config()
  dataset = experiment.load_data(config)
  assert meta == {'dataset': 'synthetic', 'train_size': 200, 'test_size': len(dataset.test_y),
                  'num_classes': dataset.num_classes, 'encoder': 'mlp', 'feature_dim': 128,
                  'algorithm': 'fedavg', 'ssl_method': 'simclr', 'seed': 0, 'rounds': 2,
                  'round': 2, 'workdir': str(run.resolve())}
  f = {name: np.load(out / f'{name}.npy') for name in
       ('trained_train', 'trained_test', 'random_train', 'random_test', 'train_labels',
        'test_labels')}
  for split, n in (('train', 200), ('test', len(dataset.test_y))):
    assert f[f'trained_{split}'].shape == f[f'random_{split}'].shape == (n, 128)
    assert f[f'trained_{split}'].dtype == np.float32
  np.testing.assert_array_equal(f['train_labels'], dataset.train_y[:200])
  np.testing.assert_array_equal(f['test_labels'], dataset.test_y)
  assert f['train_labels'].dtype == np.int32
  assert np.abs(f['trained_train'] - f['random_train']).max() > 1e-3

  # The features of the restored round-2 state and of the run's own init, computed here.
  sizes = np.asarray(experiment.build_fed_data(config, dataset)[0].n)
  algo = experiment.build_algorithm(config, dataset, client_sizes=sizes)
  init = core.init_state(algo, experiment.run_keys(config)[0], config.num_clients)
  with checkpoint.Checkpointer(run / 'checkpoints', save_every=0, read_only=True) as ckpt:
    _, trained, _ = ckpt.restore(init)
  for state, prefix in ((trained, 'trained'), (init, 'random')):
    variables, per_client = algo.eval_variables(state)
    assert not per_client
    for split, images in (('train', dataset.train_x), ('test', dataset.test_x)):
      want = np.asarray(experiment.encoder_features(algo, variables, False, images, dataset))
      np.testing.assert_allclose(f[f'{prefix}_{split}'], want, rtol=1e-5, atol=1e-5)


def test_personalised_algorithms_are_refused_in_one_line(tmp_path):
  from experiments import export_features  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / 'independent'
  workdir.mkdir()
  (workdir / 'config.json').write_text(json.dumps(_tiny_config(algorithm='independent').to_dict()))
  with pytest.raises(ConfigError) as info:
    export_features.export_features(workdir, tmp_path / 'out')
  assert str(info.value) == ("config.algorithm = 'independent' keeps one model per client "
                             "(personalised): export_features exports the one shared encoder of "
                             'a run and refuses it')
  assert not (tmp_path / 'out').exists()
  with pytest.raises(ConfigError, match='no config.json there'):
    export_features.export_features(tmp_path / 'nowhere', tmp_path / 'out')
