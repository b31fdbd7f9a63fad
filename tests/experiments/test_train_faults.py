"""What a run survives, end to end through experiments.train on tiny synthetic runs: a forced NaN
and a real divergence, a stop signal mid-run, damaged checkpoints, a changed config on resume and a
second run on the same workdir. Each case asserts its one line, its exit status or exception, the
files left behind, and that a resumed run ends exactly where the uninterrupted one did with every
metrics row once. (The SIGKILL / SIGTERM resume of the binary itself: test_train_binary.py.)"""
import errno
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fedjax_ssl import experiment
from fedjax_ssl.runs import lock, numerics, run_guard, signals, training
from fedjax_ssl.core import round as rd

REPO = pathlib.Path(__file__).resolve().parents[2]
ROUNDS = 3
_MAKE_ROUND_STEP = rd.make_round_step


def _config(**overrides):
  from configs import quickstart  # pylint: disable=g-import-not-at-top
  config = quickstart.get_config()
  config.update(dict(dataset='synthetic', train_size=100, num_clients=2, clients_per_round=2,
                     partition='iid', batch_size=20, local_epochs=1, rounds=ROUNDS,
                     checkpoint_every=1, probe='adam', probe_epochs=1, probe_std_epochs=0,
                     eval_every=0, knn_k=10, encoder='mlp', augmentation='flip'))
  config.update(overrides)
  return config


@pytest.fixture(scope='module', autouse=True)
def compilation_cache(tmp_path_factory):
  """Every run of this module builds its round anew; a persistent compilation cache lets the runs
  after the first skip XLA's compilation (about 4 s a run instead of 15 on the shared 2 cores)."""
  from jax.experimental.compilation_cache import compilation_cache as cc  # pylint: disable=g-import-not-at-top
  saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
  cc.reset_cache()
  jax.config.update('jax_compilation_cache_dir', str(tmp_path_factory.mktemp('jax_cache')))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  yield
  cc.reset_cache()
  jax.config.update('jax_compilation_cache_dir', saved[0])
  jax.config.update('jax_persistent_cache_min_compile_time_secs', saved[1])


def _train(workdir, **kwargs):
  from fedjax_ssl.runs import training as train  # pylint: disable=g-import-not-at-top
  overrides = kwargs.pop('config', {})
  return train.train_and_evaluate(_config(**overrides), str(workdir), verbose=False, **kwargs)


@pytest.fixture(scope='module')
def baseline(tmp_path_factory):
  """An uninterrupted run (checkpoints of rounds 2 and 3 kept); tests copy it, never change it."""
  workdir = tmp_path_factory.mktemp('baseline')
  results = _train(workdir)
  assert results['status'] == 'completed'
  return workdir


