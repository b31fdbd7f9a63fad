r"""Federated SSL training: the flags and the process set-up (malloc, several processes, the cache
folder) around the library's loop, `fedjax_ssl.runs.training.train_and_evaluate`.

  python -m experiments.train --config configs/quickstart.py --workdir /tmp/quickstart
  python -m experiments.train --config configs/quickstart.py --workdir /tmp/q --config.rounds=5

What a run writes and prints, what it survives (and its exit statuses), resuming and several
processes: docs/notes/harness.md#train-binary.
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
import socket  # noqa: E402
import time  # noqa: E402

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
_COORDINATOR_TIMEOUT = flags.DEFINE_integer(
    'coordinator_timeout', 300, 'Seconds a process other than 0 waits for --coordinator_address '
    'to accept a connection before it stops with one line.')
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


def _wait_for_coordinator(address: str, timeout: int, pid: int, n: int) -> None:
  """Returns once `address` accepts a TCP connection; ConfigError after `timeout` seconds.

  jax.distributed's own wait ends in an interpreter abort and a stack dump (a failed check in its
  client), so the address is tried here first."""
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit():
    raise cv.ConfigError(f'--coordinator_address = {address!r} is invalid: must be HOST:PORT')
  deadline = time.monotonic() + timeout
  while True:
    try:
      socket.create_connection((host.strip('[]'), int(port)), timeout=2).close()
      return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise cv.ConfigError(
            f'--coordinator_address = {address} did not accept a connection within {timeout} s '
            f'(process {pid} of {n}: {e.strerror or e}): start process 0, which serves it, and '
            'check the host and port (--coordinator_timeout)') from None
      time.sleep(0.5)


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
    if pid > 0:
      _wait_for_coordinator(_COORDINATOR.value, _COORDINATOR_TIMEOUT.value, pid, n)
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
  except run_guard.PeerLost as e:
    # Not `jax.distributed.shutdown()`: its barrier waits for the lost process until the
    # heartbeat timeout and then aborts the interpreter with a stack dump.
    sys.stdout.flush()
    sys.stderr.write(f'error: {e}\n')
    sys.stderr.flush()
    os._exit(run_guard.EXIT_PEER_LOST)
  finally:
    if n > 1:
      jax.distributed.shutdown()
  if results['status'] == 'diverged':  # the message is printed; the status tells a script
    sys.exit(run_guard.EXIT_DIVERGED)


if __name__ == '__main__':
  cv.run(main, reference=experiment.default_config, moved=run_identity.MOVED_KEYS)
