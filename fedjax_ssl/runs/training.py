"""The training loop as library code: `train_and_evaluate(config, workdir)` runs, or resumes, one
configured federated run in a run directory and returns its results; `experiments/train.py` is only
its flags and process set-up. Research code calls it (or its pieces) the same way:

  from fedjax_ssl.runs import training
  results = training.train_and_evaluate(config, '/tmp/run', cache_dir=compilation.enable_cache())

Inside the workdir's lock and stop-signal handling, `train_and_evaluate` is five stages, each a
function a researcher can call or replace: `setup` (config against the workdir's, data, algorithm,
strategy, compiled round: a `Run`), `resume` (the newest intact checkpoint, or round 0),
`references` (random-init encoder and raw pixels: `shared_references.References`), `train_rounds`
(the loop: metrics, evaluations, checkpoints, signals, divergence; an `Outcome`) and `report`
(results.json, metrics.png, the closing lines).

The stages do not ask which process they run in: the run's `logging_utils.Console` prints only in
process 0, and its `RunDir` writes only there (`RunDir.writes`); every process computes the same.
The files of WORKDIR are named, read and written by that `RunDir`; what a run survives and how a
resume stays exact are in the binary's docstring (experiments/train.py) and docs/DESIGN.md §12-13.
Reference rows shared across runs (the raw-pixel row, the random-init evaluation) go through
CACHE_DIR/references (`runs.shared_references`).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pathlib
import signal
import sys
import time
import traceback

import jax
import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl import evaluation, experiment, files
from fedjax_ssl.core import compilation, conv_choice, rng, strategies
from fedjax_ssl.core.state import FedState
from fedjax_ssl.runs import (checkpoint, divergence, lock, logging_utils, numerics, plotting,
                             results, resuming, run_guard, run_setup, shared_references, signals)
from fedjax_ssl.runs.run_dir import RunDir
from fedjax_ssl.runs.run_setup import Run, setup
from fedjax_ssl.runs.shared_references import References


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
  where runs that read the same pixels share the raw-pixel reference
  (`shared_references.raw_pixel_reference`).
  `cache_dir`: the folder of `compilation.enable_cache` (the binaries' --cache_dir), where
  `strategy='auto'` keeps its measured choices and, under references/ unless `reference_cache` is
  given, the reference evaluations (random-init encoder, raw pixels) runs of equal inputs share;
  None: 'auto' is the static per-backend default and nothing is shared.

  Returns process 0's results ("status": "completed", or "diverged" when a round became non-finite:
  the run stopped there); the other processes return only the status. Raises
  `run_guard.RunStateError` (a ConfigError) when the workdir refuses the run, and
  `signals.Preempted` (a SystemExit) after a stop signal once the round's checkpoint is saved.
  """
  if reference_cache is None and cache_dir is not None:
    reference_cache = str(pathlib.Path(cache_dir) / shared_references.REFERENCES)
  with logging_utils.RunLog() as log:
    experiment.validate_config(config)
    if strategies.multi_process() and strategies.resolve_strategy(config.strategy) != 'shard':
      raise cv.ConfigError(f'config.strategy = {config.strategy!r} is invalid with '
                           f"{jax.process_count()} processes: must be 'shard' (the participants "
                           "are spread over every process's devices)")
    process = jax.process_index()
    rundir = RunDir(workdir, writes=process == 0)
    rundir.path.mkdir(parents=True, exist_ok=True)
    console = logging_utils.Console.for_process(process, verbose)
    with lock.WorkdirLock(rundir.lock_file(process)) as held:
      warning = _acquire(held, rundir)
      log.open(rundir.log_file(process))
      if warning:
        console.report(warning)
      peers = run_guard.Peers.gather() if strategies.multi_process() else None
      with signals.StopSignals() as stop, rundir.checkpointer(config.checkpoint_every) as ckpt:
        watch = (run_guard.PeerWatch(peers, functools.partial(_peer_stopped, console, ckpt, peers))
                 if peers is not None else None)
        try:
          return _run(config, rundir, ckpt, stop, console, bar_position=bar_position,
                      restart=restart, allow_config_change=allow_config_change,
                      reference_cache=reference_cache, cache_dir=cache_dir, watch=watch)
        except files.DiskFull as e:  # the run's files so far are intact (files.writing's sites)
          saved = ckpt.latest_round()
          raise run_guard.RunStateError(
              f'{e}: free space there, then rerun the same command; it resumes from '
              + (f'the checkpoint of round {saved}' if saved is not None else 'the start')
              + ' with the metric rows before it') from None
        # A collective's failure surfaces as a JaxRuntimeError, or as a ValueError when the peer
        # is lost while jit dispatches it (seen under CPU load: "UNKNOWN: Gloo AllGather failed").
        except (jax.errors.JaxRuntimeError, ValueError) as e:
          if not (strategies.multi_process() and any(m in str(e) for m in _PEER_LOST)):
            raise
          # A peer that died leaves this process's collective failing; the error goes to
          # train.log and the console gets the cause (docs/notes/engine.md#eng-88).
          if watch is not None:
            watch.end_here()
          console.log(f'process {process}: a collective failed:\n{traceback.format_exc()}')
          saved = ckpt.latest_round()
          lost = peers.lost(str(e))
          raise run_guard.PeerLost(
              f'process {process} of {jax.process_count()}: a collective of this run failed '
              f'({str(e).splitlines()[0][:160]}): '
              + (f'{peers.describe(lost)} stopped' if lost else
                 'another process most likely stopped (see its train.process<p>.log or the '
                 'scheduler)')
              + '; rerun the same command on every process to resume from '
              + (f'the checkpoint of round {saved}' if saved is not None else 'the start')
          ) from None
        finally:
          if watch is not None:
            watch.stop()