def _copy(baseline, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(baseline, workdir)
  return workdir


def _rows(workdir):
  return [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]


def _state(workdir, round_idx=ROUNDS):
  with ocp.StandardCheckpointer() as c:
    return c.restore(workdir / 'checkpoints' / str(round_idx) / 'state')


def _assert_same_run(got, want):
  """The same final state (bit for bit), the same metrics rows (each round once), the same
  results."""
  a, b = jax.tree.leaves(_state(got)), jax.tree.leaves(_state(want))
  assert len(a) == len(b) > 5
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert _rows(got) == _rows(want)
  assert [r['round'] for r in _rows(got)] == list(range(ROUNDS + 1))
  results = json.loads((got / 'results.json').read_text())
  assert results['final'] == json.loads((want / 'results.json').read_text())['final']
  assert results['status'] == 'completed'


def _no_data(monkeypatch):
  """Makes loading data fail: for refusals, which must come before it."""
  def fail(*args, **kwargs):
    raise AssertionError('data loaded before the refusal')
  monkeypatch.setattr(experiment, 'load_data', fail)


def _round_step_hook(monkeypatch, hook):
  """Wraps every round step built from now on: hook(round number, state, metrics) -> (state,
  metrics) after each round."""
  make = _MAKE_ROUND_STEP  # not a wrapper an earlier call left in place
  def wrapped_make(*args, **kwargs):
    step = make(*args, **kwargs)
    def wrapped(state, data, key):
      state, metrics = step(state, data, key)
      return hook(int(state.round), state, metrics)
    return wrapped
  monkeypatch.setattr(rd, 'make_round_step', wrapped_make)
  # Not exported (core/export_cache.py): a run that loaded an earlier run's export of the same
  # program would run the stored program, never the hook.
  monkeypatch.setenv('FEDJAX_SSL_EXPORT', '0')


@pytest.mark.slow
def test_forced_nan_stops_the_run_at_that_round(tmp_path, monkeypatch, capfd):
  def nan_loss_at_2(r, state, metrics):
    return state, dict(metrics, loss=metrics['loss'] * np.nan) if r == 2 else metrics
  _round_step_hook(monkeypatch, nan_loss_at_2)
  results = _train(tmp_path / 'loss')
  err = capfd.readouterr().err
  assert results['status'] == 'diverged'
  assert results['diverged']['round'] == 2 and results['diverged']['quantity'] == 'loss'
  rows = _rows(tmp_path / 'loss')
  assert [r['round'] for r in rows] == [0, 1, 2] and np.isnan(rows[2]['loss'])
  line = (f'error: diverged at round 2/{ROUNDS}: loss = nan (last finite: '
          f'{rows[1]["loss"]:.6g} at round 1); lower config.lr (now 0.1) or clip gradients')
  assert [l for l in err.splitlines() if l.startswith('error:')][0].startswith(line), err
  assert 'NaN or Inf found' not in err  # tensorboardX's warning about the row is not shown
  assert json.loads((tmp_path / 'loss' / 'results.json').read_text()) == results
  assert os.listdir(tmp_path / 'loss' / 'checkpoints') == ['1']  # nothing non-finite saved

  def nan_params_at_2(r, state, metrics):
    if r == 2:
      state = state.replace(server=jax.tree.map(lambda x: x * np.nan if x.dtype == np.float32
                                                else x, state.server))
    return state, metrics
  _round_step_hook(monkeypatch, nan_params_at_2)
  results = _train(tmp_path / 'params')
  assert results['diverged']['quantity'].startswith('server parameter [')
  assert results['diverged']['last_finite_round'] == 1


def _binary(workdir, **overrides):
  """experiments.train on the module's tiny config as a user runs it (one CPU device)."""
  keys = ('dataset', 'train_size', 'num_clients', 'clients_per_round', 'partition', 'batch_size',
          'local_epochs', 'rounds', 'probe', 'probe_epochs', 'knn_k', 'encoder', 'augmentation')
  config = _config(**overrides)
  cmd = [sys.executable, '-m', 'experiments.train', '--config=configs/quickstart.py',
         f'--workdir={workdir}'] + [f'--config.{k}={config[k]}' for k in keys + tuple(overrides)]
  env = dict(os.environ, PYTHONPATH=str(REPO))
  env.pop('XLA_FLAGS', None)
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_diverging_binary_exits_3_with_one_line(tmp_path):
  workdir = tmp_path / 'w'
  out = _binary(workdir, ssl_method='supervised', lr=1e30, rounds=2)
  assert out.returncode == run_guard.EXIT_DIVERGED == 3, out.stderr[-3000:]
  assert 'Traceback' not in out.stderr
  errors = [l for l in out.stderr.splitlines() if l.startswith('error:')]
  # Both participants' updates are NaN: more than max_failed_fraction (0.5) of the round failed.
  assert len(errors) == 1 and errors[0].startswith(
      'error: diverged at round 1/2: 2 of 2 participants sent a non-finite update (clients [0, 1]),'
      ' more than max_failed_fraction = 0.5; '), out.stderr[-3000:]
  assert 'lower config.lr (now 1e+30)' in errors[0]
  assert json.loads((workdir / 'results.json').read_text())['status'] == 'diverged'


@pytest.mark.slow
def test_a_failed_client_is_logged_and_the_run_goes_on(tmp_path, capfd):
  """Round 2's client 0 fails on purpose (config.inject_client_faults): 1 of 2 participants is not
  more than max_failed_fraction = 0.5, so the run completes, its metrics row names the client; at
  max_failed_fraction = 0 the same fault stops the run as diverged in one line."""
  results = _train(tmp_path / 'ok', config=dict(inject_client_faults='2:0'))
  assert results['status'] == 'completed'
  rows = _rows(tmp_path / 'ok')
  assert [r.get('failed_ids') for r in rows[1:]] == [None, [0], None]
  assert [r['failed_clients'] for r in rows[1:]] == [0, 1, 0]
  assert all(np.isfinite(r['loss']) for r in rows[1:])
  results = _train(tmp_path / 'stop', config=dict(inject_client_faults='2:0',
                                                  max_failed_fraction=0.0))
  assert results['status'] == 'diverged' and results['diverged']['quantity'] == 'failed clients'
  err = [l for l in capfd.readouterr().err.splitlines() if l.startswith('error:')]
  assert err[-1].startswith(f'error: diverged at round 2/{ROUNDS}: 1 of 2 participants sent a '
                            'non-finite update (clients [0]), more than max_failed_fraction = 0;')
  assert os.listdir(tmp_path / 'stop' / 'checkpoints') == ['1']


@pytest.mark.slow
def test_sigterm_saves_the_round_and_the_resume_is_exact(baseline, tmp_path, monkeypatch, capfd):
  workdir = tmp_path / 'run'
  def sigterm_after_2(r, state, metrics):
    if r == 2:
      os.kill(os.getpid(), signal.SIGTERM)  # the handler sets the flag; the round completes
    return state, metrics
  _round_step_hook(monkeypatch, sigterm_after_2)
  # checkpoint_every=10 (a key that cannot change results): round 2 is saved only on the signal.
  with pytest.raises(signals.Preempted) as stopped:
    _train(workdir, config=dict(checkpoint_every=10))
  assert stopped.value.code == 143
  err = capfd.readouterr().err
  assert 'SIGTERM received: the run stops after the current round' in err
  assert (f'stopped by SIGTERM after round 2/{ROUNDS}; checkpoint {workdir}/checkpoints/2 saved; '
          f'resume with the same command: ') in err
  assert os.listdir(workdir / 'checkpoints') == ['2']
  assert [r['round'] for r in _rows(workdir)] == [0, 1, 2]
  assert not (workdir / 'results.json').exists()
  assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handlers are put back
  monkeypatch.undo()
  _train(workdir, config=dict(checkpoint_every=10))
  _assert_same_run(workdir, baseline)


def test_a_resume_keeps_the_strategy_its_run_started_with(tmp_path, monkeypatch, capfd):
  """strategy='auto' is measured once (CACHE_DIR/strategy.json) and recorded in the workdir with
  the host it ran on; a resume uses the recorded strategy even when the cache has changed its mind
  since (strategies agree only to float rounding), and ends bit-exact; a resume on another host
  (here: a pretended other CPU thread count) says so in one warning and keeps the first host in the
  record; a fresh run takes the cache's strategy; a record from before the CPU was recorded is
  kept as it was, without a warning."""
  monkeypatch.setenv('FEDJAX_SSL_AUTOTUNE', 'map1,vmap')  # a CPU's default has one candidate
  cache = tmp_path / 'cache'
  config = dict(checkpoint_every=10)
  full = _train(tmp_path / 'full', config=config, cache_dir=cache)
  measured = full['strategy']
  assert measured['source'] == 'measured' and set(measured['seconds']) == {'map1', 'vmap'}
  assert json.loads((tmp_path / 'full' / 'strategy.json').read_text()) == measured
  host = numerics.numerics_host()
  assert measured['host'] == host and host['cpu_threads'] == len(os.sched_getaffinity(0))
  # A fresh start, and a workdir from before the record: nothing to say.
  assert numerics.host_change(None, host) is None
  assert numerics.host_change({'strategy': 'map'}, host) is None
  assert numerics.host_change(measured, host) is None
  # A record from before the CPU was recorded: the other keys still compared, the CPU not.
  older = {k: v for k, v in host.items() if k != 'cpu'}
  assert numerics.host_change({'host': older}, host) is None
  assert 'cpu_threads 0 ->' in numerics.host_change({'host': dict(older, cpu_threads=0)}, host)
  assert re.fullmatch(r'.+ \((.+, )?(avx512|avx2|avx|sse4\.2|unknown)\)', host['cpu']), host['cpu']

  stopped = tmp_path / 'stopped'
  def sigterm_after_2(r, state, metrics):
    if r == 2:
      os.kill(os.getpid(), signal.SIGTERM)
    return state, metrics
  with monkeypatch.context() as m:
    _round_step_hook(m, sigterm_after_2)
    with pytest.raises(signals.Preempted):
      _train(stopped, config=config, cache_dir=cache)
  assert json.loads((stopped / 'strategy.json').read_text())['source'] == 'cache'
  other = 'vmap' if measured['strategy'] == 'map' else 'map'
  entries = json.loads((cache / 'strategy.json').read_text())
  for entry in entries.values():
    entry['choice']['strategy'] = other
  (cache / 'strategy.json').write_text(json.dumps(entries))
  capfd.readouterr()
  with monkeypatch.context() as m:
    m.setattr(numerics, 'numerics_host', lambda: dict(host, cpu_threads=host['cpu_threads'] + 1))
    resumed = _train(stopped, config=config, cache_dir=cache)
  warnings = [l for l in capfd.readouterr().err.splitlines() if l.startswith('warning:')]
  assert warnings == [
      f"warning: this run started on another host (cpu_threads {host['cpu_threads']} -> "
      f"{host['cpu_threads'] + 1}): the rounds from here may round floats differently, so they "
      'may not be bit-identical to an uninterrupted run on the first one (the numbers stay valid; '
      'docs/notes/testing.md#test-18)'], warnings
  assert (resumed['strategy']['source'], resumed['strategy']['strategy']) == (
      'workdir', measured['strategy'])
  assert resumed['strategy']['host'] == host
  _assert_same_run(stopped, tmp_path / 'full')
  fresh = _train(tmp_path / 'fresh', config=config, cache_dir=cache)
  assert (fresh['strategy']['source'], fresh['strategy']['strategy']) == ('cache', other)
  # A run recorded before the CPU was: resumed without a warning, its record kept as it was.
  older = tmp_path / 'older'
  with monkeypatch.context() as m:
    _round_step_hook(m, sigterm_after_2)
    with pytest.raises(signals.Preempted):
      _train(older, config=config, cache_dir=cache)
  record = json.loads((older / 'strategy.json').read_text())
  del record['host']['cpu']
  (older / 'strategy.json').write_text(json.dumps(record))
  capfd.readouterr()
  resumed = _train(older, config=config, cache_dir=cache)
  assert not [l for l in capfd.readouterr().err.splitlines() if l.startswith('warning:')]
  assert resumed['strategy']['host'] == record['host']


@pytest.mark.slow
def test_damaged_checkpoints_are_moved_aside_and_the_newest_intact_one_used(
    baseline, tmp_path, monkeypatch, capfd):
  workdir = _copy(baseline, tmp_path)
  rng = np.random.default_rng(0)

  def damage(step):
    for path in sorted((workdir / 'checkpoints' / str(step) / 'state').rglob('*')):
      if path.is_file() and (path.parent.name == 'd' or path.name == 'manifest.ocdbt'):
        path.write_bytes(rng.bytes(path.stat().st_size))
  damage(ROUNDS)
  _train(workdir)
  err = capfd.readouterr().err
  warning = [l for l in err.splitlines() if l.startswith('warning:')]
  assert len(warning) == 1 and warning[0].startswith(
      f'warning: checkpoint of round {ROUNDS} in {workdir}/checkpoints is unreadable (state/'), err
  assert warning[0].endswith(f'moved to {workdir}/checkpoints/corrupt/{ROUNDS}; trying the '
                             'previous checkpoint')
  assert 'Traceback' not in err
  _assert_same_run(workdir, baseline)  # round 3 redone from round 2's checkpoint

  # None intact: the run says so and refuses to start over unless --restart.
  for step in (ROUNDS - 1, ROUNDS):
    damage(step)
  with pytest.raises(run_guard.RunStateError, match=rf'no intact checkpoint in {workdir}/'
                     r'checkpoints .*rerun with --restart to start over from round 0'):
    _train(workdir)
  assert sorted(os.listdir(workdir / 'checkpoints' / 'corrupt')) == ['2', '3', '3.1']
  assert _rows(workdir) == _rows(baseline)  # nothing of the run was touched
  with pytest.raises(run_guard.RunStateError, match=r'kept under corrupt/: 2, 3, 3.1\): rerun '
                     'with --restart'):
    _train(workdir)  # still refused: the damaged ones are aside, none is intact
  _train(workdir, restart=True)
  assert 'warning: no intact checkpoint; --restart: starting over from round 0' in (
      capfd.readouterr().err)
  _assert_same_run(workdir, baseline)


@pytest.mark.slow
def test_a_resume_under_another_config_is_refused_unless_allowed(baseline, tmp_path, monkeypatch):
  workdir = _copy(baseline, tmp_path)
  with monkeypatch.context() as m:
    _no_data(m)
    with pytest.raises(run_guard.RunStateError, match=(
        rf'the config differs from the run in {workdir} \(config.json\): lr 0.1 -> 0.2, rounds 3 '
        r'-> 4; .*pass --allow_config_change')):
      _train(workdir, config=dict(rounds=4, lr=0.2))
  # Keys that cannot change results may change: a resume of the finished run.
  assert _train(workdir, config=dict(eval_every=1, checkpoint_every=5))['status'] == 'completed'

  results = _train(workdir, config=dict(rounds=4), allow_config_change=True)
  history = [{'round': ROUNDS, 'changes': {'rounds': [ROUNDS, 4]}}]
  assert results['config_changes'] == history
  assert json.loads((workdir / 'config_changes.json').read_text()) == history
  assert json.loads((workdir / 'config.json').read_text())['rounds'] == 4
  rows = _rows(workdir)
  assert [r['round'] for r in rows] == [0, 1, 2, 3, 4]
  assert rows[:ROUNDS + 1] == _rows(baseline)


def test_a_second_run_on_the_workdir_is_refused(baseline, tmp_path, monkeypatch, capfd):
  workdir = _copy(baseline, tmp_path)
  with lock.WorkdirLock(workdir / 'run.lock') as holder, monkeypatch.context() as m:
    holder.acquire()
    _no_data(m)
    with pytest.raises(run_guard.RunStateError, match=(
        rf'workdir {workdir} is in use by another run \(pid {os.getpid()} on host '
        rf'{socket.gethostname()}, started .*\): wait for it to end')):
      _train(workdir)
  # The lock of a run that died is taken over with a warning; every row stays once.
  proc = subprocess.Popen([sys.executable, '-c', 'pass'])
  proc.wait()
  (workdir / 'run.lock').write_text(json.dumps({'host': socket.gethostname(), 'pid': proc.pid}))
  _train(workdir)
  assert (f'warning: took over the lock of a run that ended without releasing it (pid {proc.pid}'
          in capfd.readouterr().err)
  assert _rows(workdir) == _rows(baseline)


def test_binary_refuses_a_held_workdir_in_one_line(tmp_path):
  workdir = tmp_path / 'w'
  workdir.mkdir()
  with lock.WorkdirLock(workdir / 'run.lock') as holder:
    holder.acquire()
    out = _binary(workdir)
  assert out.returncode == run_guard.EXIT_REFUSED == 1
  assert out.stderr.startswith(f'error: workdir {workdir} is in use by another run (pid '
                               f'{os.getpid()} on host {socket.gethostname()}, started ')
  assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ''
  assert not (workdir / 'train.log').exists()


def test_the_harness_marks_a_diverged_run_instead_of_averaging_it(tmp_path):
  from fedjax_ssl import tables  # pylint: disable=g-import-not-at-top
  table = tables.Table(name='t', title='t', base=experiment.default_config(),
                       rows={'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol')},
                       columns={'IID': dict(partition='iid')}, metrics=('probe_acc',))
  runs = tables.plan_runs(table, seeds=[0, 1])
  diverged = {'status': 'diverged', 'random_init': {'probe_acc': 0.5},
              'diverged': {'round': 7, 'quantity': 'loss', 'value': 'nan'}}
  done = {'status': 'completed', 'final': {'probe_acc': 0.6}, 'random_init': {'probe_acc': 0.5}}
  for run in runs:  # A: seed 0 finished, seed 1 diverged; B: both diverged
    wd = run.workdir(tmp_path)
    wd.mkdir(parents=True)
    (wd / 'config.json').write_text(json.dumps(run.config.to_dict()))
    ok = run.cells == [('A', 'IID')] and run.seed == 0
    (wd / 'results.json').write_text(json.dumps(done if ok else diverged))
  a, b = tables.summarize(table, runs, tmp_path)
  assert (a['n'], a['values'], a['errors']) == (1, [60.0], [])
  assert a['diverged'] == ['seed 1: diverged at round 7 (loss)']
  assert b['n'] == 0 and len(b['diverged']) == 2
  md = tables.markdown(table, [a, b], [0, 1])
  assert '| A | 60.00 [1 of 2 seeds, 1 diverged] |' in md and '| B | diverged |' in md
  tables.write_csv([a, b], tmp_path / 'table.csv')
  assert 'seed 0: diverged at round 7 (loss) | seed 1: diverged' in (
      tmp_path / 'table.csv').read_text()


