"""The algorithm registry: every registered name builds, validates its defaults, runs a round (in
bfloat16, issue 29) and refuses an unknown key in its block; a user's own algorithm
(configs/examples/custom_algorithm.py) registers from its own file and computes FedSimCLR exactly at
mu = 0."""
import collections
import dataclasses
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import algorithms, configuration, experiment
from fedjax_ssl import config_validation as cv
from fedjax_ssl.core import rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.runs.run_dir import RunDir
from tests import dtypes

REPO = pathlib.Path(__file__).resolve().parents[2]

# The algorithms the package registers (an example or a test may register more: those are theirs).
BUILT_IN = tuple(n for n in algorithms.names()
                 if algorithms.get(n).build.__module__.startswith('fedjax_ssl.'))

# Generic keys (outside the algorithm's own block) that a registered algorithm needs for a valid
# small run; every other algorithm runs with the defaults and its first accepted ssl_method.
NEEDS = {
    'centralized': dict(num_clients=1, clients_per_round=1),
    'hetero_ssfl': {'public_size': 32, 'hetero_ssfl.rad_batch': 16,
                    'hetero_ssfl.mix': 'mlp:2,hetero_cnn:2'},
    'repshare': dict(augmentation='none', reset_optimizer=False),
    'fd': dict(augmentation='none', reset_optimizer=False),
    # Their divergence is measured on convolution kernels.
    'fedu': dict(encoder='hetero_cnn'),
    'fedema': dict(encoder='hetero_cnn'),
    # Its cluster counts fit 2 participants x 4 local centroids and a bank of 32 (one batch).
    # Projector distillation compares the MLP's 128-d features with the projector output.
    'ssd': {'ssl_method': 'align_uniform', 'proj_out': 128},
    'orchestra': {'orchestra.global_clusters': 8, 'orchestra.local_clusters': 4,
                  'orchestra.memory_size': 32, 'orchestra.projector_dim': 16},
}


def _load_example():
  """configs/examples/custom_algorithm.py as a module (registers 'fedprox_simclr')."""
  path = REPO / 'configs' / 'examples' / 'custom_algorithm.py'
  spec = importlib.util.spec_from_file_location('custom_algorithm_example', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _small_config(name: str, **overrides):
  """A tiny synthetic run of algorithm `name` (MLP encoder, 4 clients, 2 per round, 2 steps each)."""
  entry = algorithms.get(name)
  c = experiment.default_config()
  c.update(dict(algorithm=name, ssl_method=algorithms.registry.accepted_objectives(entry)[0],
                dataset='synthetic', train_size=288,
                partition='iid', num_clients=4, clients_per_round=2, local_epochs=1,
                batch_size=32, encoder='mlp', heads='custom', proj_hidden=16, proj_out=8,
                pred_hidden=16, pred_out=8, augmentation='flip', knn_k=10, probe='adam', probe_epochs=1,
                strategy='map', rounds=2))
  c.moco.queue_size = 64  # within a client's 72 images (moco.check_clients)
  for key, value in {**NEEDS.get(name, {}), **overrides}.items():
    node = c
    *path, leaf = key.split('.')
    for part in path:
      node = node[part]
    node[leaf] = value
  return c


def _built(config):
  """(federated data, algorithm, initial state, key of round 0) of a validated `config`."""
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  fed_data, _ = experiment.build_fed_data(config, dataset)
  algo = experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed_data.n))
  init_key, run_key = experiment.run_keys(config)
  state = rd.init_state(algo, init_key, config.num_clients)
  return fed_data, algo, state, rng.round_key(run_key, 0)


def _one_round(config):
  fed_data, algo, state, key = _built(config)
  step = rd.make_round_step(algo, experiment.round_config(config), config.num_clients)
  new, metrics = step(state, fed_data, key)
  return algo, new, jax.device_get(metrics)


def test_registry_lists_the_built_in_algorithms():
  assert len(BUILT_IN) == len(set(BUILT_IN)) >= 15  # the methods and baselines of docs/DESIGN.md
  for name in algorithms.names():
    assert name in experiment.default_config(), name  # every algorithm has its config block


