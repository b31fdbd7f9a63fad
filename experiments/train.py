r"""Federated SSL training binary.

  python -m experiments.train --config configs/quickstart.py --workdir /tmp/quickstart
  python -m experiments.train --config configs/quickstart.py --workdir /tmp/q --config.rounds=5

The config is validated before anything is computed. Progress is a bar over rounds with the live
loss; metrics go to WORKDIR/metrics.jsonl and TensorBoard events under WORKDIR/tb; orbax checkpoints
(atomic) every `checkpoint_every` rounds under WORKDIR/checkpoints. Re-running with the same workdir
resumes from the latest checkpoint and ends in exactly the state an uninterrupted run reaches: every
random draw of round r derives from fold_in(root_key, r), and the log is truncated to the restored
round. At the end: linear probe and kNN of the trained encoder next to those of the random-init
encoder (WORKDIR/results.json) and a plot of loss and accuracy against rounds (WORKDIR/metrics.png).
"""
from __future__ import annotations

import json
import os
import pathlib
import time

from absl import app, flags, logging
import jax
from ml_collections import config_flags

from fedjax_ssl import checkpoint, experiment, logging_utils, plotting
from fedjax_ssl.core import rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.data import partition

_CONFIG = config_flags.DEFINE_config_file('config', None, 'ml_collections config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, logs and results.')
flags.mark_flags_as_required(['config', 'workdir'])


def _write_json(path: pathlib.Path, obj) -> None:
  """Atomic JSON write (temporary file + rename)."""
  tmp = path.with_suffix(path.suffix + '.tmp')
  tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
  os.replace(tmp, path)


def _scalars(results: dict) -> dict:
  """The scalar entries of an evaluation dict (per-client lists go to results.json only)."""
  return {k: v for k, v in results.items() if not isinstance(v, list)}


def train_and_evaluate(config, workdir: str) -> dict:
  """Runs (or resumes) the configured experiment; returns the final results dict."""
  experiment.validate_config(config)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)

  dataset = experiment.load_data(config)
  fed_data, info = experiment.build_fed_data(config, dataset)
  logging.info('dataset %s: %d train / %d test, %d clients, sizes %s\n%s', dataset.name,
               len(dataset.train_y), len(dataset.test_y), config.num_clients,
               [int(v) for v in fed_data.n], partition.format_histogram(info['histogram']))
  algo = experiment.build_algorithm(config, dataset)
  round_step = rd.make_round_step(algo, experiment.round_config(config), config.num_clients)

  init_key, run_key = jax.random.split(jax.random.PRNGKey(config.seed))
  state = rd.init_state(algo, init_key, config.num_clients)

  random_init_path = workdir / 'random_init.json'
  if random_init_path.exists():
    random_init = json.loads(random_init_path.read_text())
  else:
    t0 = time.time()
    random_init = experiment.evaluate(config, algo, state, dataset)
    _write_json(random_init_path, random_init)
    logging.info('random-init encoder: %s (%.1fs)', random_init, time.time() - t0)

  ckpt = checkpoint.Checkpointer(workdir / 'checkpoints', save_every=config.checkpoint_every)
  writer = logging_utils.MetricsWriter(str(workdir))
  start = 0
  if ckpt.latest_round() is not None:
    start, state, _ = ckpt.restore(state)
    logging.info('resumed from round %d', start)
  if start == 0:
    # Round 0 is the random-init encoder, so every accuracy curve starts there.
    writer.truncate_after(-1)
    writer.write(0, _scalars(random_init))
    _write_json(workdir / 'config.json', config.to_dict())
  else:
    writer.truncate_after(start)

  final = None
  bar = logging_utils.progress(total=config.rounds, initial=start, desc=f'{algo.name}')
  for r in range(start, config.rounds):
    state, metrics = round_step(state, fed_data, rng.round_key(run_key, r))
    record = {k: float(v) for k, v in metrics.items()}
    if r + 1 == config.rounds:
      final = experiment.evaluate(config, algo, state, dataset)
      record.update(_scalars(final))
    elif config.eval_every and (r + 1) % config.eval_every == 0:
      record.update(experiment.evaluate(config, algo, state, dataset, probe=False))
    # One record per round, written before that round's checkpoint: a resumed run truncates the
    # log to its checkpoint and so never duplicates or loses a round.
    writer.write(r + 1, record)
    bar.set_metrics(record)
    bar.update(1)
    ckpt.maybe_save(r + 1, state, metadata={'config': config.to_dict()},
                    force=r + 1 == config.rounds)
  bar.close()

  if final is None:  # resumed from the final checkpoint: evaluation is deterministic, redo it
    final = experiment.evaluate(config, algo, state, dataset)
  writer.close()
  ckpt.close()
  results = {'final': final, 'random_init': random_init, 'rounds': config.rounds,
             'algorithm': algo.name, 'ssl_method': config.ssl_method}
  _write_json(workdir / 'results.json', results)

  records = logging_utils.read_metrics(str(workdir / 'metrics.jsonl'))
  plotting.plot_metrics(
      records, str(workdir / 'metrics.png'), keys=['loss', 'knn_acc', 'probe_acc'],
      title=f'{algo.name} / {config.ssl_method} on {dataset.name} (round 0 = random init)',
      hlines={'knn_acc': {'random-init encoder': random_init.get('knn_acc')},
              'probe_acc': {'random-init encoder': random_init.get('probe_acc')}})
  print(f'linear probe accuracy: trained encoder {final.get("probe_acc", float("nan")):.4f} | '
        f'random-init encoder {random_init.get("probe_acc", float("nan")):.4f}')
  print(f'kNN accuracy:          trained encoder {final.get("knn_acc", float("nan")):.4f} | '
        f'random-init encoder {random_init.get("knn_acc", float("nan")):.4f}')
  print(f'results: {workdir / "results.json"}   plot: {workdir / "metrics.png"}')
  return results


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == '__main__':
  app.run(main)