def _no_space(path):
  return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.slow
@pytest.mark.parametrize('where', ['metrics', 'checkpoint', 'results'])
def test_a_full_disk_ends_in_one_line_and_the_resume_is_exact(where, baseline, tmp_path,
                                                              monkeypatch):
  """A write that finds no room (ENOSPC, injected where each file is written: a metrics row at
  round 2, the checkpoint of round 2 — as orbax reports it, wrapped in its own error — and
  results.json) ends the run with RunStateError (one `error:` line, exit status 1 in the binary)
  naming the file; the checkpoints and metric rows before it are intact, and once there is room the
  same command resumes to exactly the uninterrupted run."""
  from fedjax_ssl import files  # pylint: disable=g-import-not-at-top
  from fedjax_ssl.runs import checkpoint, logging_utils  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / 'run'
  if where == 'metrics':
    real = logging_utils.MetricsWriter.write
    def write(self, round_idx, metrics):
      if round_idx == 2:
        raise _no_space(self.jsonl_path)
      return real(self, round_idx, metrics)
    monkeypatch.setattr(logging_utils.MetricsWriter, 'write', write)
    path, resumes_from, rounds_left = workdir / 'metrics.jsonl', 1, [0, 1]
  elif where == 'checkpoint':
    real = checkpoint.Checkpointer.maybe_save
    def maybe_save(self, round_idx, state, **kwargs):
      if round_idx == 2:
        try:
          raise _no_space(pathlib.Path(self.directory) / '2.orbax-checkpoint-tmp')
        except OSError as e:
          raise ValueError('checkpoint save failed') from e
      return real(self, round_idx, state, **kwargs)
    monkeypatch.setattr(checkpoint.Checkpointer, 'maybe_save', maybe_save)
    path, resumes_from, rounds_left = workdir / 'checkpoints' / '2', 1, [0, 1, 2]
  else:
    real = files.write_json
    def write_json(target, obj, **kwargs):
      if pathlib.Path(target).name == 'results.json':
        raise _no_space(target)
      return real(target, obj, **kwargs)
    monkeypatch.setattr(files, 'write_json', write_json)
    path, resumes_from, rounds_left = workdir / 'results.json', ROUNDS, list(range(ROUNDS + 1))
  with pytest.raises(run_guard.RunStateError) as err:
    _train(workdir)
  assert str(err.value) == (
      f'no space left writing {path} (No space left on device): free space there, then rerun the '
      f'same command; it resumes from the checkpoint of round {resumes_from} with the metric rows '
      'before it')
  assert [r['round'] for r in _rows(workdir)] == rounds_left
  assert sorted(int(d) for d in os.listdir(workdir / 'checkpoints') if d.isdigit())[-1] == (
      resumes_from)
  assert not (workdir / 'results.json').exists()
  monkeypatch.undo()  # room again
  _train(workdir)
  _assert_same_run(workdir, baseline)