@pytest.mark.slow
@pytest.mark.parametrize('name', BUILT_IN)
def test_every_registered_algorithm_builds_validates_and_runs_a_bf16_round(name):
  """One round per algorithm, in bfloat16 (issue 29: every algorithm runs under mixed precision;
  float32, the default, is what each algorithm's own tests run): the local training contracts in
  bf16, the whole state stays float32 and finite, evaluation's features are float32. And one of the
  round's participants fails on purpose (issue 50, core/faults.py): it is counted and named, left
  out (the state stays finite) and rolled back to its state before the round."""
  config = _small_config(name, precision='bfloat16')
  algorithms.registry.validate(config)  # its block's defaults pass its own checks
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  fed_data, _ = experiment.build_fed_data(config, dataset)
  algo = experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed_data.n))
  init_key, run_key = experiment.run_keys(config)
  state = rd.init_state(algo, init_key, config.num_clients)
  key = rng.round_key(run_key, 0)
  m = config.clients_per_round
  bad = int(rd.sample_participants(key, config.num_clients, m)[0])
  faulty = () if m == 1 else ((0, bad),)  # one centralized client: nobody would be left
  step = rd.make_round_step(algo, dataclasses.replace(experiment.round_config(config),
                                                      inject_faults=faulty), config.num_clients)
  before = jax.device_get(rd.cohort_stacks(algo, state.clients))
  traced = step.trace(state, fed_data, key)  # traced once: inspected, then compiled and run
  trained = collections.Counter(dtypes.contractions(traced.jaxpr.jaxpr))
  assert trained[('dot_general', ('bfloat16', 'bfloat16'))] > 0, trained  # the local training
  state, metrics = jax.device_get(traced.lower().compile()(state, fed_data, key))
  assert np.isfinite(metrics['loss'])  # FedSC's spectral contrastive loss may be negative
  assert int(state.round) == 1
  assert float(metrics['failed_clients']) == len(faulty)
  assert [int(i) for i in metrics['failed_ids'] if i >= 0] == [bad][:len(faulty)]
  if faulty:
    cohort, stack_before, stack = next(
        (c, b, s) for c, b, s in zip(rd.cohorts(algo, config.num_clients), before,
                                     rd.cohort_stacks(algo, state.clients)) if bad in c.members)
    local = cohort.members.index(bad)
    for a, b in zip(jax.tree_util.tree_leaves(stack), jax.tree_util.tree_leaves(stack_before)):
      np.testing.assert_array_equal(np.asarray(a[local]), np.asarray(b[local]))
  assert metrics['bytes_up'] >= 0 and metrics['bytes_down'] >= 0  # independent training sends 0
  leaves = jax.tree_util.tree_leaves((state.server, state.clients))
  assert all(np.all(np.isfinite(np.asarray(a))) for a in leaves if jnp.issubdtype(a.dtype, jnp.floating))
  # Parameters, optimizer state, BN statistics, EMA targets and the server: float32 throughout.
  assert dtypes.float_dtypes((state.clients, state.server)) == {'float32'}
  h, w, c = dataset.train_x.shape[1:]
  for apply, variables in dtypes.encoder_applies(algo, state):
    closed = jax.make_jaxpr(apply)(variables, jnp.zeros((2, h, w, c), jnp.float32))
    found = set(dtypes.contractions(closed.jaxpr))
    assert found and all(d == ('bfloat16', 'bfloat16') for _, d in found), found
    assert closed.out_avals[0].dtype == jnp.float32  # evaluation's features


@pytest.mark.parametrize('name', BUILT_IN)
def test_unknown_key_in_an_algorithm_block_is_refused_with_the_valid_keys(name):
  config = _small_config(name)
  config[name].not_a_key = 1
  known = sorted(algorithms.get(name).defaults().keys())
  with pytest.raises(cv.ConfigError, match=rf'config\.{name}\.not_a_key') as err:
    experiment.validate_config(config)
  assert str(known) in str(err.value), str(err.value)


def test_unregistered_algorithm_is_refused_listing_the_registered_ones():
  config = _small_config('fedavg')
  config.algorithm = 'fedavgg'
  with pytest.raises(cv.ConfigError, match=r"config.algorithm = 'fedavgg' is invalid: must be one "
                                           r"of \['fedavg', 'centralized', .*did you mean 'fedavg'"):
    experiment.validate_config(config)


