"""The training loop as library code: `train_and_evaluate(config, workdir)` runs, or resumes, one
configured federated run in a run directory and returns its results; `experiments/train.py` is only
its flags and process set-up. Research code calls it (or its pieces) the same way:

  from fedjax_ssl import training
  results = training.train_and_evaluate(config, '/tmp/run', cache_dir=compilation.enable_cache())

Inside the workdir's lock and stop-signal handling, `train_and_evaluate` is five stages, each a
function a researcher can call or replace: `setup` (config against the workdir's, data, algorithm,
strategy, compiled round: a `Run`), `resume` (the newest intact checkpoint, or round 0),
`references` (random-init encoder and raw pixels), `train_rounds` (the loop: metrics, evaluations,
checkpoints, signals, divergence; an `Outcome`) and `report` (results.json, metrics.png, the
closing lines).

The files of WORKDIR are named, read and written by one object, `run_dir.RunDir`; what a run
survives and how a resume stays exact are in the binary's docstring (experiments/train.py) and
docs/DESIGN.md §12-13. Reference rows shared across runs
(`raw_pixel_reference`, the random-init evaluation) go through CACHE_DIR/references, and
`reference_evaluations` evaluates them for a config without training (experiments.reproduce).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import signal
import time
from typing import Any

import jax
import numpy as np

from fedjax_ssl import (algorithms, checkpoint, configuration, experiment, files, logging_utils, plotting,
                        run_guard)
from fedjax_ssl.run_dir import RunDir
from fedjax_ssl import config_validation as cv
from fedjax_ssl.core import compilation, rng, strategies
from fedjax_ssl.core import round as rd
from fedjax_ssl.data import partition
from fedjax_ssl.data.info import DatasetInfo

REFERENCES = 'references'  # under the cache folder: reference evaluations shared across runs


def _stored_strategy(rundir: RunDir, ckpt: checkpoint.Checkpointer, chunk: int) -> dict | None:
  """The strategy of the run a resume continues (WORKDIR/strategy.json), None for a fresh start.
  A workdir with checkpoints but no record ran before strategies were measured: the static default
  of this backend, which is what 'auto' was then."""
  if not (ckpt.all_rounds() or ckpt.moved_aside()):
    return None
  path = rundir.strategy_file
  if path.exists():
    try:
      return rundir.read_json(path)
    except ValueError as e:
      run_guard.report(f'warning: {path} cannot be read ({e}): resuming under the static default '
                       'strategy; the result may differ from the run\'s at float rounding')
  return {'strategy': strategies.default_strategy(), 'map_chunk_size': chunk, 'source': 'workdir'}


def numerics_host() -> dict:
  """What besides the config and the strategy sets a run's float rounding: the backend, its device,
  jax's version and, on CPU, the threads XLA may use (the CPUs this process may run on). XLA:CPU
  splits the sums of matrix products and convolutions across its threads, so the same run on 1 and
  on 2 threads rounds differently from the first round on and, training being chaotic, ends a few
  tenths of a point apart (docs/notes/testing.md#test-18)."""
  backend = jax.default_backend()
  return {'backend': backend, 'device_kind': jax.local_devices()[0].device_kind,
          'jax': jax.__version__,
          'cpu_threads': len(os.sched_getaffinity(0)) if backend == 'cpu' else None}


def host_change(stored: dict | None, current: dict) -> str | None:
  """The warning for a resume on another numerics host than the run started on (`numerics_host`;
  None when the same, or when the workdir predates the record)."""
  host = (stored or {}).get('host')
  if host is None or host == current:
    return None
  changed = ', '.join(f'{k} {host.get(k)!r} -> {v!r}' for k, v in current.items()
                      if host.get(k) != v)
  return (f'warning: this run started on another host ({changed}): the rounds from here round '
          'floats differently, so they are not bit-identical to an uninterrupted run on the first '
          'one (the numbers stay valid; docs/notes/testing.md#test-18)')


def _scalars(results: dict) -> dict:
  """The scalar entries of an evaluation dict (per-client lists go to results.json only)."""
  return {k: v for k, v in results.items() if not isinstance(v, list)}


_EVAL_KEYS = ('test_acc', 'knn_acc', 'probe_acc', 'probe_std_acc', 'ft_acc_1pct', 'ft_acc_10pct')


def best_over_rounds(records: list, key: str) -> dict:
  """{'<key>_best': the highest value of `key` over the logged rounds (round 0, the random-init
  encoder, left out), '<key>_best_round': its round (the first on ties)}; {} when no round has it.

  FedU2 reports the best kNN over rounds (its code logs `best_knn_acc`); the kNN monitor of every
  `eval_every`-th round and the final evaluation compute the same kNN (k = knn_k on the whole
  training split), so their maximum is that number at this run's evaluation cadence.
  """
  rounds = [(r[key], r['round']) for r in records if key in r and r['round'] > 0]
  if not rounds:
    return {}
  best = max(v for v, _ in rounds)
  return {f'{key}_best': best, f'{key}_best_round': min(i for v, i in rounds if v == best)}


def _metrics_text(record: dict) -> str:
  keys = [k for k in ('loss',) + _EVAL_KEYS if k in record]
  return '  '.join(f'{k} {record[k]:.4f}' for k in keys)


def _data_summary(config, dataset) -> str:
  scheme = config.partition + (f'(alpha={config.alpha})' if config.partition == 'dirichlet' else
                               f'(k={config.classes_per_client})' if config.partition == 'classes'
                               else '')
  public = f', {config.public_size} public' if config.public_size else ''
  unlabelled = ('' if dataset.unlabeled_x is None else
                f' (the clients train on {len(dataset.unlabeled_x)} unlabelled images)')
  return (f'{dataset.name}: {len(dataset.train_y)} train / {len(dataset.test_y)} test '
          f'images{unlabelled}{public}; {config.num_clients} clients, {scheme} partition, '
          f'{config.clients_per_round} per round')


def train_and_evaluate(config, workdir: str, *, verbose: bool = True, bar_position: int = 0,
                       restart: bool = False, allow_config_change: bool = False,
                       reference_cache: str | None = None,
                       cache_dir: pathlib.Path | str | None = None) -> dict:
  """Runs (or resumes) the configured experiment; returns the results dict.

  verbose=False leaves out the lines meant for a person (partition table, per-evaluation metrics,
  closing summary; experiments.reproduce prints its own table): only the bar, warnings and fault
  lines reach the console. bar_position places the rounds bar under an outer bar (tqdm `position`).
  Library logs go to WORKDIR/train.log (appended on resume), whatever `verbose`. `restart` and
  `allow_config_change` are the binary's flags of those names. `reference_cache`: a directory
  where runs that read the same pixels share the raw-pixel reference (`raw_pixel_reference`).
  `cache_dir`: the folder of `compilation.enable_cache` (the binaries' --cache_dir), where
  `strategy='auto'` keeps its measured choices and, under references/ unless `reference_cache` is
  given, the reference evaluations (random-init encoder, raw pixels) runs of equal inputs share;
  None: 'auto' is the static per-backend default and nothing is shared.

  Returns process 0's results ("status": "completed", or "diverged" when a round became non-finite:
  the run stopped there); the other processes return only the status. Raises
  `run_guard.RunStateError` (a ConfigError) when the workdir refuses the run, and
  `run_guard.Preempted` (a SystemExit) after a stop signal once the round's checkpoint is saved.
  """
  if reference_cache is None and cache_dir is not None:
    reference_cache = str(pathlib.Path(cache_dir) / REFERENCES)
  with logging_utils.RunLog() as log:
    experiment.validate_config(config)
    if strategies.multi_process() and strategies.resolve_strategy(config.strategy) != 'shard':
      raise cv.ConfigError(f'config.strategy = {config.strategy!r} is invalid with '
                           f"{jax.process_count()} processes: must be 'shard' (the participants "
                           "are spread over every process's devices)")
    rundir = RunDir(workdir)
    rundir.path.mkdir(parents=True, exist_ok=True)
    process = jax.process_index()
    primary = process == 0
    with run_guard.WorkdirLock(rundir.lock_file(process)) as lock:
      try:
        warning, refused = lock.acquire(), None
      except run_guard.RunStateError as e:
        warning, refused = None, e
      if run_guard.agree_max(refused is not None):  # every process refuses if one does
        raise refused or run_guard.RunStateError(
            f'workdir {rundir.path} is in use by another run (seen by another process of this run)')
      log.open(rundir.log_file(process))
      if warning:
        run_guard.report(warning, echo=primary)
      with run_guard.StopSignals() as stop, rundir.checkpointer(config.checkpoint_every) as ckpt:
        try:
          return _run(config, rundir, ckpt, stop, verbose=verbose and primary,
                      bar_position=bar_position, primary=primary, restart=restart,
                      allow_config_change=allow_config_change, reference_cache=reference_cache,
                      cache_dir=cache_dir)
        except files.DiskFull as e:  # the run's files so far are intact (files.writing's sites)
          saved = ckpt.latest_round()
          raise run_guard.RunStateError(
              f'{e}: free space there, then rerun the same command; it resumes from '
              + (f'the checkpoint of round {saved}' if saved is not None else 'the start')
              + ' with the metric rows before it') from None


@dataclasses.dataclass
class Run:
  """A run once set up (`setup`): what its later stages share.

  Attributes:
    config: the run's config; rundir: its run directory (`RunDir`, the run's files); primary:
    process 0 (the one that writes).
    dataset, fed_data: the data (fed_data replicated over the processes); algo: the Algorithm;
    plan: the algorithm's run plan or None; round_cfg: the RoundConfig; init_key, run_key: the keys
    of the initial state and of the rounds; choice: the resolved strategy (autotune.Choice);
    round_step: the compiled round; per_participant: message sizes per cohort (rd.message_bytes);
    changes: the config's changes against the workdir's config.json ({} when none or new);
    host: the numerics host the run started on (`numerics_host`), recorded in strategy.json;
    verbose: the console lines for a person are printed.
  """
  config: Any
  rundir: RunDir
  primary: bool
  verbose: bool
  dataset: Any
  fed_data: Any
  algo: Any
  plan: Any
  round_cfg: Any
  init_key: Any
  run_key: Any
  choice: Any
  round_step: Any
  per_participant: Any
  changes: dict
  host: Any
  _init_fn: Any = None  # the compiled `algo.init` (rd.compiled_init) on first use; False: eager

  def say(self, message: str) -> None:
    """A line for a person: train.log always, the console when verbose."""
    logging_utils.say(message, echo=self.verbose)

  def initial_state(self):
    """The run's round-0 state; with several processes, global arrays (every process built the same
    data and state). On the device it is one compiled program (`rd.compiled_init`, cached across
    runs); an `init` that cannot be traced runs eagerly, with a warning."""
    if self._init_fn is None and self.config.client_state == 'device':
      self._init_fn = rd.compiled_init(self.algo, self.config.num_clients)
    try:
      state = rd.init_state(self.algo, self.init_key, self.config.num_clients,
                            client_state=self.config.client_state, init_fn=self._init_fn or None)
    except jax.errors.JAXTypeError as e:  # a Python-side init (concrete values): run it eagerly
      if not self._init_fn:
        raise
      logging.warning('%s.init cannot be one program (%s): initialised eagerly', self.algo.name,
                      str(e).splitlines()[0][:200])
      self._init_fn = False
      state = rd.init_state(self.algo, self.init_key, self.config.num_clients,
                            client_state=self.config.client_state)
    return state.replace(server=strategies.replicate(state.server),
                         round=strategies.replicate(state.round),
                         clients=(state.clients if self.config.client_state == 'host' else
                                  strategies.replicate(state.clients)))


def _run(config, rundir: RunDir, ckpt: checkpoint.Checkpointer,
         stop: run_guard.StopSignals, *, verbose: bool, bar_position: int, primary: bool,
         restart: bool, allow_config_change: bool, reference_cache: str | None,
         cache_dir) -> dict:
  # Every compile before round 1 (initial state, references): with the round's own, the compile
  # time a run pays before its first round ends (results.json first_round.setup_compile_seconds).
  with compilation.compile_timer() as before:
    run, state = setup(config, rundir, ckpt, verbose=verbose, primary=primary,
                       allow_config_change=allow_config_change, cache_dir=cache_dir)
    start, state = resume(run, ckpt, state, restart=restart)
    random_init, raw_pixels = references(run, state, start, reference_cache=reference_cache)
  outcome = train_rounds(run, ckpt, stop, state, start, random_init, raw_pixels,
                         bar_position=bar_position)
  outcome.setup_compile_seconds = before.total
  if outcome.diverged is not None or not primary:
    return outcome.diverged or {'status': 'completed'}
  return report(run, outcome, random_init, raw_pixels)


def setup(config, rundir: RunDir, ckpt: checkpoint.Checkpointer, *, verbose: bool = True,
          primary: bool = True, allow_config_change: bool = False, cache_dir=None) -> tuple:
  """Checks the config against the workdir's, loads and partitions the data, builds the algorithm,
  resolves the strategy (measured once per program under `cache_dir` when 'auto'; a resume keeps
  its own) and compiles the round; logs the run's header lines. Nothing is trained. Returns
  (`Run`, its initial state): the state is built once, as it holds every client's state."""
  logging_utils.say(f'workdir {rundir.path}; config '
                    f'{json.dumps(config.to_dict(), sort_keys=True)}', echo=False)
  # Resuming continues the workdir's run: refuse another config before loading anything.
  stored = run_guard.stored_config(rundir)
  changes = run_guard.config_changes(stored, config) if stored is not None else {}
  if changes and ckpt.all_rounds():  # DP-FedAvg's ledger: no change, even when allowed
    run_guard.refuse_dp_changes(changes, algorithms.registry.dp_enabled(config))
  if changes and ckpt.all_rounds() and not allow_config_change:
    run_guard.refuse_changed_config(rundir, changes)
  elif changes and not ckpt.all_rounds():
    run_guard.report(f'warning: the config differs from the workdir\'s config.json '
                     f'({run_guard.format_changes(changes)}) and there is no checkpoint to '
                     'resume: starting over from round 0', echo=primary)

  known_before_loading = configuration.dataset_info(config) is not None
  dataset = experiment.load_data(config)
  if not known_before_loading:  # validate_config could not check the sizes: check them now
    configuration.check_data_config(config, DatasetInfo.of(dataset))
  fed_data, info = experiment.build_fed_data(config, dataset)
  logging_utils.say(_data_summary(config, dataset) + '\n' +
                    partition.format_histogram(info['histogram']), echo=verbose)
  algo = experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed_data.n))
  plan = experiment.run_plan(config, dataset, np.asarray(fed_data.n))
  if plan is not None:
    logging_utils.say(plan.text, echo=verbose)
  init_key, run_key = experiment.run_keys(config)
  run = Run(config=config, rundir=rundir, primary=primary, verbose=verbose, dataset=dataset,
            fed_data=strategies.replicate(fed_data), algo=algo, plan=plan,
            round_cfg=experiment.round_config(config), init_key=init_key, run_key=run_key,
            choice=None, round_step=None, per_participant=None, changes=changes, host=None)
  # The strategy: 'auto' is measured once per program (cached under cache_dir); a resumed run keeps
  # the one it started with, since strategies agree only to float rounding.
  stored_strategy = _stored_strategy(rundir, ckpt, config.map_chunk_size)
  run.choice, run.round_step = experiment.choose_strategy(
      config, algo, run.fed_data, run.initial_state, run_key, cache_dir=cache_dir,
      stored=stored_strategy)
  run.host = numerics_host()
  moved = host_change(stored_strategy, run.host)
  if moved:
    run_guard.report(moved, echo=primary)
    run.host = stored_strategy['host']   # the record keeps the host the run started on
  devices = jax.device_count()
  encoders = (', '.join(f'{c.name} x{len(c.members)}' for c in algo.cohorts) if algo.cohorts
              else config.encoder)
  run.say(f'{algo.name} / {config.ssl_method}, {encoders} encoder, {config.rounds} '
          f'round{"s" if config.rounds > 1 else ""}; jax on {jax.default_backend()} ({devices} '
          f'device{"s" if devices > 1 else ""}), {run.choice.text()}')
  state = run.initial_state()
  run.per_participant = rd.message_bytes(algo, run.round_cfg, config.num_clients, state,
                                         run.fed_data)
  run.say('communication per participant and round: ' + ', '.join(
      f'{c.name}: up {b.up:,} B, down {b.down:,} B'
      for c, b in zip(rd.cohorts(algo, config.num_clients), run.per_participant)))
  return run, state


