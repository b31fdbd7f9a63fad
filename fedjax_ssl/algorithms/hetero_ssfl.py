"""Hetero-SSFL (Makhija, Ho, Ghosh, "Federated Self-supervised Learning for Heterogeneous Clients",
arXiv 2205.12493): clients of different architectures keep personal models and align them through
the kernels of their representations on a public Representation Alignment Dataset (RAD).

Round t (decisions A1-A28 in docs/notes/hetero_ssfl.md):
  prepare    round 0: the server's cache of every client's RAD representation A_j = Φ_j(X) [L, d_j]
             (online predictor output, A7) is filled from the initial models (A27: `Prepare`'s
             summarize / absorb, computed where the models are held); afterwards it
             holds each client's latest upload, stale for non-participants (Algorithm 1, A4).
             Over SimCLR (no predictor; not in the paper) Φ is the projector output.
             mu_t = mu (constant) or mu * sqrt(t) with the round index t counted from 0 as
             FedHeNN's code does (`mu_schedule='sqrt'`: mu_t = 0 in the first round).
  broadcast  K̄ = Σ_j w_j A_j A_jᵀ over all clients with w_j = 1/N (A3, A5, A6), or over this
             round's participants only, from their cached (= current) representations
             (`kbar_clients='participants'`, FedHeNN); as the L x L kernel (`broadcast='kernel'`)
             or as the cached representations (`'representations'`: memory O(L Σ d_j) instead of
             O(L²), but every step then costs O(b_R (Σ d_j)²) for ‖K̄_R‖², so it only pays for a
             few narrow clients). Feature averaging Φ̄ = Σ w_j A_j, K̄ = Φ̄Φ̄ᵀ is the flag
             `average='features'` (v001 Eq. 2; needs one width). The RAD images go out too.
  local      the method's SSL loss (BYOL; SimSiam, SimCLR as flags) + mu_t · d on every step, where
             d = 1 - CKA_c(A Aᵀ, K̄[R, R]) for A = Φ_i(X_R) on a fresh random RAD sub-batch R of
             b_R = `rad_batch` points (A8; b_R = L is FedHeNN's exact full-RAD mode), centred per
             sub-block (A1, A2; `centered=False` and `sign='similarity'`, i.e. + mu·CKA as v000
             writes it, are the literal alternatives). BatchNorm on RAD passes: train-mode batch
             statistics whose running-average update is discarded (A9), or eval mode (flag).
             Optimiser reset every round (A14). No global model: every client keeps its own.
  upload     A_i = Φ_i(X) on the whole RAD after training, in consecutive chunks of b_R rows (so
             train-mode BatchNorm sees batches of the size the loss used).
  aggregate  the server writes the uploads into its cache.

`mu = 0` is standalone local SSL (Table 4/7's "Local SSL"): nothing is computed on the RAD and
nothing is exchanged.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl import models
from fedjax_ssl.algorithms import fedavg, registry, ssl_client
from fedjax_ssl.core import strategies
from fedjax_ssl.core.algorithm import Algorithm, Cohort, Prepare
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.ops import cka

SIGNS = ('distance', 'similarity')
AVERAGES = ('kernels', 'features')
KBAR_CLIENTS = ('all', 'participants')
BN_MODES = ('train', 'eval')
MU_SCHEDULES = ('constant', 'sqrt')
BROADCASTS = ('kernel', 'representations')
# Φ per method: the online predictor output (A7); SimCLR has no predictor, so its projector output
# (the vector its loss compares) is aligned instead.
REPRESENTATION = {'byol': 'p', 'simsiam': 'p', 'simclr': 'z'}
METHODS = tuple(REPRESENTATION)
# fold_in tag of the RAD sub-batch draw inside a step key (the views never use it).
RAD_STREAM = 0x4AD


def rad_representations(spec: ssl_client.ClientSpec, variables, rad_x: jax.Array, *,
                        bn_mode: str) -> jax.Array:
  """Φ(X): the online predictor output (SimCLR: projector output) of un-augmented RAD images, in
  one forward pass.

  Args:
    variables: {'params', 'batch_stats'} of the client's online network.
    rad_x: uint8 [b, H, W, C].
    bn_mode: 'train' (batch statistics of these b images; the running statistics are not
      updated, A9) or 'eval' (running statistics).
  Returns:
    float [b, d].
  """
  x = augment.normalize(augment.to_float(rad_x), spec.mean, spec.std)
  if bn_mode == 'train':
    out, _ = spec.model.apply(variables, x, train=True, mutable=['batch_stats'])
  else:
    out = spec.model.apply(variables, x, train=False)
  return out[REPRESENTATION[spec.method]]


def upload_representations(spec: ssl_client.ClientSpec, variables, rad_x: jax.Array, *,
                           bn_mode: str, chunk: int) -> jax.Array:
  """Φ(X) of the whole RAD [L, d], `chunk` consecutive rows per pass (L % chunk == 0)."""
  num = rad_x.shape[0] // chunk
  chunks = rad_x.reshape((num, chunk) + rad_x.shape[1:])
  out = jax.lax.map(lambda c: rad_representations(spec, variables, c, bn_mode=bn_mode), chunks)
  return out.reshape((num * chunk,) + out.shape[2:])


def _variables(client):
  return {'params': client['params'], 'batch_stats': client['batch_stats']}


def rad_indices(key: jax.Array, rad_size: int, rad_batch: int) -> jax.Array:
  """int32 [b_R]: a uniform sub-batch of the RAD without replacement (all of it when b_R = L)."""
  if rad_batch == rad_size:
    return jnp.arange(rad_size, dtype=jnp.int32)
  return jax.random.choice(key, rad_size, (rad_batch,), replace=False).astype(jnp.int32)


def alignment_penalty(a: jax.Array, msg, rows: jax.Array, *, sign: str, centered: bool
                      ) -> jax.Array:
  """d(A, K̄[R, R]) for a client's RAD sub-batch representation a [b_R, d].

  msg holds either 'kbar' [L, L] or 'reps' (per cohort [C_c, L, d_c]) with 'weights' (per cohort
  [C_c]); both give the same value (ops.cka). sign 'distance' is 1 - CKA, 'similarity' is + CKA.
  """
  if 'kbar' in msg:
    kbar = msg['kbar'][rows][:, rows]
    dist = cka.cka_distance_to_kernel(a, kbar, centered=centered)
  else:
    others = tuple(r[:, rows] for r in msg['reps'])
    dist = cka.cka_distance_to_aggregate(a, others, msg['weights'], centered=centered)
  return dist if sign == 'distance' else 1.0 - dist


def make(specs: Sequence[Tuple[str, ssl_client.ClientSpec]], members: Sequence[Sequence[int]], *,
         rad_size: int, mu: float, rad_batch: int = 0, mu_schedule: str = 'constant',
         sign: str = 'distance', centered: bool = True, average: str = 'kernels',
         kbar_clients: str = 'all', bn_mode: str = 'train', broadcast: str = 'kernel'
         ) -> Algorithm:
  """Hetero-SSFL over one cohort per architecture.

  Args:
    specs: (name, ClientSpec) per cohort; method one of METHODS (representation: REPRESENTATION),
      representation widths may differ (they must agree for average='features').
    members: sorted global client ids of each cohort; together every client exactly once.
    rad_size: L, the public set's size (FedData.public_x has L rows).
    mu: weight of the alignment term (0 = standalone local SSL).
    rad_batch: b_R RAD points per local step and per upload pass (0 = L, the exact mode); must
      divide L.
    mu_schedule, sign, centered, average, kbar_clients, bn_mode, broadcast: see the module
      docstring; the defaults are the recommended decisions.
  """
  b_r = rad_batch or rad_size
  for key, value, allowed in (('mu_schedule', mu_schedule, MU_SCHEDULES), ('sign', sign, SIGNS),
                              ('average', average, AVERAGES),
                              ('kbar_clients', kbar_clients, KBAR_CLIENTS),
                              ('bn_mode', bn_mode, BN_MODES), ('broadcast', broadcast, BROADCASTS)):
    if value not in allowed:
      raise ValueError(f'hetero_ssfl.{key} = {value!r} is invalid: must be one of {allowed}')
  for name, spec in specs:
    if spec.method not in METHODS:
      raise ValueError(f'ssl_method {spec.method!r} is invalid for Hetero-SSFL (cohort {name!r}): '
                       f'must be one of {METHODS} (the representation is the predictor output, '
                       "SimCLR's projector output)")
  if mu < 0:
    raise ValueError(f'hetero_ssfl.mu = {mu!r} is invalid: must be >= 0')
  align = mu > 0
  if align and (not 1 <= b_r <= rad_size or rad_size % b_r):
    raise ValueError(f'hetero_ssfl.rad_batch = {rad_batch} is invalid: must divide the RAD size '
                     f'{rad_size} (0 = all of it)')
  num_clients = sum(len(m) for m in members)
  widths = tuple(_rep_width(spec) for _, spec in specs)
  if average == 'features' and len(set(widths)) > 1:
    raise ValueError(f"hetero_ssfl.average = 'features' is invalid with representation widths "
                     f'{widths}: averaging features needs one width; use \'kernels\'')

  def client_algo(name, spec):
    def init(key, num):
      return jax.vmap(lambda k: ssl_client.init_client(spec, k))(jax.random.split(key, num)), {}

    def begin(client, msg, key):
      del msg, key
      return fedavg.mark_participated(ssl_client.begin_round(spec, client))

    def local_step(client, batch, key, msg, lr):
      if not align:
        return ssl_client.local_step(spec, client, batch, key, msg, lr)
      rows = rad_indices(jax.random.fold_in(key, RAD_STREAM), rad_size, b_r)
      rad_x = msg['public_x'][rows]

      def extra(params):
        a = rad_representations(spec, {'params': params, 'batch_stats': client['batch_stats']},
                                rad_x, bn_mode=bn_mode)
        return msg['mu'] * alignment_penalty(a, msg, rows, sign=sign, centered=centered)
      return ssl_client.local_step(spec, client, batch, key, msg, lr, extra_loss=extra)

    def upload(client, msg, local):
      if not align:
        return {}
      return upload_representations(spec, _variables(client), msg['public_x'], bn_mode=bn_mode,
                                    chunk=b_r)

    return Algorithm(
        name=f'hetero_ssfl/{name}', init=init, broadcast=lambda server: server, begin=begin,
        local_step=local_step, upload=upload,
        aggregate=lambda server, payloads, weights, ids: server,
        eval_variables=lambda state: (_variables(state.clients), True),
        encoder_apply=lambda v, x: spec.model.encoder.apply(ssl_client.encoder_variables(v), x,
                                                            train=False),
        personalized=True)

  cohorts = tuple(Cohort(name, tuple(int(i) for i in m), client_algo(name, spec))
                  for (name, spec), m in zip(specs, members))

  def init(key, num):
    del num
    keys = jax.random.split(key, len(cohorts))
    clients = tuple(c.client.init(k, len(c.members))[0] for c, k in zip(cohorts, keys))
    if not align:
      return clients, {}
    server = {'reps': tuple(jnp.zeros((len(c.members), rad_size, w), jnp.float32)
                            for c, w in zip(cohorts, widths)),
              # 1 for the clients whose representation enters this round's K̄.
              'in_kbar': jnp.ones((num_clients,), jnp.float32),
              'mu': jnp.zeros((), jnp.float32)}
    return clients, server

  def initial_representations(server, stacks, data, ids, key):
    """A27: K̄ of round 0 from the initial models of every client: per cohort [n, L, d_c] for the
    n clients of its stack given (all, or one process's block), from the public set alone."""
    del server, ids, key
    return tuple(jax.lax.map(lambda c, s=spec: upload_representations(
        s, _variables(c), data.public_x, bn_mode=bn_mode, chunk=b_r), stack)
                 for (_, spec), stack in zip(specs, stacks))

  def absorb(server, reps):
    return dict(server, reps=tuple(a.astype(r.dtype) for a, r in zip(reps, server['reps'])))

  def prepare(state, data, ids, key):
    del data, key
    t = state.round.astype(state.server['mu'].dtype)
    mu_t = mu * (jnp.sqrt(t) if mu_schedule == 'sqrt' else jnp.ones_like(t))
    in_kbar = jnp.ones_like(state.server['in_kbar'])
    if kbar_clients == 'participants':
      in_kbar = jnp.zeros_like(in_kbar).at[ids].set(1.0)
    return dict(state.server, mu=mu_t, in_kbar=in_kbar)

  def weights(server):
    """w_j per cohort [C_c]: 1/N over every client, or 1/m over this round's participants."""
    w = server['in_kbar'] / jnp.sum(server['in_kbar'])
    return tuple(w[jnp.asarray(c.members)] for c in cohorts)

  def broadcast_fn(server):
    w = weights(server)
    reps = server['reps']
    if average == 'features':
      phibar = sum(jnp.einsum('j,jld->ld', wc, r) for wc, r in zip(w, reps))
      reps, w = (phibar[None],), (jnp.ones((1,), phibar.dtype),)
    if broadcast == 'kernel':
      return {'kbar': cka.aggregate_kernel(reps, w), 'mu': server['mu']}
    return {'reps': reps, 'weights': w, 'mu': server['mu']}

  def aggregate(server, payloads, weights_, slots):
    # Unfilled slots and absent participants weigh 0: their representations stay as they were.
    reps = tuple(r.at[jnp.where(w > 0, s.local, r.shape[0])].set(p.astype(r.dtype), mode='drop')
                 for r, p, w, s in zip(server['reps'], payloads, weights_, slots))
    return dict(server, reps=reps)

  def eval_variables(state):
    return tuple(_variables(stack) for stack in state.clients), True

  return Algorithm(
      name='hetero_ssfl', init=init, broadcast=broadcast_fn if align else (lambda server: {}),
      begin=None, local_step=None, end=None, upload=None,
      aggregate=aggregate if align else (lambda server, payloads, weights_, slots: server),
      eval_variables=eval_variables, encoder_apply=None, personalized=True,
      prepare=(Prepare(prepare, summarize=initial_representations, absorb=absorb) if align
               else None), uses_public=align,
      cohorts=cohorts)


def _rep_width(spec: ssl_client.ClientSpec) -> int:
  """Width d of the representation Φ, traced abstractly (no parameters are allocated)."""
  x = jax.ShapeDtypeStruct((2,) + tuple(spec.input_shape), jnp.float32)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)

  def apply(k, v):
    variables = spec.model.init(k, v, train=False)
    return spec.model.apply(variables, v, train=False)[REPRESENTATION[spec.method]]
  return int(jax.eval_shape(apply, key, x).shape[-1])


