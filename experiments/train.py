r"""Federated SSL training binary.

  python -m experiments.train --config configs/quickstart.py --workdir /tmp/quickstart
  python -m experiments.train --config configs/quickstart.py --workdir /tmp/q --config.rounds=5

The config is validated before any data is loaded or any model is built; a config error (also an
unknown `--config.key`) is one `error: ...` line on stderr and exit status 1. The console shows the
partition table, a bar over rounds with the live loss, one line per evaluated round and the final
comparison; library logs (orbax, absl, jax, tfds; INFO and up) go to WORKDIR/train.log, warnings and
errors also to the console. Metrics go to WORKDIR/metrics.jsonl and TensorBoard events under
WORKDIR/tb; orbax checkpoints (atomic) every `checkpoint_every` rounds under WORKDIR/checkpoints.
Re-running with the same workdir resumes from the latest checkpoint and ends in exactly the state an
uninterrupted run reaches: every random draw of round r derives from fold_in(root_key, r), and the
log is truncated to the restored round. At the end: linear probe and kNN of the trained encoder next
to those of the random-init encoder (WORKDIR/results.json) and a plot of loss and accuracy against
rounds (WORKDIR/metrics.png).

Several processes (JAX's multi-controller runtime, `jax.distributed`; on CPU its gloo collectives):
start the same command once per process with --num_processes=N --process_id=i and one
--coordinator_address=HOST:PORT (process 0's host). The config must use strategy 'shard': the
round's participants are spread over every process's devices. Every process builds the same data
and state and evaluates its own copy (so that all reach the next round's collectives together);
process 0 alone prints, logs metrics and writes results and plots (the others log to
WORKDIR/train.process<i>.log). Checkpoints go through orbax's multi-host protocol (every process
takes part, as orbax requires), so a re-run resumes as above.

  python -m experiments.train --config configs/quickstart.py --workdir /tmp/q \
      --config.strategy=shard --coordinator_address=127.0.0.1:8476 --num_processes=2 --process_id=0
  (and the same with --process_id=1, at the same time)
"""
from __future__ import annotations

import json
import os
import pathlib
import time

from absl import app, flags

# First thing, before anything runs on JAX: glibc's malloc keeps freed memory from here on, so that
# repeated XLA:CPU executions reuse their temporaries instead of page-faulting fresh ones every call
# (fedjax_ssl/core/host_memory.py; FEDJAX_SSL_MALLOC=system keeps glibc's defaults). mallopt governs
# later allocations only; importing jax (which fedjax_ssl.core does) creates none of XLA's buffers.
# Only as a program: importing this module (tests, experiments.reproduce) changes nothing.
from fedjax_ssl.core import host_memory

if __name__ == '__main__':
  host_memory.keep_freed_memory()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from fedjax_ssl import checkpoint, configuration, experiment, logging_utils, plotting  # noqa: E402
from fedjax_ssl.data.info import DatasetInfo  # noqa: E402
from fedjax_ssl import config_validation as cv  # noqa: E402
from fedjax_ssl.core import rng, strategies  # noqa: E402
from fedjax_ssl.core import round as rd  # noqa: E402
from fedjax_ssl.data import partition  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'ml_collections config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, logs and results.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None,
                                   'HOST:PORT of process 0, for a run over several processes.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 1, 'Processes of the run (jax.distributed).')
_PROCESS_ID = flags.DEFINE_integer('process_id', 0, 'This process, in [0, num_processes).')
flags.mark_flags_as_required(['config', 'workdir'])

LOG_FILE = 'train.log'


def _write_json(path: pathlib.Path, obj) -> None:
  """Atomic JSON write (temporary file + rename)."""
  tmp = path.with_suffix(path.suffix + '.tmp')
  tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
  os.replace(tmp, path)


def _scalars(results: dict) -> dict:
  """The scalar entries of an evaluation dict (per-client lists go to results.json only)."""
  return {k: v for k, v in results.items() if not isinstance(v, list)}


_EVAL_KEYS = ('test_acc', 'knn_acc', 'probe_acc', 'probe_std_acc')


