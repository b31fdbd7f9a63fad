"""FedDecorr and L-DAWA as algorithms: FedDecorr's local loss is the base SSL loss plus beta times
the numpy decorrelation loss of each view's representation (backbone or projector), beta = 0 is
FedAvg's step bit for bit; L-DAWA's server is the numpy L-DAWA of the uploads around the round's
global model (uniform or data-size weights); and their config checks."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment, models
from fedjax_ssl.algorithms import fedavg, feddecorr, ldawa, ssl_client
from fedjax_ssl.core import optim
from fedjax_ssl.core.algorithm import restore_client
from fedjax_ssl.data import augment
from fedjax_ssl.ops import decorr
from tests.algorithms.test_registry import _small_config
from tests.ops.test_decorr import np_feddecorr
from tests.ops.test_ldawa import np_ldawa

AUG = augment.AugmentConfig(out_size=8, crop_scale=(0.5, 1.0), flip_prob=0.5, jitter_prob=0.0,
                            grayscale_prob=0.0)


def _spec(method):
  enc = models.get_encoder('small_cnn', conv_features=(4,), dense_features=(12, 6))
  pred = models.MLPHead(8, 5) if method in ('byol', 'simsiam') else None
  model = models.SSLModel(enc, models.MLPHead(8, 5), pred)
  return ssl_client.ClientSpec(objective=method, model=model, tx=optim.make_optimizer('sgd'), aug=AUG,
                               mean=(0.5,), std=(0.3,), input_shape=(8, 8, 1))


def _client_and_batch(spec, seed=0):
  algo = fedavg.make(spec)
  clients, server = algo.init(jax.random.PRNGKey(seed), 1)
  client = algo.begin(restore_client(algo, jax.tree_util.tree_map(lambda a: a[0], clients), server),
                      server, jax.random.PRNGKey(1))
  x = np.random.RandomState(seed).randint(0, 256, (16, 8, 8, 1)).astype(np.uint8)
  return client, {'x': jnp.asarray(x), 'y': jnp.zeros(16, jnp.int32)}


def _float64(tree):
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


# One forward pass of a 3-layer network and the loss, in float64: rounding ~1e3 x 1.1e-16.
RTOL = 1e-11


@pytest.mark.parametrize('method,features', [('simsiam', 'backbone'), ('byol', 'projector'),
                                             ('simclr', 'backbone')])
def test_feddecorr_loss_is_the_ssl_loss_plus_beta_times_numpy_decorrelation(method, features):
  beta = 0.3
  base = _spec(method)
  spec = dataclasses.replace(
      base, feature_regularizer=lambda z, key: beta * decorr.feddecorr_loss(z),
      regularized=feddecorr.FEATURES[features])
  assert feddecorr.make(base, beta=beta, features=features).name == 'feddecorr'
  key = jax.random.PRNGKey(5)
  with jax.enable_x64(True):
    client, batch = _client_and_batch(base)
    client = _float64(client)
    total, _ = ssl_client.loss_fn(spec, client['params'], client, batch, key)
    plain, _ = ssl_client.loss_fn(base, client['params'], client, batch, key)
    assert total.dtype == jnp.float64
    # The representations the term must see: the same two views, in train mode, BatchNorm running
    # statistics updated by the first view before the second (as loss_fn does).
    v1, v2 = ssl_client._views(base, key, batch['x'], 2)  # pylint: disable=protected-access
    bs = client['batch_stats']
    o1, bs = ssl_client.apply_train(base.model, client['params'], bs, v1, with_predictor=False)
    o2, _ = ssl_client.apply_train(base.model, client['params'], bs, v2, with_predictor=False)
  out = feddecorr.FEATURES[features]
  want = beta * (np_feddecorr(np.asarray(o1[out])) + np_feddecorr(np.asarray(o2[out])))
  assert want > 1e-3 * abs(float(plain))   # the term is not negligible
  assert float(total) - float(plain) == pytest.approx(want, rel=RTOL, abs=RTOL * abs(float(plain)))


def test_feddecorr_beta_0_is_fedavg_step_bit_for_bit():
  spec = _spec('simsiam')
  client, batch = _client_and_batch(spec)
  key, lr = jax.random.PRNGKey(2), jnp.float32(0.1)
  got = jax.jit(feddecorr.make(spec, beta=0.0).local_step)(client, batch, key, None, lr)
  want = jax.jit(fedavg.make(spec).local_step)(client, batch, key, None, lr)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert jnp.array_equal(a, b)


@pytest.mark.parametrize('size_weights', [False, True])
def test_ldawa_server_is_numpy_ldawa_of_the_uploads(size_weights):
  spec = _spec('byol')
  algo = ldawa.make(spec, size_weights=size_weights)
  rs = np.random.default_rng(0)
  m = 3
  with jax.enable_x64(True):
    _, server = algo.init(jax.random.PRNGKey(0), m)
    server = _float64(server)
    uploads = [jax.tree_util.tree_map(lambda a: np.asarray(a) + 0.5 * rs.normal(size=a.shape),
                                      server) for _ in range(m)]
    weights = rs.dirichlet(np.ones(m))
    stacked = jax.tree_util.tree_map(lambda *a: jnp.asarray(np.stack(a)), *uploads)
    got = algo.aggregate(server, stacked, jnp.asarray(weights), jnp.arange(m))
  want = np_ldawa(uploads, jax.tree_util.tree_map(np.asarray, server),
                  weights if size_weights else np.full(m, 1 / m))
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=1e-13 * np.max(np.abs(w)))


@pytest.mark.parametrize('name,overrides,message', [
    ('feddecorr', {'feddecorr.beta': -0.1}, r'config.feddecorr.beta = -0.1 is invalid: must be a '
                                            r'finite number >= 0'),
    ('feddecorr', {'feddecorr.features': 'backbon'}, r"config.feddecorr.features = 'backbon' is "
                                                    r"invalid: .*did you mean 'backbone'"),
    ('feddecorr', {'ssl_method': 'sc'}, r"config.ssl_method = 'sc' is invalid for algorithm "
                                        r"'feddecorr': must be one of \('byol', 'simsiam', "
                                        r"'simclr', 'align_uniform'\)"),
])
def test_bad_values_are_refused(name, overrides, message):
  with pytest.raises(cv.ConfigError, match=message):
    experiment.validate_config(_small_config(name, **overrides))