def _peer_stopped(console: logging_utils.Console, ckpt: checkpoint.Checkpointer,
                  peers: run_guard.Peers, lost: list[int]) -> None:
  """`run_guard.PeerWatch`'s end of this process: a process of the run on this host stopped while
  this one may wait in a collective that never fails. The same line as a failed collective's
  (exit `EXIT_PEER_LOST`), from the watch's thread, so through `os._exit`."""
  saved = ckpt.latest_round()
  line = (f'process {jax.process_index()} of {jax.process_count()}: {peers.describe(lost)} '
          'stopped; rerun the same command on every process to resume from '
          + (f'the checkpoint of round {saved}' if saved is not None else 'the start'))
  console.log(line)
  sys.stdout.flush()
  sys.stderr.write(f'error: {line}\n')
  sys.stderr.flush()
  os._exit(run_guard.EXIT_PEER_LOST)


# How a collective whose peer is gone fails (gloo on CPU, NCCL on GPU, the coordination service):
# any other runtime error of a several-process run is this process's own and propagates as is.
_PEER_LOST = ('Gloo', 'NCCL', 'Connection reset', 'Connection closed', 'UNAVAILABLE',
              'DEADLINE_EXCEEDED')


def _acquire(held: lock.WorkdirLock, rundir: RunDir) -> str | None:
  """Takes the workdir's lock (its warning, if any); every process refuses if one does."""
  try:
    warning, refused = held.acquire(), None
  except run_guard.RunStateError as e:
    warning, refused = None, e
  if run_guard.agree_max(refused is not None):
    raise refused or run_guard.RunStateError(
        f'workdir {rundir.path} is in use by another run (seen by another process of this run)')
  return warning


