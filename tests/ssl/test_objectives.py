"""The objective registry: the built-in objectives, what algorithms require of one, the keys that
moved into the objectives' blocks (refused when set, migrated when read), and VICReg and Barlow
Twins in one round of every algorithm that accepts them."""
import importlib.machinery
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import algorithms, configuration, experiment, models, run_identity, ssl
from fedjax_ssl import config_validation as cv
from fedjax_ssl.algorithms import ssl_client
from fedjax_ssl.core import optim, rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.runs.run_dir import RunDir
from tests.algorithms import test_registry

BUILT_IN = ('byol', 'simsiam', 'simclr', 'sc', 'supervised', 'vicreg', 'barlow_twins', 'moco',
            'swav')


def test_built_in_objectives_and_their_blocks():
  assert ssl.names()[:len(BUILT_IN)] == BUILT_IN
  c = configuration.default_config()
  for name in BUILT_IN:
    assert name in c, name  # every objective has its block
  assert c.byol.ema_tau == 0.99 and c.simclr.temperature == 0.5 and not c.simclr.zero_diagonal
  assert (c.vicreg.sim_coeff, c.vicreg.std_coeff, c.vicreg.cov_coeff) == (25.0, 25.0, 1.0)
  assert c.barlow_twins.off_diagonal_weight == 0.0051
  assert (c.moco.temperature, c.moco.queue_size, c.moco.ema_tau) == (0.2, 4096, 0.99)
  assert ssl.get('byol').shared == ('encoder', 'projector', 'predictor')
  assert ssl.get('vicreg').shared == ('encoder', 'projector')
  assert ssl.get('supervised').shared == ('encoder', 'head')
  assert ssl.get('byol').capabilities() == ('projector', 'predictor', 'target')


def test_algorithms_take_the_objectives_that_fit_them():
  accepted = lambda name: algorithms.registry.accepted_objectives(algorithms.get(name))
  assert set(accepted('fedavg')) >= set(BUILT_IN)
  assert accepted('fedu') == accepted('fedema') == ('byol', 'simsiam')
  assert set(accepted('fedu2')) >= {'byol', 'simsiam', 'simclr', 'sc', 'vicreg', 'barlow_twins',
                                    'moco'}
  assert 'supervised' not in accepted('fedu2')
  assert accepted('fedsc') == ('sc',)


def test_an_objective_lacking_what_the_algorithm_needs_is_refused_naming_both():
  config = test_registry._small_config('fedema', ssl_method='vicreg')
  with pytest.raises(cv.ConfigError, match=r"config.ssl_method = 'vicreg' is invalid for algorithm "
                                           r"'fedema': it needs an objective with a predictor, "
                                           r"which 'vicreg' has not"):
    experiment.validate_config(config)


def test_bad_objective_values_and_names_are_refused():
  config = test_registry._small_config('fedavg', ssl_method='vicreg')
  config.vicreg.std_coeff = -1.0
  with pytest.raises(cv.ConfigError, match=r'config.vicreg.std_coeff = -1.0 is invalid'):
    experiment.validate_config(config)
  config = test_registry._small_config('fedavg', ssl_method='barlow_twin')
  with pytest.raises(cv.ConfigError, match=r"config.ssl_method = 'barlow_twin' is invalid: must be "
                                           r"one of .*did you mean 'barlow_twins'"):
    experiment.validate_config(config)
  config = test_registry._small_config('fedavg', ssl_method='simclr')
  config.simclr.tau = 0.1
  with pytest.raises(cv.ConfigError, match=r"unknown config key 'config.simclr.tau'"):
    experiment.validate_config(config)
  with pytest.raises(ValueError, match="objective 'byol' is already registered"):
    ssl.register(ssl.Objective(name='byol', loss=lambda *a: 0.0))
  with pytest.raises(ValueError, match="objective 'mine' has a momentum target: its config block "
                                       "must have 'ema_tau'"):
    ssl.register(ssl.Objective(name='mine', loss=lambda *a: 0.0, target=True))
  assert 'mine' not in ssl.names()


