"""FedAvg over an SSL (or supervised) client: FedBYOL, FedSimSiam, FedSimCLR, supervised FedAvg, and
centralized training (one client holding all data).

Per round (EasyFL `fedssl`; docs/notes/fedssl.md#algorithms): every participant adopts the global online
network (encoder + projector + predictor, with their BatchNorm statistics), trains E local epochs,
uploads its online network, and the server replaces the global network by the data-size-weighted mean
(BatchNorm running statistics included, as EasyFL / FedSC average the whole state dict).
BYOL's target stays local (EasyFL) — or is reset to the online network at every sync
(`byol_target_sync='reset'`, FedSC's FedAvg+BYOL). At a client's first participation the target is
the global online network in both modes.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl.algorithms import registry, ssl_client
from fedjax_ssl.core.algorithm import (Algorithm, GlobalModel, Stateless, keep_trained, replicate,
                                        weighted_mean)
from fedjax_ssl.data.types import DataInfo

BYOL_TARGET_SYNC = ('keep', 'reset')
# The global model of a server that is the online network {'params', 'batch_stats'}: a server
# optimizer steps its parameters; the BatchNorm statistics stay the average.
ONLINE_PARAMS = GlobalModel(get=lambda server: server['params'],
                            set=lambda server, params: dict(server, params=params))


def select_tree(flag, a, b):
  """Pytree select on a scalar bool."""
  return jax.tree_util.tree_map(lambda x, y: jnp.where(flag, x, y), a, b)


def shared_subset(spec: ssl_client.ClientSpec, client) -> dict:
  """The online network every participant uploads: {'params', 'batch_stats'} restricted to the
  objective's shared modules."""
  names = spec.shared
  return {'params': {k: client['params'][k] for k in names if k in client['params']},
          'batch_stats': {k: client['batch_stats'][k] for k in names if k in client['batch_stats']}}


def adopt_global(spec: ssl_client.ClientSpec, client, glob, names) -> dict:
  """Client with the modules `names` (params and BN statistics) replaced by the global ones."""
  return dict(client,
              params=ssl_client.replace_modules(client['params'], glob['params'], names),
              batch_stats=ssl_client.replace_modules(client['batch_stats'], glob['batch_stats'], names))


def sync_target(spec: ssl_client.ClientSpec, client, reset) -> dict:
  """Momentum target (BYOL): target <- online (encoder + projector) where `reset` (scalar bool),
  else keep; a client without a target is returned as it is."""
  if not spec.objective.target:
    return client
  fresh = ssl_client.target_from_online(client['params'], client['batch_stats'])
  return dict(client, target=select_tree(reset, fresh, client['target']))


def mark_participated(client) -> dict:
  return dict(client, extras=dict(client['extras'], participated=jnp.ones((), jnp.float32)))


def init_shared(spec: ssl_client.ClientSpec, key, num_clients):
  """All clients start from the same initial model, which is also the global model."""
  client = ssl_client.init_client(spec, key)
  return replicate(client, num_clients), shared_subset(spec, client)


def classifier_apply(spec: ssl_client.ClientSpec):
  """(variables, x) -> logits of a supervised spec's whole Classifier in inference mode (None for
  SSL methods, which have no classifier)."""
  if not spec.objective.classifier:
    return None
  return lambda v, x: spec.model.apply(v, x, train=False)


def global_model_algorithm(spec: ssl_client.ClientSpec, *, name: str, init, begin,
                           end=keep_trained) -> Algorithm:
  """An algorithm whose server keeps the data-weighted mean of the participants' online networks
  and evaluates that global model (FedAvg, FedU, FedEMA differ only in init / begin / end)."""
  return Algorithm(
      name=name, init=init, broadcast=lambda server: server, begin=begin,
      local_step=lambda c, b, k, msg, lr: ssl_client.local_step(spec, c, b, k, msg, lr),
      end=end,
      upload=lambda client, msg, local: shared_subset(spec, client),
      aggregate=lambda server, payloads, weights, ids: weighted_mean(payloads, weights),
      eval_variables=lambda state: (state.server, False),
      encoder_apply=lambda v, x: spec.model.encoder.apply(ssl_client.encoder_variables(v), x,
                                                          train=False),
      classifier_apply=classifier_apply(spec),
      ragged_batches=spec.objective.ragged_batches,
      global_model=ONLINE_PARAMS,
      # The server is the uploaded online network itself (DP-FedAvg's Δ_k = upload - server).
      update_reference=lambda server: server,
  )


def _private(tree: dict, names) -> dict:
  """The top-level entries of `tree` that are not the shared modules `names`."""
  return {k: v for k, v in tree.items() if k not in names}