def _run(config, rundir: RunDir, ckpt: checkpoint.Checkpointer, stop: signals.StopSignals,
         console: logging_utils.Console, *, bar_position: int, restart: bool,
         allow_config_change: bool, reference_cache: str | None, cache_dir,
         watch: run_guard.PeerWatch | None = None) -> dict:
  # Every compile before round 1 (initial state, references): with the round's own, the compile
  # time a run pays before its first round ends (results.json first_round.setup_compile_seconds).
  with compilation.compile_timer() as before:
    run, state = setup(config, rundir, ckpt, console=console,
                       allow_config_change=allow_config_change, cache_dir=cache_dir)
    start, state = resume(run, ckpt, state, restart=restart)
    refs = references(run, state, start, reference_cache=reference_cache)
  run = run_setup.drop_train_rows(run)
  outcome = train_rounds(run, ckpt, stop, state, start, refs, bar_position=bar_position)
  if outcome.final is None and outcome.diverged is None and run.divided_evaluation:
    # Resumed from the final checkpoint: a divided evaluation gathers from every process, so each
    # redoes it here, not process 0 alone in `report`.
    outcome = dataclasses.replace(outcome, final=_evaluate(run, outcome.state, config.rounds))
  if config.per_client_eval and config.placement == 'divided' and outcome.diverged is None:
    # Each process scores the clients it holds and the entries are gathered: every process runs it.
    outcome = dataclasses.replace(outcome, per_client=evaluation.per_client_results(
        config, run.algo, _local(outcome.state), run.dataset, run.fed_data, run.client_splits))
  if watch is not None:  # this process's last collective is done: a peer may now finish and exit
    watch.stop()
  if not rundir.writes:  # another process than 0: process 0 reports
    return {'status': 'diverged' if outcome.diverged is not None else 'completed'}
  if outcome.diverged is not None:
    return outcome.diverged
  return report(run, outcome, refs, setup_compile_seconds=before.total)


def resume(run: Run, ckpt: checkpoint.Checkpointer, state: FedState, *, restart: bool = False
           ) -> tuple[int, FedState]:
  """(first round to train, state): 0 and `state` (the initial one `setup` returned), or the newest
  intact checkpoint's round and state. Runs before the reference evaluations, so that a workdir
  without an intact checkpoint is refused before that compute. Unreadable checkpoints moved aside
  by an earlier attempt count: starting over needs `restart` until the run has saved an intact one
  again."""
  if not (ckpt.all_rounds() or ckpt.moved_aside()):
    return 0, state
  restored = resuming.restore_newest_intact(
      ckpt, run_setup.checkpoint_template(run, state), console=run.console,
      moves=run.rundir.writes, check=lambda r, restored: run_setup.stale_block(run, r, restored))
  if restored is not None:
    start, state, _ = restored
    state = run_setup.from_checkpoint(run, state)
    run.console.say(f'resumed from the checkpoint of round {start} in {run.rundir.checkpoints}')
    return start, state
  if not restart:
    raise run_guard.RunStateError(
        f'no intact checkpoint in {run.rundir.checkpoints} (the unreadable ones are kept under '
        f'{checkpoint.CORRUPT_DIR}/: {", ".join(ckpt.moved_aside())}): rerun with --restart '
        'to start over from round 0')
  run.console.report('warning: no intact checkpoint; --restart: starting over from round 0')
  return 0, state


