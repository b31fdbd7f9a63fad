"""FedU (Zhuang et al., ICCV 2021, arXiv:2108.06492) as in EasyFL (BUILD_NOTES.md "Algorithms").

Each participant adopts the global online encoder + projector. Its predictor follows the
divergence-aware predictor update (DAPU): the global predictor if the divergence measured after its
previous local training was below `dapu_threshold` (0.4), otherwise its own local predictor. The
divergence is `conv_divergence` between the encoder at the start and at the end of local training.
The BYOL target stays local. At a client's first participation everything comes from the server.
"""
from __future__ import annotations

import jax.numpy as jnp

from fedjax_ssl.algorithms import fedavg, ssl_client
from fedjax_ssl.algorithms.base import Algorithm
from fedjax_ssl.algorithms.divergence import conv_divergence

METHODS = ('byol', 'simsiam')


def make(spec: ssl_client.ClientSpec, *, dapu_threshold: float = 0.4) -> Algorithm:
  if spec.method not in METHODS:
    raise ValueError(f'FedU needs a predictor: ssl_method = {spec.method!r} is invalid, must be one '
                     f'of {METHODS}')
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