def config_block() -> ml_collections.ConfigDict:
  """Hetero-SSFL's keys, `config.hetero_ssfl`; defaults follow docs/notes/hetero_ssfl.md."""
  h = ml_collections.ConfigDict()
  # Architectures: 'encoder:count,...' covering num_clients ('' = every client config.encoder).
  h.mix = ''
  h.assignment = 'ordered'        # ordered (first counts to the first encoder) | shuffled (by seed)
  h.mu = 0.1                      # v001 / F.2 for CIFAR (v000: 0.5); 0 = standalone local SSL
  h.mu_schedule = 'constant'      # constant | sqrt (FedHeNN: mu * sqrt(round))
  h.rad_batch = 1000              # b_R RAD points per local step (A8); 0 = the whole RAD
  h.sign = 'distance'             # distance 1 - CKA (A1) | similarity + CKA (v000 literal)
  h.centered = True               # False: the paper's uncentred formula (A2)
  h.average = 'kernels'           # kernels K̄ = Σ w K (A3) | features Φ̄ = Σ w Φ (v001 Eq. 2)
  h.kbar_clients = 'all'          # all (stale cache, A4) | participants (this round's, FedHeNN)
  h.bn_mode = 'train'             # BatchNorm on RAD passes: train batch stats (A9) | eval
  h.broadcast = 'kernel'          # what K̄ travels as: kernel [L, L] | representations [N, L, d]
  return h


