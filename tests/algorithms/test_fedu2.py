"""FedU2's server step (EUA) and client hook (FUR) beyond the round-equivalence tests: the EUA
geometry against numpy float64 (Theorem 1's equal directional derivatives on real parameter
trees, the step sizes, FedAvg as the limit of identical clients), the FUR term entering the loss
exactly once per view, and the config checks."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment, models, run_identity, tables
from fedjax_ssl.algorithms import fedu2, ssl_client
from fedjax_ssl.core import optim
from fedjax_ssl.data import augment


def _trees(seed, m):
  """A global pytree and m uploads = global + independent deviations of different sizes."""
  rs = np.random.default_rng(seed)
  glob = {'a': rs.normal(size=(3, 4)), 'b': {'c': rs.normal(size=(5,))}}
  ups = jax.tree_util.tree_map(
      lambda g: np.stack([g + rs.normal(scale=0.1 * (k + 1), size=g.shape) for k in range(m)]),
      glob)
  return glob, ups


def _flat(tree):
  return np.concatenate([np.ravel(l) for l in jax.tree_util.tree_leaves(tree)])


def _flat_stack(tree, m):
  return np.stack([_flat(jax.tree_util.tree_map(lambda a: a[k], tree)) for k in range(m)])


@pytest.mark.parametrize('direction', fedu2.EUA_DIRECTIONS)
def test_eua_update_gives_equal_directional_derivatives_to_active_clients(direction):
  """Theorem 1: along d = sum_k p_k g_k every client with p_k > 0 has the same first-order change
  rate <g_k, d>, and no client a smaller one (min-norm optimality); the update moves theta_g by
  server_lr * d exactly."""
  m = 5
  with jax.enable_x64(True):
    glob, ups = _trees(0, m)
    glob, ups = jax.tree_util.tree_map(jnp.asarray, (glob, ups))
    gram = fedu2.deviation_gram(glob, ups)
    res = fedu2.eua_coefficients(gram, jnp.full((m,), 1 / m), direction=direction,
                                 solver='exact', solver_iters=0, server_lr=0.3, step='fixed',
                                 admm_c=10.0, admm_rho=1.0)
    new = fedu2.apply_coefficients(glob, ups, res['coef'])
  deltas = _flat(glob)[None] - _flat_stack(ups, m)
  np.testing.assert_allclose(np.asarray(gram), deltas @ deltas.T, rtol=1e-12)
  norms = np.linalg.norm(deltas, axis=1)
  g = 2 * deltas / (norms if direction == 'code' else norms ** 2)[:, None]
  p = np.asarray(res['p'])
  d = p @ g
  np.testing.assert_allclose(_flat(new), _flat(glob) - 0.3 * d, rtol=1e-12, atol=1e-14)
  rates = g @ d
  active = p > 1e-6
  assert active.sum() >= 2
  np.testing.assert_allclose(rates[active], rates[active].mean(), rtol=1e-6)
  assert np.all(rates >= rates[active].mean() * (1 - 1e-6))
  np.testing.assert_allclose(np.asarray(res['deviation']), norms, rtol=1e-12)
  assert float(res['step_norm']) == pytest.approx(0.3 * np.linalg.norm(d), rel=1e-10)


def test_deviation_step_with_identical_clients_is_fedavg_and_code_step_is_bounded():
  with jax.enable_x64(True):
    glob, ups = _trees(1, 1)
    same = jax.tree_util.tree_map(lambda u: np.concatenate([u] * 4), ups)
    glob, same = jax.tree_util.tree_map(jnp.asarray, (glob, same))
    gram = fedu2.deviation_gram(glob, same)
    kw = dict(direction='code', solver='exact', solver_iters=0, admm_c=10.0, admm_rho=1.0)
    res = fedu2.eua_coefficients(gram, jnp.full((4,), 0.25), server_lr=1.0, step='deviation', **kw)
    new = fedu2.apply_coefficients(glob, same, res['coef'])
    np.testing.assert_allclose(_flat(new), _flat(jax.tree_util.tree_map(lambda u: u[0], same)),
                               rtol=1e-12, atol=1e-14)
    # The code's fixed step: |d| = 2 for agreeing clients, so the global model moves by 2 server_lr
    # whatever the deviation (overshooting it when |Delta| < 2 server_lr).
    res = fedu2.eua_coefficients(gram, jnp.full((4,), 0.25), server_lr=8.0, step='fixed', **kw)
    assert float(res['step_norm']) == pytest.approx(16.0, rel=1e-10)


def test_a_client_that_did_not_move_gets_a_zero_direction():
  with jax.enable_x64(True):
    glob, ups = _trees(2, 3)
    ups = jax.tree_util.tree_map(lambda u, g: np.concatenate([g[None], u[1:]]), ups, glob)
    gram = fedu2.deviation_gram(*jax.tree_util.tree_map(jnp.asarray, (glob, ups)))
    s = fedu2.direction_scales(jnp.diagonal(gram), 'code')
    assert float(s[0]) == 0.0 and np.all(np.isfinite(np.asarray(s)))
    res = fedu2.eua_coefficients(gram, jnp.full((3,), 1 / 3), direction='code', solver='exact',
                                 solver_iters=0, server_lr=1.0, step='fixed', admm_c=10.0,
                                 admm_rho=1.0)
    # g_0 = 0 is the min-norm point: the global model stays (where client 0 already is).
    assert float(res['step_norm']) == pytest.approx(0.0, abs=1e-9)


def _spec(reg):
  enc = models.get_encoder('small_cnn', conv_features=(4,), dense_features=(12, 6))
  model = models.SSLModel(enc, models.MLPHead(8, 5), models.MLPHead(8, 5))
  aug = augment.AugmentConfig(out_size=8, crop_scale=(0.5, 1.0), flip_prob=0.5, jitter_prob=0.0,
                              grayscale_prob=0.0)
  return ssl_client.ClientSpec(objective='byol', model=model, tx=optim.make_optimizer('sgd'), aug=aug,
                               mean=(0.5,), std=(0.3,), input_shape=(8, 8, 1),
                               feature_regularizer=reg)


def test_feature_regularizer_adds_its_term_once_per_view_with_the_regularizer_keys():
  seen = []

  def reg(z, key):
    seen.append((z, key))
    return jnp.sum(z ** 2) * 0.01 + jax.random.uniform(key)

  plain, with_reg = _spec(None), _spec(reg)
  client = ssl_client.init_client(plain, jax.random.PRNGKey(0))
  batch = {'x': jnp.asarray(np.random.default_rng(0).integers(0, 255, (6, 8, 8, 1)), jnp.uint8),
           'y': jnp.zeros((6,), jnp.int32)}
  key = jax.random.PRNGKey(5)
  base, _ = ssl_client.loss_fn(plain, client['params'], client, batch, key)
  total, _ = ssl_client.loss_fn(with_reg, client['params'], client, batch, key)
  assert len(seen) == 2
  keys = jax.random.split(jax.random.fold_in(key, ssl_client.REGULARIZER_STREAM), 2)
  expected = sum(float(jnp.sum(z ** 2) * 0.01 + jax.random.uniform(k))
                 for (z, _), k in zip(seen, keys))
  assert float(total - base) == pytest.approx(expected, rel=1e-5)
  assert not np.array_equal(np.asarray(seen[0][0]), np.asarray(seen[1][0]))


def _fedu2_config(**fedu2_overrides):
  c = experiment.default_config()
  c.dataset, c.algorithm, c.ssl_method = 'fashion_mnist_subset', 'fedu2', 'byol'
  c.num_clients = c.clients_per_round = 4
  for k, v in fedu2_overrides.items():
    c.fedu2[k] = v
  return c


@pytest.mark.parametrize('overrides,match', [
    (dict(fur='ot'), r"config.fedu2.fur = 'ot' is invalid: must be one of"),
    (dict(solver='sgd'), r"config.fedu2.solver = 'sgd' is invalid"),
    (dict(lambda_u=-0.1), r'config.fedu2.lambda_u = -0.1 is invalid: must be a finite number >= 0'),
    (dict(tau_a=0.0), r'config.fedu2.tau_a = 0.0 is invalid: must be a finite number > 0'),
    (dict(uot_iters=0), r'config.fedu2.uot_iters = 0 is invalid'),
])
def test_bad_fedu2_keys_are_named(overrides, match):
  with pytest.raises(cv.ConfigError, match=match):
    experiment.validate_config(_fedu2_config(**overrides))


def test_fedu2_needs_an_ssl_method_and_rejects_unknown_sub_keys():
  c = _fedu2_config()
  c.ssl_method = 'supervised'
  with pytest.raises(cv.ConfigError, match=r"ssl_method = 'supervised' is invalid for algorithm "
                                           r"'fedu2'"):
    experiment.validate_config(c)
  c = _fedu2_config()
  with pytest.raises(cv.ConfigError, match=r"unknown config key 'config.fedu2.lamda_u'.*did you "
                                           r"mean 'config.fedu2.lambda_u'"):
    cv.check_known_keys(ml_collections.ConfigDict(dict(c.to_dict(), fedu2={'lamda_u': 1.0})),
                        experiment.default_config())
  experiment.validate_config(_fedu2_config())


def test_tables_override_sub_config_keys_with_dots():
  table = tables.load_table('configs/fedu2/table2.py', 'quick')
  row = 'FedU2-FUR-BYOL (no FUR)'
  col = next(iter(table.columns))
  config = tables.cell_config(table, row, col, seed=1)
  assert config.fedu2.fur == 'none' and config.algorithm == 'fedu2'
  bad = tables.Table(name='t', title='t', base=table.base, rows={'r': {'fedu2.nope': 1}},
                     columns={'c': {}}, metrics=('knn_acc',))
  with pytest.raises(cv.ConfigError, match=r"config key 'fedu2.nope' does not exist"):
    tables.cell_config(bad, 'r', 'c', seed=0)
  # fedu2 keys do not split the runs of other algorithms.
  a, b = experiment.default_config(), experiment.default_config()
  b.fedu2.lambda_u = 0.5
  assert run_identity.run_key(a) == run_identity.run_key(b)