def resume(run: Run, ckpt: checkpoint.Checkpointer, state, *, restart: bool = False) -> tuple:
  """(first round to train, state): 0 and `state` (the initial one `setup` returned), or the newest
  intact checkpoint's round and state. Runs before the reference evaluations, so that a workdir
  without an intact checkpoint is refused before that compute. Unreadable checkpoints moved aside
  by an earlier attempt count: starting over needs `restart` until the run has saved an intact one
  again."""
  if not (ckpt.all_rounds() or ckpt.moved_aside()):
    return 0, state
  restored = run_guard.restore_newest_intact(ckpt, state, echo=run.primary, primary=run.primary)
  if restored is not None:
    start, state, _ = restored
    run.say(f'resumed from the checkpoint of round {start} in {run.rundir.checkpoints}')
    return start, state
  if not restart:
    raise run_guard.RunStateError(
        f'no intact checkpoint in {run.rundir.checkpoints} (the unreadable ones are kept under '
        f'{checkpoint.CORRUPT_DIR}/: {", ".join(ckpt.moved_aside())}): rerun with --restart '
        'to start over from round 0')
  run_guard.report('warning: no intact checkpoint; --restart: starting over from round 0',
                   echo=run.primary)
  return 0, state


def references(run: Run, state, start: int, *, reference_cache: str | None = None) -> tuple:
  """(random_init, raw_pixels): the random-init encoder's evaluation (WORKDIR/random_init.json for
  the config that wrote config.json, else shared through `reference_cache`, else evaluated) and
  the raw-pixel reference row (None unless `experiment.has_raw_pixel_reference`: the logistic
  probe or fine-tuning, not on the synthetic set). Every process evaluates (on its own copy: no
  collective), so that all of them reach the next round's collectives together; process 0 alone
  writes."""
  config = run.config
  random_init_path = run.rundir.random_init_file
  if random_init_path.exists() and not run.changes:
    random_init = run.rundir.read_json(random_init_path)
    took = f'(from {random_init_path.name})'
  else:
    initial = _local(state if start == 0 else run.initial_state())
    random_init, took = _shared_reference(
        reference_cache, 'random_init', run.primary,
        lambda: experiment.evaluation_key(config, run.algo, initial, run.dataset),
        lambda: experiment.evaluate(config, run.algo, initial, run.dataset))
    if run.primary:
      run.rundir.write_json(random_init_path, random_init)
  width = len(str(config.rounds))
  run.say(f'round {0:>{width}}/{config.rounds}  random-init encoder: '
          f'{_metrics_text(_scalars(random_init))}  {took}')
  raw_pixels = None
  if (config.probe == 'logistic' or config.finetune != 'none') and config.dataset == 'synthetic':
    run.say('raw pixels (reference): skipped on the synthetic set, whose classes differ in their '
            'mean image by construction (sources.make_synthetic)')
  elif experiment.has_raw_pixel_reference(config):  # the same probe, kNN, fine-tuning on pixels
    raw_pixels, took = raw_pixel_reference(config, run.dataset, run.rundir,
                                           reuse=not run.changes, shared_dir=reference_cache,
                                           primary=run.primary)
    run.say(f'raw pixels (reference): {_metrics_text(_scalars(raw_pixels))}  {took}')
  return random_init, raw_pixels


