"""Mixed precision (`config.precision`, docs/notes/engine.md#eng-58): under 'bfloat16' every
convolution and matmul of the encoders and heads computes in bf16 while parameters, BatchNorm
statistics, model outputs and the whole federated state stay float32; the quickstart's loss follows
float32's within a stated tolerance; an unknown precision is refused before any compute. Every
registered algorithm runs a bf16 round in the registry sweep (tests/algorithms/test_registry.py)."""
import collections
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

from fedjax_ssl import experiment, models
from fedjax_ssl import config_validation as cv
from fedjax_ssl.algorithms import ssl_client
from fedjax_ssl.core import rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.ssl import losses
from tests import dtypes
from tests.algorithms.test_registry import _small_config

REPO = pathlib.Path(__file__).resolve().parents[2]
BF16 = jnp.bfloat16
# bf16 keeps 8 significant bits: one rounding is a relative error of at most u = 2^-8.
U_BF16 = 2.0 ** -8


@pytest.mark.parametrize('conv_impl', ['xla', 'im2col'])
@pytest.mark.parametrize('name', list(models.ENCODERS))
def test_every_encoder_computes_in_bf16_with_float32_parameters_and_features(name, conv_impl):
  enc = models.get_encoder(name, conv_impl=conv_impl, dtype=BF16)
  x = jax.ShapeDtypeStruct((2,) + models.input_shape(name), jnp.float32)
  variables = jax.eval_shape(lambda x: enc.init(jax.random.PRNGKey(0), x, train=False), x)
  assert dtypes.float_dtypes(variables) == {'float32'}  # parameters and BatchNorm running statistics

  def grad_of_features(params, state, x):  # a training step's forward and backward pass
    def total(p):
      h, new_state = enc.apply({'params': p, **state}, x, train=True, mutable=['batch_stats'])
      return jnp.sum(h), (h, new_state)
    return jax.grad(total, has_aux=True)(params)

  args = (variables['params'], {k: v for k, v in variables.items() if k != 'params'}, x)
  found = collections.Counter(dtypes.contractions(jax.make_jaxpr(grad_of_features)(*args).jaxpr))
  assert found and all(dtypes == ('bfloat16', 'bfloat16') for _, dtypes in found), found
  grads, (h, new_state) = jax.eval_shape(grad_of_features, *args)
  assert h.dtype == jnp.float32 and dtypes.float_dtypes(grads) == {'float32'}
  assert dtypes.float_dtypes(new_state) <= {'float32'}  # updated running statistics ({} without BN)


def test_bf16_activations_and_float32_batchnorm_statistics():
  enc = models.get_encoder('resnet18', conv_impl='im2col', dtype=BF16)
  x = jax.ShapeDtypeStruct((4, 32, 32, 3), jnp.float32)
  variables = jax.eval_shape(lambda x: enc.init(jax.random.PRNGKey(0), x, train=False), x)
  h, state = jax.eval_shape(
      lambda v, x: enc.apply(v, x, train=True, mutable=['batch_stats', 'intermediates'],
                             capture_intermediates=True), variables, x)
  outputs = {jax.tree_util.keystr(path): a.dtype
             for path, a in jax.tree_util.tree_flatten_with_path(state['intermediates'])[0]}
  assert outputs.pop("['__call__'][0]") == h.dtype == jnp.float32  # the encoder's features
  # Every submodule's output: convolutions, BatchNorms (after their float32 normalisation), blocks.
  assert len(outputs) == 48 and set(outputs.values()) == {jnp.dtype(BF16)}, outputs
  assert dtypes.float_dtypes(state['batch_stats']) == {'float32'}


def test_float32_precision_adds_no_cast_and_heads_follow_the_config():
  config = _small_config('fedavg', precision='float32')
  assert models.compute_dtype('float32') is None  # layers cast nothing: the code of before the key
  model = ssl_client.model_from_config(config, 10)
  assert model.encoder.dtype is None and model.projector.dtype is None
  config.precision = 'bfloat16'
  model = ssl_client.model_from_config(config, 10)
  assert (model.encoder.dtype, model.projector.dtype, model.predictor.dtype) == (BF16,) * 3
  config.ssl_method = 'supervised'
  assert ssl_client.model_from_config(config, 10).dtype == BF16
  head, z = models.MLPHead(6, 4, dtype=BF16), jax.ShapeDtypeStruct((2, 5), jnp.float32)
  variables = jax.eval_shape(lambda z: head.init(jax.random.PRNGKey(0), z, train=False), z)
  out = jax.eval_shape(lambda v, z: head.apply(v, z, train=False), variables, z)
  assert out.dtype == jnp.float32


