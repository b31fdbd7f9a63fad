"""Hetero-SSFL: the multi-cohort round step equals a per-client loop with a float64 server; the
configuration of a mix of architectures is validated before any compute."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment, models
from fedjax_ssl.algorithms import hetero_ssfl, ssl_client
from fedjax_ssl.core import optim, rng
from fedjax_ssl.core import round as rd
from tests import reference
from tests.core.test_round_equivalence import (AUG, BATCH, EPOCHS, NUM_CLIENTS, _assert_tree_close,
                                          _data, _float64, _round_cfg)

RAD = 12
# Interleaved cohorts, so slots and global ids differ; with 3 of 6 participants a cohort's 3 slots
# are usually not all filled.
MEMBERS = ((0, 2, 3), (1, 4, 5))


def _spec(encoder, method='byol'):
  predictor = None if method == 'simclr' else models.MLPHead(8, 5)
  model = models.SSLModel(encoder, models.MLPHead(8, 5), predictor)
  tx = optim.make_optimizer('sgd', momentum=0.9, weight_decay=1e-3)
  return ssl_client.ClientSpec(objective=method, model=model, tx=tx, aug=AUG, mean=(0.5,),
                               std=(0.3,), input_shape=(8, 8, 1),
                               hparams={'ema_tau': 0.9, 'temperature': 0.5})


def _specs(method='byol'):
  return (('cnn', _spec(models.get_encoder('small_cnn', conv_features=(4,), dense_features=(12, 6)),
                        method)),
          ('mlp', _spec(models.get_encoder('mlp', features=(10, 6)), method)))


SPECS = _specs()

VARIANTS = {
    # The recommended decisions: 1 - centred CKA against Σ_j K_j / N over every client's cached
    # representation, sent as the L x L kernel, train-mode BatchNorm on RAD sub-batches of 6.
    'default': dict(mu=0.7, rad_batch=6),
    # Every literal alternative at once: + CKA, uncentred, feature averaging, the last round's
    # uploaders only, eval-mode BatchNorm, mu * sqrt(t), representations broadcast, the full RAD.
    'literal': dict(mu=0.7, rad_batch=0, sign='similarity', centered=False, average='features',
                    kbar_clients='participants', bn_mode='eval', mu_schedule='sqrt',
                    broadcast='representations'),
    # Over SimCLR (not in the paper): the projector output is aligned.
    'simclr': dict(mu=0.7, rad_batch=6),
}


def _hetero_data():
  data = _data()
  rs = np.random.RandomState(1)
  return data.replace(public_x=jnp.asarray(rs.randint(0, 256, (RAD, 8, 8, 1)).astype(np.uint8)))


@functools.lru_cache(maxsize=None)
def _algo(variant):
  specs = _specs('simclr' if variant == 'simclr' else 'byol')
  algo = hetero_ssfl.make(specs, MEMBERS, rad_size=RAD, **VARIANTS[variant])
  return algo, tuple(jax.jit(c.client.local_step) for c in algo.cohorts)


def _check(variant, strategy, rounds, m=3):
  kw = VARIANTS[variant]
  with jax.enable_x64(True):
    algo, steps = _algo(variant)
    data = _hetero_data()
    cfg = _round_cfg(strategy, m)
    step = rd.make_round_step(algo, cfg, NUM_CLIENTS, donate=False)
    state = _float64(rd.init_state(algo, jax.random.PRNGKey(3), NUM_CLIENTS))
    for r in range(rounds):
      key = rng.round_key(jax.random.PRNGKey(7), r)
      ref_clients, ref_server, ref_loss = reference.numpy_hetero_round(
          algo, steps, state.clients, state.server, data, key, r, clients_per_round=m,
          batch_size=BATCH, local_epochs=EPOCHS, lr_fn=cfg.lr_fn, mu=kw['mu'],
          **{k: kw[k] for k in ('mu_schedule', 'average', 'kbar_clients', 'broadcast') if k in kw})
      state, metrics = step(state, data, key)
      _assert_tree_close(state.clients, ref_clients, f'{variant}/{strategy} round {r} clients')
      _assert_tree_close(state.server, ref_server, f'{variant}/{strategy} round {r} server')
      np.testing.assert_allclose(float(metrics['loss']), ref_loss, rtol=1e-6)
  return state


# Two rounds, so the stale cache and the participants-only K̄ matter; each strategy once (map
# with chunks of 2 over a cohort's 3 slots: a full chunk and a remainder).
@pytest.mark.slow
@pytest.mark.parametrize('variant,strategy,rounds', [('default', 'vmap', 2), ('literal', 'map', 2),
                                                     ('simclr', 'vmap', 2)])
def test_cohort_round_step_matches_reference_loop(variant, strategy, rounds):
  state = _check(variant, strategy, rounds)
  # The alignment term is live: the cache holds distinct, non-zero representations per client.
  reps = np.concatenate([np.asarray(r) for r in state.server['reps']])
  assert np.all(np.abs(reps).max(axis=(1, 2)) > 0)


def test_alignment_term_reaches_the_gradient_and_mu_zero_is_plain_byol():
  """One local step with the broadcast's mu = 0 is exactly the plain BYOL step; mu > 0 moves the
  online network differently (the CKA term is in the gradient) and leaves the BYOL target's EMA
  rule unchanged."""
  algo, steps = _algo('default')
  spec = SPECS[0][1]
  client = jax.tree_util.tree_map(lambda a: a[0], algo.cohorts[0].client.init(
      jax.random.PRNGKey(3), 3)[0])
  data = _hetero_data()
  batch = {'x': data.x[:BATCH], 'y': data.y[:BATCH]}
  kbar = jnp.asarray(np.random.RandomState(2).randn(RAD, 4), jnp.float32)
  msg = {'kbar': kbar @ kbar.T, 'public_x': data.public_x}
  key = jax.random.PRNGKey(5)
  plain, plain_loss = jax.jit(functools.partial(ssl_client.local_step, spec))(
      client, batch, key, msg, 0.1)
  outs = {mu: steps[0](client, batch, key, dict(msg, mu=jnp.float32(mu)), 0.1) for mu in (0.0, 5.0)}
  # Equal up to float32 rounding: the 0 * penalty term changes XLA's fusion of the step (measured
  # differences are 1-2 ulp); the CKA term with mu = 5 moves the same leaves by > 1e-3 relative.
  for a, b in zip(jax.tree_util.tree_leaves(outs[0.0]), jax.tree_util.tree_leaves((plain, plain_loss))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  moved = outs[5.0][0]['params']['encoder']['conv1']['kernel'] - client['params']['encoder']['conv1']['kernel']
  plain_moved = plain['params']['encoder']['conv1']['kernel'] - client['params']['encoder']['conv1']['kernel']
  assert float(jnp.max(jnp.abs(moved - plain_moved))) > 1e-3 * float(jnp.max(jnp.abs(plain_moved)))
  assert float(outs[5.0][1]) > float(plain_loss)  # + 5 * (1 - CKA) with CKA < 1


def test_simclr_aligns_its_projector_output():
  """Over SimCLR Φ is the projector output z (BYOL: the predictor output p), in the cache's width
  and in the uploads."""
  data = _hetero_data()
  for method, key in (('simclr', 'z'), ('byol', 'p')):
    algo = hetero_ssfl.make(_specs(method), MEMBERS, rad_size=RAD, mu=0.5, rad_batch=6)
    spec = _specs(method)[0][1]
    client = jax.tree_util.tree_map(lambda a: a[0], algo.cohorts[0].client.init(
        jax.random.PRNGKey(3), 3)[0])
    variables = {'params': client['params'], 'batch_stats': client['batch_stats']}
    x = (data.public_x.astype(jnp.float32) / 255.0 - 0.5) / 0.3
    want = spec.model.apply(variables, x[:6], train=True, mutable=['batch_stats'])[0][key]
    got = hetero_ssfl.rad_representations(spec, variables, data.public_x[:6], bn_mode='train')
    # x / 255 differs from the uint8 table by an ulp; the forward pass keeps that at ~1e-6.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The upload passes the RAD in chunks of rad_batch = 6: its first chunk is the rows above.
    up = algo.cohorts[0].client.upload(client, {'public_x': data.public_x}, None)
    assert up.shape == (RAD, 5)
    np.testing.assert_allclose(up[:6], got, rtol=1e-5, atol=1e-5)
    assert [r.shape for r in algo.init(jax.random.PRNGKey(0), NUM_CLIENTS)[1]['reps']] == [
        (len(m), RAD, 5) for m in MEMBERS]


def test_standalone_mu_zero_exchanges_nothing():
  algo = hetero_ssfl.make(SPECS, MEMBERS, rad_size=RAD, mu=0.0)
  assert algo.prepare is None and not algo.uses_public
  assert algo.init(jax.random.PRNGKey(0), NUM_CLIENTS)[1] == {}


def test_rad_sub_batches_are_uniform_without_replacement():
  counts = np.zeros(RAD)
  for s in range(300):
    rows = np.asarray(hetero_ssfl.rad_indices(jax.random.PRNGKey(s), RAD, 4))
    assert len(set(rows.tolist())) == 4
    counts[rows] += 1
  # 4 of 12 per draw: 100 expected per row, binomial sd ~8.2.
  assert np.all(np.abs(counts - 100) < 5 * 8.2), counts
  np.testing.assert_array_equal(hetero_ssfl.rad_indices(jax.random.PRNGKey(0), RAD, RAD),
                                np.arange(RAD))


def _config(**hetero):
  c = experiment.default_config()
  c.update(dict(dataset='fashion_mnist_subset', algorithm='hetero_ssfl', num_clients=5,
                clients_per_round=5, partition='classes', classes_per_client=2, public_size=100,
                batch_size=32, knn_k=10, heads='custom'))
  c.hetero_ssfl.update(dict(dict(mix='small_cnn:3,mlp:2', rad_batch=50), **hetero))
  return c


def test_mix_assignment_is_recorded_and_covers_every_client():
  c = _config()
  assert hetero_ssfl.cohort_groups(c) == (('small_cnn', (0, 1, 2)), ('mlp', (3, 4)))
  c.hetero_ssfl.assignment = 'shuffled'
  groups = hetero_ssfl.cohort_groups(c)
  assert sorted(i for _, m in groups for i in m) == list(range(5))
  assert [len(m) for _, m in groups] == [3, 2]
  assert groups == hetero_ssfl.cohort_groups(c)  # a pure function of the seed
  c.seed = 1
  others = [hetero_ssfl.cohort_groups(c) for c.seed in range(1, 6)]
  assert any(o != groups for o in others)


@pytest.mark.parametrize('overrides,top,match', [
    (dict(mix='small_cnn:3,resnet99:2'), {}, "resnet99"),
    (dict(mix='small_cnn:3,mlp:1'), {}, 'add up to 4 clients, but config.num_clients = 5'),
    (dict(mix='small_cnn:3,small_cnn:2'), {}, "'small_cnn' appears twice"),
    (dict(mix='small_cnn=3'), {}, "is not 'encoder:count'"),
    (dict(mix='small_cnn:5,mlp:0'), {}, 'needs at least 1'),
    (dict(), dict(public_size=0), 'public_size = 0 is invalid for Hetero-SSFL'),
    (dict(rad_batch=30), {}, 'rad_batch = 30 is invalid with config.public_size = 100'),
    (dict(), dict(public_size=10_000), 'public_size = 10000 is invalid: must be <'),
    (dict(), dict(ssl_method='sc'), "ssl_method = 'sc' is invalid for algorithm"),
    (dict(bn_mode='batch'), {}, "hetero_ssfl.bn_mode = 'batch' is invalid"),
    (dict(), dict(algorithm='fedavg'), "several architectures in one federation"),
])
def test_bad_hetero_configs_fail_before_compute(overrides, top, match):
  c = _config(**overrides)
  c.update(top)
  with pytest.raises(cv.ConfigError, match=match):
    experiment.validate_config(c)


def test_valid_hetero_config_builds_one_cohort_per_encoder():
  c = _config()
  experiment.validate_config(c)
  dataset = experiment.load_data(c)
  algo = experiment.build_algorithm(c, dataset)
  assert [(co.name, co.members) for co in algo.cohorts] == [('small_cnn', (0, 1, 2)),
                                                            ('mlp', (3, 4))]
  clients, server = algo.init(jax.random.PRNGKey(0), 5)
  assert [jax.tree_util.tree_leaves(s)[0].shape[0] for s in clients] == [3, 2]
  assert [r.shape for r in server['reps']] == [(3, 100, 128), (2, 100, 128)]
