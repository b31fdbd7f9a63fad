"""core/fedbuff.py (FedBuff, Nguyen et al. 2022): the vectorised server step against a slow
per-client event loop (a heap of pending updates, each client trained alone, aggregation in float64
numpy), the reduction to synchronous FedAvg, determinism per seed, bit-exact resume, the virtual
clock without training, the training loop's rows, and the one-line refusals."""
import heapq
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment
from fedjax_ssl.runs.checkpoint import Checkpointer
from fedjax_ssl.core import fedbuff, rng
from fedjax_ssl.core import round as rd
from tests.algorithms.test_registry import _small_config
from tests.core.test_server_opt import _assert_equal

C = 4  # _small_config's clients


def _config(**fb):
  config = _small_config('fedavg')
  config.fedbuff.update(dict(dict(enabled=True, concurrency=3, buffer_size=2, speed_sigma=0.5),
                             **fb))
  return config


class _Run:
  """A FedBuff config's data, wrapped algorithm, initial state and ONE compiled server step."""

  def __init__(self, config):
    experiment.validate_config(config)
    dataset = experiment.load_data(config)
    self.fed_data, _ = experiment.build_fed_data(config, dataset)
    self.algo = experiment.build_algorithm(config, dataset,
                                           client_sizes=np.asarray(self.fed_data.n))
    self.cfg = experiment.round_config(config)
    self.init_key, self.run_key = experiment.run_keys(config)
    self.step = fedbuff.make_step(self.algo, self.cfg, C, donate=False)

  def init(self):
    return rd.init_state(self.algo, self.init_key, C)

  def steps(self, state, count):
    rows = []
    for t in range(int(state.round), int(state.round) + count):
      state, metrics = self.step(state, self.fed_data, rng.round_key(self.run_key, t))
      rows.append(jax.device_get(metrics))
    return state, rows


def _flat(tree):
  return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)]


def _np_staleness(fb, s):
  if fb.staleness == 'constant':
    return 1.0
  if fb.staleness == 'polynomial':
    return (1.0 + s) ** -fb.staleness_exponent
  return 1.0 if s <= fb.hinge_b else 1.0 / (fb.hinge_a * (s - fb.hinge_b) + 1.0)


def _event_loop(run, steps):
  """FedBuff one client at a time: a heap of (finish, start version, client, delta); P clients
  start from x_0, every server version starts B idle clients, and the B earliest arrivals are
  averaged with n_k / sum n times s(staleness) in float64. Draws the same random numbers as the
  engine (`sample_idle`, `latencies`, the clients' keys); everything else is its own.
  Returns (per step (popped client ids, their staleness, clock), the final global model leaves)."""
  inner, fb = run.algo.inner, run.algo.fedbuff
  p, b = fb.concurrency, fb.buffer_size
  fn = jax.jit(rd.client_round_fn(inner, run.cfg))
  state = run.init()
  clients = jax.tree_util.tree_map(np.array, state.clients)
  server = state.server['algorithm']
  speed = fedbuff.speed_factors(run.init_key, C, fb)
  n = np.asarray(run.fed_data.n, np.float64)
  heap, clock, log = [], np.float32(0.0), []

  def start(ids, key, t):
    msg = rd.round_message(inner, server, run.fed_data)
    ref = _flat(inner.update_reference(server))
    lat = np.asarray(fedbuff.latencies(key, jnp.asarray(ids, jnp.int32), speed, fb))
    for cid, l in zip(ids, lat):
      client = jax.tree_util.tree_map(lambda a, c=cid: a[c], clients)
      new, payload, _ = fn(client, rng.client_key(key, cid), jnp.int32(cid), run.fed_data, msg,
                           run.cfg.lr_fn(jnp.int32(t)))
      for a, v in zip(jax.tree_util.tree_leaves(clients), jax.tree_util.tree_leaves(new)):
        a[cid] = np.asarray(v)
      delta = [u - r for u, r in zip(_flat(payload), ref)]
      heapq.heappush(heap, (np.float32(clock + np.float32(l)), t, int(cid), delta))

  for t in range(steps):
    key = rng.round_key(run.run_key, t)
    if t == 0 and p > b:
      pkey = jax.random.fold_in(key, fedbuff.PREFILL_STREAM)
      start([int(i) for i in fedbuff.sample_idle(pkey, jnp.zeros((C,), bool), p - b)], pkey, t)
    busy = np.zeros(C, bool)
    busy[[e[2] for e in heap]] = True
    start([int(i) for i in fedbuff.sample_idle(key, jnp.asarray(busy), b)], key, t)
    popped = [heapq.heappop(heap) for _ in range(b)]
    total = sum(n[cid] for _, _, cid, _ in popped)
    ref = _flat(inner.update_reference(server))
    for _, v, cid, delta in popped:
      w = n[cid] / total * _np_staleness(fb, t - v)
      ref = [r + w * d for r, d in zip(ref, delta)]
    treedef = jax.tree_util.tree_structure(inner.update_reference(server))
    proposal = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(r, jnp.float32) for r in ref])
    server = proposal  # FedAvg's aggregate of one upload of weight 1 is that upload
    clock = max(f for f, *_ in popped)
    log.append((sorted(cid for _, _, cid, _ in popped), sorted(t - v for _, v, _, _ in popped),
                float(clock)))
  return log, _flat(server)


