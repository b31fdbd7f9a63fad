"""SSD, Soft Separation and Distillation (Fang, Lin, King, Zhang, ICCV 2025; official code
github:hc-fang/ssd, "FedAlignUniformSubspace"), over an SSL client with a projector.

FedAvg of the online network (`fedavg.make`: the same server, broadcast, client and upload; nothing
SSD-specific is uploaded) whose local loss gains, per view v of the two,

  ½ (gamma * `ops.ssd.dsr_loss`(z_v, Q, d_k) + delta * `ops.ssd.distillation_loss`(h_v, z_v, tau))

(the code averages each term over the views): Dimension-Scaled Regularisation on the projector
output z and Projector Distillation between the encoder output h and z. d_k is client k's fixed
dimension-scaling vector (alpha on floor(D/K) disjoint dimensions, 1 elsewhere) in the random
orthogonal basis Q shared by all clients; both are drawn once from the run's seed, before
training, and never change. gamma = 1, delta = 0.1, alpha = 10, tau = 0.5 are the code's.
gamma = delta = 0 is FedAvg of the base objective (FedAlignUniform in the paper) bit for bit.
`ssd.separation = 'hard'` is the paper's hard separation (HSD, in its soft-against-hard
comparison): d_k is 1 on the block and 0 elsewhere, so that DSR pulls each embedding towards its
projection onto the client's subspace (`ops.ssd.scaling_vectors`).

Which d a participant uses (`ssd.assign`): 'client' (default) d_k of its own id, every round;
'slot' the code's: d_i of its position i among the round's participants (sorted ids), so only the
first clients_per_round vectors are ever used under partial participation. The participant learns
its index from its personalised broadcast (one int32; the vectors themselves are a function of the
seed, as if sent once before round 1). docs/notes/ssd.md.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl import models
from fedjax_ssl.algorithms import fedavg, registry, ssl_client
from fedjax_ssl.core.algorithm import Algorithm, Prepare, weighted_mean
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.ops import ssd as ops

ASSIGN = ('client', 'slot')
# Stream of the run's seed from which Q and the d_k are drawn (numpy, host-side, once).
SEED_STREAM = 0x55D
# Broadcast keys: the participant's index into the vectors, and (slot mode) the round's cohort.
INDEX, COHORT = 'ssd_index', 'ssd_cohort'


@dataclasses.dataclass(frozen=True)
class SSDConfig:
  """SSD's settings, config.ssd (module docstring)."""
  alpha: float = 10.0
  gamma: float = 1.0
  delta: float = 0.1
  temperature: float = 0.5
  subset_size: int = 0
  dsr_form: str = 'code'
  basis: str = 'random_orthogonal'
  assign: str = 'client'
  pd_direction: str = 'code'
  pd_stopgrad_z: bool = False
  separation: str = 'soft'


def draw(seed: int, num_vectors: int, dim: int, sc: SSDConfig):
  """(Q [D, D], d [K, D]) float64, drawn once from `seed` (Q first, then the permutation)."""
  rng = np.random.default_rng([int(seed), SEED_STREAM])
  q = ops.orthogonal_basis(rng, dim, sc.basis)
  return q, ops.scaling_vectors(rng, num_vectors, dim, sc.alpha, sc.subset_size, sc.separation)


def regularizer(sc: SSDConfig, q: jax.Array, d: jax.Array):
  """(outputs of one view, key) -> ½ (gamma DSR + delta PD), or None when both weights are 0."""
  if sc.gamma == 0 and sc.delta == 0:
    return None

  def term(out, key):
    del key
    total = jnp.zeros((), jnp.float32)
    # A zero weight adds no term at all, so gamma = 0 (or delta = 0) is the other term alone.
    if sc.gamma != 0:
      total = total + sc.gamma * ops.dsr_loss(out['z'], q.astype(out['z'].dtype),
                                              d.astype(out['z'].dtype), form=sc.dsr_form)
    if sc.delta != 0:
      total = total + sc.delta * ops.distillation_loss(
          out['h'], out['z'], sc.temperature, direction=sc.pd_direction,
          stop_gradient_z=sc.pd_stopgrad_z)
    return total / 2
  return term