@pytest.mark.parametrize('old, new', list(run_identity.MOVED_KEYS.items()))
def test_a_moved_key_is_refused_naming_the_new_one(old, new):
  config = test_registry._small_config('fedavg')
  config[old] = 0.5
  with pytest.raises(cv.ConfigError, match=rf'config.{old} is no longer a key: it moved to '
                                           rf'config.{new}'):
    experiment.validate_config(config)
  error = cv.unknown_override(['prog', f'--config.{old}=0.5'], experiment.default_config(),
                              moved=run_identity.MOVED_KEYS)
  assert str(error).startswith(f'config.{old} in --config.{old}=0.5 is no longer a key: it moved '
                               f'to config.{new}'), str(error)


def test_a_stored_config_with_the_old_keys_is_migrated_with_its_identity(tmp_path):
  """A config.json written before the move: read with its values in the blocks, and its run key is
  the key of the same run configured today (a resume or a reproduce cell finds it)."""
  today = configuration.default_config()
  today.update(dict(ssl_method='simclr'))
  today.simclr.temperature, today.simclr.zero_diagonal, today.byol.ema_tau = 0.2, True, 0.96
  saved = today.to_dict()
  for name in ('simclr', 'byol'):
    del saved[name]
  saved.update(temperature=0.2, nt_xent_zero_diagonal=True, ema_tau=0.96)
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  config = RunDir(tmp_path).read_config()
  assert (config.simclr.temperature, config.simclr.zero_diagonal, config.byol.ema_tau) == (
      0.2, True, 0.96)
  assert run_identity.run_key(config) == run_identity.run_key(today)
  # The blocks of objectives other than the configured one do not make the run.
  other = configuration.default_config()
  other.update(today)
  other.byol.ema_tau = 0.5
  assert run_identity.run_key(other) == run_identity.run_key(today)
  other.simclr.temperature = 0.3
  assert run_identity.run_key(other) != run_identity.run_key(today)


def test_client_spec_takes_an_objective_name_with_its_block_defaults():
  spec = ssl_client.ClientSpec(objective='simclr', model=None, tx=None, aug=None, mean=(0.5,),
                               std=(0.3,), input_shape=(8, 8, 1), hparams={'temperature': 0.2})
  assert spec.objective is ssl.get('simclr') and spec.method == 'simclr'
  assert spec.hparams == {'temperature': 0.2, 'zero_diagonal': False}


SWEEP = [(name, objective)
         for objective in ('vicreg', 'barlow_twins', 'moco', 'swav', 'align_uniform')
         for name in algorithms.names() if name != 'fedprox_simclr'
         if objective in algorithms.registry.accepted_objectives(algorithms.get(name))]


def test_the_sweep_covers_the_general_algorithms():
  assert {n for n, o in SWEEP if o == 'vicreg'} >= {'fedavg', 'centralized', 'independent', 'fedu2',
                                                     'ldawa'}
  # Issue 68: every algorithm that needs no predictor, FedDecorr and FedX included, and SSD.
  assert {n for n, o in SWEEP if o == 'align_uniform'} >= {
      'fedavg', 'centralized', 'independent', 'fedu2', 'ldawa', 'feddecorr', 'fedx', 'ssd'}


@pytest.mark.slow
@pytest.mark.parametrize('name, objective', SWEEP)
def test_the_new_objectives_run_a_round_of_every_algorithm_that_takes_them(name, objective):
  """One round: finite loss and state, and the shared modules moved (the loss has gradients)."""
  config = test_registry._small_config(name, ssl_method=objective)
  algo, state, metrics = test_registry._one_round(config)
  assert np.isfinite(metrics['loss'])
  leaves = jax.tree_util.tree_leaves((state.server, state.clients))
  assert all(np.all(np.isfinite(np.asarray(a))) for a in leaves)
  start = rd.init_state(algo, experiment.run_keys(config)[0], config.num_clients)
  # The evaluated encoder (the global one, or every client's) moved: the loss has gradients.
  (before, _), (after, _) = algo.eval_variables(start), algo.eval_variables(state)
  moved = jax.tree_util.tree_map(lambda a, b: not np.array_equal(np.asarray(a), np.asarray(b)),
                                 before['params']['encoder'], after['params']['encoder'])
  assert any(jax.tree_util.tree_leaves(moved)), name


