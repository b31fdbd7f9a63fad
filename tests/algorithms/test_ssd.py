"""SSD as an algorithm: the vectorised round against the slow per-client reference loop
(tests/reference.py) with the personalised index and (slot mode) the round's cohort written
independently; a step's loss is the base loss plus ½ Σ_v (gamma DSR + delta PD) of the numpy
references; gamma = delta = 0 is FedAlignUniform bit for bit over two rounds; the upload is
FedAvg's; which vector a client gets; and the config checks (one line, before compute)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment, models
from fedjax_ssl.algorithms import fedavg, ssd, ssl_client
from fedjax_ssl.core import optim, rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import restore_client
from tests import reference
from tests.algorithms import test_registry
from tests.algorithms.test_registry import _small_config
from tests.core.test_round_equivalence import (AUG, BATCH, EPOCHS, NUM_CLIENTS, _assert_tree_close,
                                               _data, _float64, _overlay, _persisted, _round_cfg)
from tests.ops.test_ssd import dsr_code, dsr_hard_code, pd_code

DIM = 6   # the encoder's features and the projector output (projector distillation compares them)


def _spec():
  enc = models.get_encoder('small_cnn', conv_features=(4,), dense_features=(12, DIM))
  model = models.SSLModel(enc, models.MLPHead(8, DIM), None)
  return ssl_client.ClientSpec(objective='align_uniform', model=model,
                               tx=optim.make_optimizer('sgd', momentum=0.9, weight_decay=1e-3),
                               aug=AUG, mean=(0.5,), std=(0.3,), input_shape=(8, 8, 1))


SPEC = _spec()


@functools.lru_cache(maxsize=None)
def _algo(assign='client', gamma=1.0, delta=0.1, stateless=True, m=4, separation='soft'):
  sc = ssd.SSDConfig(assign=assign, gamma=gamma, delta=delta, separation=separation)
  q, d = ssd.draw(0, NUM_CLIENTS, DIM, sc)
  algo = ssd.make(SPEC, q=q, d=d, sc=sc, clients_per_round=m, stateless=stateless)
  return algo, jax.jit(algo.local_step)


def _ref_hooks(assign):
  """(prepare, personalize, aggregate) of the reference loop, written from the module docstring."""
  if assign == 'client':
    return None, lambda msg, cid: dict(msg, ssd_index=np.int32(cid)), None
  prepare = lambda server, data, ids, r, key: dict(server, ssd_cohort=np.asarray(ids, np.int32))

  def personalize(msg, cid):
    out = {k: v for k, v in msg.items() if k != 'ssd_cohort'}
    return dict(out, ssd_index=np.int32(list(np.asarray(msg['ssd_cohort'])).index(cid)))

  def aggregate(server, payloads, weights):
    return dict(reference.numpy_weighted_mean(payloads, weights), ssd_cohort=server['ssd_cohort'])
  return prepare, personalize, aggregate


@pytest.mark.parametrize('assign', ['client', 'slot'])
def test_vmap_round_step_matches_reference_loop(assign):
  """4 of 6 clients, two rounds (first-time and returning participants), float64."""
  m = 4
  prepare, personalize, aggregate = _ref_hooks(assign)
  with jax.enable_x64(True):
    algo, _ = _algo(assign, m=m)
    twin, twin_step = _algo(assign, stateless=False, m=m)
    data = _data()
    cfg = _round_cfg('vmap', m)
    step = rd.make_round_step(algo, cfg, NUM_CLIENTS, donate=False)
    state = _float64(rd.init_state(algo, jax.random.PRNGKey(3), NUM_CLIENTS))
    full = _float64(rd.init_state(twin, jax.random.PRNGKey(3), NUM_CLIENTS)).clients
    for r in range(2):
      key = rng.round_key(jax.random.PRNGKey(7), r)
      ref_clients, ref_server, ref_loss = reference.reference_round(
          twin, twin_step, _overlay(full, state.clients), state.server, data, key, r,
          clients_per_round=m, batch_size=BATCH, local_epochs=EPOCHS, lr_fn=cfg.lr_fn,
          prepare=prepare, personalize=personalize, aggregate=aggregate)
      state, metrics = step(state, data, key)
      _assert_tree_close(state.clients, _persisted(algo, ref_clients), f'ssd/{assign} round {r}')
      full = ref_clients
      server = {k: v for k, v in state.server.items() if k != 'ssd_cohort'}
      want = {k: v for k, v in ref_server.items() if k != 'ssd_cohort'}
      _assert_tree_close(server, want, f'ssd/{assign} round {r} server')
      if assign == 'slot':
        ids = rd.sample_participants(key, NUM_CLIENTS, m)
        assert np.array_equal(np.asarray(state.server['ssd_cohort']), np.asarray(ids))
      np.testing.assert_allclose(float(metrics['loss']), ref_loss, rtol=1e-6)


def _client_and_batch(algo, seed=0):
  clients, server = algo.init(jax.random.PRNGKey(seed), 1)
  client = algo.begin(restore_client(algo, jax.tree_util.tree_map(lambda a: a[0], clients),
                                     server), server, jax.random.PRNGKey(1))
  x = np.random.RandomState(seed).randint(0, 256, (16, 8, 8, 1)).astype(np.uint8)
  return client, {'x': jnp.asarray(x), 'y': jnp.zeros(16, jnp.int32)}


@pytest.mark.parametrize('cid,separation', [(0, 'soft'), (4, 'soft'), (4, 'hard')])
def test_step_loss_is_the_base_loss_plus_half_the_view_sum_of_numpy_dsr_and_pd(cid, separation):
  gamma, delta = 0.7, 0.3
  algo, _ = _algo(gamma=gamma, delta=delta, separation=separation)
  q, soft = ssd.draw(0, NUM_CLIENTS, DIM, ssd.SSDConfig())
  _, d = ssd.draw(0, NUM_CLIENTS, DIM, ssd.SSDConfig(separation=separation))
  # HSD's reference is the projection onto the soft vector's block (the same draws).
  dsr = ((lambda z: dsr_code(z, q, d[cid])) if separation == 'soft' else
         (lambda z: dsr_hard_code(z, q[:, soft[cid] > 1])))
  key = jax.random.PRNGKey(5)
  with jax.enable_x64(True):
    client, batch = _client_and_batch(algo)
    client = _float64(client)
    reg = ssd.regularizer(ssd.SSDConfig(gamma=gamma, delta=delta, separation=separation),
                          jnp.asarray(q), jnp.asarray(d[cid]))
    spec = ssl_client.ClientSpec(**{**SPEC.__dict__, 'feature_regularizer': reg,
                                    'regularized': 'outputs'})
    total, _ = ssl_client.loss_fn(spec, client['params'], client, batch, key)
    plain, _ = ssl_client.loss_fn(SPEC, client['params'], client, batch, key)
    views = ssl_client._views(SPEC, key, batch['x'], 2)  # pylint: disable=protected-access
    bs, outs = client['batch_stats'], []
    for v in views:
      o, bs = ssl_client.apply_train(SPEC.model, client['params'], bs, v, with_predictor=False)
      outs.append(o)
    # The algorithm's own step: the same loss through its personalised index.
    _, step_loss = algo.local_step(client, batch, key, {'ssd_index': jnp.int32(cid)},
                                   jnp.float64(0.0))
  want = sum(0.5 * (gamma * dsr(np.asarray(o['z']))
                    + delta * pd_code(np.asarray(o['h']), np.asarray(o['z']))) for o in outs)
  assert want > 1e-3 * abs(float(plain))
  # One forward of a 3-layer network and the terms, in float64: ~1e3 x 1.1e-16.
  assert float(total) - float(plain) == pytest.approx(want, rel=1e-11, abs=1e-11)
  assert float(step_loss) == pytest.approx(float(total), rel=1e-14)


def test_gamma_delta_0_is_fed_align_uniform_bit_for_bit():
  """Two rounds of 4 of 6 clients: the same keys and the same trajectory as FedAvg of the base."""
  algo, _ = _algo(gamma=0.0, delta=0.0)
  base = fedavg.make(SPEC)
  cfg = _round_cfg('vmap', 4)
  data = _data()
  states = [rd.init_state(a, jax.random.PRNGKey(3), NUM_CLIENTS) for a in (algo, base)]
  steps = [rd.make_round_step(a, cfg, NUM_CLIENTS, donate=False) for a in (algo, base)]
  for r in range(2):
    key = rng.round_key(jax.random.PRNGKey(7), r)
    states = [s(st, data, key)[0] for s, st in zip(steps, states)]
  for a, b in zip(jax.tree_util.tree_leaves(states[0]), jax.tree_util.tree_leaves(states[1])):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_upload_is_fedavgs_and_vectors_stay_with_their_client():
  algo, _ = _algo()
  base = fedavg.make(SPEC)
  client, _ = _client_and_batch(algo)
  up, want = algo.upload(client, None, None), base.upload(client, None, None)
  assert jax.tree_util.tree_structure(up) == jax.tree_util.tree_structure(want)
  for a, b in zip(jax.tree_util.tree_leaves(up), jax.tree_util.tree_leaves(want)):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  _, server = algo.init(jax.random.PRNGKey(0), NUM_CLIENTS)
  for cid in range(NUM_CLIENTS):  # client mode: the index is the id, whoever else takes part
    assert int(algo.personalize(server, jnp.int32(cid))['ssd_index']) == cid
  slot, _ = _algo('slot', m=4)
  _, server = slot.init(jax.random.PRNGKey(0), NUM_CLIENTS)
  server = dict(server, ssd_cohort=jnp.asarray([1, 2, 4, 5], jnp.int32))
  assert [int(slot.personalize(server, jnp.int32(c))['ssd_index']) for c in (1, 2, 4, 5)] == [
      0, 1, 2, 3]   # slot mode: only the first clients_per_round vectors are used
  # The vectors are drawn from the seed alone: the same every time.
  q, d = ssd.draw(3, 10, 512, ssd.SSDConfig())
  q2, d2 = ssd.draw(3, 10, 512, ssd.SSDConfig())
  assert np.array_equal(q, q2) and np.array_equal(d, d2) and np.all((d > 1).sum(1) == 51)


@pytest.mark.parametrize('overrides,message', [
    ({'ssd.alpha': 0.0}, r'config.ssd.alpha = 0.0 is invalid: must be a finite number > 0'),
    ({'ssd.temperature': -0.5}, r'config.ssd.temperature = -0.5 is invalid: must be a finite '
                                r'number > 0'),
    ({'num_clients': 200, 'clients_per_round': 2},
     r'config.num_clients = 200 is invalid for algorithm ssd with a 128-d projector output: each '
     r'client needs its own disjoint block'),
    ({'ssl_method': 'supervised'}, r"config.ssl_method = 'supervised' is invalid for algorithm "
                                   r"'ssd': it needs an objective with a projector"),
    ({'proj_out': 64}, r"config.ssd.delta = 0.1 is invalid with encoder 'mlp' \(128-d features\) "
                       r"and a 64-d projector output"),
    ({'ssd.assign': 'slots'}, r"config.ssd.assign = 'slots' is invalid: .*did you mean 'slot'"),
    ({'ssd.separation': 'hsd'}, r"config.ssd.separation = 'hsd' is invalid: must be one of"),
])
def test_bad_values_are_refused(overrides, message):
  with pytest.raises(cv.ConfigError, match=message):
    experiment.validate_config(_small_config('ssd', **overrides))


def test_defaults_are_the_codes():
  c = experiment.default_config().ssd
  assert (c.alpha, c.gamma, c.delta, c.temperature) == (10.0, 1.0, 0.1, 0.5)
  assert (c.dsr_form, c.basis, c.assign, c.pd_direction, c.separation) == (
      'code', 'random_orthogonal', 'client', 'code', 'soft')
  experiment.validate_config(_small_config('ssd', proj_out=64, **{'ssd.delta': 0.0}))


@pytest.mark.parametrize('assign', ['client', 'slot'])
def test_a_server_optimizer_steps_ssds_global_model(assign):
  """SSD keeps FedAvg's global model (slot mode beside the round's cohort): FedAdam steps it, and
  the evaluated variables are the online network alone."""
  config = _small_config('ssd', server_optimizer='adam', server_lr=0.01,
                         **{'ssd.assign': assign})
  algo, state, metrics = test_registry._one_round(config)
  assert np.isfinite(metrics['loss']) and int(state.round) == 1
  variables, per_client = algo.eval_variables(state)
  assert not per_client and set(variables) == {'params', 'batch_stats'}