def cohort_groups(config: ml_collections.ConfigDict) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
  """(encoder, sorted client ids) per cohort from hetero_ssfl.mix and .assignment.

  'ordered' gives the first count clients to the first encoder and so on; 'shuffled' does the same
  over a permutation of the clients drawn from the seed (the paper draws architectures at random).
  Raises ConfigError for a malformed mix, an unknown encoder, a repeated encoder, a zero count or
  counts that do not add up to num_clients.
  """
  h, num = config.hetero_ssfl, config.num_clients
  if not h.mix:
    return ((config.encoder, tuple(range(num))),)
  counts = []
  for item in h.mix.split(','):
    name, sep, count = item.strip().partition(':')
    if not sep or not count.strip().isdigit():
      raise cv.ConfigError(f'config.hetero_ssfl.mix = {h.mix!r} is invalid: {item!r} is not '
                           "'encoder:count' (e.g. 'resnet34:3,resnet18:2')")
    name = name.strip()
    cv.check_choice('hetero_ssfl.mix encoder', name, tuple(models.ENCODERS))
    if name in dict(counts):
      raise cv.ConfigError(f'config.hetero_ssfl.mix = {h.mix!r} is invalid: encoder {name!r} '
                           'appears twice')
    if int(count) < 1:
      raise cv.ConfigError(f'config.hetero_ssfl.mix = {h.mix!r} is invalid: encoder {name!r} has '
                           f'{count} clients; every listed encoder needs at least 1')
    counts.append((name, int(count)))
  total = sum(c for _, c in counts)
  if total != num:
    raise cv.ConfigError(f'config.hetero_ssfl.mix = {h.mix!r} is invalid: its counts add up to '
                         f'{total} clients, but config.num_clients = {num}; the mix must cover '
                         'every client exactly once')
  order = np.arange(num)
  if h.assignment == 'shuffled':
    order = np.random.default_rng([config.seed, 0x4e7]).permutation(num)
  out, start = [], 0
  for name, count in counts:
    out.append((name, tuple(sorted(int(i) for i in order[start:start + count]))))
    start += count
  return tuple(out)


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  """Choices and ranges of `config.hetero_ssfl`, the mix against the strategy, the RAD size."""
  del dataset_info
  h = config.hetero_ssfl
  cv.check_choice('hetero_ssfl.assignment', h.assignment, ('ordered', 'shuffled'))
  cv.check_choice('hetero_ssfl.mu_schedule', h.mu_schedule, MU_SCHEDULES)
  cv.check_choice('hetero_ssfl.sign', h.sign, SIGNS)
  cv.check_choice('hetero_ssfl.average', h.average, AVERAGES)
  cv.check_choice('hetero_ssfl.kbar_clients', h.kbar_clients, KBAR_CLIENTS)
  cv.check_choice('hetero_ssfl.bn_mode', h.bn_mode, BN_MODES)
  cv.check_choice('hetero_ssfl.broadcast', h.broadcast, BROADCASTS)
  if not isinstance(h.centered, bool):
    raise cv.ConfigError(f'config.hetero_ssfl.centered = {h.centered!r} is invalid: must be a bool')
  cv.check_float_range('hetero_ssfl.mu', h.mu, 0.0, None)
  cv.check_int_range('hetero_ssfl.rad_batch', h.rad_batch, 0, 10_000_000)
  groups = cohort_groups(config)
  strategy = strategies.resolve_strategy(config.strategy)
  for name, members in groups:  # each cohort fills min(m, C_k) slots under the strategy
    try:
      strategies.check_participants(strategy, min(config.clients_per_round, len(members)),
                                    config.map_chunk_size)
    except ValueError as e:
      raise cv.ConfigError(f'config.hetero_ssfl.mix = {h.mix!r} is invalid: cohort {name!r} trains '
                           f'{min(config.clients_per_round, len(members))} slots per round: {e}') from None
  if h.mu > 0:
    if config.public_size < 1:
      raise cv.ConfigError(f'config.public_size = {config.public_size} is invalid for Hetero-SSFL '
                           f'with hetero_ssfl.mu = {h.mu}: the RAD is carved out of the training '
                           'split, set public_size > 0 (the paper: 5000)')
    b_r = h.rad_batch or config.public_size
    if b_r > config.public_size or config.public_size % b_r:
      raise cv.ConfigError(f'config.hetero_ssfl.rad_batch = {h.rad_batch} is invalid with '
                           f'config.public_size = {config.public_size}: it must divide the RAD '
                           'size (0 = the whole RAD every step)')


