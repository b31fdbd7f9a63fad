r"""Your own algorithm in one file: FedProx over FedSimCLR, registered and run by the library's binaries.

FedProx (Li et al., MLSys 2020) adds the proximal term mu/2 * ||w - w_global||^2 to every local
step's loss, where w are the parameters the client shares and w_global the model it received this
round; mu = 0 is FedSimCLR exactly. Everything else is FedSimCLR: the same client, the same server
average. Only public names of fedjax_ssl are used, and the library is not edited:

  python -m experiments.train --config configs/examples/custom_algorithm.py \
      --config.dataset=synthetic --config.rounds=2 --workdir /tmp/fedprox

  python -m experiments.train --config configs/examples/custom_algorithm.py \
      --config.train_size=10000 --config.fedprox_simclr.mu=0.1 --workdir /tmp/fedprox_fmnist

The pieces: `build(config, info)` returns an Algorithm (here FedAvg's with another `local_step`);
`config_block()` is the algorithm's config block, `config.fedprox_simclr`; `validate` checks it
before any compute; `register` makes `config.algorithm = 'fedprox_simclr'` known to every binary.
"""
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

import fedjax_ssl as fs
from fedjax_ssl import config_validation as cv
from fedjax_ssl.algorithms import fedavg, ssl_client


def proximal_term(params, global_params, mu: float) -> jax.Array:
  """mu/2 * sum of squared differences over the leaves of `global_params` (the shared modules)."""
  shared = {k: params[k] for k in global_params}
  sq = jax.tree_util.tree_map(lambda w, g: jnp.sum((w - g) ** 2), shared, global_params)
  return 0.5 * mu * sum(jax.tree_util.tree_leaves(sq))


def build(config: ml_collections.ConfigDict, info) -> fs.core.Algorithm:
  spec = ssl_client.spec_from_config(config, info)
  mu = float(config.fedprox_simclr.mu)

  def local_step(client, batch, key, msg, lr):
    # msg is FedAvg's broadcast: the global online network {'params', 'batch_stats'}.
    prox = lambda params: proximal_term(params, msg['params'], mu)
    return ssl_client.local_step(spec, client, batch, key, msg, lr, extra_loss=prox)

  return dataclasses.replace(fedavg.make(spec, name='fedprox_simclr'), local_step=local_step)


def config_block() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({'mu': 0.01})


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  del dataset_info
  cv.check_float_range('fedprox_simclr.mu', config.fedprox_simclr.mu, 0.0, None)


fs.algorithms.register('fedprox_simclr', build, defaults=config_block, validate=validate,
                       methods=('simclr',), doc='FedProx over FedSimCLR (user example)')


def get_config() -> ml_collections.ConfigDict:
  """A small federation (LeNet-5, 10 clients, half of them per round) under FedProx-SimCLR; the
  dataset is a flag away (Fashion-MNIST by default, `--config.dataset=synthetic` for a smoke run)."""
  c = fs.experiment.default_config()   # now holds config.fedprox_simclr
  c.algorithm = 'fedprox_simclr'
  c.ssl_method = 'simclr'
  c.dataset = 'fashion_mnist'
  c.encoder = 'lenet5'
  c.heads = 'custom'
  c.augmentation = 'fedsc'
  c.partition = 'dirichlet'
  c.alpha = 0.5
  c.num_clients = 10
  c.clients_per_round = 5
  c.rounds = 20
  c.local_epochs = 1
  c.batch_size = 128
  c.lr = 0.1
  c.weight_decay = 0.0
  c.simclr.temperature = 0.2
  c.checkpoint_every = 5
  return c
