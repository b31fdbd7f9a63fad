"""FedX as an algorithm: one step's loss is the sum of its four terms, each recomputed in float64
numpy from the same views (local NT-Xent, BYOL or alignment + uniformity, global NT-Xent against
the frozen global model, global and local relational terms against the anchor batch); the global
model gets no gradient; the relational terms wait for the first anchors; the step keeps its batch
as the next anchors; the predictor is averaged; and its config checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment, models
from fedjax_ssl.algorithms import fedx, ssl_client
from fedjax_ssl.core import optim
from fedjax_ssl.core.algorithm import restore_client
from fedjax_ssl.data import augment
from tests.algorithms.test_registry import _small_config
from tests.ops.test_relational import np_relational_js
from tests.ssl.test_align_uniform import np_align_uniform

AUG = augment.AugmentConfig(out_size=8, crop_scale=(0.5, 1.0), flip_prob=0.5, jitter_prob=0.0,
                            grayscale_prob=0.0)
B = 6


def _spec(method):
  enc = models.get_encoder('small_cnn', conv_features=(4,), dense_features=(12, 6))
  model = models.SSLModel(enc, models.MLPHead(8, 5), models.MLPHead(8, 5))
  return ssl_client.ClientSpec(objective=method, model=model, tx=optim.make_optimizer('sgd'), aug=AUG,
                               mean=(0.5,), std=(0.3,), input_shape=(8, 8, 1))


def _float64(tree):
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _setup(method, perturb=0.0):
  """A begun client with valid anchors, a batch, and a global model (the broadcast, or a perturbed
  copy of it so that global and local models differ)."""
  spec = _spec(method)
  algo = fedx.make(spec, batch_size=B)
  clients, server = algo.init(jax.random.PRNGKey(0), 1)
  client = algo.begin(restore_client(algo, jax.tree_util.tree_map(lambda a: a[0], clients), server),
                      server, jax.random.PRNGKey(1))
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randint(0, 256, (B, 8, 8, 1)).astype(np.uint8))
  anchors = jnp.asarray(rng.randint(0, 256, (B, 8, 8, 1)).astype(np.uint8))
  client = dict(client, anchor={'x': anchors, 'valid': jnp.ones((), jnp.float32)})
  leaves, tree = jax.tree_util.tree_flatten(server)
  keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
  glob = jax.tree_util.tree_unflatten(tree, [
      a + perturb * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)])
  return spec, algo, client, {'x': x, 'y': jnp.zeros(B, jnp.int32)}, glob


def np_nt_xent(z1, z2, t):
  z = np.concatenate([z1, z2]).astype(np.float64)
  z = z / np.linalg.norm(z, axis=1, keepdims=True)
  n = len(z)
  loss = 0.0
  for i in range(n):
    pos = (i + n // 2) % n
    logits = [z[i] @ z[j] / t for j in range(n) if j != i]
    loss += -(z[i] @ z[pos] / t) + np.log(np.sum(np.exp(logits)))
  return loss / n


def np_byol(p1, p2, t1, t2):
  cos = lambda a, b: np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
  return np.mean(2 - 2 * cos(p1, t2)) + np.mean(2 - 2 * cos(p2, t1))


@pytest.mark.parametrize('method,perturb', [('simclr', 0.0), ('simclr', 0.3), ('byol', 0.3),
                                             ('align_uniform', 0.3)])
def test_one_step_loss_is_the_sum_of_the_four_numpy_terms(method, perturb):
  fx = fedx.FedXConfig(global_weight=0.7, relational_weight=1.3)
  key = jax.random.PRNGKey(5)
  with jax.enable_x64(True):
    spec, _, client, batch, glob = _setup(method, perturb)
    client, glob = _float64(client), _float64(glob)
    total, (_, _, terms) = fedx.loss_fn(spec, fx, client['params'], client, batch, key, glob)
    assert total.dtype == jnp.float64
    # The same rows: both views from the step key, the anchors re-augmented from its own stream.
    v0, v1 = ssl_client._views(spec, key, batch['x'], 2)  # pylint: disable=protected-access
    va = augment.normalize(augment.augment_batch(jax.random.fold_in(key, fedx.ANCHOR_STREAM),
                                                 client['anchor']['x'], AUG), spec.mean, spec.std)
    x = jnp.concatenate([v0, v1, va])
    o, _ = ssl_client.apply_train(spec.model, client['params'], client['batch_stats'], x)
    g = spec.model.apply(glob, x, train=False, with_predictor=False)
    t = (ssl_client.apply_train(spec.model, client['target']['params'],
                                client['target']['batch_stats'], x[:2 * B],
                                with_predictor=False)[0]['z'] if method == 'byol' else None)
  z, p, gz = (np.asarray(o['z']), np.asarray(o['p']), np.asarray(g['z']))
  z0, z1, za = z[:B], z[B:2 * B], z[2 * B:]
  p0, p1 = p[:B], p[B:2 * B]
  local = {'byol': lambda: np_byol(p0, p1, np.asarray(t[:B]), np.asarray(t[B:])),
           'align_uniform': lambda: np_align_uniform(z0, z1),   # the SSD paper's FedX row
           'simclr': lambda: np_nt_xent(z0, z1, 0.1)}[method]()
  want = {'local': local,
          'global': np_nt_xent(p0, gz[B:2 * B], 0.1),
          'rel_global': np_relational_js(p0, p1, gz[2 * B:], 0.1, 0.01),
          'rel_local': np_relational_js(z0, z1, za, 0.1, 0.01)}
  for name, value in want.items():
    assert float(terms[name]) == pytest.approx(value, rel=1e-10), name
    assert abs(value) > 1e-6, name   # no term vanishes by construction (align_uniform's is < 0)
  assert float(total) == pytest.approx(
      want['local'] + 0.7 * want['global'] + 1.3 * (want['rel_global'] + want['rel_local']),
      rel=1e-10)
  if perturb == 0.0:   # global = local model: only BatchNorm's train / inference mode differs
    assert not np.allclose(gz[B:2 * B], z1)


def test_the_global_model_is_frozen_and_relational_terms_wait_for_anchors():
  spec, algo, client, batch, glob = _setup('simclr', 0.3)
  fx = fedx.FedXConfig()
  key = jax.random.PRNGKey(3)
  g_grad = jax.grad(lambda gl: fedx.loss_fn(spec, fx, client['params'], client, batch, key, gl)[0])(glob)
  assert all(float(jnp.max(jnp.abs(a))) == 0.0 for a in jax.tree_util.tree_leaves(g_grad))
  fresh = dict(client, anchor=dict(client['anchor'], valid=jnp.zeros((), jnp.float32)))
  total, (_, _, terms) = fedx.loss_fn(spec, fx, fresh['params'], fresh, batch, key, glob)
  assert float(total) == pytest.approx(float(terms['local'] + terms['global']), rel=1e-6)
  new, loss = algo.local_step(fresh, batch, key, glob, 0.1)
  assert float(loss) == pytest.approx(float(total), rel=1e-6)
  np.testing.assert_array_equal(np.asarray(new['anchor']['x']), np.asarray(batch['x']))
  assert float(new['anchor']['valid']) == 1.0
  # The whole online network goes up, the predictor included (SimCLR's too).
  assert set(algo.upload(new, glob, None)['params']) == {'encoder', 'projector', 'predictor'}


def test_a_byol_step_moves_the_target_by_its_ema():
  """FedX-BYOL's step: the target becomes tau * target + (1 - tau) * the new online network (the
  BYOL block's ema_tau), which an objective-registry rename once broke (issue 49's runs found it)."""
  spec, algo, client, batch, glob = _setup('byol', 0.3)
  tau = spec.hparams['ema_tau']
  assert 0 < tau < 1
  new, loss = algo.local_step(client, batch, jax.random.PRNGKey(3), glob, 0.1)
  assert np.isfinite(float(loss))
  online = ssl_client.target_from_online(new['params'], new['batch_stats'])['params']
  for old_t, new_t, on in zip(*(jax.tree_util.tree_leaves(x) for x in (
      client['target']['params'], new['target']['params'], online))):
    want = tau * np.asarray(old_t) + (1 - tau) * np.asarray(on)
    np.testing.assert_allclose(np.asarray(new_t), want, rtol=1e-6, atol=1e-7)


def test_config_checks():
  experiment.validate_config(_small_config('fedx'))
  experiment.validate_config(_small_config('fedx', ssl_method='byol'))
  for key, value, match in [('fedx.temperature', 0.0, 'fedx.temperature'),
                            ('fedx.relational_weight', -1.0, 'fedx.relational_weight'),
                            ('pred_out', 4, 'pred_out')]:
    with pytest.raises(cv.ConfigError, match=match):
      experiment.validate_config(_small_config('fedx', **{key: value}))
  with pytest.raises(cv.ConfigError, match="'fedx'"):
    experiment.validate_config(_small_config('fedx', ssl_method='simsiam'))