@dataclasses.dataclass
class Outcome:
  """What `train_rounds` ends with: the last state, the final evaluation (None when the run resumed
  from its final checkpoint), the first round's compile times (None when no round ran), this
  process's age when that round started (`compilation.process_age`) and the seconds compiling
  before it (set by `_run`), the metrics writer (process 0; None elsewhere), and, when a round
  diverged, that results dict."""
  state: Any
  final: dict | None = None
  compile_times: Any = None
  process_age: float | None = None
  setup_compile_seconds: float | None = None
  writer: logging_utils.MetricsWriter | None = None
  diverged: dict | None = None


def _strategy_record(run: Run) -> dict:
  """strategy.json (and results.json's 'strategy'): the resolved strategy and the host it ran on."""
  return {**run.choice.to_json(), 'host': run.host}


def _open_metrics(run: Run, start: int, random_init: dict) -> logging_utils.MetricsWriter | None:
  """Process 0's metrics writer, its log cut to the restored round (round 0 = the random-init
  encoder on a fresh start), and the run's config.json and strategy.json written."""
  if not run.primary:
    return None
  writer = run.rundir.metrics_writer()
  if start == 0:
    # Round 0 is the random-init encoder, so every accuracy curve starts there.
    writer.truncate_after(-1)
    writer.write(0, _scalars(random_init))
    run.rundir.write_config(run.config)
    run.rundir.write_json(run.rundir.strategy_file, _strategy_record(run))
    run.rundir.clear_config_changes()
  else:
    writer.truncate_after(start)  # rows past the restored round are dropped before any append
    if run.changes:  # --allow_config_change: the run goes on under the new values from here
      run.rundir.record_config_changes(start, run.changes)
      run.rundir.write_config(run.config)
      run.say(f'config changed at round {start}: {run_guard.format_changes(run.changes)}')
  return writer


