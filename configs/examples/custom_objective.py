r"""Your own SSL objective in one file: alignment + uniformity, registered and run under any algorithm.

Wang & Isola (ICML 2020) train the projections z (L2-normalised) of two views with

    align    = mean_b ||z1_b - z2_b||^alpha
    uniform  = log mean_{b≠b'} exp(-t ||z_b - z_b'||²), over each view's batch, averaged over views
    loss     = align + uniform_weight * uniform

(alpha 2, t 2, weight 1 in the paper). The objective declares what the engine needs: two views, a
projector but no predictor and no momentum target, so it runs under every algorithm that asks no
more (FedAvg, FedU2, L-DAWA, independent and centralized training; not FedU or FedEMA, which need a
predictor). Only public names of fedjax_ssl are used, and the library is not edited:

  python -m experiments.train --config configs/examples/custom_objective.py \
      --config.dataset=synthetic --config.rounds=2 --workdir /tmp/align_uniform

  python -m experiments.train --config configs/examples/custom_objective.py \
      --config.dataset=synthetic --config.rounds=2 --config.algorithm=fedu2 \
      --workdir /tmp/align_uniform_fedu2

  python -m experiments.train --config configs/examples/custom_objective.py \
      --config.train_size=20000 --workdir /tmp/align_uniform_fmnist

The first two take about a minute each on 2 CPU cores; the third is the quickstart's federation
(LeNet-5) with this objective on the first 20,000 Fashion-MNIST images. The pieces: `loss(hparams, online, target, batch,
shared)` gets one output dict per view ('z' the projector output, 'h' the backbone features);
`defaults()` is the objective's config block, `config.my_align_uniform`; `validate` checks it
before any compute; `register` makes `config.ssl_method = 'my_align_uniform'` known to every
binary. (The library's own `align_uniform`, the SSD paper's base, is the same loss at alpha = 2;
this example keeps its own name so that it registers next to it.)
"""
import jax
import jax.numpy as jnp
import ml_collections

import fedjax_ssl as fs
from fedjax_ssl import config_validation as cv


def align_uniform(z1: jax.Array, z2: jax.Array, *, alpha: float, t: float,
                  uniform_weight: float) -> jax.Array:
  """The loss of two views' projections z1, z2 [B, d] (B >= 2), normalised here; a scalar."""
  z1, z2 = fs.ssl.l2_normalize(z1), fs.ssl.l2_normalize(z2)
  align = jnp.mean(jnp.sum((z1 - z2) ** 2, axis=-1) ** (alpha / 2))

  def uniform(z):
    sq = jnp.sum((z[:, None, :] - z[None, :, :]) ** 2, axis=-1)
    off = ~jnp.eye(z.shape[0], dtype=bool)
    # log-mean-exp over the B(B - 1) pairs b ≠ b'.
    return jax.nn.logsumexp(jnp.where(off, -t * sq, -jnp.inf)) - jnp.log(off.sum())

  return align + uniform_weight * (uniform(z1) + uniform(z2)) / 2


def loss(hparams, online, target, batch, shared):
  del target, batch, shared  # no momentum target; no algorithm hands this loss anything
  return align_uniform(online[0]['z'], online[1]['z'], alpha=hparams['alpha'], t=hparams['t'],
                       uniform_weight=hparams['uniform_weight'])


def defaults() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({'alpha': 2.0, 't': 2.0, 'uniform_weight': 1.0})


def validate(block: ml_collections.ConfigDict) -> None:
  cv.check_float_range('my_align_uniform.alpha', block.alpha, 0.0, None, inclusive=(False, True))
  cv.check_float_range('my_align_uniform.t', block.t, 0.0, None, inclusive=(False, True))
  cv.check_float_range('my_align_uniform.uniform_weight', block.uniform_weight, 0.0, None)


fs.ssl.register(fs.ssl.Objective(
    name='my_align_uniform', loss=loss, defaults=defaults, validate=validate,
    doc='alignment + uniformity on the hypersphere (user example)'))


def get_config() -> ml_collections.ConfigDict:
  """The quickstart's federation (LeNet-5, 10 clients, Dirichlet 0.5) under FedAvg with this
  objective; the dataset is a flag away (`--config.dataset=synthetic` for a smoke run)."""
  c = fs.experiment.default_config()   # now holds config.my_align_uniform
  c.ssl_method = 'my_align_uniform'
  c.algorithm = 'fedavg'
  c.dataset = 'fashion_mnist'
  c.encoder = 'lenet5'
  c.heads = 'custom'
  c.augmentation = 'fedsc'
  c.partition = 'dirichlet'
  c.alpha = 0.5
  c.num_clients = 10
  c.clients_per_round = 10
  c.rounds = 25
  c.local_epochs = 1
  c.batch_size = 128
  c.lr = 0.1
  c.weight_decay = 0.0
  c.checkpoint_every = 5
  return c
