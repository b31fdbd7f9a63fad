"""FedEMA (Zhuang et al., ICLR 2022, arXiv:2204.04385) as in EasyFL (docs/notes/fedssl.md#algorithms).

At every participation after the first, with d the divergence of the client's previous local training
and lambda_k its auto-scaler:
    mu_k = min(lambda_k * d, 1)
    online (encoder + projector) <- mu_k * local + (1 - mu_k) * global
    predictor                    <- mu_k * local + (1 - mu_k) * global
A larger divergence keeps more of the local model. The auto-scaler is fixed once, after the client's
first local training: lambda_k = autoscaler_tau / d_first (tau = 0.7). BatchNorm statistics of the
encoder + projector come from the global model (EasyFL mixes parameters only); the predictor keeps its
local statistics when mu_k > 0.5 (EasyFL then moves the local predictor towards the global one) and
takes the global ones otherwise. The BYOL target stays local. At the first participation everything
comes from the server.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl.algorithms import fedavg, registry, ssl_client
from fedjax_ssl.core.algorithm import Algorithm
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.algorithms.divergence import conv_divergence

_ONLINE = ('encoder', 'projector')


def mix(local, glob, mu):
  """mu * local + (1 - mu) * global, leafwise."""
  return jax.tree_util.tree_map(lambda l, g: mu * l + (1.0 - mu) * g, local, glob)


def make(spec: ssl_client.ClientSpec, *, autoscaler_tau: float = 0.7) -> Algorithm:
  if not spec.objective.predictor:
    raise ValueError(f'FedEMA needs a predictor: ssl_method = {spec.method!r} has none')
  if autoscaler_tau <= 0:
    raise ValueError(f'fedema.autoscaler_tau = {autoscaler_tau} is invalid: must be > 0')

  def init(key, num_clients):
    clients, server = fedavg.init_shared(spec, key, num_clients)
    zeros = jnp.zeros((num_clients,), jnp.float32)
    clients['extras'].update(divergence=zeros, scaler=zeros)
    return clients, server

  def begin(client, msg, key):
    del key
    extras = client['extras']
    first = extras['participated'] == 0
    client = ssl_client.begin_round(spec, client)
    mu = jnp.minimum(extras['scaler'] * extras['divergence'], 1.0)
    p_loc, p_glob = client['params'], msg['params']
    mixed = {k: mix(p_loc[k], p_glob[k], mu) for k in _ONLINE + ('predictor',)}
    params = fedavg.select_tree(first, ssl_client.replace_modules(p_loc, p_glob, mixed.keys()),
                                ssl_client.replace_modules(p_loc, mixed, mixed.keys()))
    bs_loc, bs_glob = client['batch_stats'], msg['batch_stats']
    bs = ssl_client.replace_modules(bs_loc, bs_glob, _ONLINE)
    if 'predictor' in bs_loc:
      keep_local = (~first) & (mu > 0.5)
      bs['predictor'] = fedavg.select_tree(keep_local, bs_loc['predictor'], bs_glob['predictor'])
    client = dict(client, params=params, batch_stats=bs)
    client = fedavg.sync_target(spec, client, first)
    return fedavg.mark_participated(client)

  def end(start, client, msg):
    d = conv_divergence(start['params']['encoder'], client['params']['encoder'])
    scaler = client['extras']['scaler']
    # Fixed once: after the first local training (scaler still 0).
    scaler = jnp.where(scaler == 0, autoscaler_tau / jnp.maximum(d, 1e-12), scaler)
    return dict(client, extras=dict(client['extras'], divergence=d, scaler=scaler))

  return fedavg.global_model_algorithm(spec, name='fedema', init=init, begin=begin, end=end)


def config_block() -> ml_collections.ConfigDict:
  """FedEMA's keys, `config.fedema`."""
  return ml_collections.ConfigDict({'autoscaler_tau': 0.7})


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  del dataset_info
  cv.check_float_range('fedema.autoscaler_tau', config.fedema.autoscaler_tau, 0.0, None,
                       inclusive=(False, True))


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  return make(ssl_client.spec_from_config(config, info),
              autoscaler_tau=config.fedema.autoscaler_tau)


registry.register('fedema', build, dp=True,
                  defaults=config_block, validate=validate, needs=('predictor',),
                  doc='FedEMA, divergence-scaled EMA update')