def make(spec: ssl_client.ClientSpec, *, q, d, sc: SSDConfig = SSDConfig(),
         clients_per_round: int = 0, byol_target_sync: str = 'keep', stateless: bool = True
         ) -> Algorithm:
  """SSD over `spec` with the basis q [D, D] and the vectors d [K, D] (`draw`).

  clients_per_round: the round's m, needed by assign = 'slot' (the server keeps the round's
  participant ids, [m], for the broadcast).
  """
  if sc.assign not in ASSIGN:
    raise ValueError(f'ssd.assign = {sc.assign!r} is invalid: must be one of {ASSIGN}')
  if sc.assign == 'slot' and clients_per_round < 1:
    raise ValueError("ssd.assign = 'slot' needs clients_per_round >= 1")
  base = fedavg.make(spec, byol_target_sync=byol_target_sync, name='ssd', stateless=stateless)
  # Kept in float64 on the host and made constants of the traced step in the default float
  # dtype (float64 under x64, so that a float64 test sees an orthogonal Q to float64 rounding).
  q, d = np.asarray(q, np.float64), np.asarray(d, np.float64)

  def local_step(client, batch, key, msg, lr):
    reg = regularizer(sc, jnp.asarray(q), jnp.asarray(d)[msg[INDEX]])
    step_spec = spec if reg is None else dataclasses.replace(
        spec, feature_regularizer=reg, regularized='outputs')
    return ssl_client.local_step(step_spec, client, batch, key, msg, lr)

  if sc.assign == 'client':
    return dataclasses.replace(
        base, local_step=local_step,
        personalize=lambda msg, cid: dict(msg, **{INDEX: jnp.asarray(cid, jnp.int32)}))

  def init(key, num_clients):
    clients, server = base.init(key, num_clients)
    return clients, dict(server, **{COHORT: jnp.zeros((clients_per_round,), jnp.int32)})

  def personalize(msg, cid):
    slot = jnp.argmax(msg[COHORT] == cid).astype(jnp.int32)
    return dict({k: v for k, v in msg.items() if k != COHORT}, **{INDEX: slot})

  def aggregate(server, payloads, weights, ids):
    return dict(weighted_mean(payloads, weights), **{COHORT: server[COHORT]})

  model = lambda server: {k: server[k] for k in ('params', 'batch_stats')}
  return dataclasses.replace(
      base, init=init, local_step=local_step, personalize=personalize, aggregate=aggregate,
      prepare=Prepare(lambda state, data, ids, key: dict(state.server, **{COHORT: ids})),
      eval_variables=lambda state: (model(state.server), False))


def config_block() -> ml_collections.ConfigDict:
  """SSD's keys, `config.ssd` (the code's values; module docstring)."""
  return ml_collections.ConfigDict(dataclasses.asdict(SSDConfig()))


def projector_dim(config: ml_collections.ConfigDict) -> int:
  """D, the projector's output dimension of the configured heads."""
  if config.heads == 'custom':
    return int(config.proj_out)
  return int(models.HEAD_PRESETS[config.heads]['projector']['out'])


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  del dataset_info
  s = config.ssd
  cv.check_float_range('ssd.alpha', s.alpha, 0.0, None, inclusive=(False, True))
  cv.check_float_range('ssd.gamma', s.gamma, 0.0, None)
  cv.check_float_range('ssd.delta', s.delta, 0.0, None)
  cv.check_float_range('ssd.temperature', s.temperature, 0.0, None, inclusive=(False, True))
  cv.check_int_range('ssd.subset_size', s.subset_size, 0, None)
  cv.check_choice('ssd.dsr_form', s.dsr_form, ops.DSR_FORMS)
  cv.check_choice('ssd.basis', s.basis, ops.BASES)
  cv.check_choice('ssd.assign', s.assign, ASSIGN)
  cv.check_choice('ssd.pd_direction', s.pd_direction, ops.PD_DIRECTIONS)
  cv.check_choice('ssd.separation', s.separation, ops.SEPARATIONS)
  if not isinstance(s.pd_stopgrad_z, bool):
    raise cv.ConfigError(f'config.ssd.pd_stopgrad_z = {s.pd_stopgrad_z!r} is invalid: must be '
                         'True or False')
  dim, k = projector_dim(config), int(config.num_clients)
  m = s.subset_size if s.subset_size > 0 else dim // k
  if m < 1 or k * m > dim:
    raise cv.ConfigError(
        f'config.num_clients = {k} is invalid for algorithm ssd with a {dim}-d projector output'
        + (f' and ssd.subset_size = {s.subset_size}' if s.subset_size > 0 else '')
        + f': each client needs its own disjoint block of dimensions (num_clients x block <= {dim})')
  if s.delta > 0:
    h_dim = models.feature_dim(config.encoder)
    if h_dim != dim:
      raise cv.ConfigError(
          f'config.ssd.delta = {s.delta} is invalid with encoder {config.encoder!r} ({h_dim}-d '
          f'features) and a {dim}-d projector output: projector distillation compares them '
          'coordinate by coordinate; make them equal or set ssd.delta = 0')


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  s = config.ssd
  sc = SSDConfig(**{k: s[k] for k in config_block().keys()})
  q, d = draw(config.seed, int(config.num_clients), projector_dim(config), sc)
  return make(ssl_client.spec_from_config(config, info), q=q, d=d, sc=sc,
              clients_per_round=int(config.clients_per_round),
              byol_target_sync=config.byol_target_sync)


registry.register('ssd', build, defaults=config_block, validate=validate, needs=('projector',),
                  doc='FedAvg + dimension-scaled regularisation + projector distillation '
                      '(Fang et al., ICCV 2025)')
