"""The server/client rules of FedAvg, FedU and FedEMA, the divergence, the weighted average and the
optimiser/schedule, checked against hand-written numpy versions of the formulas of EasyFL (the
FedU/FedEMA authors' code; docs/notes/fedssl.md#algorithms)."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import experiment, models
from fedjax_ssl.algorithms import fedavg, fedema, fedu, ssl_client
from fedjax_ssl.core.algorithm import restore_client, weighted_mean
from fedjax_ssl.algorithms.divergence import conv_divergence
from fedjax_ssl.core import optim
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import Dataset


def _spec():
  enc = models.get_encoder('small_cnn', conv_features=(3,), dense_features=(6, 4))
  model = models.SSLModel(enc, models.MLPHead(5, 4), models.MLPHead(5, 4))
  return ssl_client.ClientSpec(objective='byol', model=model, tx=optim.make_optimizer('sgd'),
                               aug=augment.AugmentConfig(), mean=(0.5,), std=(0.3,),
                               input_shape=(8, 8, 1))


def _client_and_global(spec):
  """A client whose every leaf differs from the global model's."""
  client = ssl_client.init_client(spec, jax.random.PRNGKey(0))
  other = ssl_client.init_client(spec, jax.random.PRNGKey(1))
  glob = fedavg.shared_subset(spec, other)
  glob['batch_stats'] = jax.tree_util.tree_map(lambda a: a + 3.0, glob['batch_stats'])
  return client, glob


def _assert_equal(actual, expected):
  """Exact leafwise equality of two pytrees of the same structure."""
  a, e = jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)
  assert len(a) == len(e) > 0
  for x, y in zip(a, e):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _np(tree):
  return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


def test_conv_divergence_matches_numpy():
  rs = np.random.RandomState(0)
  before = {'conv1': {'kernel': rs.randn(3, 3, 1, 4), 'bias': rs.randn(4)},
            'conv2': {'kernel': rs.randn(3, 3, 4, 8)}, 'fc': {'kernel': rs.randn(8, 2)}}
  after = jax.tree_util.tree_map(lambda a: a + rs.randn(*a.shape), before)
  expected = np.mean([np.linalg.norm((after[k]['kernel'] - before[k]['kernel']).ravel())
                      for k in ('conv1', 'conv2')])
  got = conv_divergence(jax.tree_util.tree_map(jnp.asarray, before),
                        jax.tree_util.tree_map(jnp.asarray, after))
  np.testing.assert_allclose(float(got), expected, rtol=1e-5)
  with pytest.raises(ValueError, match='convolution kernels'):
    conv_divergence({'fc': jnp.ones((2, 2))}, {'fc': jnp.zeros((2, 2))})


def test_weighted_mean_matches_numpy():
  rs = np.random.RandomState(1)
  stacked = {'a': rs.randn(3, 4, 2).astype(np.float32), 'b': rs.randn(3).astype(np.float32)}
  w = np.array([0.2, 0.5, 0.3], np.float32)
  got = weighted_mean(jax.tree_util.tree_map(jnp.asarray, stacked), jnp.asarray(w))
  for k in stacked:
    np.testing.assert_allclose(np.asarray(got[k]), np.tensordot(w.astype(np.float64), stacked[k], 1),
                               rtol=1e-6, atol=1e-7)