def _load_objective_example():
  """configs/examples/custom_objective.py as a module (registers 'my_align_uniform')."""
  path = test_registry.REPO / 'configs' / 'examples' / 'custom_objective.py'
  spec = importlib.util.spec_from_file_location('custom_objective_example', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def np_align_uniform(z1, z2, alpha, t, weight):
  """Wang & Isola's align + uniform in float64 loops over the pairs."""
  n1 = z1 / np.linalg.norm(z1, axis=1, keepdims=True)
  n2 = z2 / np.linalg.norm(z2, axis=1, keepdims=True)
  b = len(z1)
  align = np.mean([np.linalg.norm(n1[i] - n2[i]) ** alpha for i in range(b)])
  uniform = 0.0
  for z in (n1, n2):
    pairs = [np.exp(-t * np.sum((z[i] - z[j]) ** 2)) for i in range(b) for j in range(b) if i != j]
    uniform += np.log(np.mean(pairs)) / 2
  return align + weight * uniform


@pytest.mark.slow
def test_custom_objective_registers_from_its_own_file_and_trains_under_fedavg_and_fedu2():
  example = _load_objective_example()
  example = _load_objective_example()  # executed twice (absl's config flag, an import): allowed
  assert 'my_align_uniform' in ssl.names()
  configuration.validate_config(example.get_config())
  rng_np = np.random.default_rng(3)
  z1, z2 = rng_np.normal(size=(6, 4)), rng_np.normal(size=(6, 4))
  for alpha, t, weight in ((2.0, 2.0, 1.0), (1.0, 0.5, 3.0)):
    got = example.align_uniform(jnp.asarray(z1, jnp.float32), jnp.asarray(z2, jnp.float32),
                                alpha=alpha, t=t, uniform_weight=weight)
    # float32 over sums of ~B² terms of size ~1: a few float32 ulps of the result.
    np.testing.assert_allclose(float(got), np_align_uniform(z1, z2, alpha, t, weight), rtol=1e-5,
                               atol=1e-5)
  for name in ('fedavg', 'fedu2'):
    config = test_registry._small_config(name, ssl_method='my_align_uniform')
    _, state, metrics = test_registry._one_round(config)
    assert np.isfinite(metrics['loss']) and int(state.round) == 1
  config = test_registry._small_config('fedema', ssl_method='my_align_uniform')
  with pytest.raises(cv.ConfigError, match="it needs an objective with a predictor, which "
                                           "'my_align_uniform' has not"):
    experiment.validate_config(config)


def test_wide8192_preset_is_the_vicreg_and_barlow_twins_expander():
  """512-8192(BN)-8192(BN)-8192, shapes only (abstract init, no FLOPs)."""
  projector, predictor = models.make_heads('wide8192', with_predictor=False)
  assert predictor is None
  variables = jax.eval_shape(lambda: projector.init(jax.random.PRNGKey(0),
                                                    jnp.zeros((2, 512)), train=True))
  shapes = {k: v['kernel'].shape for k, v in variables['params'].items() if 'kernel' in v}
  assert shapes == {'fc1': (512, 8192), 'fc1_2': (8192, 8192), 'fc2': (8192, 8192)}
  assert set(variables['batch_stats']) == {'bn', 'bn_2'}


@pytest.mark.slow
@pytest.mark.parametrize('client_state', ['device', 'host'])
def test_moco_queue_is_per_client_state_that_survives_rounds_it_sits_out(client_state):
  """FedMoCo, 4 clients of 72 images, 2 per round, 2 rounds of 2 steps of batch 32 (stateless
  FedAvg clients), queue 72 (the longest allowed: a client's data): each participant's queue holds
  32 keys per step it trained up to its length, a client that sat out keeps its queue, and
  `moco.reset_state` keeps only the round's keys."""
  def run(reset):
    config = test_registry._small_config('fedavg', ssl_method='moco', client_state=client_state,
                                         rounds=2)
    config.moco.queue_size = 72
    config.moco.reset_state = reset
    experiment.validate_config(config)
    dataset = experiment.load_data(config)
    fed_data, _ = experiment.build_fed_data(config, dataset)
    algo = experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed_data.n))
    init_key, run_key = experiment.run_keys(config)
    state = rd.init_state(algo, init_key, config.num_clients, client_state=client_state)
    step = rd.make_round_step(algo, experiment.round_config(config), config.num_clients)
    for r in range(2):
      state, metrics = step(state, fed_data, rng.round_key(run_key, r))
      assert np.isfinite(float(metrics['loss']))
    return np.asarray(jax.device_get(state.clients['objective']['count'])), state
  counts, state = run(reset=False)
  steps = 288 // 4 // 32  # each client's examples / batch, 1 local epoch
  rounds_trained = {0: 0, 32 * steps: 1, 72: 2}  # a second round fills the 72 slots
  assert set(np.unique(counts)) <= set(rounds_trained), counts
  assert sum(rounds_trained[int(c)] for c in counts) == 2 * 2  # 2 rounds x 2 participants
  reset, _ = run(reset=True)
  assert set(np.unique(reset)) <= {0, 32 * steps} and reset.sum() <= counts.sum()
  queue = np.asarray(jax.device_get(state.clients['objective']['queue']))
  for c, n in enumerate(counts):  # filled rows are unit keys, the rest still zero
    np.testing.assert_allclose(np.linalg.norm(queue[c, :n], axis=1), 1.0, rtol=1e-5)
    assert not queue[c, n:].any()