def persistent_part(spec: ssl_client.ClientSpec, client, byol_target_sync: str) -> dict:
  """What of a FedAvg client survives a round, i.e. what `begin` does not overwrite.

  `begin` replaces the shared modules by the global ones, resets the optimizer (when
  spec.reset_optimizer) and, for BYOL with target sync 'reset', the target. Left: modules the method
  does not share (none for the built-in models), the optimizer state without a reset (e.g. the
  persistent Adam of representation sharing's FL), and BYOL's local target with the flag that says
  whether it was ever set ('keep'). Supervised FedAvg, FedSimCLR and FedSimSiam with the reset keep
  {}: nothing is stored per client.
  """
  names = spec.shared
  out = {}
  for field in ('params', 'batch_stats'):
    if _private(client[field], names):
      out[field] = _private(client[field], names)
  return dict(out, **kept_local_state(spec, client, byol_target_sync))


def kept_local_state(spec: ssl_client.ClientSpec, client, byol_target_sync: str) -> dict:
  """The optimizer state without a reset, BYOL's local target under 'keep' (with its flag) and the
  objective's per-client state: the part of `persistent_part` that does not depend on which modules
  are shared."""
  out = {}
  if not spec.reset_optimizer:
    out['opt_state'] = client['opt_state']
  if 'objective' in client:  # the objective's per-client state (MoCo's queue)
    out['objective'] = client['objective']
  if spec.objective.target and byol_target_sync == 'keep':
    out['target'] = client['target']
    out['extras'] = {'participated': client['extras']['participated']}
  return out


def rebuild_client(spec: ssl_client.ClientSpec, stored: dict, msg) -> dict:
  """A full FedAvg client from its persistent part and the broadcast global model.

  The parts `begin` overwrites get placeholders of the right structure: the global model, a fresh
  optimizer state, a target copied from the global online network, participated = 0.
  """
  params = dict(msg['params'], **stored.get('params', {}))
  batch_stats = dict(msg['batch_stats'], **stored.get('batch_stats', {}))
  client = {'params': params, 'batch_stats': batch_stats,
            'opt_state': stored['opt_state'] if 'opt_state' in stored else spec.tx.init(params),
            'extras': stored.get('extras', {'participated': jnp.zeros((), jnp.float32)})}
  if spec.objective.target:
    client['target'] = (stored['target'] if 'target' in stored
                        else ssl_client.target_from_online(params, batch_stats))
  if 'objective' in stored:
    client['objective'] = stored['objective']
  return client


def make(spec: ssl_client.ClientSpec, *, byol_target_sync: str = 'keep', name: str = 'fedavg',
         stateless: bool = True) -> Algorithm:
  """FedAvg of `spec`'s online network.

  stateless: store per client only what survives a round (`persistent_part`; memory = the server
    plus the round's participants). False stores every client's whole state, as before stateless
    clients existed; both compute the same numbers (tests/core/test_round_equivalence.py).
  """
  if byol_target_sync not in BYOL_TARGET_SYNC:
    raise ValueError(f'byol_target_sync = {byol_target_sync!r} is invalid: must be one of '
                     f'{BYOL_TARGET_SYNC}')
  names = spec.shared

  def begin(client, msg, key):
    del key
    first = client['extras']['participated'] == 0
    client = adopt_global(spec, ssl_client.begin_round(spec, client), msg, names)
    client = sync_target(spec, client, first | (byol_target_sync == 'reset'))
    return mark_participated(client)

  algo = global_model_algorithm(
      spec, name=name, init=lambda key, num_clients: init_shared(spec, key, num_clients),
      begin=begin)
  if not stateless:
    return algo
  persist = lambda client: persistent_part(spec, client, byol_target_sync)

  def init(key, num_clients):
    client = ssl_client.init_client(spec, key)
    return replicate(persist(client), num_clients), shared_subset(spec, client)

  return dataclasses.replace(
      algo, init=init,
      stateless=Stateless(persist, lambda stored, msg: rebuild_client(spec, stored, msg)))


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  """FedAvg over the configured SSL (or supervised) client."""
  return make(ssl_client.spec_from_config(config, info), byol_target_sync=config.byol_target_sync)


def build_centralized(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  """Centralized training: FedAvg with one client that holds all the data."""
  return make(ssl_client.spec_from_config(config, info), byol_target_sync=config.byol_target_sync,
              name='centralized')


def validate_centralized(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  del dataset_info
  if config.num_clients != 1:
    raise cv.ConfigError(f'config.num_clients = {config.num_clients} is invalid for algorithm '
                         f"'centralized': it must be 1 (all data on one client)")


registry.register('fedavg', build, dp=True,
                  doc='FedAvg of the online network (FedBYOL, FedSimCLR, ...)')
registry.register('centralized', build_centralized, validate=validate_centralized,
                  doc='one client holding all the data', aggregates=False)
