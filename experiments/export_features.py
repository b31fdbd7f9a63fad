r"""Exports the frozen-encoder features of a training workdir, trained and random-init, as .npy files.

  python -m experiments.export_features --workdir W --out D [--round R]

Writes into D (created if needed):
  trained_train.npy, trained_test.npy   float32 [N, d], [M, d]: the encoder of the run's checkpoint
                                        (the latest round unless --round);
  random_train.npy, random_test.npy     the same for the run's own random-init encoder: the state
                                        `core.init_state` gives from the run's seed before round 0;
  train_labels.npy, test_labels.npy     int32 [N], [M];
  meta.json                             dataset, train_size (N), test_size (M), num_classes,
                                        encoder, feature_dim, algorithm, ssl_method, seed, rounds
                                        (of the config), round (of the checkpoint exported).
Train rows are the run's training images in dataset order (the first config.train_size when set,
as `experiment.load_data` gives them; a public/RAD set carved out for some algorithms stays in);
test rows are the whole test split. Features are the backbone output `experiment.encoder_features`
gives (un-augmented images, eval mode), the input of the probes (fedjax_ssl.eval.protocol).

The workdir is loaded as experiments.reprobe does (config.json over today's defaults, the run's
client sizes, algorithm and init key; the checkpoint read-only, so it is safe next to a running
job). Algorithms with one model per client (personalised: independent, repshare, fd, hetero_ssfl)
are refused with a one-line error: there is no single encoder to export. Errors in the workdir or
config are one `error: ...` line on stderr, exit status 1.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Dict, Optional

from absl import flags
import numpy as np

from fedjax_ssl import core, experiment, run_identity
from fedjax_ssl.runs.run_dir import RunDir
from fedjax_ssl import config_validation as cv

FILES = ('trained_train.npy', 'trained_test.npy', 'random_train.npy', 'random_test.npy',
         'train_labels.npy', 'test_labels.npy', 'meta.json')


def export_features(workdir: pathlib.Path, out: pathlib.Path,
                    round_idx: Optional[int] = None) -> Dict[str, Any]:
  """Writes `FILES` into out; returns the meta dict.

  Raises:
    ConfigError: not a workdir, no checkpoint (or not round_idx), or a personalised algorithm.
  """
  rundir = RunDir(workdir)
  if not rundir.has_config():
    raise cv.ConfigError(f'--workdir = {str(workdir)!r} is invalid: no config.json there (must be '
                         'the workdir of an experiments.train run)')
  config = rundir.read_config()
  dataset = experiment.load_data(config)
  # The run's client sizes: FedSC's privacy plan (and so its algorithm) depends on them.
  sizes = np.asarray(experiment.build_fed_data(config, dataset)[0].n)
  algo = experiment.build_algorithm(config, dataset, client_sizes=sizes)
  # The same init key as experiments.train: the run's own random-init encoder.
  init_key, _ = experiment.run_keys(config)
  random_state = core.init_state(algo, init_key, config.num_clients)
  random_vars, per_client = algo.eval_variables(random_state)
  if per_client:
    raise cv.ConfigError(f'config.algorithm = {config.algorithm!r} keeps one model per client '
                         '(personalised): export_features exports the one shared encoder of a run '
                         'and refuses it')
  if not rundir.checkpoints.is_dir():
    raise cv.ConfigError(f'--workdir = {str(workdir)!r} is invalid: no checkpoint under '
                         f'{rundir.checkpoints}')
  with rundir.checkpointer(read_only=True) as ckpt:
    rounds = ckpt.all_rounds()
    if not rounds:
      raise cv.ConfigError(f'--workdir = {str(workdir)!r} is invalid: no checkpoint under '
                           f'{rundir.checkpoints}')
    if round_idx is not None and round_idx not in rounds:
      raise cv.ConfigError(f'--round = {round_idx} is invalid: the checkpointed rounds are '
                           f'{rounds}')
    round_done, trained_state, _ = ckpt.restore(random_state, round_idx)
  trained_vars, _ = algo.eval_variables(trained_state)

  def features(variables, images):
    return np.asarray(experiment.encoder_features(algo, variables, False, images, dataset),
                      np.float32)

  arrays = {
      'trained_train': features(trained_vars, dataset.train_x),
      'trained_test': features(trained_vars, dataset.test_x),
      'random_train': features(random_vars, dataset.train_x),
      'random_test': features(random_vars, dataset.test_x),
      'train_labels': np.asarray(dataset.train_y, np.int32),
      'test_labels': np.asarray(dataset.test_y, np.int32),
  }
  meta = {
      'dataset': config.dataset, 'train_size': int(len(dataset.train_y)),
      'test_size': int(len(dataset.test_y)), 'num_classes': int(dataset.num_classes),
      'encoder': config.encoder, 'feature_dim': int(arrays['trained_train'].shape[1]),
      'algorithm': config.algorithm, 'ssl_method': config.ssl_method, 'seed': int(config.seed),
      'rounds': int(config.rounds), 'round': int(round_done), 'workdir': str(workdir.resolve()),
  }
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  for name, array in arrays.items():
    np.save(out / f'{name}.npy', array)
  (out / 'meta.json').write_text(json.dumps(meta, indent=2) + '\n')
  return meta


def define_flags() -> None:
  """The binary's flags; defined only when it runs, so that tests and other binaries (whose
  --workdir would clash) can import `export_features`."""
  flags.DEFINE_string('workdir', None, 'Workdir of an experiments.train run.', required=True)
  flags.DEFINE_string('out', None, 'Directory the .npy files and meta.json go to.', required=True)
  flags.DEFINE_integer('round', None, 'Checkpointed round to export (default: latest).')


def main(argv):
  del argv
  f = flags.FLAGS
  meta = export_features(pathlib.Path(f.workdir), pathlib.Path(f.out), f.round)
  print(json.dumps(meta))


if __name__ == '__main__':
  define_flags()
  cv.run(main, reference=experiment.default_config, moved=run_identity.MOVED_KEYS)
