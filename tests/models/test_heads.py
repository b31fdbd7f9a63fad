"""fedjax_ssl/models/heads.py: the heads' parameter counts against the papers' code, BatchNorm in
training and evaluation against numpy, and the SSL model and classifier wiring."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import models
from tests.models.references import bn_count, dense_count, randn, random_variables, shape_params


@pytest.mark.parametrize('preset,expected_proj,expected_pred', [
    ('fedsc', 1_050_112, 1_050_112),                          # FedSC code: 512-1024-512 MLPs, no BN
    ('fedu2', 2_103_808, 2_103_808),                          # FedU2 code: 512-2048(BN)-512 MLPs
    ('easyfl', dense_count(512, 4096) + bn_count(4096) + dense_count(4096, 2048),
     dense_count(2048, 4096) + bn_count(4096) + dense_count(4096, 2048)),
])
def test_head_param_counts(preset, expected_proj, expected_pred):
  model = models.SSLModel(models.get_encoder('mlp', features=(512,)), *models.make_heads(preset))
  params = shape_params(model, (4, 4, 1))['params']
  assert set(params) == {'encoder', 'projector', 'predictor'}
  assert models.count_params(params['projector']) == expected_proj
  assert models.count_params(params['predictor']) == expected_pred


def test_mlp_head_batchnorm_train_and_eval():
  head = models.MLPHead(hidden=5, out=3, use_bn=True)
  x = np.random.default_rng(0).normal(size=(6, 4))
  xj = jnp.asarray(x, jnp.float32)
  v = random_variables(head, xj, seed=1, train=False)
  v['batch_stats'] = {'bn': {'mean': jnp.zeros(5), 'var': jnp.ones(5)}}  # fresh-init statistics
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), v['params'])
  a = x @ p['fc1']['kernel'] + p['fc1']['bias']

  def tail(n):
    return np.maximum(n * p['bn']['scale'] + p['bn']['bias'], 0) @ p['fc2']['kernel'] + p['fc2']['bias']

  # Train: normalise with the (biased) batch statistics, update running stats with momentum 0.9.
  y, upd = head.apply(v, xj, train=True, mutable=['batch_stats'])
  mu, var = a.mean(0), a.var(0)
  np.testing.assert_allclose(y, tail((a - mu) / np.sqrt(var + 1e-5)), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(upd['batch_stats']['bn']['mean'], 0.1 * mu, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(upd['batch_stats']['bn']['var'], 0.9 + 0.1 * var, rtol=1e-5, atol=1e-6)
  # Eval: running statistics are used and left unchanged.
  v2 = {'params': v['params'], 'batch_stats': upd['batch_stats']}
  y2, upd2 = head.apply(v2, xj, train=False, mutable=['batch_stats'])
  rm, rv = 0.1 * mu, 0.9 + 0.1 * var
  np.testing.assert_allclose(y2, tail((a - rm) / np.sqrt(rv + 1e-5)), rtol=1e-4, atol=1e-4)
  for s, t in zip(jax.tree_util.tree_leaves(upd2), jax.tree_util.tree_leaves(upd)):
    np.testing.assert_array_equal(s, t)


def test_ssl_model_and_classifier_wiring():
  model = models.build_ssl_model('mlp', 'fedsc', features=(6,))
  x = randn(0, (4, 3, 3, 1))
  v = random_variables(model, x, seed=1, train=True)
  assert set(v['params']) == {'encoder', 'projector', 'predictor'}
  out = jax.jit(lambda v, x: model.apply(v, x, train=False))(v, x)
  assert set(out) == {'h', 'z', 'p'}
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), v['params'])
  flat = np.asarray(x, np.float64).reshape(4, -1)
  h = np.maximum(flat @ p['encoder']['fc1']['kernel'] + p['encoder']['fc1']['bias'], 0)
  mlp = lambda q, u: np.maximum(u @ q['fc1']['kernel'] + q['fc1']['bias'], 0) @ q['fc2']['kernel'] + q['fc2']['bias']
  np.testing.assert_allclose(out['h'], h, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out['z'], mlp(p['projector'], h), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out['p'], mlp(p['predictor'], mlp(p['projector'], h)), rtol=1e-4, atol=1e-5)
  # BYOL target: the {'encoder', 'projector'} subtree applied without the predictor.
  target = {'params': {k: v['params'][k] for k in ('encoder', 'projector')}}
  t = jax.jit(lambda v, x: model.apply(v, x, train=False, with_predictor=False))(target, x)
  assert set(t) == {'h', 'z'}
  np.testing.assert_allclose(t['z'], out['z'], rtol=1e-6)
  # No projector: z is h.
  bare = models.SSLModel(models.get_encoder('mlp', features=(6,)))
  o = bare.apply({'params': {'encoder': v['params']['encoder']}}, x, train=False)
  np.testing.assert_array_equal(o['z'], o['h'])
  clf = models.Classifier(models.get_encoder('mlp', features=(6,)), 5)
  cv = random_variables(clf, x, seed=2, train=False)
  assert set(cv['params']) == {'encoder', 'head'}
  q = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), cv['params'])
  hc = np.maximum(flat @ q['encoder']['fc1']['kernel'] + q['encoder']['fc1']['bias'], 0)
  np.testing.assert_allclose(clf.apply(cv, x, train=False), hc @ q['head']['kernel'] + q['head']['bias'],
                             rtol=1e-5, atol=1e-5)