def test_an_ssl_method_the_algorithm_does_not_take_is_refused_with_the_reason():
  with pytest.raises(cv.ConfigError, match=r"config.ssl_method = 'simclr' is invalid for algorithm "
                                           r"'fedu': it needs an objective with a predictor, which "
                                           r"'simclr' has not \(objectives that have: byol, "
                                           r"simsiam"):
    experiment.validate_config(_small_config('fedu', ssl_method='simclr'))
  with pytest.raises(cv.ConfigError, match=r"config.ssl_method = 'byol' is invalid for algorithm "
                                           r"'fedsc': must be one of \('sc',\)"):
    experiment.validate_config(_small_config('fedsc', ssl_method='byol'))


def test_an_exclusive_key_of_another_algorithm_is_refused():
  config = _small_config('fedavg')
  config.hetero_ssfl.mix = 'mlp:4'
  with pytest.raises(cv.ConfigError, match=r"config.hetero_ssfl.mix = 'mlp:4' is invalid with "
                                           r"algorithm 'fedavg': only algorithm 'hetero_ssfl' reads"):
    experiment.validate_config(config)


def test_register_refuses_a_taken_name_and_bad_methods():
  with pytest.raises(ValueError, match="algorithm 'fedavg' is already registered"):
    algorithms.register('fedavg', lambda config, info: None)
  with pytest.raises(ValueError, match=r"methods = \('dino',\) of algorithm 'x' is invalid"):
    algorithms.register('x', lambda config, info: None, methods=('dino',))
  with pytest.raises(ValueError, match=r"needs = \('queue',\) of algorithm 'x' is invalid"):
    algorithms.register('x', lambda config, info: None, needs=('queue',))
  with pytest.raises(ValueError, match="algorithm name 'a-b' is invalid"):
    algorithms.register('a-b', lambda config, info: None)
  assert 'x' not in algorithms.names()


def test_custom_algorithm_registers_from_its_own_file_and_mu_0_is_fedsimclr():
  example = _load_example()
  example = _load_example()  # executing the file twice (absl's config flag, an import) is allowed
  assert 'fedprox_simclr' in algorithms.names()
  config = example.get_config()
  assert config.fedprox_simclr.mu == 0.01
  configuration.validate_config(config)

  def run(name, mu):
    c = _small_config('fedavg', algorithm=name, ssl_method='simclr', strategy='map')
    c.fedprox_simclr.mu = mu
    return _one_round(c)

  _, base, base_m = run('fedavg', 0.0)
  _, prox0, prox0_m = run('fedprox_simclr', 0.0)
  _, prox, prox_m = run('fedprox_simclr', 10.0)  # another constant in the step: a second compile
  # mu = 0 adds exact zeros to the gradient, but in another program, which XLA may fuse otherwise:
  # equal up to float32 rounding through the round's steps (2^-20 relative, 16 ulps; mu = 10 below
  # moves the model by far more).
  for a, b in zip(jax.tree_util.tree_leaves(base.server), jax.tree_util.tree_leaves(prox0.server)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2.0 ** -20, atol=1e-9)
  np.testing.assert_allclose(prox0_m['loss'], base_m['loss'], rtol=2.0 ** -20)
  # mu > 0 pulls every local step towards the round's global model: the new global model ends
  # nearer the initial one than FedSimCLR's does.
  c = _small_config('fedavg', ssl_method='simclr', strategy='map')
  algo = experiment.build_algorithm(c, experiment.load_data(c))
  init = rd.init_state(algo, experiment.run_keys(c)[0], c.num_clients).server['params']
  dist = lambda s: sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(
      jax.tree_util.tree_leaves(s.server['params']), jax.tree_util.tree_leaves(init)))
  assert dist(prox) < 0.9 * dist(base), (dist(prox), dist(base))
  assert np.isfinite(prox_m['loss'])


def test_load_run_config_moves_keys_of_older_runs_into_their_blocks(tmp_path):
  saved = experiment.default_config().to_dict()
  for block in ('fedu', 'fedema', 'independent'):
    del saved[block]
  saved.update(dapu_threshold=0.3, autoscaler_tau=0.5, independent_init=False)
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  config = RunDir(tmp_path).read_config()
  assert (config.fedu.dapu_threshold, config.fedema.autoscaler_tau,
          config.independent.independent_init) == (0.3, 0.5, False)
  assert 'dapu_threshold' not in config