def train_rounds(run: Run, ckpt: checkpoint.Checkpointer, stop: run_guard.StopSignals, state,
                 start: int, random_init: dict, raw_pixels, *, bar_position: int = 0) -> Outcome:
  """Rounds start+1 .. config.rounds: each round's metrics row (evaluations every eval_every and at
  the last round), a checkpoint per checkpoint_every (always the last), a stop signal honoured
  after the round's checkpoint (run_guard.Preempted), a divergence reported and recorded."""
  config, algo, primary = run.config, run.algo, run.primary
  writer = _open_metrics(run, start, random_init)
  history = logging_utils.read_metrics(str(writer.jsonl_path)) if primary else []
  param_names, params_finite = run_guard.make_finite_check(state.server)
  watch = run_guard.DivergenceWatch(config.rounds, param_names, history)
  width = len(str(config.rounds))
  out = Outcome(state=state, writer=writer)
  bar = logging_utils.progress(total=config.rounds, initial=start, desc=f'{algo.name}',
                               position=bar_position, leave=bar_position == 0,
                               disable=None if primary else True)
  signum = stop.agreed()  # a signal during the set-up: there is no new round to save
  if signum:
    bar.close()
    _stopped(signum, f'before round {start + 1}/{config.rounds} (nothing new to save)', primary)
  t_start = time.time()
  for r in range(start, config.rounds):
    key = rng.round_key(run.run_key, r)
    if out.compile_times is None:  # the process's first round: its compile, apart from the rest
      out.process_age = compilation.process_age()
      with compilation.compile_timer() as out.compile_times:
        state, metrics = run.round_step(state, run.fed_data, key)
        jax.block_until_ready(state)
      logging_utils.say(f'round {r + 1} step: {out.compile_times.text()} of '
                        f'{out.compile_times.wall:.1f}s; export '
                        f'{experiment.export_status(run.round_step)}', echo=False)
    else:
      state, metrics = run.round_step(state, run.fed_data, key)
    out.state = state
    failed = [int(i) for i in np.asarray(metrics.pop('failed_ids')) if i >= 0]
    record = {k: float(v) for k, v in metrics.items()}
    diverged = (run_guard.too_many_failed(r + 1, config.rounds, failed, config.clients_per_round,
                                          config.max_failed_fraction)
                or watch.check(r + 1, record, params_finite(state.server)))
    if failed:
      record['failed_ids'] = failed
      logging_utils.say(f'round {r + 1}: client(s) {failed} sent a non-finite update, left out of '
                        'the aggregate and rolled back to the start of the round', echo=False)
    if algo.host_metrics is not None:  # e.g. the privacy ledger's epsilon spent so far
      record.update(algo.host_metrics(state))
    if diverged is not None:  # no evaluation and no checkpoint of a non-finite state
      if primary:
        _write_non_finite(writer, r + 1, record)
      bar.close()
      out.diverged = _diverged(config, algo, diverged, random_init, raw_pixels, run.rundir,
                               writer, primary)
      return out
    evaluated = True
    if r + 1 == config.rounds:
      out.final = experiment.evaluate(config, algo, _local(state), run.dataset)
      record.update(_scalars(out.final))
    elif config.eval_every and (r + 1) % config.eval_every == 0:
      record.update(_scalars(experiment.evaluate(config, algo, _local(state), run.dataset,
                                                 probe=False)))
    else:
      evaluated = False
    # One record per round, written before that round's checkpoint: a resumed run truncates the
    # log to its checkpoint and so never duplicates or loses a round.
    if primary:
      with files.writing(writer.jsonl_path):
        writer.write(r + 1, record)
    if evaluated:
      run.say(f'round {r + 1:>{width}}/{config.rounds}  {_metrics_text(record)}  '
              f'({time.time() - t_start:.0f}s elapsed)')
    else:
      logging_utils.say(f'round {r + 1}/{config.rounds}  {_metrics_text(record)}', echo=False)
    bar.set_metrics(record)
    bar.update(1)
    # After the last round a signal lets the run finish: its evaluation is done, only the results
    # are left to write.
    signum = stop.agreed() if r + 1 < config.rounds else 0
    with files.writing(run.rundir.checkpoints / str(r + 1)):
      ckpt.maybe_save(r + 1, state, metadata={'config': config.to_dict()},
                      force=r + 1 == config.rounds or bool(signum))
    if signum:
      bar.close()
      _stopped(signum, f'after round {r + 1}/{config.rounds}; checkpoint '
               f'{run.rundir.checkpoints / str(r + 1)} saved', primary)
  bar.close()
  return out