def references(run: Run, state: FedState, start: int, *, reference_cache: str | None = None
               ) -> References:
  """The run's reference rows: the random-init encoder's evaluation (WORKDIR/random_init.json for
  the config that wrote config.json, else shared through `reference_cache`, else evaluated) and
  the raw-pixel row (None unless `experiment.has_raw_pixel_reference`: the logistic probe or
  fine-tuning, not on the synthetic set). Every process evaluates, so that all of them reach
  the next round's collectives together; under a divided evaluation (`run.divided_evaluation`:
  one gather of the training features or of the clients' scores) with several processes, each
  evaluates the random-init row rather than read a file one of them may not see yet."""
  config, console, rundir = run.config, run.console, run.rundir
  # A divided evaluation gathers from every process: each evaluates, whatever files one of them
  # sees (process 0 writes random_init.json and the shared cache while the others look).
  collective = run.divided_evaluation and strategies.multi_process()
  if rundir.random_init_file.exists() and not run.changes and not collective:
    random_init = rundir.read_json(rundir.random_init_file)
    took = f'(from {rundir.random_init_file.name})'
  else:
    initial = _local(state if start == 0 else run.initial_state())
    random_init, took = shared_references.shared_reference(
        None if collective else reference_cache, 'random_init',
        lambda: experiment.evaluation_key(config, run.algo, initial, run.dataset),
        lambda: experiment.evaluate(config, run.algo, initial, run.dataset,
                                    **run.evaluation_inputs),
        writes=rundir.writes, console=console)
    rundir.write_json(rundir.random_init_file, random_init)
  console.say(f'round {0:>{len(str(config.rounds))}}/{config.rounds}  random-init encoder: '
              f'{results.metrics_text(results.scalars(random_init))}  {took}')
  raw_pixels = None
  if (config.probe == 'logistic' or config.finetune != 'none') and config.dataset == 'synthetic':
    console.say('raw pixels (reference): skipped on the synthetic set, whose classes differ in '
                'their mean image by construction (sources.make_synthetic)')
  elif experiment.has_raw_pixel_reference(config):  # the same probe, kNN, fine-tuning on pixels
    raw_pixels, took = shared_references.raw_pixel_reference(
        config, run.dataset, rundir, reuse=not run.changes, shared_dir=reference_cache,
        console=console)
    console.say(f'raw pixels (reference): {results.metrics_text(results.scalars(raw_pixels))}'
                f'  {took}')
  return References(random_init, raw_pixels)


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What `train_rounds` ends with: the last state, the metrics writer, the final evaluation (None
  when the run resumed from its final checkpoint), this process's first round's compile times and
  its age when that round started (`compilation.process_age`; None when no round ran), when a
  round diverged, that results dict, and under placement 'divided' the per-client results
  (`evaluation.per_client_results`, gathered from every process)."""
  state: FedState
  writer: logging_utils.MetricsWriter
  final: dict | None = None
  compile_times: compilation.CompileTimes | None = None
  process_age: float | None = None
  diverged: dict | None = None
  per_client: tuple | None = None


def train_rounds(run: Run, ckpt: checkpoint.Checkpointer, stop: signals.StopSignals,
                 state: FedState, start: int, refs: References, *, bar_position: int = 0
                 ) -> Outcome:
  """Rounds start+1 .. config.rounds: each round's metrics row (evaluations every eval_every and at
  the last round), a checkpoint per checkpoint_every (always the last), a stop signal honoured
  after the round's checkpoint (signals.Preempted), a divergence reported and recorded."""
  config, console = run.config, run.console
  writer = _open_metrics(run, start, refs)
  param_names, params_finite = divergence.make_finite_check(state.server)
  watch = divergence.DivergenceWatch(config.rounds, param_names, writer.read())
  bar = console.progress(total=config.rounds, initial=start, desc=f'{run.algo.name}',
                         position=bar_position, leave=bar_position == 0)
  signum = stop.agreed()  # a signal during the set-up: there is no new round to save
  if signum:
    bar.close()
    _stopped(signum, f'before round {start + 1}/{config.rounds} (nothing new to save)', console)
  final = times = age = None
  t_start = time.time()
  for r in range(start, config.rounds):
    if times is None:  # the process's first round: its compile, apart from the rest
      state, metrics, times, age = _first_round(run, state, r)
    else:
      state, metrics = run.round_step(state, run.fed_data, rng.round_key(run.run_key, r))
    record, diverged = _round_record(run, state, metrics, r, watch, params_finite)
    if diverged is not None:  # no evaluation and no checkpoint of a non-finite state
      _write_non_finite(writer, r + 1, record)
      bar.close()
      return Outcome(state, writer, compile_times=times, process_age=age,
                     diverged=_diverged(run, diverged, refs, writer))
    evaluation = _evaluate(run, state, r + 1)
    record.update(results.scalars(evaluation or {}))
    final = evaluation if r + 1 == config.rounds else None
    # One record per round, written before that round's checkpoint: a resumed run truncates the
    # log to its checkpoint and so never duplicates or loses a round.
    with files.writing(writer.jsonl_path):
      writer.write(r + 1, record)
    _show_round(console, config, r + 1, record, evaluation is not None, t_start)
    bar.set_metrics(record)
    bar.update(1)
    # After the last round a signal lets the run finish: its evaluation is done, only the results
    # are left to write.
    signum = stop.agreed() if r + 1 < config.rounds else 0
    force = r + 1 == config.rounds or bool(signum)
    if ckpt.due(r + 1, force):  # the saved form of a divided state is a copy: only when due
      with files.writing(run.rundir.checkpoints / str(r + 1)):
        ckpt.maybe_save(r + 1, run_setup.checkpoint_form(run, state, r + 1),
                        metadata={'config': config.to_dict()}, force=force)
    if signum:
      bar.close()
      _stopped(signum, f'after round {r + 1}/{config.rounds}; checkpoint '
               f'{run.rundir.checkpoints / str(r + 1)} saved', console)
  bar.close()
  return Outcome(state, writer, final=final, compile_times=times, process_age=age)