@pytest.mark.slow
@pytest.mark.parametrize('shared', [True, False])
def test_swav_prototypes_are_shared_or_kept_per_client(shared):
  """`swav.shared_prototypes`: FedAvg averages the prototype layer with the online network, or
  every client keeps its own (stored with the client; the round's participants trained theirs)."""
  config = test_registry._small_config('fedavg', ssl_method='swav')
  config.swav.num_prototypes = 6
  config.swav.shared_prototypes = shared
  algo, state, metrics = test_registry._one_round(config)
  assert np.isfinite(metrics['loss'])
  start = rd.init_state(algo, experiment.run_keys(config)[0], config.num_clients)
  stored = state.clients.get('params', {})
  if shared:
    assert 'prototypes' in state.server['params'] and 'prototypes' not in stored
    assert not np.array_equal(np.asarray(state.server['params']['prototypes']['kernel']),
                              np.asarray(start.server['params']['prototypes']['kernel']))
  else:
    assert 'prototypes' not in state.server['params']
    kernels = np.asarray(stored['prototypes']['kernel'])            # [C, dz, K]
    before = np.asarray(start.clients['params']['prototypes']['kernel'])
    moved = [not np.array_equal(kernels[c], before[c]) for c in range(config.num_clients)]
    assert sum(moved) == config.clients_per_round                   # the participants only
    a, b = [kernels[c] for c in range(config.num_clients) if moved[c]]
    assert not np.array_equal(a, b)                                 # each its own


def test_swav_renormalizes_the_prototypes_before_every_step():
  """The release normalises the prototypes to unit rows before every forward: one SGD step from a
  kernel at 3x unit norm equals normalize(kernel) - lr * (the gradient at the normalised one)."""
  config = test_registry._small_config('fedavg', ssl_method='swav', momentum=0.0,
                                       weight_decay=0.0)
  dataset = experiment.load_data(config)
  spec = ssl_client.spec_from_config(config, DataInfo.of(dataset))
  key = jax.random.PRNGKey(0)
  client = ssl_client.init_client(spec, key)
  params = client['params']
  client['params'] = dict(params, prototypes={'kernel': 3.0 * params['prototypes']['kernel']})
  batch = {'x': jnp.asarray(dataset.train_x[:16]), 'y': jnp.asarray(dataset.train_y[:16])}
  new, _ = ssl_client.local_step(spec, client, batch, key, None, jnp.float32(0.5))
  unit = ssl_client.normalize_prototypes(client['params'])
  np.testing.assert_allclose(np.linalg.norm(np.asarray(unit['prototypes']['kernel']), axis=0), 1.0,
                             rtol=1e-6)
  grads = jax.grad(lambda p: ssl_client.loss_fn(spec, p, dict(client, params=unit), batch,
                                                key)[0])(unit)
  want = unit['prototypes']['kernel'] - 0.5 * grads['prototypes']['kernel']
  np.testing.assert_allclose(np.asarray(new['params']['prototypes']['kernel']), np.asarray(want),
                             rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('queue_size, symmetric, message', [
    (73, False, 'moco.queue_size = 73 is invalid for this partition: must be <= 72, the images of '
                'its smallest client (client 0); a longer queue holds keys of every image that '
                'client has, so each query meets its own image among its negatives'),
    (31, False, 'moco.queue_size = 31 is invalid: must be >= 32, the keys one step enqueues '
                '(batch_size = 32)'),
    (40, True, 'moco.queue_size = 40 is invalid: must be >= 64, the keys one step enqueues '
               '(batch_size = 32 x 2, symmetric)'),
], ids=['longer_than_a_client', 'shorter_than_a_step', 'symmetric_step'])
def test_moco_queue_is_refused_against_the_clients_data_before_compute(queue_size, symmetric,
                                                                       message):
  config = test_registry._small_config('fedavg', ssl_method='moco')
  config.moco.queue_size, config.moco.symmetric = queue_size, symmetric
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  fed_data, _ = experiment.build_fed_data(config, dataset)
  with pytest.raises(cv.ConfigError) as e:
    experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed_data.n))
  assert str(e.value) == message