def report(run: Run, outcome: Outcome, random_init: dict, raw_pixels) -> dict:
  """Process 0, after the last round: the final evaluation (redone when the run resumed from its
  final checkpoint: it is deterministic), results.json, metrics.png and the closing lines."""
  config, algo, rundir = run.config, run.algo, run.rundir
  final = outcome.final
  if final is None:  # resumed from the final checkpoint: evaluation is deterministic, redo it
    final = experiment.evaluate(config, algo, _local(outcome.state), run.dataset)
  if algo.host_metrics is not None:
    final.update(algo.host_metrics(outcome.state))
  outcome.writer.close()
  results = _results('completed', config, algo, random_init, raw_pixels, rundir, final=final)
  if algo.cohorts:  # the architecture of every client, as this run assigned it
    results['cohorts'] = {c.name: list(c.members) for c in algo.cohorts}
  if run.plan is not None:
    results[run.plan.key] = dict(run.plan.summary, **{k: final[k] for k in run.plan.final_metrics})
  records = rundir.read_metrics()
  final.update(best_over_rounds(records, 'knn_acc'))
  results['communication'] = _communication(algo, config, run.per_participant, records)
  results['strategy'] = _strategy_record(run)
  if outcome.compile_times is not None:
    results['first_round'] = dict(
        outcome.compile_times.to_json(), export=experiment.export_status(run.round_step),
        export_file_seconds=getattr(run.round_step, 'seconds', 0.0),
        process_seconds_at_start=outcome.process_age,
        setup_compile_seconds=outcome.setup_compile_seconds)
  rundir.write_results(results)

  accs = [k for k in _EVAL_KEYS if k in final]
  # FedBuff hook (core/fedbuff.py): curves against the virtual clock when the rows carry it.
  x_key, curve_records = plotting.time_axis(records)
  plotting.plot_metrics(
      curve_records, str(rundir.plot_file), keys=['loss'] + accs,
      title=f'{algo.name} / {config.ssl_method} on {run.dataset.name} (round 0 = random init)',
      hlines=_reference_lines(accs, random_init, raw_pixels), x_key=x_key)
  say = run.say
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
  for key in ('ft_acc_1pct', 'ft_acc_10pct'):
    if key in final:
      say(f'{key + ":":22s} trained encoder {final[key]:.4f} | random-init encoder '
          f'{random_init.get(key, float("nan")):.4f}  (fine-tuned, config.finetune = '
          f'{config.finetune!r})')
  if raw_pixels is not None:
    for key in ('probe_acc', 'probe_acc_1pct', 'knn_acc', 'knn_acc_1pct', 'knn_acc_1pct_k20'):
      if key in final:
        say(f'{key + ":":22s} trained encoder {final[key]:.4f} | random-init encoder '
            f'{random_init.get(key, float("nan")):.4f} | raw pixels '
            f'{raw_pixels.get(key, float("nan")):.4f}')
  say(f'results: {rundir.results_file}   plot: {rundir.plot_file}   log: {rundir.log_file()}')
  return results


