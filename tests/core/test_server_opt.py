"""core/server_opt.py: each server optimizer against a float64 numpy transcription of Reddi et al.'s
equations for three steps, the wrapper around an algorithm's server (aggregate, broadcast, prepare,
evaluation), plain FedAvg unchanged bit for bit, exact resume from a checkpoint, and the config
checks."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import algorithms, experiment
from fedjax_ssl.algorithms import fedavg, ssl_client
from fedjax_ssl.runs.checkpoint import Checkpointer
from fedjax_ssl.core import rng, server_opt
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import Algorithm, Prepare, weighted_mean
from fedjax_ssl.core.state import FedState
from fedjax_ssl.data.types import DataInfo
from tests.algorithms import test_registry
from tests.algorithms.test_registry import _small_config

# Non-default hyper-parameters, so that a rule using a default where it should not fails; eps large
# enough that v_{-1} = eps² and eps in the denominator both matter.
HP = dict(lr=0.3, momentum=0.8, b1=0.7, b2=0.95, eps=1e-2)
# The size of the pseudo-gradient in each of the three steps: large, small, medium, so that Yogi's
# sign(v - g²) takes both signs.
STEP_SCALES = (1.0, 0.01, 0.3)


def np_server_steps(name, x, proposals, lr, momentum, b1, b2, eps, yogi_signs=None):
  """Reddi et al. (ICLR 2021), Algorithm 2 with Δ = x̄ - x (the proposal minus the global model),
  and FedAvgM as heavy-ball momentum on -Δ; returns the parameters after each step (and appends
  Yogi's sign(v - Δ²) of each step to `yogi_signs`)."""
  x = np.asarray(x, np.float64)
  m, v, buf = np.zeros_like(x), np.full_like(x, eps ** 2), np.zeros_like(x)
  out = []
  for xbar in proposals:
    delta = np.asarray(xbar, np.float64) - x
    if name == 'sgd':
      x = x + lr * delta
    elif name == 'momentum':
      buf = momentum * buf - delta
      x = x - lr * buf
    else:
      m = b1 * m + (1 - b1) * delta
      if name == 'adam':
        v = b2 * v + (1 - b2) * delta ** 2
      elif name == 'yogi':
        if yogi_signs is not None:
          yogi_signs.append(np.sign(v - delta ** 2))
        v = v - (1 - b2) * delta ** 2 * np.sign(v - delta ** 2)
      else:
        v = v + delta ** 2
      x = x + lr * m / (np.sqrt(v) + eps)
    out.append(x)
  return out


# Three steps of a handful of float64 operations per entry: rounding ~10 x 1.1e-16 relative to the
# parameters' scale (Adam-type steps divide by sqrt(v) + eps >= 2 eps, bounded).
RTOL = 1e-12


@pytest.mark.parametrize('name', server_opt.OPTIMIZERS)
def test_rules_match_reddi_equations_for_three_steps(name):
  rs = np.random.default_rng(0)
  x0 = {'a': rs.normal(size=(4, 3)), 'b': rs.normal(size=5)}
  proposals = [jax.tree_util.tree_map(lambda p, s=s: p + s * rs.normal(size=p.shape), x0)
               for s in STEP_SCALES]
  with jax.enable_x64(True):
    tx = server_opt.make(name, **HP)
    params = jax.tree_util.tree_map(jnp.asarray, x0)
    state = tx.init(params)
    step = jax.jit(lambda p, q, s: server_opt.step(tx, p, q, s))
    got = []
    for xbar in proposals:
      # Each step starts from the previous step's parameters; the proposal is an offset of x0 so
      # that the pseudo-gradient is not the previous step's.
      params, state = step(params, jax.tree_util.tree_map(jnp.asarray, xbar), state)
      got.append(params)
  signs = []
  for key in x0:
    want = np_server_steps(name, x0[key], [p[key] for p in proposals], **HP, yogi_signs=signs)
    for t, (g, w) in enumerate(zip(got, want)):
      assert np.asarray(g[key]).dtype == np.float64
      np.testing.assert_allclose(np.asarray(g[key]), w, rtol=0, atol=RTOL * np.max(np.abs(w)),
                                 err_msg=f'{name} step {t} leaf {key}')
  if name == 'yogi':  # both branches of the sign were taken
    signs = np.concatenate([a.ravel() for a in signs])
    assert np.any(signs > 0) and np.any(signs < 0)


def test_sgd_at_lr_1_is_plain_aggregation():
  assert server_opt.make('sgd', 1.0) is None
  assert server_opt.make('sgd', 0.5) is not None
  with pytest.raises(ValueError, match=r"server_optimizer = 'adamw' is invalid"):
    server_opt.make('adamw')


def _toy_algorithm():
  """A server holding a global model {'params', 'batch_stats'} and a step counter, averaged by
  `aggregate`; a `prepare` that counts rounds (so the wrapper must keep the optimizer state
  through it); no clients."""
  server = {'params': {'w': jnp.arange(6.0).reshape(3, 2) / 7, 'b': jnp.ones(2)},
            'batch_stats': {'mean': jnp.zeros(2)}}
  return Algorithm(
      name='toy', init=lambda key, num_clients: ({}, dict(server, rounds=jnp.zeros(()))),
      broadcast=lambda s: {k: s[k] for k in ('params', 'batch_stats')}, begin=None,
      local_step=None, upload=None,
      aggregate=lambda s, p, w, ids: dict(s, **weighted_mean(p, w)),
      eval_variables=lambda state: (state.server['params'], False), encoder_apply=None,
      prepare=Prepare(lambda state, data, ids, key: dict(state.server,
                                                         rounds=state.server['rounds'] + 1)),
      host_metrics=lambda state: {'rounds': float(state.server['rounds'])},
      global_model=fedavg.ONLINE_PARAMS)


def test_wrapped_server_steps_the_parameters_and_averages_the_rest():
  """Three rounds of FedYogi on the toy server: the parameters follow the numpy equations from the
  proposals (the weighted means), the BatchNorm statistics are the plain weighted mean, and
  everything that reads the server sees the algorithm's own."""
  rs = np.random.default_rng(1)
  with jax.enable_x64(True):
    toy = _toy_algorithm()
    algo = server_opt.wrap(toy, server_opt.make('yogi', **HP))
    _, server = algo.init(None, 3)
    x0 = jax.tree_util.tree_map(np.asarray, server['algorithm']['params'])
    proposals = []
    for t, s in enumerate(STEP_SCALES):
      state = FedState(clients={}, server=server, round=jnp.int32(t))
      server = algo.prepare.fn(state, None, None, None)
      assert algo.broadcast(server).keys() == {'params', 'batch_stats'}
      payloads = jax.tree_util.tree_map(
          lambda a: jnp.asarray(np.asarray(a) + s * rs.normal(size=(3,) + a.shape)),
          algo.broadcast(server))
      weights = jnp.asarray(rs.dirichlet(np.ones(3)))
      proposals.append(weighted_mean(payloads['params'], weights))
      server = algo.aggregate(server, payloads, weights, jnp.arange(3))
      stats = weighted_mean(payloads['batch_stats'], weights)
      np.testing.assert_allclose(np.asarray(server['algorithm']['batch_stats']['mean']),
                                 np.asarray(stats['mean']), rtol=RTOL)
    state = FedState(clients={}, server=server, round=jnp.int32(3))
    assert algo.host_metrics(state) == {'rounds': 3.0}
    variables, per_client = algo.eval_variables(state)
    assert not per_client and variables is server['algorithm']['params']
  for key in x0:
    want = np_server_steps('yogi', x0[key], [np.asarray(p[key]) for p in proposals], **HP)[-1]
    np.testing.assert_allclose(np.asarray(server['algorithm']['params'][key]), want, rtol=0,
                               atol=RTOL * np.max(np.abs(want)))


def test_wrap_refuses_an_algorithm_without_a_global_model():
  toy = dataclasses.replace(_toy_algorithm(), global_model=None)
  with pytest.raises(ValueError, match="algorithm 'toy' declares no global model"):
    server_opt.wrap(toy, server_opt.make('sgd', 0.5))


class _Run:
  """`config`'s data, algorithm (through the registry unless `algo` is given; with the client sizes,
  as the training binary builds it), initial state and ONE compiled round step, so that several
  runs share a compilation."""

  def __init__(self, config, algo=None):
    dataset = experiment.load_data(config)
    self.fed_data, _ = experiment.build_fed_data(config, dataset)
    self.algo = algo or experiment.build_algorithm(config, dataset,
                                                   client_sizes=np.asarray(self.fed_data.n))
    self.init_key, self.run_key = experiment.run_keys(config)
    self.num_clients = config.num_clients
    self.step = rd.make_round_step(self.algo, experiment.round_config(config), config.num_clients,
                                   donate=False)

  def init(self):
    return rd.init_state(self.algo, self.init_key, self.num_clients)

  def rounds(self, state, count):
    start = int(state.round)
    for r in range(start, start + count):
      state, _ = self.step(state, self.fed_data, rng.round_key(self.run_key, r))
    return state


def _assert_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and la
  for x, y in zip(la, lb):
    assert jnp.array_equal(x, y)


def test_sgd_at_lr_1_is_todays_fedavg_bit_for_bit():
  """The registry's FedAvg with server_optimizer='sgd', server_lr=1 against fedavg.make built
  directly (the algorithm before server optimizers existed): the same state after 2 rounds."""
  config = _small_config('fedavg', server_optimizer='sgd', server_lr=1.0)
  experiment.validate_config(config)
  run = _Run(config)
  state = run.rounds(run.init(), 2)
  assert 'server_opt' not in state.server
  info = DataInfo.of(experiment.load_data(config))
  plain = _Run(config, fedavg.make(ssl_client.spec_from_config(config, info)))
  _assert_equal(state, plain.rounds(plain.init(), 2))


def test_adam_state_is_checkpointed_and_resumes_exactly(tmp_path):
  """FedAdam: 3 rounds straight equal 2 rounds, a checkpoint, a restore into a fresh template and 1
  more round, bit for bit (the moments are in FedState.server)."""
  config = _small_config('fedavg', server_optimizer='adam', server_lr=0.1)
  experiment.validate_config(config)
  run = _Run(config)
  two = run.rounds(run.init(), 2)
  assert any(float(jnp.max(jnp.abs(a))) > 0
             for a in jax.tree_util.tree_leaves(two.server['server_opt']))
  with Checkpointer(str(tmp_path), save_every=1) as ckpt:
    ckpt.maybe_save(2, two)
    _, restored, _ = ckpt.restore(run.init())
  _assert_equal(run.rounds(restored, 1), run.rounds(two, 1))


@pytest.mark.parametrize('overrides,message', [
    (dict(server_optimizer='adm'), r"config.server_optimizer = 'adm' is invalid: must be one of "
                                   r".*did you mean 'adam'\?"),
    (dict(server_optimizer='adam', server_lr=0.0), r'config.server_lr = 0.0 is invalid: must be '
                                                   r'a finite number > 0'),
    (dict(server_optimizer='yogi', server_b2=1.0), r'config.server_b2 = 1.0 is invalid'),
    (dict(server_optimizer='adagrad', server_b2=0.9),
     r"config.server_b2 = 0.9 is invalid with server_optimizer = 'adagrad': only \('adam', "
     r"'yogi'\) read it"),
    (dict(server_optimizer='sgd', server_momentum=0.5),
     r"config.server_momentum = 0.5 is invalid with server_optimizer = 'sgd'"),
])
def test_bad_server_optimizer_settings_are_refused(overrides, message):
  with pytest.raises(cv.ConfigError, match=message):
    experiment.validate_config(_small_config('fedavg', **overrides))


def test_personalised_algorithms_refuse_a_server_optimizer():
  with pytest.raises(cv.ConfigError, match=r"config.server_optimizer = 'adam' \(server_lr = 1.0\) "
                                           r"is invalid for algorithm 'independent': it keeps no "
                                           r"global model"):
    experiment.validate_config(_small_config('independent', server_optimizer='adam'))
  # sgd at another rate is a server optimizer too.
  with pytest.raises(cv.ConfigError, match="invalid for algorithm 'independent'"):
    experiment.validate_config(_small_config('independent', server_lr=0.5))


@pytest.mark.parametrize('name', [n for n in test_registry.BUILT_IN
                                  if algorithms.get(n).global_model])
def test_every_global_model_algorithm_takes_a_server_optimizer(name):
  """Built through the registry, each holds the optimizer's state for exactly its global
  parameters (FedU2: the BYOL target's too, which EUA moves)."""
  config = _small_config(name, server_optimizer='yogi')
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  fed_data, _ = experiment.build_fed_data(config, dataset)
  algo = experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed_data.n))
  _, server = algo.init(jax.random.PRNGKey(0), config.num_clients)
  params = algo.global_model.get(server)
  moments = server['server_opt'][0]
  assert jax.tree_util.tree_structure(moments.m) == jax.tree_util.tree_structure(params)
  assert algo.broadcast(server) is not None and 'server_opt' not in algo.broadcast(server)