def test_byol_ema_schedule_lr_moves_the_target_at_tau_to_the_learning_rate_ratio():
  """byol.ema_schedule = 'lr': a step at learning rate lr moves the target at ema_tau ** (lr /
  config.lr) (the EMA scaling rule), so a cosine learning rate takes tau towards 1; 'constant'
  keeps ema_tau whatever lr (and its program is the one from before the key existed)."""
  config = test_registry._small_config('fedavg', ssl_method='byol', lr=0.2)
  config.byol.ema_tau, config.byol.ema_schedule = 0.9, 'lr'
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  spec = ssl_client.spec_from_config(config, DataInfo.of(dataset))
  assert spec.hparams['base_lr'] == 0.2
  # float32 pow (exp of y log x): a few ulps, 8 allowed.
  for lr, want in ((0.2, 0.9), (0.05, 0.9 ** 0.25), (0.0, 1.0)):
    assert float(ssl_client.target_rate(spec, jnp.float32(lr))) == pytest.approx(want, rel=1e-6)
  # Cosine rounds: 1 - tau_r is (1 - tau) lr_r / lr to first order (BYOL's schedule's shape); with
  # k = lr_r / lr <= 1, 1 - tau^k = -k ln tau - (k ln tau)^2 / 2 + ... and -ln tau = (1 - tau)
  # + (1 - tau)^2 / 2 + ..., so the two differ by at most ~(1 - tau)^2.
  for r in range(0, 50, 7):
    lr = optim.round_lr(0.2, 'cosine', r, 50)
    one_minus = 1.0 - float(ssl_client.target_rate(spec, lr))
    assert one_minus == pytest.approx(0.1 * float(lr) / 0.2, abs=0.1 ** 2)
  key = jax.random.PRNGKey(0)
  client = ssl_client.init_client(spec, key)
  batch = {'x': jnp.asarray(dataset.train_x[:16]), 'y': jnp.asarray(dataset.train_y[:16])}
  new, _ = ssl_client.local_step(spec, client, batch, key, None, jnp.float32(0.05))
  online = ssl_client.target_from_online(new['params'], new['batch_stats'])['params']
  tau = 0.9 ** 0.25
  for old_t, new_t, on in zip(*(jax.tree_util.tree_leaves(x) for x in (
      client['target']['params'], new['target']['params'], online))):
    np.testing.assert_allclose(np.asarray(new_t),
                               tau * np.asarray(old_t) + (1 - tau) * np.asarray(on),
                               rtol=1e-6, atol=1e-7)
  constant = ssl_client.spec_from_config(
      test_registry._small_config('fedavg', ssl_method='byol', lr=0.2), DataInfo.of(dataset))
  assert ssl_client.target_rate(constant, jnp.float32(0.05)) == 0.99
  config.byol.ema_schedule = 'cosine'
  with pytest.raises(cv.ConfigError, match=r"config.byol.ema_schedule = 'cosine' is invalid: must "
                                           r"be one of \['constant', 'lr'\]"):
    experiment.validate_config(config)
  with pytest.raises(ValueError, match=r"ema_schedule = 'lr' needs hparams\['base_lr'\] > 0"):
    ssl_client.ClientSpec(objective='byol', model=None, tx=None, aug=None, mean=(0.5,), std=(0.3,),
                          input_shape=(8, 8, 1), hparams={'ema_schedule': 'lr'})



