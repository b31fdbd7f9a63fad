"""BatchNorm in float32 done right: the batch variance is computed as E[(x - E[x])^2] (two passes),
not as E[x^2] - E[x]^2, which cancels catastrophically when |mean| >> std. Checked on the layer
against numpy float64 and on one BYOL step with BN heads against the same step in float64."""
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl import models
from fedjax_ssl.algorithms import ssl_client
from fedjax_ssl.core import optim
from fedjax_ssl.data import augment
from fedjax_ssl.models import layers

EPS32 = float(np.finfo(np.float32).eps)


def test_batchnorm_train_output_and_variance_match_float64_with_a_large_mean():
  rng = np.random.default_rng(0)
  # Features with mean 300 and std 1 (a ReLU layer far from zero): the one-pass formula loses
  # log2(300^2) ~ 16 of float32's 24 bits here.
  x = (300.0 + rng.standard_normal((256, 16))).astype(np.float32)
  bn = layers.BatchNorm(use_running_average=False)
  variables = bn.init(jax.random.PRNGKey(0), x)
  y, updates = bn.apply(variables, x, mutable=['batch_stats'])
  x64 = x.astype(np.float64)
  mean, var = x64.mean(0), x64.var(0)
  want = (x64 - mean) / np.sqrt(var + 1e-5)
  # Two-pass in float32: the centred values carry |x| * eps of error each, so the normalised output
  # is off by about |x| * eps / std ~ 300 * 1.2e-7 = 3.6e-5; 4x margin.
  assert np.max(np.abs(np.asarray(y, np.float64) - want)) < 4 * 300 * EPS32
  # Running variance (flax keeps the biased batch variance, momentum 0.1 from 1): the same accuracy.
  got_var = np.asarray(updates['batch_stats']['var'], np.float64)
  want_var = 0.9 + 0.1 * x64.var(0)
  assert np.max(np.abs(got_var - want_var) / want_var) < 4 * 300 * EPS32


def _byol_spec(offset: float) -> ssl_client.ClientSpec:
  model = models.SSLModel(models.get_encoder('lenet5'), models.MLPHead(256, 128, True),
                          models.MLPHead(256, 128, True))
  # mean = -offset shifts every input pixel by +offset: the encoder's features then sit far from 0.
  return ssl_client.ClientSpec(
      objective='byol', model=model, tx=optim.make_optimizer('sgd', momentum=0.9, weight_decay=0.0),
      aug=augment.preset('none', 28), mean=(-offset,), std=(1.0,), input_shape=(28, 28, 1))


def test_one_byol_step_with_bn_heads_matches_float64():
  x = np.load('tests/data/fashion_mnist_subset.npz')['train_x'][:128]
  batch = {'x': jnp.asarray(x), 'y': jnp.zeros(128, jnp.int32)}
  spec = _byol_spec(offset=10.0)
  client = ssl_client.init_client(spec, jax.random.PRNGKey(0))
  step = lambda c: ssl_client.local_step(spec, c, batch, jax.random.PRNGKey(1), None, 0.1)
  new32, loss32 = jax.jit(step)(client)
  with jax.enable_x64(True):
    c64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), client)
    new64, loss64 = jax.jit(step)(c64)
    new64, loss64, c64 = jax.device_get((new64, loss64, c64))
  assert abs(float(loss32) - float(loss64)) < 1e-5 * abs(float(loss64))
  for module in ('encoder', 'projector', 'predictor'):
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(a, np.float64))
                                        for a in jax.tree_util.tree_leaves(tree)])
    d32 = flat(new32['params'][module]) - flat(client['params'][module])
    d64 = flat(new64['params'][module]) - flat(c64['params'][module])
    rel = np.linalg.norm(d32 - d64) / np.linalg.norm(d64)
    # The exact variance keeps the update within ~1e-5 of float64 here (PyTorch float32: 3e-6 to
    # 7e-5); the one-pass variance was 2e-4 to 5e-4 off on this batch.
    assert rel < 1e-4, (module, rel)