def _metrics_text(record: dict) -> str:
  keys = [k for k in ('loss',) + _EVAL_KEYS if k in record]
  return '  '.join(f'{k} {record[k]:.4f}' for k in keys)


def _data_summary(config, dataset) -> str:
  scheme = config.partition + (f'(alpha={config.alpha})' if config.partition == 'dirichlet' else
                               f'(k={config.classes_per_client})' if config.partition == 'classes'
                               else '')
  public = f', {config.public_size} public' if config.public_size else ''
  return (f'{dataset.name}: {len(dataset.train_y)} train / {len(dataset.test_y)} test '
          f'images{public}; {config.num_clients} clients, {scheme} partition, '
          f'{config.clients_per_round} per round')


def train_and_evaluate(config, workdir: str, *, verbose: bool = True,
                       bar_position: int = 0) -> dict:
  """Runs (or resumes) the configured experiment; returns the final results dict.

  verbose=False leaves out the lines meant for a person (partition table, per-evaluation metrics,
  closing summary; experiments.reproduce prints its own table): only the bar and warnings reach
  the console. bar_position places the rounds bar under an outer bar (tqdm `position`). Library
  logs go to WORKDIR/train.log (appended on resume), whatever `verbose`.
  """
  with logging_utils.RunLog() as log:
    experiment.validate_config(config)
    if strategies.multi_process() and strategies.resolve_strategy(config.strategy) != 'shard':
      raise cv.ConfigError(f'config.strategy = {config.strategy!r} is invalid with '
                           f"{jax.process_count()} processes: must be 'shard' (the participants "
                           "are spread over every process's devices)")
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    primary = jax.process_index() == 0
    log.open(workdir / (LOG_FILE if primary else f'train.process{jax.process_index()}.log'))
    return _run(config, workdir, verbose=verbose and primary, bar_position=bar_position,
                primary=primary)