@pytest.mark.parametrize('fb', [dict(), dict(staleness='hinge', hinge_a=2.0, hinge_b=0.0,
                                             latency='constant', concurrency=4, buffer_size=1)])
def test_vectorised_step_equals_a_per_client_event_loop(fb):
  """Same participants, staleness and clock per step, and the same model after 5 steps within
  float32 rounding of 5 compounded steps (each ~1e-6 of the parameters' scale:
  tests/core/test_round_equivalence.py's bound; 1e-5 leaves room for the compounding)."""
  run = _Run(_config(**fb))
  state, rows = run.steps(run.init(), 5)
  log, want = _event_loop(run, 5)
  assert max(s for _, st, _ in log for s in st) >= 1  # stale updates were exercised
  for row, (_, stale, clock) in zip(rows, log):
    assert float(row['virtual_time']) == clock
    assert float(row['staleness_mean']) == pytest.approx(np.mean(stale), abs=1e-6)
    assert float(row['staleness_max']) == max(stale)
  pool = state.server['fedbuff']
  assert float(pool.clock) == log[-1][2]
  for got, w in zip(_flat(run.algo.inner.update_reference(state.server['algorithm'])), want):
    assert np.max(np.abs(got - w)) <= 1e-5 * max(1.0, float(np.max(np.abs(w))))


def test_buffer_equal_to_concurrency_equal_to_the_cohort_is_synchronous_fedavg():
  """B = P = clients_per_round = C with constant latency: every update is fresh, each step is a
  synchronous FedAvg round (same participants, keys and data weights), the clock advances by the
  slowest participant (1 per round without speed factors); the model equals the synchronous
  engine's within float32 rounding (x + sum w (u - x) against sum w u: ~1e-6 of the scale)."""
  config = _config(concurrency=C, buffer_size=C, latency='constant', speed_sigma=0.0,
                   staleness='polynomial')
  config.clients_per_round = C
  run = _Run(config)
  got, rows = run.steps(run.init(), 3)
  sync_config = _small_config('fedavg')
  sync_config.clients_per_round = C
  experiment.validate_config(sync_config)
  dataset = experiment.load_data(sync_config)
  algo = experiment.build_algorithm(sync_config, dataset, client_sizes=np.asarray(run.fed_data.n))
  step = rd.make_round_step(algo, experiment.round_config(sync_config), C, donate=False)
  state = rd.init_state(algo, run.init_key, C)
  for t in range(3):
    state, _ = step(state, run.fed_data, rng.round_key(run.run_key, t))
  assert [float(r['virtual_time']) for r in rows] == [1.0, 2.0, 3.0]
  assert [float(r['staleness_max']) for r in rows] == [0.0, 0.0, 0.0]
  for a, b in zip(_flat(got.server['algorithm']), _flat(state.server)):
    assert np.max(np.abs(a - b)) <= 1e-5 * max(1.0, float(np.max(np.abs(b))))
  for a, b in zip(_flat(got.clients), _flat(state.clients)):
    assert np.max(np.abs(a - b)) <= 1e-5 * max(1.0, float(np.max(np.abs(b))))


def test_deterministic_per_seed_and_resume_is_bit_exact(tmp_path):
  """Two runs of a seed are equal bit for bit; 4 steps straight equal 2, a checkpoint, a restore
  (pending deltas, finish times, versions, clock in the server) and 2 more; another seed draws
  another schedule; `virtual_times` (no training) gives the clock the steps logged."""
  config = _config(concurrency=4, buffer_size=2)
  config.rounds = 4
  run = _Run(config)
  two, rows_a = run.steps(run.init(), 2)
  again, _ = run.steps(run.init(), 2)
  _assert_equal(two, again)
  with Checkpointer(str(tmp_path), save_every=1) as ckpt:
    ckpt.maybe_save(2, two)
    _, restored, _ = ckpt.restore(run.init())
  four, rows_b = run.steps(two, 2)
  resumed, rows_c = run.steps(restored, 2)
  _assert_equal(resumed, four)
  assert [float(r['virtual_time']) for r in rows_b] == [float(r['virtual_time']) for r in rows_c]
  clock = [float(r['virtual_time']) for r in rows_a + rows_b]
  assert fedbuff.virtual_times(run.algo.fedbuff, run.init_key, run.run_key, C, 4) == clock
  config.seed = 1
  other = _Run(config)
  assert fedbuff.virtual_times(other.algo.fedbuff, other.init_key, other.run_key, C, 4) != clock


def test_staleness_weights_are_the_papers_forms():
  s = jnp.arange(6)
  fb = fedbuff.FedBuffConfig(concurrency=2, buffer_size=1)
  np.testing.assert_allclose(fedbuff.staleness_weight(fb, s), 1.0 / np.sqrt(1.0 + np.arange(6)),
                             rtol=1e-6)
  fb = fedbuff.FedBuffConfig(concurrency=2, buffer_size=1, staleness='hinge', hinge_a=10.0,
                             hinge_b=2.0)
  np.testing.assert_allclose(fedbuff.staleness_weight(fb, s),
                             [1, 1, 1, 1 / 11, 1 / 21, 1 / 31], rtol=1e-6)
  fb = fedbuff.FedBuffConfig(concurrency=2, buffer_size=1, staleness='constant')
  np.testing.assert_array_equal(fedbuff.staleness_weight(fb, s), np.ones(6))