def _shared_reference(shared_dir, name: str, primary: bool, key_fn, compute):
  """(metrics, a note for the log line): SHARED_DIR/<name>-<key_fn()>.json when an earlier run
  with the same key wrote it, else compute(), then written there by the primary process (no
  SHARED_DIR: computed). An unreadable file is evaluated again, with a warning."""
  shared = pathlib.Path(shared_dir) / f'{name}-{key_fn()}.json' if shared_dir else None
  if shared is not None and shared.exists():
    try:
      return json.loads(shared.read_text()), f'(from {shared})'
    except ValueError as e:
      run_guard.report(f'warning: {shared} cannot be read ({e}): evaluating again', echo=primary)
  t0 = time.time()
  metrics = compute()
  if primary and shared is not None:
    shared.parent.mkdir(parents=True, exist_ok=True)
    with files.writing(shared):
      files.write_json(shared, metrics)
  return metrics, f'({time.time() - t0:.1f}s)'


def raw_pixel_reference(config, dataset, rundir: RunDir | None, *, reuse: bool,
                        shared_dir=None, primary: bool = True):
  """The raw-pixel reference row and where it came from: WORKDIR/raw_pixels.json when `reuse`
  (the config that wrote config.json is unchanged), else SHARED_DIR/raw_pixels-<key>.json when an
  earlier run with the same `experiment.raw_pixel_key` wrote it, else computed. Computed or shared,
  it is written to the run directory (which stands alone; rundir None: no run directory) and,
  when computed, to shared_dir.

  The evaluation is the slowest of a run's reference evaluations (200-225 s on 20,000 Fashion-MNIST
  images on one core of the 2-core box, 630 s with four jobs sharing it, against 68 s for the
  random-init encoder), and every row of a table at one seed reads the same pixels: the binaries
  share it across runs through CACHE_DIR/references (`compilation.enable_cache`).
  Returns (metrics dict, a note for the log line)."""
  raw_path = rundir.raw_pixels_file if rundir is not None else None
  if reuse and raw_path is not None and raw_path.exists():
    return rundir.read_json(raw_path), f'(from {raw_path.name})'
  metrics, took = _shared_reference(shared_dir, 'raw_pixels', primary,
                                    lambda: experiment.raw_pixel_key(config, dataset),
                                    lambda: experiment.raw_pixel_metrics(config, dataset))
  if primary and raw_path is not None:
    rundir.write_json(raw_path, metrics)
  return metrics, took