def encoders(config: ml_collections.ConfigDict) -> Sequence[Tuple[str, str]]:
  """[(config key, encoder)] of the run: the mix's encoders, or config.encoder without a mix."""
  if not config.hetero_ssfl.mix:
    return [('config.encoder', config.encoder)]
  return [('config.hetero_ssfl.mix encoder', e) for e, _ in cohort_groups(config)]


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  """Hetero-SSFL over the cohorts of `config.hetero_ssfl.mix`."""
  h, groups = config.hetero_ssfl, cohort_groups(config)
  return make([(name, ssl_client.spec_from_config(config, info, name)) for name, _ in groups],
              [members for _, members in groups], rad_size=config.public_size, mu=float(h.mu),
              rad_batch=h.rad_batch, mu_schedule=h.mu_schedule, sign=h.sign, centered=h.centered,
              average=h.average, kbar_clients=h.kbar_clients, bn_mode=h.bn_mode,
              broadcast=h.broadcast)


# Why config.dp (DP-FedAvg, ops/dp_fedavg.py) is refused.
_DP_REFUSAL = ("its server aligns the cohorts' representations on the public set, not a weighted "
               "mean of uploads")
registry.register('hetero_ssfl', build, dp_refusal=_DP_REFUSAL,
                  defaults=config_block, validate=validate, methods=METHODS,
                  methods_note=('the aligned representation is the predictor output (SimCLR: the '
                                'projector output)'),
                  exclusive=('mix',), encoders=encoders,
                  doc='several architectures in one federation, aligned by CKA on a public set',
                  global_model=False)
