"""FedU (Zhuang et al., ICCV 2021, arXiv:2108.06492) as in EasyFL (docs/notes/fedssl.md#algorithms).

Each participant adopts the global online encoder + projector. Its predictor follows the
divergence-aware predictor update (DAPU): the global predictor if the divergence measured after its
previous local training was below `dapu_threshold` (0.4), otherwise its own local predictor. The
divergence is `conv_divergence` between the encoder at the start and at the end of local training.
The BYOL target stays local. At a client's first participation everything comes from the server.
"""
from __future__ import annotations

import jax.numpy as jnp
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl.algorithms import fedavg, registry, ssl_client
from fedjax_ssl.core.algorithm import Algorithm
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.algorithms.divergence import conv_divergence

def make(spec: ssl_client.ClientSpec, *, dapu_threshold: float = 0.4) -> Algorithm:
  if not spec.objective.predictor:
    raise ValueError(f'FedU needs a predictor: ssl_method = {spec.method!r} has none')
  if dapu_threshold <= 0:
    raise ValueError(f'fedu.dapu_threshold = {dapu_threshold} is invalid: must be > 0')

  def init(key, num_clients):
    clients, server = fedavg.init_shared(spec, key, num_clients)
    clients['extras']['divergence'] = jnp.zeros((num_clients,), jnp.float32)
    return clients, server

  def begin(client, msg, key):
    del key
    first = client['extras']['participated'] == 0
    client = ssl_client.begin_round(spec, client)
    use_global_pred = first | (client['extras']['divergence'] < dapu_threshold)
    adopted = fedavg.adopt_global(spec, client, msg, ('encoder', 'projector', 'predictor'))
    local_pred = fedavg.adopt_global(spec, client, msg, ('encoder', 'projector'))
    client = fedavg.select_tree(use_global_pred, adopted, local_pred)
    client = fedavg.sync_target(spec, client, first)
    return fedavg.mark_participated(client)

  def end(start, client, msg):
    d = conv_divergence(start['params']['encoder'], client['params']['encoder'])
    return dict(client, extras=dict(client['extras'], divergence=d))

  return fedavg.global_model_algorithm(spec, name='fedu', init=init, begin=begin, end=end)


def config_block() -> ml_collections.ConfigDict:
  """FedU's keys, `config.fedu`."""
  return ml_collections.ConfigDict({'dapu_threshold': 0.4})


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  del dataset_info
  cv.check_float_range('fedu.dapu_threshold', config.fedu.dapu_threshold, 0.0, None,
                       inclusive=(False, True))


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  return make(ssl_client.spec_from_config(config, info), dapu_threshold=config.fedu.dapu_threshold)


registry.register('fedu', build, dp=True,
                  defaults=config_block, validate=validate, needs=('predictor',),
                  doc='FedU, divergence-aware predictor update')