def reference_evaluations(config, reference_cache: str | None = None,
                          memo: dict | None = None) -> tuple:
  """(random_init, raw_pixels): the references a run of `config` records at round 0
  (random_init.json and raw_pixels.json; raw_pixels None unless config.probe = 'logistic'),
  evaluated the same way without training and without a workdir. For a table cell carried from an
  older table.csv, which kept each seed's result but not its references
  (`experiments.reproduce --recompute_references`).

  `memo` ({`experiment.evaluation_key`: metrics}) shares one random-init evaluation between the
  configs that evaluate equal variables on equal data; `reference_cache` is the raw-pixel cache
  directory of `raw_pixel_reference`."""
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  fed_data, _ = experiment.build_fed_data(config, dataset)
  algo = experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed_data.n))
  init_key, _ = experiment.run_keys(config)
  state = rd.init_state(algo, init_key, config.num_clients, client_state=config.client_state)
  memo = {} if memo is None else memo
  key = experiment.evaluation_key(config, algo, state, dataset)
  if key not in memo:
    memo[key] = experiment.evaluate(config, algo, state, dataset)
  raw_pixels = None
  if experiment.has_raw_pixel_reference(config):  # as a run: `references`
    raw_pixels, _ = raw_pixel_reference(config, dataset, None, reuse=False,
                                        shared_dir=reference_cache)
  return memo[key], raw_pixels