def _run(config, workdir: pathlib.Path, *, verbose: bool, bar_position: int, primary: bool
         ) -> dict:
  def say(message):  # a line for a person: train.log always, the console when verbose
    logging_utils.say(message, echo=verbose)
  logging_utils.say(f'workdir {workdir}; config {json.dumps(config.to_dict(), sort_keys=True)}',
                    echo=False)
  known_before_loading = configuration.dataset_info(config) is not None
  dataset = experiment.load_data(config)
  if not known_before_loading:  # validate_config could not check the sizes: check them now
    configuration.check_data_config(config, DatasetInfo.of(dataset))
  fed_data, info = experiment.build_fed_data(config, dataset)
  say(_data_summary(config, dataset) + '\n' +
      partition.format_histogram(info['histogram']))
  algo = experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed_data.n))
  plan = experiment.run_plan(config, dataset, np.asarray(fed_data.n))
  if plan is not None:
    say(plan.text)
  round_cfg = experiment.round_config(config)
  round_step = rd.make_round_step(algo, round_cfg, config.num_clients)
  devices = jax.device_count()
  encoders = (', '.join(f'{c.name} x{len(c.members)}' for c in algo.cohorts) if algo.cohorts
              else config.encoder)
  say(f'{algo.name} / {config.ssl_method}, {encoders} encoder, {config.rounds} '
      f'round{"s" if config.rounds > 1 else ""}; jax on {jax.default_backend()} ({devices} '
      f'device{"s" if devices > 1 else ""}), strategy '
      f'{strategies.resolve_strategy(config.strategy)!r}')

  init_key, run_key = experiment.run_keys(config)
  state = rd.init_state(algo, init_key, config.num_clients, client_state=config.client_state)
  # Several processes: every process built the same data and state; make them global arrays.
  fed_data = strategies.replicate(fed_data)
  state = state.replace(server=strategies.replicate(state.server),
                        round=strategies.replicate(state.round),
                        clients=(state.clients if config.client_state == 'host' else
                                 strategies.replicate(state.clients)))
  per_participant = rd.message_bytes(algo, round_cfg, config.num_clients, state, fed_data)
  say('communication per participant and round: ' + ', '.join(
      f'{c.name}: up {b.up:,} B, down {b.down:,} B'
      for c, b in zip(rd.cohorts(algo, config.num_clients), per_participant)))

  random_init_path = workdir / 'random_init.json'
  # Every process evaluates (on its own copy: no collective), so that all of them reach the next
  # round's collectives together; process 0 alone writes.
  if random_init_path.exists():
    random_init = json.loads(random_init_path.read_text())
    took = f'(from {random_init_path.name})'
  else:
    t0 = time.time()
    random_init = experiment.evaluate(config, algo, _local(state), dataset)
    if primary:
      _write_json(random_init_path, random_init)
    took = f'({time.time() - t0:.1f}s)'
  width = len(str(config.rounds))
  say(f'round {0:>{width}}/{config.rounds}  random-init encoder: '
      f'{_metrics_text(_scalars(random_init))}  {took}')
  raw_pixels = None
  if config.probe == 'logistic':  # the reference row: the same probe and kNN on the pixels
    raw_path = workdir / 'raw_pixels.json'
    if raw_path.exists():
      raw_pixels = json.loads(raw_path.read_text())
    else:
      raw_pixels = experiment.raw_pixel_metrics(config, dataset)
      if primary:
        _write_json(raw_path, raw_pixels)
    say(f'raw pixels (reference): {_metrics_text(_scalars(raw_pixels))}')

  ckpt = checkpoint.Checkpointer(workdir / 'checkpoints', save_every=config.checkpoint_every)
  writer = logging_utils.MetricsWriter(str(workdir)) if primary else None
  start = 0
  if ckpt.latest_round() is not None:
    start, state, _ = ckpt.restore(state)
    say(f'resumed from the checkpoint of round {start} in {workdir / "checkpoints"}')
  if primary and start == 0:
    # Round 0 is the random-init encoder, so every accuracy curve starts there.
    writer.truncate_after(-1)
    writer.write(0, _scalars(random_init))
    _write_json(workdir / 'config.json', config.to_dict())
  elif primary:
    writer.truncate_after(start)

  final = None
  bar = logging_utils.progress(total=config.rounds, initial=start, desc=f'{algo.name}',
                               position=bar_position, leave=bar_position == 0,
                               disable=None if primary else True)
  t_start = time.time()
  for r in range(start, config.rounds):
    state, metrics = round_step(state, fed_data, rng.round_key(run_key, r))
    record = {k: float(v) for k, v in metrics.items()}
    if algo.host_metrics is not None:  # e.g. the privacy ledger's epsilon spent so far
      record.update(algo.host_metrics(state))
    evaluated = True
    if r + 1 == config.rounds:
      final = experiment.evaluate(config, algo, _local(state), dataset)
      record.update(_scalars(final))
    elif config.eval_every and (r + 1) % config.eval_every == 0:
      record.update(_scalars(experiment.evaluate(config, algo, _local(state), dataset,
                                                 probe=False)))
    else:
      evaluated = False
    # One record per round, written before that round's checkpoint: a resumed run truncates the
    # log to its checkpoint and so never duplicates or loses a round.
    if primary:
      writer.write(r + 1, record)
    if evaluated:
      say(f'round {r + 1:>{width}}/{config.rounds}  {_metrics_text(record)}  '
          f'({time.time() - t_start:.0f}s elapsed)')
    else:
      logging_utils.say(f'round {r + 1}/{config.rounds}  {_metrics_text(record)}', echo=False)
    bar.set_metrics(record)
    bar.update(1)
    ckpt.maybe_save(r + 1, state, metadata={'config': config.to_dict()},
                    force=r + 1 == config.rounds)
  bar.close()
  ckpt.close()
  if not primary:
    return {}

  if final is None:  # resumed from the final checkpoint: evaluation is deterministic, redo it
    final = experiment.evaluate(config, algo, _local(state), dataset)
  if algo.host_metrics is not None:
    final.update(algo.host_metrics(state))
  writer.close()
  results = {'final': final, 'random_init': random_init, 'rounds': config.rounds,
             'algorithm': algo.name, 'ssl_method': config.ssl_method}
  if raw_pixels is not None:
    results['raw_pixels'] = raw_pixels
  if algo.cohorts:  # the architecture of every client, as this run assigned it
    results['cohorts'] = {c.name: list(c.members) for c in algo.cohorts}
  if plan is not None:
    results[plan.key] = dict(plan.summary, **{k: final[k] for k in plan.final_metrics})
  records = logging_utils.read_metrics(str(workdir / 'metrics.jsonl'))
  results['communication'] = _communication(algo, config, per_participant, records)
  _write_json(workdir / 'results.json', results)

  accs = [k for k in _EVAL_KEYS if k in final]
  plotting.plot_metrics(
      records, str(workdir / 'metrics.png'), keys=['loss'] + accs,
      title=f'{algo.name} / {config.ssl_method} on {dataset.name} (round 0 = random init)',
      hlines={k: {'random-init encoder': random_init[k]} for k in accs if k in random_init})
  if 'test_acc' in final:
    say(f'test accuracy (classifier): {final["test_acc"]:.4f} | random init '
        f'{random_init.get("test_acc", float("nan")):.4f}')
  comm = results['communication']
  say(f'communication: {comm["bytes_up_total"]:,.0f} B up, {comm["bytes_down_total"]:,.0f} B down '
      f'in {config.rounds} rounds')
  if 'probe_acc' in final:
    say(f'linear probe accuracy: trained encoder {final["probe_acc"]:.4f} | '
        f'random-init encoder {random_init.get("probe_acc", float("nan")):.4f}')
  if 'probe_std_acc' in final:
    say(f'standardised probe:    trained encoder {final["probe_std_acc"]:.4f} | '
        f'random-init encoder {random_init.get("probe_std_acc", float("nan")):.4f}  '
        f'({config.probe_std_epochs} epochs on z-scored features)')
  if 'knn_acc' in final:
    say(f'kNN accuracy:          trained encoder {final["knn_acc"]:.4f} | '
        f'random-init encoder {random_init.get("knn_acc", float("nan")):.4f}')
  if raw_pixels is not None:
    for key in ('probe_acc', 'probe_acc_1pct', 'knn_acc', 'knn_acc_1pct', 'knn_acc_1pct_k20'):
      if key in final:
        say(f'{key + ":":22s} trained encoder {final[key]:.4f} | random-init encoder '
            f'{random_init.get(key, float("nan")):.4f} | raw pixels '
            f'{raw_pixels.get(key, float("nan")):.4f}')
  say(f'results: {workdir / "results.json"}   plot: {workdir / "metrics.png"}   '
      f'log: {workdir / LOG_FILE}')
  return results


