"""Independent local learning (IL / "Local SSL"): every client trains its own model on its own data,
nothing is communicated. Clients start from independent random initialisations (as the
representation-sharing code's `get_model` per client), or from one shared one with
`independent_init=False`. Evaluation is per client (personalised models).
"""
from __future__ import annotations

import jax
import ml_collections

from fedjax_ssl.algorithms import fedavg, registry, ssl_client
from fedjax_ssl.core.algorithm import Algorithm, replicate
from fedjax_ssl.data.types import DataInfo


def make(spec: ssl_client.ClientSpec, *, independent_init: bool = True) -> Algorithm:
  def init(key, num_clients):
    if independent_init:
      keys = jax.random.split(key, num_clients)
      clients = jax.vmap(lambda k: ssl_client.init_client(spec, k))(keys)
    else:
      clients = replicate(ssl_client.init_client(spec, key), num_clients)
    return clients, {}

  def begin(client, msg, key):
    del msg, key
    return fedavg.mark_participated(ssl_client.begin_round(spec, client))

  def eval_variables(state):
    return {'params': state.clients['params'], 'batch_stats': state.clients['batch_stats']}, True

  return Algorithm(
      name='independent', init=init, broadcast=lambda server: server, begin=begin,
      local_step=lambda c, b, k, msg, lr: ssl_client.local_step(spec, c, b, k, msg, lr),
     
      upload=lambda client, msg, local: {},
      aggregate=lambda server, payloads, weights, ids: server,
      eval_variables=eval_variables,
      encoder_apply=lambda v, x: spec.model.encoder.apply(ssl_client.encoder_variables(v), x,
                                                          train=False),
      personalized=True,
      classifier_apply=fedavg.classifier_apply(spec),
      ragged_batches=spec.objective.ragged_batches,
  )


def config_block() -> ml_collections.ConfigDict:
  """Independent training's keys, `config.independent`."""
  # True: every client its own random init (representation-sharing code); False: one shared init.
  return ml_collections.ConfigDict({'independent_init': True})


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  return make(ssl_client.spec_from_config(config, info),
              independent_init=config.independent.independent_init)


registry.register('independent', build, defaults=config_block,
                  doc='each client trains alone (IL / local SSL), evaluated client by client',
                  global_model=False, aggregates=False)
