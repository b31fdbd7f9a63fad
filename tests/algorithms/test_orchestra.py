"""Orchestra as an algorithm: one step's clustering and rotation terms equal their float64 numpy
formulas on the same views; the target moves by EMA before the step and the bank receives its
projections; the setup round trains nothing and fills the bank; the whole round (setup and two
training rounds) under vmap and map equals a slow per-client loop with a numpy server (data-weighted
mean and the release's global clustering); bad values are refused in one line before compute; a
run resumes exactly from a checkpoint (the global centroids and the round counter included)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment, models
from fedjax_ssl.algorithms import orchestra, ssl_client
from fedjax_ssl.runs.checkpoint import Checkpointer
from fedjax_ssl.core import optim, rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import restore_client
from fedjax_ssl.data import augment
from tests import reference
from tests.algorithms.test_registry import _small_config
from tests.core import test_round_equivalence as eq
from tests.core.test_server_opt import _Run, _assert_equal
from tests.ops.test_orchestra import np_cluster_loss, np_global_clustering, np_normalize

AUG = augment.AugmentConfig(out_size=8, crop_scale=(0.5, 1.0), flip_prob=0.5, jitter_prob=0.0,
                            grayscale_prob=0.0)
B = 6
OC = orchestra.OrchestraConfig(global_clusters=4, local_clusters=3, memory_size=8, temperature=0.2,
                               ema_tau=0.9, projector_dim=8, deg_weight=0.7, global_iters=40)


def _spec():
  enc = models.get_encoder('small_cnn', conv_features=(4,), dense_features=(12, 6))
  model = models.SSLModel(enc, models.MLPHead(8, 5), None)
  return ssl_client.ClientSpec(objective='byol', model=model,
                               tx=optim.make_optimizer('sgd', momentum=0.9, weight_decay=1e-3),
                               aug=AUG, mean=(0.5,), std=(0.3,), input_shape=(8, 8, 1))


def _float64(tree):
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _setup(rounds_done):
  """(the algorithm's spec, algo, a begun client, a batch, the broadcast), float64, with unit
  global centroids and the online network's parameters off the target's (one step of noise)."""
  spec = dataclasses.replace(_spec(), model=orchestra.model_of(_spec(), OC.projector_dim))
  algo = orchestra.make(_spec(), oc=OC)
  clients, server = algo.init(jax.random.PRNGKey(0), 1)
  rs = np.random.RandomState(0)
  c = rs.normal(size=(OC.global_clusters, OC.projector_dim))
  server = dict(server, centroids=jnp.asarray(np_normalize(c), jnp.float32),
                rounds_done=jnp.asarray(rounds_done, jnp.int32))
  server['params'] = jax.tree_util.tree_map(
      lambda a: a + 0.05 * jnp.asarray(rs.normal(size=a.shape), a.dtype), server['params'])
  server = _float64(server)
  stored = _float64(jax.tree_util.tree_map(lambda a: a[0], clients))
  client = algo.begin(restore_client(algo, stored, server), server, jax.random.PRNGKey(1))
  x = jnp.asarray(rs.randint(0, 256, (B, 8, 8, 1)).astype(np.uint8))
  return spec, algo, client, {'x': x, 'y': jnp.zeros(B, jnp.int32)}, server


def _np(tree):
  return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


def test_one_step_terms_equal_numpy_on_the_same_views():
  key = jax.random.PRNGKey(5)
  with jax.enable_x64(True):
    spec, _, client, batch, msg = _setup(rounds_done=1)
    total, (_, tparams, _, tz, terms) = jax.jit(functools.partial(orchestra.loss_fn, spec, OC))(
        client['params'], client, batch, key, msg)
    assert total.dtype == jnp.float64
    # The same views; the rotation written with numpy; the EMA written with numpy.
    views = ssl_client._views(spec, key, batch['x'], 3)  # pylint: disable=protected-access
    v1, v2, v3 = (np.asarray(v) for v in views)
    rot = np.asarray(jax.random.randint(jax.random.fold_in(key, orchestra.ROTATION_STREAM), (B,),
                                        0, 4))
    x3 = np.stack([np.rot90(v3[i], rot[i], axes=(0, 1)) for i in range(B)])
    online = {k: client['params'][k] for k in ('encoder', 'projector')}
    want_t = jax.tree_util.tree_map(lambda t, o: 0.9 * t + 0.1 * o, _np(client['target']['params']),
                                    _np(online))
    for a, b in zip(jax.tree_util.tree_leaves(tparams), jax.tree_util.tree_leaves(want_t)):
      np.testing.assert_allclose(np.asarray(a), b, rtol=1e-14, atol=1e-16)
    apply = jax.jit(lambda p, bs, x: ssl_client.apply_train(spec.model, p, bs, x,
                                                            with_predictor=False))
    t, _ = apply(tparams, client['target']['batch_stats'], v1)
    _, bs = apply(online, client['batch_stats'], v1)
    o2, bs = apply(online, bs, v2)
    o3, _ = apply(online, bs, x3)
  z2, z3, zt = np.asarray(o2['z']), np.asarray(o3['z']), np.asarray(t['z'])
  # Unit rows: a near-zero entry carries the float64 rounding of the row's scale (~1e-16), which no
  # relative bound of its own meets (1 of 48 entries: 1.1e-14 relative under XLA:CPU's loop
  # emitters); atol 1e-15 is ~5 ulps of 1.
  np.testing.assert_allclose(np.asarray(tz), np_normalize(zt), rtol=1e-14, atol=1e-15)
  want_cluster = np_cluster_loss(z2, zt, np.asarray(msg['centroids']), OC.temperature)
  deg = _np(client['params']['deg'])
  logits = z3 @ deg['kernel'] + deg['bias']
  logits = logits - logits.max(axis=1, keepdims=True)
  want_deg = np.mean(np.log(np.exp(logits).sum(axis=1)) - logits[np.arange(B), rot])
  assert float(terms['cluster']) == pytest.approx(want_cluster, rel=1e-12)
  assert float(terms['deg']) == pytest.approx(want_deg, rel=1e-12)
  assert float(total) == pytest.approx(want_cluster + 0.7 * want_deg, rel=1e-12)
  assert want_cluster > 0.1 and want_deg > 0.1


def test_a_training_step_moves_the_target_first_and_feeds_the_bank():
  key = jax.random.PRNGKey(6)
  with jax.enable_x64(True):
    spec, algo, client, batch, msg = _setup(rounds_done=3)
    _, (_, tparams, _, tz, _) = jax.jit(functools.partial(orchestra.loss_fn, spec, OC))(
        client['params'], client, batch, key, msg)
    new, loss = jax.jit(algo.local_step)(client, batch, key, msg, 0.1)
    # The centroids are constants of the step: no gradient reaches them.
    g = jax.jit(jax.grad(lambda c: orchestra.loss_fn(spec, OC, client['params'], client, batch,
                                                     key, dict(msg, centroids=c))[0]))(
        msg['centroids'])
  assert not np.any(np.asarray(g))
  assert loss.dtype == jnp.float32 and float(loss) > 0
  # The same float64 operations traced inside lax.cond (fused differently): rounding only, a few
  # u of the parameters and, for the bank's unit rows (a forward through the network), of 1.
  for a, b in zip(jax.tree_util.tree_leaves(new['target']['params']),
                  jax.tree_util.tree_leaves(tparams)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-13, atol=1e-15)
  np.testing.assert_allclose(np.asarray(new['memory']),
                             np.concatenate([np.asarray(client['memory']), np.asarray(tz)])[-8:],
                             rtol=0, atol=1e-13)
  changed = lambda a, b: any(not np.array_equal(x, y) for x, y in
                             zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
  assert changed(new['params'], client['params'])
  assert changed(new['batch_stats'], client['batch_stats'])


def test_the_setup_round_trains_nothing_and_fills_the_bank_in_order():
  with jax.enable_x64(True):
    spec, algo, client, batch, msg = _setup(rounds_done=0)
    keys = [jax.random.PRNGKey(10 + i) for i in range(3)]
    step = jax.jit(algo.local_step)
    s1, l1 = step(client, batch, keys[0], msg, 0.1)
    s2, _ = step(s1, batch, keys[1], msg, 0.1)
    s3, _ = step(s2, batch, keys[2], msg, 0.1)

    @jax.jit
    def target_projection(k):
      v1 = ssl_client._views(spec, k, batch['x'], 3)[0]  # pylint: disable=protected-access
      t, _ = ssl_client.apply_train(spec.model, client['target']['params'],
                                    client['target']['batch_stats'], v1, with_predictor=False)
      return t['z']
    proj = [np_normalize(np.asarray(target_projection(k))) for k in keys[:2]]
  assert float(l1) == 0.0
  for s in (s1, s2, s3):
    for field in ('params', 'batch_stats', 'opt_state', 'target'):
      _assert_equal(s[field], client[field])
  # Unit rows, as in the test above: atol 1e-15 for their near-zero entries.
  np.testing.assert_allclose(np.asarray(s1['memory'][:B]), proj[0], rtol=1e-14, atol=1e-15)
  np.testing.assert_array_equal(np.asarray(s1['memory'][B:]), np.asarray(client['memory'][B:]))
  np.testing.assert_allclose(np.asarray(s2['memory']),
                             np.concatenate([proj[0], proj[1][:8 - B]]), rtol=1e-14, atol=1e-15)
  assert [int(s['filled']) for s in (s1, s2, s3)] == [B, 8, 8]
  _assert_equal(s3['memory'], s2['memory'])


# The round: tests/core/test_round_equivalence.py's clients (sizes 18/5/28/12/22/16, batch 8, 2
# epochs, 4 of 6 participants) with a bank of 12 (> the batch: partial FIFO pushes, a setup fill
# over two steps).
ROUND_OC = dataclasses.replace(OC, memory_size=12, global_iters=60)


def np_aggregate(server, payloads, weights):
  """The server written out: float64 data-weighted mean of the online networks and targets, the
  release's global clustering (numpy) of every participant's local centroids, one more round."""
  model = reference.numpy_weighted_mean(
      [{k: p[k] for k in ('params', 'batch_stats', 'target')} for p in payloads], weights)
  local = np.concatenate([np.asarray(p['local_centroids']) for p in payloads])
  centroids = np_global_clustering(local, np.asarray(server['centroids']), ROUND_OC.temperature,
                                   iters=ROUND_OC.global_iters)
  return dict(model, centroids=centroids.astype(np.asarray(server['centroids']).dtype),
              rounds_done=server['rounds_done'] + 1)


# vmap only: 'map' runs for one algorithm of each server shape in tests/core/test_round_equivalence.py
# (the strategies change how clients are mapped, not what an algorithm computes).
@pytest.mark.parametrize('strategy', ['vmap'])
def test_round_equals_a_per_client_loop_with_a_numpy_server(strategy):
  with jax.enable_x64(True):
    algo = orchestra.make(eq._spec('byol'), oc=ROUND_OC)
    twin = orchestra.make(eq._spec('byol'), oc=ROUND_OC, stateless=False)
    data = eq._data()
    cfg = eq._round_cfg(strategy, 4)
    step = rd.make_round_step(algo, cfg, eq.NUM_CLIENTS, donate=False)
    state = _float64(rd.init_state(algo, jax.random.PRNGKey(3), eq.NUM_CLIENTS))
    full = _float64(rd.init_state(twin, jax.random.PRNGKey(3), eq.NUM_CLIENTS).clients)
    assert state.clients == {}   # stateless: nothing is stored per client
    twin_step = jax.jit(twin.local_step)
    for r in range(3):
      key = rng.round_key(jax.random.PRNGKey(7), r)
      ref_clients, ref_server, ref_loss = reference.reference_round(
          twin, twin_step, full, state.server, data, key, r, clients_per_round=4,
          batch_size=eq.BATCH, local_epochs=eq.EPOCHS, lr_fn=cfg.lr_fn, aggregate=np_aggregate)
      before = state.server
      state, metrics = step(state, data, key)
      eq._assert_tree_close(state.server, ref_server, f'orchestra/{strategy} round {r} server')
      np.testing.assert_allclose(float(metrics['loss']), ref_loss, rtol=1e-6)
      full = ref_clients
      assert int(state.server['rounds_done']) == r + 1
      moved = any(not np.allclose(np.asarray(a), np.asarray(b)) for a, b in zip(
          jax.tree_util.tree_leaves(state.server['params']),
          jax.tree_util.tree_leaves(before['params'])))
      # Round 0 is the setup round: the model stays, the centroids are clustered.
      assert moved == (r > 0), r
      assert (ref_loss == 0.0) == (r == 0)
      assert not np.allclose(np.asarray(state.server['centroids']),
                             np.asarray(before['centroids']))


@pytest.mark.parametrize('overrides,message', [
    ({'orchestra.local_clusters': 33},
     r'config.orchestra.local_clusters = 33 is invalid: it must be <= orchestra.memory_size = 32'),
    ({'orchestra.global_clusters': 9},
     r'config.orchestra.global_clusters = 9 is invalid: it must be <= clients_per_round x '
     r'local_clusters = 2 x 4 = 8'),
    ({'orchestra.targets': 'sinkhorn', 'batch_size': 4, 'orchestra.local_clusters': 4},
     r"config.orchestra.global_clusters = 8 is invalid with orchestra.targets = 'sinkhorn': it "
     r'must be <= batch_size = 4'),
    ({'orchestra.temperature': -0.1}, r'config.orchestra.temperature = -0.1 is invalid'),
    ({'orchestra.temperature': 0.0}, r'config.orchestra.temperature = 0.0 is invalid'),
    ({'orchestra.ema_tau': 1.5}, r'config.orchestra.ema_tau = 1.5 is invalid'),
    ({'orchestra.deg_weight': -1.0}, r'config.orchestra.deg_weight = -1.0 is invalid'),
    ({'orchestra.sinkhorn_lambda': 0.0}, r'config.orchestra.sinkhorn_lambda = 0.0 is invalid'),
    ({'orchestra.global_clusters': 0}, r'config.orchestra.global_clusters = 0 is invalid'),
    ({'orchestra.local_iters': 0}, r'config.orchestra.local_iters = 0 is invalid'),
    ({'orchestra.targets': 'sinkorn'}, r"config.orchestra.targets = 'sinkorn' is invalid"),
    ({'ssl_method': 'simclr'}, r"config.ssl_method = 'simclr' is invalid for algorithm "
                               r"'orchestra': must be one of \('byol',\)"),
])
def test_bad_values_are_refused_in_one_line_before_compute(overrides, message):
  with pytest.raises(cv.ConfigError, match=message) as err:
    experiment.validate_config(_small_config('orchestra', **overrides))
  assert '\n' not in str(err.value)


def test_the_defaults_validate_and_the_paper_tables_settings_hold():
  experiment.validate_config(_small_config('orchestra'))
  block = experiment.default_config().orchestra
  assert (block.global_clusters, block.local_clusters, block.memory_size, block.temperature,
          block.ema_tau, block.projector_dim) == (128, 16, 128, 0.1, 0.996, 512)


def test_checkpoint_resume_is_exact_with_the_global_centroids(tmp_path):
  """3 rounds straight equal 2 rounds, a checkpoint, a restore into a fresh template and 1 more
  round, bit for bit: the server's centroids and round counter travel in FedState.server."""
  config = _small_config('orchestra', rounds=3)
  experiment.validate_config(config)
  run = _Run(config)
  one = run.rounds(run.init(), 1)
  two = run.rounds(one, 1)
  assert int(two.server['rounds_done']) == 2
  assert not np.array_equal(np.asarray(one.server['centroids']),
                            np.asarray(two.server['centroids']))
  with Checkpointer(str(tmp_path), save_every=1) as ckpt:
    ckpt.maybe_save(2, two)
    _, restored, _ = ckpt.restore(run.init())
  _assert_equal(restored.server, two.server)
  _assert_equal(run.rounds(restored, 1), run.rounds(two, 1))