def add_raw_pixel_reference(config, rundir: RunDir, reference_cache: str | None = None
                            ) -> dict | None:
  """Records the raw-pixel reference in a finished run that lacks it, training nothing: a run of
  `config` (its config.json) finished before its reference metrics existed (fine-tuning's raw-pixel
  row came later than the runs of the fine-tuning tables). The row depends on the data and the
  protocol's settings only, not on the run, so evaluating it now gives what the run would have
  recorded at round 0 (`raw_pixel_reference`, through the cross-run cache). Writes raw_pixels.json
  and adds the metrics it lacked to results.json's 'raw_pixels' (every value it had is kept);
  returns the metrics added, or None when the run had them all or records no raw-pixel reference."""
  results = rundir.read_results()
  if results is None:
    raise ValueError(f'{rundir.path} holds no results.json: only a finished run gets references '
                     'added (run it, or resume it, instead)')
  had = results.get('raw_pixels')
  if not experiment.has_raw_pixel_reference(config) or (
      had is not None and set(experiment.finetune_keys(config)) <= set(had)):
    return None  # nothing to add: checked before loading any data
  dataset = experiment.load_data(config)
  metrics, _ = raw_pixel_reference(config, dataset, None, reuse=False, shared_dir=reference_cache)
  had = had or {}
  added = {k: v for k, v in metrics.items() if k not in had}
  rundir.write_json(rundir.raw_pixels_file, {**metrics, **had})
  rundir.write_results({**results, 'raw_pixels': {**had, **added}})
  return added or None


def _reference_lines(keys, random_init: dict, raw_pixels) -> dict:
  """{metric: {label: value}}: the random-init encoder and (where measured) raw pixels, the dashed
  lines of metrics.png's accuracy panels."""
  lines = {}
  for key in keys:
    refs = {'random-init encoder': random_init.get(key),
            'raw pixels': (raw_pixels or {}).get(key)}
    refs = {label: value for label, value in refs.items() if isinstance(value, (int, float))}
    if refs:
      lines[key] = refs
  return lines


def _results(status: str, config, algo, random_init: dict, raw_pixels, rundir: RunDir,
             **fields) -> dict:
  """What every results.json holds: the status, `fields`, the references (random init, raw
  pixels), the run's identity and the config changes it went through."""
  results = {'status': status, **fields, 'random_init': random_init, 'rounds': config.rounds,
             'algorithm': algo.name, 'ssl_method': config.ssl_method}
  if raw_pixels is not None:
    results['raw_pixels'] = raw_pixels
  config_history = rundir.read_config_changes()
  if config_history:
    results['config_changes'] = config_history
  return results


def _write_non_finite(writer: logging_utils.MetricsWriter, round_idx: int, record: dict) -> None:
  """Logs the round that diverged (metrics.jsonl keeps NaN / Infinity) without tensorboardX's
  console warning about them: the divergence line says more."""
  tb_log = logging.getLogger('tensorboardX.x2num')
  level = tb_log.level
  tb_log.setLevel(logging.ERROR)
  try:
    writer.write(round_idx, record)
  finally:
    tb_log.setLevel(level)


def _stopped(signum: int, where: str, primary: bool):
  """Reports a stop on `signum` and raises run_guard.Preempted (exit status 128 + signum)."""
  run_guard.report(f'stopped by {signal.Signals(signum).name} {where}; resume with the same '
                   f'command: {run_guard.resume_command()}', echo=primary)
  raise run_guard.Preempted(signum)


def _diverged(config, algo, diverged: run_guard.Divergence, random_init: dict, raw_pixels,
              rundir: RunDir, writer, primary: bool) -> dict:
  """Reports a divergence in one line and writes results.json with "status": "diverged"."""
  run_guard.report(diverged.message(run_guard.divergence_hint(config.lr, config.grad_clip_norm)),
                   echo=primary)
  if not primary:
    return {'status': 'diverged'}
  writer.close()
  results = _results('diverged', config, algo, random_init, raw_pixels, rundir,
                     diverged=diverged.to_json())
  rundir.write_results(results)
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