def test_cosine_schedule_and_sgd_match_pytorch_formulas():
  # round_lr is float32 by design. Its cos argument pi·t/T (<= pi) carries ~3 roundings and cos adds a few ulps, so
  # the absolute error is a few eps·base_lr, which near t = T is a large *relative* error of the small 1 + cos
  # (a fixed rtol = 1e-6 had a 3x margin). 16·eps·base_lr: > 25x margin; an off-by-one round moves the value by
  # >= 2e-2·base_lr.
  for t in (0, 3, 7, 10):
    np.testing.assert_allclose(float(optim.round_lr(0.032, 'cosine', t, 10)),
                               0.032 * (1 + math.cos(math.pi * t / 10)) / 2, rtol=0,
                               atol=16 * np.finfo(np.float32).eps * 0.032)
  assert float(optim.round_lr(0.1, 'constant', 5, 10)) == pytest.approx(0.1)
  # torch.optim.SGD(momentum=0.9, weight_decay=wd) after clip_grad_norm_(3): g <- clip(g) + wd*p;
  # buf <- 0.9 buf + g; p <- p - lr buf.
  tx = optim.make_optimizer('sgd', momentum=0.9, weight_decay=0.01, grad_clip_norm=3.0)
  p = np.array([1.0, -2.0]); buf = np.zeros(2); lr = 0.1
  params, state = jnp.asarray(p, jnp.float32), tx.init(jnp.asarray(p, jnp.float32))
  for g in ([3.0, 4.0], [0.5, -1.0]):
    g = np.array(g)
    g_clip = g * min(1.0, 3.0 / np.linalg.norm(g))
    buf = 0.9 * buf + g_clip + 0.01 * p
    p = p - lr * buf
    upd, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
    params = params - lr * upd
  np.testing.assert_allclose(np.asarray(params), p, rtol=1e-6)
  with pytest.raises(ValueError, match="optimizer.name = 'rmsprop'"):
    optim.make_optimizer('rmsprop')


def test_plain_sgd_is_the_gradient_and_trains():
  """momentum = 0 and weight_decay = 0 leave no transform (optax rejects an empty chain): the
  direction is the gradient itself, and a supervised FedAvg local step runs with it."""
  tx = optim.make_optimizer('sgd', momentum=0.0, weight_decay=0.0)
  params = jnp.asarray([1.0, -2.0])
  state = tx.init(params)
  for g in ([3.0, 4.0], [0.5, -1.0]):
    upd, state = tx.update(jnp.asarray(g), state, params)
    np.testing.assert_array_equal(np.asarray(upd), np.asarray(g, np.float32))
  config = experiment.default_config()
  config.update(dict(algorithm='fedavg', ssl_method='supervised', encoder='small_cnn',
                     heads='custom', augmentation='none', momentum=0.0, weight_decay=0.0,
                     num_clients=1, clients_per_round=1))
  x = np.random.RandomState(0).randint(0, 256, (8, 28, 28, 1)).astype(np.uint8)
  y = np.arange(8, dtype=np.int32) % 10
  ds = Dataset(name='tiny', train_x=x, train_y=y, test_x=x, test_y=y, num_classes=10,
               mean=(0.5,), std=(0.25,))
  algo = experiment.build_algorithm(config, ds)
  clients, server = algo.init(jax.random.PRNGKey(0), 1)
  msg = algo.broadcast(server)
  client = algo.begin(restore_client(algo, jax.tree_util.tree_map(lambda a: a[0], clients), msg),
                      msg, jax.random.PRNGKey(1))
  batch = {'x': jnp.asarray(x), 'y': jnp.asarray(y)}
  new, loss = jax.jit(algo.local_step)(client, batch, jax.random.PRNGKey(2), algo.broadcast(server),
                                       jnp.float32(0.1))
  assert np.isfinite(float(loss))
  moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree_util.tree_leaves(new['params']), jax.tree_util.tree_leaves(client['params']))]
  assert max(moved) > 0


@pytest.mark.parametrize('sync', ['keep', 'reset'])
def test_fedavg_begin_adopts_global_and_handles_target(sync):
  spec = _spec()
  algo = fedavg.make(spec, byol_target_sync=sync)
  client, glob = _client_and_global(spec)
  for participated in (0.0, 1.0):
    c = dict(client, extras={'participated': jnp.float32(participated)})
    out = algo.begin(c, glob, jax.random.PRNGKey(0))
    for k in ('encoder', 'projector', 'predictor'):
      _assert_equal(out['params'][k], glob['params'][k])
    fresh = participated == 0.0 or sync == 'reset'
    expected_target = glob['params']['encoder'] if fresh else client['target']['params']['encoder']
    _assert_equal(out['target']['params']['encoder'], expected_target)
    assert float(out['extras']['participated']) == 1.0