def _open_metrics(run: Run, start: int, refs: References) -> logging_utils.MetricsWriter:
  """The metrics writer, its log cut to the restored round (round 0 = the random-init encoder on a
  fresh start), and the run's config.json and strategy.json written."""
  rundir = run.rundir
  writer = rundir.metrics_writer()
  if start == 0:
    # Round 0 is the random-init encoder, so every accuracy curve starts there.
    writer.truncate_after(-1)
    writer.write(0, results.scalars(refs.random_init))
    rundir.write_config(run.config)
    rundir.write_json(rundir.strategy_file, numerics.strategy_record(run.choice, run.host))
    rundir.clear_config_changes()
  else:
    writer.truncate_after(start)  # rows past the restored round are dropped before any append
    if run.changes:  # --allow_config_change: the run goes on under the new values from here
      rundir.record_config_changes(start, run.changes)
      rundir.write_config(run.config)
      run.console.say(f'config changed at round {start}: '
                      f'{resuming.format_changes(run.changes)}')
  return writer


def _first_round(run: Run, state: FedState, r: int) -> tuple:
  """Round r + 1 as this process's first: (state, metrics, its compile times, this process's age
  when it started)."""
  age = compilation.process_age()
  with compilation.compile_timer() as times:
    state, metrics = run.round_step(state, run.fed_data, rng.round_key(run.run_key, r))
    jax.block_until_ready(state)
  run.console.log(f'round {r + 1} step: {times.text()} of {times.wall:.1f}s; export '
                  f'{experiment.export_status(run.round_step)}')
  return state, metrics, times, age


def _round_record(run: Run, state: FedState, metrics: dict, r: int,
                  watch: divergence.DivergenceWatch, params_finite) -> tuple:
  """(the metrics row of round r + 1, its divergence or None): the round's metrics as floats, the
  clients that failed (left out of the aggregate) and the algorithm's host metrics."""
  config = run.config
  failed = [int(i) for i in np.asarray(metrics.pop('failed_ids')) if i >= 0]
  record = {k: float(v) for k, v in metrics.items()}
  diverged = (divergence.too_many_failed(r + 1, config.rounds, failed, config.clients_per_round,
                                         config.max_failed_fraction)
              or watch.check(r + 1, record, params_finite(state.server)))
  if failed:
    record['failed_ids'] = failed
    run.console.log(f'round {r + 1}: client(s) {failed} sent a non-finite update, left out of '
                    'the aggregate and rolled back to the start of the round')
  if run.algo.host_metrics is not None:  # e.g. the privacy ledger's epsilon spent so far
    record.update(run.algo.host_metrics(state))
  return record, diverged


def _evaluate(run: Run, state: FedState, round_idx: int) -> dict | None:
  """The evaluation after round `round_idx`: the full one after the last round, the kNN monitor
  every eval_every rounds, else None."""
  config = run.config
  if round_idx == config.rounds:
    return experiment.evaluate(config, run.algo, _local(state), run.dataset,
                               **run.evaluation_inputs)
  if config.eval_every and round_idx % config.eval_every == 0:
    return experiment.evaluate(config, run.algo, _local(state), run.dataset, probe=False,
                               **run.evaluation_inputs)
  return None


def _show_round(console: logging_utils.Console, config, round_idx: int, record: dict,
                evaluated: bool, t_start: float) -> None:
  """A round's line: for a person when it was evaluated, else in the log only."""
  if evaluated:
    console.say(f'round {round_idx:>{len(str(config.rounds))}}/{config.rounds}  '
                f'{results.metrics_text(record)}  ({time.time() - t_start:.0f}s elapsed)')
  else:
    console.log(f'round {round_idx}/{config.rounds}  {results.metrics_text(record)}')


