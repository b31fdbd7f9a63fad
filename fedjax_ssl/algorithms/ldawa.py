"""L-DAWA (Rehman et al., "L-DAWA: Layer-wise Divergence Aware Weight Aggregation in Federated
Self-Supervised Visual Representation Learning", ICCV 2023), as FedU2's L-DAWA-SimCLR / -BYOL
baselines.

The FedAvg client and broadcast (`fedavg.make`); the server replaces the weighted mean by
`ops.ldawa.aggregate`: each participant's layer scaled by its cosine with the round's global layer,
then averaged, uniformly over the participants as the authors' release (or by data size,
`ldawa.size_weights=True`). The uploaded online network (parameters and BatchNorm statistics) is
aggregated this way; BYOL's target stays local as in FedBYOL. docs/notes/fedu2.md#fedu2-baselines.
"""
from __future__ import annotations

import dataclasses

import ml_collections

from fedjax_ssl.algorithms import fedavg, registry, ssl_client
from fedjax_ssl.core.algorithm import Algorithm, uniform_weights
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.ops import ldawa as ldawa_ops


def make(spec: ssl_client.ClientSpec, *, size_weights: bool = False,
         byol_target_sync: str = 'keep', stateless: bool = True) -> Algorithm:
  """FedAvg of `spec` with L-DAWA's aggregation (uniform weights unless `size_weights`;
  `stateless` as in fedavg.make)."""
  def aggregate(server, payloads, weights, ids):
    del ids
    # Uniform over the present participants (an absent one weighs 0: core/faults.py).
    return ldawa_ops.aggregate(payloads, server,
                               weights if size_weights else uniform_weights(weights))
  return dataclasses.replace(
      fedavg.make(spec, byol_target_sync=byol_target_sync, name='ldawa', stateless=stateless),
      aggregate=aggregate,
      update_reference=None)  # layer-wise angles, not a weighted mean: no DP-FedAvg


def config_block() -> ml_collections.ConfigDict:
  """L-DAWA's keys, `config.ldawa`."""
  return ml_collections.ConfigDict({'size_weights': False})


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  return make(ssl_client.spec_from_config(config, info),
              size_weights=bool(config.ldawa.size_weights),
              byol_target_sync=config.byol_target_sync)


registry.register('ldawa', build, defaults=config_block,
                  doc='layer-wise cosine-scaled aggregation (Rehman et al., ICCV 2023)')