def test_losses_promote_bf16_outputs_to_float32():
  """ssl/losses.py's promise, for a model that would hand them bf16 (ours cast first)."""
  z = jax.random.normal(jax.random.PRNGKey(0), (6, 4)).astype(BF16)
  values = [losses.byol_loss(z, z[::-1], z, z[::-1]), losses.simsiam_loss(z, z[::-1], z, z[::-1]),
            losses.nt_xent(z, z[::-1], 0.5), losses.spectral_contrastive_loss(z, z[::-1], mu=1.0),
            losses.cross_entropy_loss(z, jnp.arange(6) % 4)]
  assert [v.dtype for v in values] == [jnp.float32] * 5


def _quickstart(precision: str):
  """configs/quickstart.py (FedSimCLR, Dir(0.5), lr 0.1) on LeNet-5 with the fedsc crops (the
  tolerances below count LeNet-5's layers) at a tiny size: the shipped Fashion-MNIST subset's first
  512 images over 4 clients, batch 32 (4 steps per client per round)."""
  sys.path.insert(0, str(REPO / 'configs'))
  try:
    import quickstart  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.remove(str(REPO / 'configs'))
  config = quickstart.get_config()
  config.update(dict(dataset='fashion_mnist_subset', train_size=512, num_clients=4,
                     clients_per_round=4, batch_size=32, rounds=2, probe='adam', knn_k=10,
                     precision=precision, encoder='lenet5', augmentation='fedsc'))
  experiment.validate_config(config)
  return config


@pytest.mark.slow  # two compiled quickstart rounds, ~50 s of CPU
def test_quickstart_loss_in_bf16_is_within_the_tolerance_of_float32():
  """Tolerances, from u = 2^-8 = 3.9e-3 (one bf16 rounding):

  * One step's loss, same parameters and batch: every one of the 6 matmul layers (LeNet-5's 3
    convolutions and feature layer, the projector's 2 Dense) rounds its input, weights and output,
    so z carries a relative error of about sqrt(6) u (independent roundings of rms u/sqrt(3), 3 per
    layer). A cosine between two d = 128 vectors moves by about sqrt(2/d) of that, 0.3 u; cos/T with
    T = 0.2 makes it 1.5 u per logit and about 2 u per NT-Xent term (a logit minus a logsumexp); the
    loss averages 2B = 64 terms of random sign: 2 u / 8 = 0.26 u. Bound: u (measured: at most
    0.24 u, rms 0.17 u, seeds 0-7).
  * The loss after 2 rounds: 8 SGD steps at lr 0.1 feed those differences back into the parameters
    and the two runs' trajectories drift apart, which no closed form bounds. Measured on seeds 0-7:
    |relative difference| at most 1.8 % (4.6 u), rms 0.9 %. Bound: 4 % (about 10 u: twice the
    largest measured drift, 4.4 times its rms). The first check is the tight one.
  """
  f32, bf16 = _quickstart('float32'), _quickstart('bfloat16')
  dataset = experiment.load_data(f32)
  info = DataInfo.of(dataset)
  specs = [ssl_client.spec_from_config(c, info) for c in (f32, bf16)]
  batch = {'x': jnp.asarray(dataset.train_x[:32]), 'y': jnp.zeros(32, jnp.int32)}
  for seed in range(4):
    client = ssl_client.init_client(specs[0], jax.random.PRNGKey(seed))
    a, b = (float(ssl_client.loss_fn(s, client['params'], client, batch, jax.random.PRNGKey(9))[0])
            for s in specs)
    assert abs(b - a) <= U_BF16 * abs(a), (seed, a, b)

  fed_data, _ = experiment.build_fed_data(f32, dataset)
  after_two = {}
  for config in (f32, bf16):
    algo = experiment.build_algorithm(config, dataset)
    step = rd.make_round_step(algo, experiment.round_config(config), config.num_clients)
    for seed in range(2):  # one compiled step per precision; seeds change the keys only
      init_key, run_key = rng.run_keys(seed)
      state = rd.init_state(algo, init_key, config.num_clients)
      for r in range(2):
        state, metrics = step(state, fed_data, rng.round_key(run_key, r))
      after_two[config.precision, seed] = float(metrics['loss'])
      assert dtypes.float_dtypes(state.server) == {'float32'}
  for seed in range(2):
    a, b = after_two['float32', seed], after_two['bfloat16', seed]
    assert abs(b - a) <= 0.04 * abs(a), (seed, a, b)


def test_unknown_precision_is_refused_before_compute_naming_the_allowed_values():
  for value, hint in (('float16', "; did you mean 'bfloat16'?"), ('fp8', '')):
    with pytest.raises(cv.ConfigError) as err:
      experiment.validate_config(_small_config('fedavg', precision=value))
    assert str(err.value) == (f"config.precision = '{value}' is invalid: must be one of "
                              f"['float32', 'bfloat16']{hint}")
  with pytest.raises(ValueError, match=r"precision='fp8'; allowed: \('float32', 'bfloat16'\)"):
    models.compute_dtype('fp8')
