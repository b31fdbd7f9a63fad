r"""Federated SSL training binary: the flags and the process set-up (malloc, several processes, the
cache folder) around the library's loop, `fedjax_ssl.runs.training.train_and_evaluate`.

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
to those of the random-init encoder (WORKDIR/results.json, "status": "completed") and a plot of loss
and accuracy against rounds (WORKDIR/metrics.png).

What a run survives (fedjax_ssl/runs/run_guard.py; each case ends in one line and an exit status):
  * divergence: a non-finite loss or round metric, or non-finite new server parameters, stop the
    run at that round (round, quantity, last finite value, what to try); results.json records
    "status": "diverged"; exit status 3.
  * SIGTERM / SIGINT (preemption, Ctrl-C): the current round finishes, its checkpoint is saved, the
    command to resume is printed; exit status 128 + signal (143 / 130). Every process stops after
    the same round; during the last round the run completes instead. A second signal stops at once.
  * an unreadable checkpoint (damaged or partial files): reported (round, file, error), moved to
    WORKDIR/checkpoints/corrupt/<round> and the newest intact one is used; with none intact the run
    refuses to start over unless --restart.
  * a resume under another config: refused with the differences listed (keys that cannot change
    results, resuming.NEUTRAL_KEYS, may change); --allow_config_change continues and records the
    change and its round in WORKDIR/config_changes.json and results.json.
  * a second run on the same workdir: refused while the first holds WORKDIR/run.lock (its host and
    pid); the lock of a run that died is taken over with a warning.
  Refusals exit with status 1 before any training.

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

import sys

from absl import app, flags

# First thing, before anything runs on JAX: glibc's malloc keeps freed memory from here on, so that
# repeated XLA:CPU executions reuse their temporaries instead of page-faulting fresh ones every call
# (fedjax_ssl/core/host_memory.py; FEDJAX_SSL_MALLOC=system keeps glibc's defaults). mallopt governs
# later allocations only; importing jax (which fedjax_ssl.core does) creates none of XLA's buffers.
# Only as a program: importing this module changes nothing.
from fedjax_ssl.core import host_memory

if __name__ == '__main__':
  host_memory.keep_freed_memory()

import jax  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import os  # noqa: E402

from fedjax_ssl import config_validation as cv  # noqa: E402
from fedjax_ssl import configuration, experiment, run_identity  # noqa: E402
from fedjax_ssl.runs import run_guard, training  # noqa: E402
from fedjax_ssl.core import autotune, compilation  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'ml_collections config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, logs and results.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None,
                                   'HOST:PORT of process 0, for a run over several processes.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 1, 'Processes of the run (jax.distributed).')
_PROCESS_ID = flags.DEFINE_integer('process_id', 0, 'This process, in [0, num_processes).')
_RESTART = flags.DEFINE_bool(
    'restart', False, 'Start over from round 0 when no checkpoint of the workdir can be read back '
    '(they are kept under checkpoints/corrupt/); without it such a run stops.')
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    'allow_config_change', False, 'Resume even though the config differs from the workdir\'s run; '
    'the change and its round are recorded in config_changes.json and results.json.')
_CACHE_DIR = flags.DEFINE_string(
    'cache_dir', None, 'Folder of the cross-run caches: compiled programs (JAX\'s persistent '
    'compilation cache, CACHE_DIR/xla) and the strategies strategy=\'auto\' measured '
    '(CACHE_DIR/strategy.json) and the shared reference evaluations (CACHE_DIR/references). '
    'Default: $FEDJAX_SSL_CACHE_DIR, else $XDG_CACHE_HOME/fedjax_ssl (~/.cache/fedjax_ssl); '
    '\'\' turns them off.')
flags.mark_flags_as_required(['config', 'workdir'])


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
    cache_dir = compilation.enable_cache(_CACHE_DIR.value)
    autotune.check_environment()
  except ValueError as e:  # a cache folder that cannot be written, a bad FEDJAX_SSL_AUTOTUNE
    raise cv.ConfigError(str(e)) from None
  config = _CONFIG.value
  if configuration.smoke_requested(os.environ):
    config = configuration.smoke(config)
  try:
    results = training.train_and_evaluate(
        config, _WORKDIR.value, restart=_RESTART.value,
        allow_config_change=_ALLOW_CONFIG_CHANGE.value, cache_dir=cache_dir)
  finally:
    if n > 1:
      jax.distributed.shutdown()
  if results['status'] == 'diverged':  # the message is printed; the status tells a script
    sys.exit(run_guard.EXIT_DIVERGED)


if __name__ == '__main__':
  cv.run(main, reference=experiment.default_config, moved=run_identity.MOVED_KEYS)