@pytest.mark.parametrize('divergence, expect_global', [(0.1, True), (0.9, False)])
def test_fedu_dapu_rule(divergence, expect_global):
  spec = _spec()
  algo = fedu.make(spec, dapu_threshold=0.4)
  client, glob = _client_and_global(spec)
  client['extras'] = {'participated': jnp.float32(1.0), 'divergence': jnp.float32(divergence)}
  out = algo.begin(client, glob, jax.random.PRNGKey(0))
  want_pred = glob if expect_global else client
  _assert_equal(out['params']['predictor'], want_pred['params']['predictor'])
  _assert_equal(out['params']['encoder'], glob['params']['encoder'])
  # The target stays local for a returning client.
  _assert_equal(out['target'], client['target'])


@pytest.mark.parametrize('divergence, scaler', [(0.2, 2.0), (0.3, 3.0), (0.8, 5.0)])
def test_fedema_mixing_rule(divergence, scaler):
  spec = _spec()
  algo = fedema.make(spec, autoscaler_tau=0.7)
  client, glob = _client_and_global(spec)
  client['extras'] = {'participated': jnp.float32(1.0), 'divergence': jnp.float32(divergence),
                      'scaler': jnp.float32(scaler)}
  out = algo.begin(client, glob, jax.random.PRNGKey(0))
  mu = min(scaler * divergence, 1.0)
  loc, g = _np(client['params']), _np(glob['params'])
  for k in ('encoder', 'projector', 'predictor'):
    for a, l, gg in zip(jax.tree_util.tree_leaves(out['params'][k]), jax.tree_util.tree_leaves(loc[k]),
                        jax.tree_util.tree_leaves(g[k])):
      np.testing.assert_allclose(np.asarray(a), mu * l + (1 - mu) * gg, rtol=1e-5, atol=1e-6)
  # BN statistics: encoder/projector global; predictor local iff mu > 0.5.
  pred_src = client if mu > 0.5 else glob
  _assert_equal(out['batch_stats']['predictor'], pred_src['batch_stats']['predictor'])
  _assert_equal(out['batch_stats']['projector'], glob['batch_stats']['projector'])


def test_fedema_first_participation_and_autoscaler():
  spec = _spec()
  algo = fedema.make(spec, autoscaler_tau=0.7)
  client, glob = _client_and_global(spec)
  client['extras'] = {'participated': jnp.float32(0.0), 'divergence': jnp.float32(0.0),
                      'scaler': jnp.float32(0.0)}
  start = algo.begin(client, glob, jax.random.PRNGKey(0))
  _assert_equal(start['params'], glob['params'])
  trained = dict(start, params=dict(start['params'], encoder=jax.tree_util.tree_map(
      lambda a: a + 0.01 * jnp.ones_like(a), start['params']['encoder'])))
  end = algo.end(start, trained, glob)
  d = float(conv_divergence(start['params']['encoder'], trained['params']['encoder']))
  np.testing.assert_allclose(float(end['extras']['divergence']), d, rtol=1e-6)
  np.testing.assert_allclose(float(end['extras']['scaler']), 0.7 / d, rtol=1e-5)
  # The scaler is fixed once: a second training keeps it.
  again = algo.end(start, dict(trained, extras=end['extras']), glob)
  np.testing.assert_allclose(float(again['extras']['scaler']), 0.7 / d, rtol=1e-5)


def test_fedu_and_fedema_need_a_predictor():
  spec = _spec()
  simclr = dataclasses.replace(spec, objective='simclr')
  with pytest.raises(ValueError, match="FedU needs a predictor: ssl_method = 'simclr' has none"):
    fedu.make(simclr)
  with pytest.raises(ValueError, match="FedEMA needs a predictor: ssl_method = 'simclr' has none"):
    fedema.make(simclr)