def test_scale_module_is_a_parameter_group_at_that_multiple_of_the_rate():
  """optim.scale_module(tx, 'predictor', k) over SGD (momentum 0.9, weight decay 0.01): three steps
  of fixed gradients against float64 PyTorch parameter groups (buf <- 0.9 buf + g + wd p,
  p <- p - lr_group buf), the predictor's group at k * lr, the rest at lr."""
  rng_np = np.random.default_rng(0)
  params = {m: {'w': rng_np.normal(size=(3, 2)).astype(np.float32)}
            for m in ('encoder', 'predictor')}
  grads = [{m: {'w': rng_np.normal(size=(3, 2)).astype(np.float32)} for m in params}
           for _ in range(3)]
  tx = optim.scale_module(optim.make_optimizer('sgd', momentum=0.9, weight_decay=0.01),
                          'predictor', 4.0)
  state, p = tx.init(params), params
  for g in grads:
    updates, state = tx.update(g, state, p)
    p = jax.tree_util.tree_map(lambda a, u: a - 0.05 * u, p, updates)
  for module, rate in (('encoder', 0.05), ('predictor', 0.2)):
    want, buf = params[module]['w'].astype(np.float64), 0.0
    for g in grads:
      buf = 0.9 * buf + g[module]['w'] + 0.01 * want
      want = want - rate * buf
    np.testing.assert_allclose(p[module]['w'], want, rtol=1e-5, atol=1e-6, err_msg=module)
  plain = optim.make_optimizer('sgd', momentum=0.9)
  assert optim.scale_module(plain, 'predictor', 1.0) is plain   # k = 1: the same program


def test_predictor_lr_scale_moves_a_byol_clients_predictor_alone():
  """config.predictor_lr_scale = k: a BYOL client's first local step moves the predictor k times
  as far (zero momentum buffer: the step is lr * k * (g + wd p)) and every other module exactly as
  with k = 1; refused for an objective without a predictor."""
  config = test_registry._small_config('fedavg', ssl_method='byol', lr=0.2)
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  info = DataInfo.of(dataset)
  key = jax.random.PRNGKey(0)
  batch = {'x': jnp.asarray(dataset.train_x[:16]), 'y': jnp.asarray(dataset.train_y[:16])}

  def step(scale):
    config.predictor_lr_scale = scale
    spec = ssl_client.spec_from_config(config, info)
    client = ssl_client.init_client(spec, key)
    return client['params'], ssl_client.local_step(spec, client, batch, key, None,
                                                   jnp.float32(0.1))[0]['params']

  start, base = step(1.0)
  _, fast = step(10.0)
  assert set(start) >= {'encoder', 'predictor'}
  for module in start:
    if module == 'predictor':
      # Each parameter is rounded to float32 after its step: the differences carry one rounding of
      # |p| each (half an ulp), and 10 (b - s) ten of them.
      jax.tree_util.tree_map(
          lambda s, b, f: np.testing.assert_allclose(
              f - s, 10 * (b - s), rtol=1e-5,
              atol=11 * np.finfo(np.float32).eps * float(np.abs(s).max())),
          start[module], base[module], fast[module])
    else:
      jax.tree_util.tree_map(np.testing.assert_array_equal, fast[module], base[module])
  config.ssl_method, config.predictor_lr_scale = 'simclr', 2.0
  with pytest.raises(cv.ConfigError, match=r"predictor_lr_scale = 2.0 is invalid with ssl_method "
                                           r"'simclr', which has no predictor"):
    experiment.validate_config(config)


@pytest.mark.parametrize('example', ['custom_objective', 'custom_algorithm'])
def test_an_example_executed_by_relative_and_absolute_path_registers_once(example, monkeypatch):
  # absl's config flag executes `configs/examples/<x>.py` as given (relative), an import executes
  # it by its absolute path: the same loss must not count as another under the taken name.
  repo = pathlib.Path(__file__).resolve().parents[2]
  monkeypatch.chdir(repo)
  paths = [f'configs/examples/{example}.py', str(repo / f'configs/examples/{example}.py')]
  for i, path in enumerate(paths):
    # A bare SourceFileLoader keeps a relative path in co_filename, as absl's loader does
    # (spec_from_file_location would make it absolute).
    loader = importlib.machinery.SourceFileLoader(f'_example_{example}_{i}', path)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    loader.exec_module(importlib.util.module_from_spec(spec))