def _communication(algo, config, per_participant, records) -> dict:
  """results.json's communication entry: exact per-participant bytes of each cohort, and the
  run's totals summed from the per-round metrics."""
  rounds = [r for r in records if 'bytes_up' in r]
  return {
      'per_participant': {c.name: {'up': b.up, 'down': b.down}
                          for c, b in zip(rd.cohorts(algo, config.num_clients), per_participant)},
      'bytes_up_total': float(sum(r['bytes_up'] for r in rounds)),
      'bytes_down_total': float(sum(r['bytes_down'] for r in rounds)),
      'rounds_counted': len(rounds),
  }


def _local(state):
  """The state as arrays of this process's first device (the state itself with one process):
  evaluation then runs in each process alone, with no collective."""
  if not strategies.multi_process():
    return state
  return jax.device_put(jax.device_get(state), jax.local_devices()[0])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  n, pid = _NUM_PROCESSES.value, _PROCESS_ID.value
  if n < 1 or not 0 <= pid < n:
    raise cv.ConfigError(f'--num_processes={n} --process_id={pid} is invalid: need '
                         'num_processes >= 1 and 0 <= process_id < num_processes')
  if n > 1:
    if not _COORDINATOR.value:
      raise cv.ConfigError(f'--num_processes={n} needs --coordinator_address=HOST:PORT '
                           '(process 0\'s host and a free port)')
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value, num_processes=n,
                               process_id=pid)
  try:
    train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  finally:
    if n > 1:
      jax.distributed.shutdown()


if __name__ == '__main__':
  cv.run(main, reference=experiment.default_config)
