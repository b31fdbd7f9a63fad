"""fedjax_ssl.runs.run_guard, piece by piece: the workdir lock, the config comparison of a resume, the
divergence check, the stop signals and the fallback over unreadable checkpoints. End to end through
experiments.train: tests/experiments/test_train_faults.py."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import experiment
from fedjax_ssl.runs import (checkpoint, divergence, lock, logging_utils, resuming, run_guard,
                             signals)
from fedjax_ssl.runs.run_dir import RunDir

QUIET = logging_utils.Console(prints=False)  # the fault lines to the log only


def _dead_pid():
  proc = subprocess.Popen([sys.executable, '-c', 'pass'])
  proc.wait()
  return proc.pid


def test_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path):
  path = tmp_path / 'run.lock'
  with lock.WorkdirLock(path) as first:
    assert first.acquire() is None
    holder = json.loads(path.read_text())
    assert holder['pid'] == os.getpid() and holder['host'] == socket.gethostname()
    # flock is per open file: a second lock in the same process is refused like another process.
    with pytest.raises(run_guard.RunStateError,
                       match=rf'workdir {tmp_path} is in use by another run \(pid {os.getpid()} on '
                             rf'host {socket.gethostname()}, started .*use another --workdir'):
      lock.WorkdirLock(path).acquire()
  assert path.read_text() == ''  # released: emptied, kept
  with lock.WorkdirLock(path) as again:
    assert again.acquire() is None  # a clean release leaves nothing to take over

  # A run killed while holding it: the kernel dropped the flock, its record stayed.
  pid = _dead_pid()
  path.write_text(json.dumps({'host': socket.gethostname(), 'pid': pid, 'started': 'then'}))
  with lock.WorkdirLock(path) as held:
    warning = held.acquire()
  assert warning == (f'warning: took over the lock of a run that ended without releasing it (pid '
                     f'{pid} on host {socket.gethostname()}, started then, no longer running)')


def test_lock_of_a_killed_process_is_free(tmp_path):
  path = tmp_path / 'run.lock'
  holder = subprocess.Popen(
      [sys.executable, '-c', 'import sys, time; from fedjax_ssl.runs import lock; '
       'lock.WorkdirLock(sys.argv[1]).acquire(); print("locked", flush=True); time.sleep(60)',
       str(path)], stdout=subprocess.PIPE, text=True,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  try:
    assert holder.stdout.readline().strip() == 'locked'
    with pytest.raises(run_guard.RunStateError, match=f'pid {holder.pid} on host'):
      lock.WorkdirLock(path).acquire()
  finally:
    holder.kill()
    holder.wait()
  with lock.WorkdirLock(path) as held:
    assert f'pid {holder.pid} on host' in held.acquire()


def test_config_changes_ignore_neutral_and_unused_keys(tmp_path):
  rundir = RunDir(tmp_path)
  assert resuming.stored_config(rundir) is None
  saved = experiment.default_config()
  saved.partition = 'iid'
  (tmp_path / 'config.json').write_text(json.dumps(saved.to_dict()))  # tuples become lists
  stored = resuming.stored_config(rundir)
  current = experiment.default_config()
  current.update(dict(partition='iid', alpha=0.1, checkpoint_every=3, eval_every=7))
  current.fedu2.lambda_u = 0.0  # the block of an algorithm this run does not use
  assert resuming.config_changes(stored, current) == {}
  current.update(dict(rounds=40, lr=0.5, label_fractions=(1.0, 0.1, 0.01)))
  changes = resuming.config_changes(stored, current)
  assert changes == {'lr': (stored.lr, 0.5), 'rounds': (stored.rounds, 40)}
  assert resuming.format_changes(changes) == f'lr {stored.lr!r} -> 0.5, rounds 100 -> 40'
  assert resuming.format_changes(changes, limit=1).endswith('and 1 more')
  (tmp_path / 'config.json').write_bytes(b'\x88{')
  with pytest.raises(run_guard.RunStateError, match='config.json is unreadable'):
    resuming.stored_config(rundir)
  with pytest.raises(run_guard.RunStateError, match=r"config differs from the run in .*"
                     r"\(config.json\): lr .*recorded in config_changes.json"):
    resuming.refuse_changed_config(rundir, changes)


def test_finite_check_flags_each_floating_leaf():
  tree = {'a': jnp.ones(3), 'b': {'w': jnp.array([1.0, jnp.inf])}, 'n': jnp.int32(4),
          'key': jax.random.PRNGKey(0), 'typed': jax.random.key(1)}
  names, check = divergence.make_finite_check(tree)
  assert names == ["['a']", "['b']['w']"]
  np.testing.assert_array_equal(np.asarray(check(tree)), [True, False])


def test_divergence_watch_reports_the_first_non_finite_quantity():
  names = ["['params']['w']"]
  history = [{'round': 0, 'knn_acc': 0.3}, {'round': 1, 'loss': 2.5, 'lr': 0.1}]
  watch = divergence.DivergenceWatch(10, names, history)
  ok = np.array([True])
  assert watch.check(2, {'loss': 1.25, 'lr': 0.1}, ok) is None
  d = watch.check(3, {'loss': float('nan'), 'lr': float('inf')}, ok)
  assert (d.round, d.quantity, d.last_finite_round, d.last_finite_value) == (3, 'loss', 2, 1.25)
  hint = divergence.divergence_hint(0.1, 0.0)
  assert d.message(hint) == (
      'error: diverged at round 3/10: loss = nan (last finite: 1.25 at round 2); lower config.lr '
      '(now 0.1) or clip gradients (config.grad_clip_norm, now 0 = off); in reduced precision '
      '(bfloat16/float16) try float32')
  assert d.to_json() == {'round': 3, 'quantity': 'loss', 'value': 'nan', 'last_finite_round': 2,
                         'last_finite_value': 1.25}
  d = watch.check(3, {'loss': 1.0}, np.array([False]))
  assert d.message('H') == ("error: diverged at round 3/10: server parameter ['params']['w'] is "
                            'not finite (finite through round 2); H')
  d = divergence.DivergenceWatch(10, names).check(1, {'loss': float('-inf')}, ok)
  assert d.message('H') == 'error: diverged at round 1/10: loss = -inf (never finite); H'
  assert 'lower config.grad_clip_norm (now 5)' in divergence.divergence_hint(1.0, 5.0)


def test_stop_signals_set_a_flag_and_put_the_handlers_back():
  # Python's own SIGINT handler as the one to go back to: a pytest-xdist worker starts with another.
  worker_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    before = {s: signal.getsignal(s) for s in signals.StopSignals.SIGNALS}
    with signals.StopSignals() as stop:
      assert stop.agreed() == 0
      os.kill(os.getpid(), signal.SIGTERM)  # handled between bytecodes: the process goes on
      assert stop.agreed() == signal.SIGTERM
      with pytest.raises(KeyboardInterrupt):  # a second signal does what it did before: SIGINT's
        os.kill(os.getpid(), signal.SIGINT)
    assert {s: signal.getsignal(s) for s in signals.StopSignals.SIGNALS} == before
  finally:
    signal.signal(signal.SIGINT, worker_sigint)
  stopped = signals.Preempted(signal.SIGTERM)
  assert isinstance(stopped, SystemExit) and stopped.code == 143
  assert signals.exit_status_for_signal(signal.SIGINT) == 130


def _corrupt(step_dir, rng):
  """Overwrites the array data files of a checkpoint with random bytes of the same size."""
  for path in sorted((step_dir / 'state').rglob('*')):
    if path.is_file() and (path.parent.name == 'd' or path.name == 'manifest.ocdbt'):
      path.write_bytes(rng.bytes(path.stat().st_size))


def test_unreadable_checkpoints_are_moved_aside_and_the_newest_intact_one_restored(tmp_path):
  state = {'w': jnp.arange(4096, dtype=jnp.float32), 'key': jax.random.PRNGKey(0)}
  rng = np.random.default_rng(0)
  with checkpoint.Checkpointer(tmp_path, save_every=1, max_to_keep=3) as ckpt:
    for r in (1, 2, 3):
      ckpt.maybe_save(r, jax.tree.map(lambda x, r=r: x + r if x.dtype == jnp.float32 else x,
                                      state))
    _corrupt(tmp_path / '3', rng)
    with pytest.raises(checkpoint.UnreadableCheckpoint, match='checkpoint of round 3 in .* is '
                                                              r'unreadable \(state/'):
      ckpt.restore(state, 3)
    r, restored, _ = resuming.restore_newest_intact(ckpt, state, console=QUIET)
    assert r == 2 and ckpt.all_rounds() == [1, 2]
    np.testing.assert_array_equal(np.asarray(restored['w']), np.arange(4096) + 2.0)
    assert sorted(os.listdir(tmp_path / 'corrupt')) == ['3']
    for step in (1, 2):
      _corrupt(tmp_path / str(step), rng)
    assert resuming.restore_newest_intact(ckpt, state, console=QUIET) is None
    assert ckpt.all_rounds() == [] and sorted(os.listdir(tmp_path / 'corrupt')) == ['1', '2', '3']
    ckpt.maybe_save(3, state)  # the same round again: moved aside under another name
    _corrupt(tmp_path / '3', rng)
    assert ckpt.move_aside(3) == str(tmp_path / 'corrupt' / '3.1')


def test_peers_name_the_process_that_stopped():
  """`Peers.lost`: a pid on this host that no longer runs (reaped, or a zombie its parent has not
  reaped) is lost; a live one is not; a process on another host is lost when the failed
  collective's text names that host's address, as gloo prints it."""
  here = socket.gethostname()
  reaped = subprocess.Popen([sys.executable, '-c', 'pass'])
  reaped.wait()
  zombie = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
  zombie.kill()
  live = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
  try:
    for _ in range(100):  # the kill is delivered asynchronously
      if not run_guard._running(zombie.pid):
        break
      time.sleep(0.05)
    other = '127.0.0.1'  # a host name unlike this one's that resolves without a network
    peers = run_guard.Peers(hosts=(here, here, here, here, other),
                            pids=(os.getpid(), reaped.pid, zombie.pid, live.pid, 1))
    assert peers.lost('Gloo all-reduce failed: Read error [10.9.9.9]:4242') == [1, 2]
    assert peers.lost('Read error [127.0.0.1]:4242: Connection reset by peer') == [1, 2, 4]
    assert peers.describe([1]) == f'process 1 (pid {reaped.pid} on {here})'
    assert run_guard.Peers.gather() == run_guard.Peers(hosts=(here,), pids=(os.getpid(),))
  finally:
    live.kill()
    live.wait()
    zombie.wait()


def test_the_peer_watch_reports_a_stopped_process_on_this_host_once_and_not_after_stop():
  """run_guard.PeerWatch (docs/notes/engine.md#eng-88): a process of the run on this host that
  stops is reported once, within its interval; after `stop()` (this process's last collective
  done) a peer that exits is not."""
  here = socket.gethostname()
  for stop_first in (False, True):
    child = subprocess.Popen(['sleep', '30'])
    peers = run_guard.Peers(hosts=(here, here, 'elsewhere'), pids=(os.getpid(), child.pid, 1))
    calls, called = [], threading.Event()
    watch = run_guard.PeerWatch(peers, lambda lost: (calls.append(lost), called.set()),
                                interval=0.05)
    if stop_first:
      watch.stop()
    child.kill()
    child.wait()
    assert called.wait(2.0) != stop_first
    assert calls == ([] if stop_first else [[1]])
