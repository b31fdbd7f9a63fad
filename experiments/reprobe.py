r"""Re-evaluates a training workdir's encoders with another linear-probe protocol.

  python -m experiments.reprobe --workdir DIR --probe_epochs 100 --standardize

Rebuilds the random-init state from the run's own config and seed, restores the trained state from
the run's checkpoints (read-only: safe next to a running job; the latest round unless --round), and
prints the linear-probe accuracy of both encoders as JSON (also written to
DIR/reprobe_<epochs>ep[_std].json). Without flags it re-runs the run's own probe protocol and
reproduces its final probe accuracy (tests/experiments/test_train_binary.py). Use it to check that a margin over
random features survives a stronger probe (docs/notes/fedssl.md#quickstart). Library logs go to
DIR/reprobe.log (warnings also to the console); a config error is one `error: ...` line on stderr.
"""
from __future__ import annotations

import json
import pathlib

from absl import flags

from fedjax_ssl import configuration, experiment, run_identity
from fedjax_ssl.runs import logging_utils
from fedjax_ssl.data.info import DatasetInfo
from fedjax_ssl import config_validation as cv
from fedjax_ssl.core import round as rd
from fedjax_ssl.runs.run_dir import RunDir


def reprobe(workdir: pathlib.Path, probe_epochs: int | None, standardize: bool,
            round_idx: int | None) -> dict:
  """{'round', 'probe_epochs', 'standardize', 'random_init_probe_acc', 'trained_probe_acc'}."""
  rundir = RunDir(workdir)
  config = rundir.read_config()
  if probe_epochs is not None:
    config.probe_epochs = probe_epochs
  config.probe_standardize = standardize
  experiment.validate_config(config)
  known_before_loading = configuration.dataset_info(config) is not None
  dataset = experiment.load_data(config)
  if not known_before_loading:
    configuration.check_data_config(config, DatasetInfo.of(dataset))
  # The run's client sizes: FedSC's privacy plan (and so its algorithm) depends on them.
  sizes = experiment.build_fed_data(config, dataset)[0].n
  algo = experiment.build_algorithm(config, dataset, client_sizes=sizes)
  # The same init key as experiments.train, so this is the run's own random-init encoder.
  init_key, _ = experiment.run_keys(config)
  random_state = rd.init_state(algo, init_key, config.num_clients)
  with rundir.checkpointer(read_only=True) as ckpt:
    if ckpt.latest_round() is None:
      raise FileNotFoundError(f'no checkpoint under {rundir.checkpoints}')
    round_done, trained_state, _ = ckpt.restore(random_state, round_idx)
  evaluate = lambda state: experiment.evaluate(config, algo, state, dataset, knn=False)['probe_acc']
  return {'round': round_done, 'probe_epochs': config.probe_epochs, 'standardize': standardize,
          'random_init_probe_acc': evaluate(random_state),
          'trained_probe_acc': evaluate(trained_state)}


def define_flags() -> None:
  """The binary's flags; defined only when it runs, so that any two binaries (whose flag names
  overlap) can be imported in one process, as the tests do."""
  flags.DEFINE_string('workdir', None, 'Workdir of an experiments.train run.', required=True)
  flags.DEFINE_integer('probe_epochs', None, "Probe epochs (default: the run's own).")
  flags.DEFINE_bool('standardize', False, 'z-score the features before the probe.')
  flags.DEFINE_integer('round', None, 'Checkpointed round to evaluate (default: latest).')


def main(argv):
  del argv
  workdir = pathlib.Path(flags.FLAGS.workdir)
  with logging_utils.RunLog() as log:
    if workdir.is_dir():
      log.open(workdir / 'reprobe.log')
    out = reprobe(workdir, flags.FLAGS.probe_epochs, flags.FLAGS.standardize, flags.FLAGS.round)
  suffix = '_std' if out['standardize'] else ''
  (workdir / f'reprobe_{out["probe_epochs"]}ep{suffix}.json').write_text(json.dumps(out, indent=2))
  print(json.dumps(out))


if __name__ == '__main__':
  define_flags()
  cv.run(main, reference=experiment.default_config, moved=run_identity.MOVED_KEYS)