def report(run: Run, outcome: Outcome, refs: References, *,
           setup_compile_seconds: float | None = None) -> dict:
  """Process 0, after the last round: the final evaluation (redone when the run resumed from its
  final checkpoint: it is deterministic), results.json, metrics.png and the closing lines.
  `setup_compile_seconds`: the compile time before round 1 (results.json's first_round)."""
  config, algo, rundir = run.config, run.algo, run.rundir
  final = outcome.final
  if final is None:  # resumed from the final checkpoint: evaluation is deterministic, redo it
    final = experiment.evaluate(config, algo, _local(outcome.state), run.dataset,
                                **run.evaluation_inputs)
  if algo.host_metrics is not None:
    final.update(algo.host_metrics(outcome.state))
  per_client = None
  if config.per_client_eval:  # issue 69: the list for results.json, the spread into `final`
    per_client, spread = outcome.per_client or evaluation.per_client_results(
        config, algo, _local(outcome.state), run.dataset, run.fed_data, run.client_splits)
    final.update(spread)
  outcome.writer.close()
  record = results.record('completed', config, algo, refs, rundir, final=final)
  if algo.cohorts:  # the architecture of every client, as this run assigned it
    record['cohorts'] = {c.name: list(c.members) for c in algo.cohorts}
  if run.plan is not None:
    record[run.plan.key] = dict(run.plan.summary, **{k: final[k] for k in run.plan.final_metrics})
  records = rundir.read_metrics()
  final.update(results.best_over_rounds(records, 'knn_acc'))
  record['communication'] = results.communication(algo, config, run.per_participant, records)
  record['strategy'] = numerics.strategy_record(run.choice, run.host)
  if per_client is not None:
    record['per_client'] = per_client
  if config.conv_impl == 'measured':  # each convolution's choice and its candidates' times
    record['conv_choice'] = conv_choice.recorded()
  if outcome.compile_times is not None:
    record['first_round'] = dict(
        outcome.compile_times.to_json(), export=experiment.export_status(run.round_step),
        export_file_seconds=getattr(run.round_step, 'seconds', 0.0),
        process_seconds_at_start=outcome.process_age,
        setup_compile_seconds=setup_compile_seconds)
  rundir.write_results(record)
  accs = [k for k in results.EVAL_KEYS if k in final]
  x_key, curve_records = plotting.time_axis(records)  # FedBuff's rows: against the virtual clock
  plotting.plot_metrics(
      curve_records, str(rundir.plot_file), keys=['loss'] + accs,
      title=f'{algo.name} / {config.ssl_method} on {run.dataset.name} (round 0 = random init)',
      hlines=refs.lines(accs), x_key=x_key)
  for line in results.closing_lines(config, final, refs, record['communication'], rundir):
    run.console.say(line)
  return record


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


def _stopped(signum: int, where: str, console: logging_utils.Console):
  """Reports a stop on `signum` and raises signals.Preempted (exit status 128 + signum)."""
  console.report(f'stopped by {signal.Signals(signum).name} {where}; resume with the same '
                 f'command: {signals.resume_command()}')
  raise signals.Preempted(signum)


def _diverged(run: Run, diverged: divergence.Divergence, refs: References,
              writer: logging_utils.MetricsWriter) -> dict:
  """Reports a divergence in one line and writes results.json with "status": "diverged"."""
  config = run.config
  run.console.report(diverged.message(divergence.divergence_hint(config.lr,
                                                                 config.grad_clip_norm)))
  writer.close()
  record = results.record('diverged', config, run.algo, refs, run.rundir,
                          diverged=diverged.to_json())
  run.rundir.write_results(record)
  return record


def _local(state: FedState) -> FedState:
  """The state as arrays of this process's first device (the state itself with one process):
  evaluation then runs in each process alone, with no collective."""
  if not strategies.multi_process():
    return state
  return jax.device_put(jax.device_get(state), jax.local_devices()[0])