def test_training_loop_logs_the_virtual_clock_and_plots_against_it(tmp_path):
  """The binary's loop: virtual_time and staleness in every trained row, results.json written,
  metrics.png drawn against virtual time."""
  from fedjax_ssl.runs import training  # pylint: disable=g-import-not-at-top
  config = _config()
  config.update(dict(rounds=2, checkpoint_every=2, knn_k=5))
  training.train_and_evaluate(config, str(tmp_path / 'w'), verbose=False)
  records = [json.loads(l) for l in (tmp_path / 'w' / 'metrics.jsonl').read_text().splitlines()]
  assert [r['round'] for r in records] == [0, 1, 2]
  times = [r['virtual_time'] for r in records[1:]]
  assert 0 < times[0] <= times[1]
  assert all('staleness_mean' in r for r in records[1:])
  assert (tmp_path / 'w' / 'metrics.png').exists()
  assert json.loads((tmp_path / 'w' / 'results.json').read_text())['fedbuff']['buffer_size'] == 2


@pytest.mark.parametrize('name,fb,message', [
    ('fedavg', dict(buffer_size=4, concurrency=3),
     'config.fedbuff.buffer_size = 4 is invalid: must be <= fedbuff.concurrency = 3'),
    ('fedavg', dict(concurrency=5, buffer_size=2),
     'config.fedbuff.concurrency = 5 is invalid: must be <= num_clients = 4'),
    ('fedavg', dict(latency_sigma=-1.0),
     'config.fedbuff.latency_sigma = -1.0 is invalid: must be a finite number >= 0'),
    ('fedavg', dict(speed_sigma=float('inf')),
     'config.fedbuff.speed_sigma = inf is invalid: must be a finite number >= 0'),
    ('fedavg', dict(latency='pareto'), "config.fedbuff.latency = 'pareto' is invalid: must be one "
                                       "of ('lognormal', 'constant')"),
    ('fedavg', dict(staleness='linear'), "config.fedbuff.staleness = 'linear' is invalid"),
    ('fedu2', dict(), "config.fedbuff.enabled = True is invalid for algorithm 'fedu2': its server "
                      'update (EUA)'),
    ('fedca', dict(), "config.fedbuff.enabled = True is invalid for algorithm 'fedca': its "
                      'aggregate is not registered'),
])
def test_bad_fedbuff_configs_are_refused_in_one_line(name, fb, message):
  config = _small_config(name)
  config.fedbuff.update(dict(dict(enabled=True, concurrency=3, buffer_size=2), **fb))
  with pytest.raises(cv.ConfigError, match=re.escape(message)) as e:
    experiment.validate_config(config)
  assert '\n' not in str(e.value)


def test_fedbuff_refuses_dp_and_host_placed_clients():
  config = _config()
  config.dp.enabled = True
  with pytest.raises(cv.ConfigError, match='invalid with config.dp.enabled = True'):
    experiment.validate_config(config)
  config = _config()
  config.client_state = 'host'
  with pytest.raises(cv.ConfigError, match="client_state = 'host' is invalid with"):
    experiment.validate_config(config)


def test_run_identity_ignores_the_block_while_fedbuff_is_off():
  from fedjax_ssl import run_identity  # pylint: disable=g-import-not-at-top
  config = _small_config('fedavg')
  config.fedbuff.buffer_size = 3
  assert 'fedbuff' not in json.loads(run_identity.run_key(config))
  config.fedbuff.enabled = True
  assert json.loads(run_identity.run_key(config))['fedbuff']['buffer_size'] == 3


def test_server_lr_is_the_papers_server_learning_rate():
  """With server_optimizer 'sgd' at server_lr eta the step moves the parameters eta of the way to
  the buffer's proposal (x + eta sum w s Delta), the BatchNorm statistics all the way (server_opt
  steps only the parameters); the same schedule and clients as at eta = 1."""
  full = _Run(_config())
  half_config = _config()
  half_config.server_lr = 0.5
  half = _Run(half_config)
  start = full.init()
  (a, _), (b, _) = full.steps(start, 1), half.steps(half.init(), 1)
  x0 = start.server['algorithm']
  got = b.server['algorithm']['algorithm']
  for x, p, h in zip(_flat(x0['params']), _flat(a.server['algorithm']['params']),
                     _flat(got['params'])):
    np.testing.assert_allclose(h, x + 0.5 * (p - x), rtol=0, atol=1e-6 * max(1.0, np.abs(p).max()))
  for p, h in zip(_flat(a.server['algorithm']['batch_stats']), _flat(got['batch_stats'])):
    np.testing.assert_allclose(h, p, rtol=0, atol=1e-6 * max(1.0, np.abs(p).max()))
