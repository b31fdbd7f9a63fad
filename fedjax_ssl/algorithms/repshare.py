"""Representation sharing by contrastive distillation ("Ours" of Berdoz et al., "Scalable
Collaborative Learning via Representation Sharing", arXiv:2211.10943).

Supervised. Every client u keeps its own classifier f_u = tau_u o phi_u (phi: the network up to the
Tanh feature layer, d' features; tau: Linear(d' -> C), the Classifier's 'head') and its own Adam
state, across rounds. Nothing but per-class feature averages travels, through a relay server:

  up   (after the local epoch, eval-mode BN, no gradient): the full class means t̄_u^c over all local
       samples, their class counts n_u^c, and one n_avg-prototype per class t_u^c (the mean of
       min(n_avg, n_u^c) random local samples of class c, drawn without replacement);
  down (before the local epoch): the global prototypes t̄^c = Σ_u n_u^c t̄_u^c / Σ_u n_u^c (A7) and the
       n_avg-prototypes T_u [C, d'] of one random other user v != u (A6; per class with
       partner = 'per_class').

Local objective per mini-batch (s = phi_u(x), z = tau_u(s)):

  CE(z, y) + lambda_kd * ||s - t̄^y||^2 + lambda_disc * BCE(softmax(z) softmax(tau_u(T_u))^T, onehot(y))

with the author code's reductions by default (MSE mean over b*d', BCE mean over b*C, A1;
reduction = 'sum' gives the paper's sums over d' and over C). The discriminator reuses the client's
own classifier on the (constant) teacher prototypes, so tau_u gets gradients through both
softmaxes (A17). Prototypes are refreshed once per round (A9); round 1 uses prototypes computed
from the untrained models before training (A8; init_prototypes = 'random' draws U(-1, 1) instead, as
Alg. 1's "S initializes randomly"). The server's relay buffer keeps every client's latest upload, so
under partial participation a non-participant's prototypes stay in use (stale).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import jax
from absl import logging
import jax.numpy as jnp
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl import models
from fedjax_ssl.algorithms import fedavg, registry, ssl_client
from fedjax_ssl.core.algorithm import Algorithm, LocalData, Prepare, present_ids
from fedjax_ssl.core import comm, rng
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.models import layers
from fedjax_ssl.ops import prototypes
from fedjax_ssl.ssl import losses

PARTNERS = ('user', 'per_class')
INIT_PROTOTYPES = ('model', 'random')
# fold_in tags of the server's draws inside rng.server_key(round key).
PARTNER_STREAM = 0x7A1
INIT_STREAM = 0x7A2


def check_supervised(spec: ssl_client.ClientSpec, name: str) -> None:
  if spec.method != 'supervised':
    raise ValueError(f"{name} trains classifiers: spec.method must be 'supervised', got "
                     f'{spec.method!r}')


def independent_clients(spec: ssl_client.ClientSpec, key: jax.Array, num_clients: int):
  """[C, ...] client states, each from its own random init (every client calls `get_model`)."""
  return jax.vmap(lambda k: ssl_client.init_client(spec, k))(jax.random.split(key, num_clients))


def head_apply(params: Dict[str, Any], f: jax.Array) -> jax.Array:
  """tau: [..., d'] features -> [..., C] logits with the Classifier's 'head' parameters."""
  return layers.Dense(params['head']['bias'].shape[-1]).apply({'params': params['head']}, f)


def _encoder_vars(params, batch_stats) -> Dict[str, Any]:
  out = {'params': params['encoder']}
  if 'encoder' in batch_stats:
    out['batch_stats'] = batch_stats['encoder']
  return out


def train_features(spec: ssl_client.ClientSpec, params, batch_stats, x: jax.Array):
  """Train-mode phi: x float [B, H, W, C] -> (features [B, d'], new batch_stats)."""
  enc = _encoder_vars(params, batch_stats)
  if 'batch_stats' not in enc:
    return spec.model.encoder.apply(enc, x, train=True), batch_stats
  s, upd = spec.model.encoder.apply(enc, x, train=True, mutable=['batch_stats'])
  return s, dict(batch_stats, encoder=upd['batch_stats'])


def eval_outputs(spec: ssl_client.ClientSpec, variables, x_uint8: jax.Array, chunk: int,
                 kind: str = 'features') -> jax.Array:
  """Eval-mode phi (kind 'features', [n, d']) or tau o phi ('logits', [n, C]) of uint8 images
  [n, H, W, C], normalised as in training, in chunks of `chunk` rows (bounded activation memory);
  no gradient flows (the shared averages are constants)."""
  variables = jax.lax.stop_gradient(variables)
  params, bs = variables['params'], variables['batch_stats']

  def one(xc):
    # In the parameters' precision (float64 under x64), as the training step's inputs.
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    x = augment.normalize_images(xc, jnp.asarray(spec.mean, dtype), jnp.asarray(spec.std, dtype),
                                 dtype)
    s = spec.model.encoder.apply(_encoder_vars(params, bs), x, train=False)
    return s if kind == 'features' else head_apply(params, s)

  n = x_uint8.shape[0]
  chunk = max(1, min(chunk, n))
  pad = (-n) % chunk
  xs = jnp.concatenate([x_uint8, jnp.zeros((pad,) + x_uint8.shape[1:], x_uint8.dtype)])
  out = jax.lax.map(one, xs.reshape((-1, chunk) + x_uint8.shape[1:]))
  return out.reshape((n + pad,) + out.shape[2:])[:n]


def class_summary(spec: ssl_client.ClientSpec, variables, local: LocalData, num_classes: int,
                  chunk: int, kind: str = 'features', n_avg: int = 0) -> Dict[str, jax.Array]:
  """A client's per-class averages over its own data: {'means' [C, k], 'counts' [C]} and, with
  n_avg > 0, {'navg' [C, k]} (k = d' for features, C for logits)."""
  out = eval_outputs(spec, variables, local.x, chunk, kind)
  valid = jnp.arange(local.x.shape[0]) < local.n
  means, counts = prototypes.class_means(out, local.y, valid, num_classes)
  summary = {'means': means, 'counts': counts}
  if n_avg:
    summary['navg'] = prototypes.navg_prototypes(local.key, out, local.y, valid, num_classes, n_avg)
  return summary


def initial_summaries(summarize, clients, data, ids: jax.Array, key: jax.Array
                      ) -> Dict[str, jax.Array]:
  """The summaries of the clients `ids` [n] from their current (initial) models `clients` (leaves
  [n, ...], row i client ids[i]'s) on their own rows in `data`: {field: [n, ...]}, one client at a
  time (lax.map: the memory of one client's forward); client c's draws from fold_in(key, c)."""
  def one(i):
    client = jax.tree_util.tree_map(lambda a: a[i], clients)
    cid = ids[i]
    return summarize(client, LocalData(*data.client(cid), jax.random.fold_in(key, cid)))
  return jax.lax.map(one, jnp.arange(ids.shape[0]))


def summaries_from_models(summarize):
  """`Prepare.summarize` of round 0's summaries from the clients' untrained models (A8): the one
  cohort's `initial_summaries` of the clients `ids`, their draws from the round key's
  `INIT_STREAM`."""
  def rows(server, stacks, data, ids, key):
    del server
    (clients,), (cids,) = stacks, ids
    return (initial_summaries(summarize, clients, data, cids,
                              jax.random.fold_in(rng.server_key(key), INIT_STREAM)),)
  return rows


def take_summaries(server, rows: Tuple[Dict[str, jax.Array]]) -> Dict[str, jax.Array]:
  """`Prepare.absorb` of round 0's summaries: the server with every client's (`initial_summaries`
  of all clients in id order, the one cohort's) as its buffers, cast to the state's dtypes."""
  (fresh,) = rows
  return dict(server, **{k: v.astype(server[k].dtype) for k, v in fresh.items()})


def store_uploads(server, payloads, weights, ids) -> Dict[str, jax.Array]:
  """The relay buffer with the present participants' rows replaced by their uploads (an absent
  participant, weight 0, keeps its row of the last round it was present in)."""
  return dict(server, **{k: server[k].at[present_ids(ids, weights, server[k].shape[0])].set(
      v.astype(server[k].dtype), mode='drop') for k, v in payloads.items()})


def variables_of(client) -> Dict[str, Any]:
  return {'params': client['params'], 'batch_stats': client['batch_stats']}


def make(spec: ssl_client.ClientSpec, *, num_classes: int, feature_dim: int,
         lambda_kd: float = 10.0, lambda_disc: float = 1.0, n_avg: int = 10,
         reduction: str = 'mean', partner: str = 'user', init_prototypes: str = 'model',
         upload_batch: int = 500) -> Algorithm:
  """The representation-sharing algorithm ('repshare').

  Args:
    spec: a supervised ClientSpec (Classifier model; persistent optimiser: reset_optimizer False).
    num_classes: C; feature_dim: d' (the encoder's Tanh feature width).
    lambda_kd, lambda_disc: loss weights (paper 10, 1).
    n_avg: samples per relayed prototype (paper 10).
    reduction: 'mean' (author code, A1) | 'sum' (paper's per-sample sums).
    partner: 'user' (one other user for all classes, §4) | 'per_class' (Alg. 1's shuffled buffers).
    init_prototypes: 'model' (from the untrained models, A8) | 'random' (U(-1, 1)).
    upload_batch: images per eval forward when summarising (memory only).
  """
  check_supervised(spec, 'repshare')
  if reduction not in prototypes.REDUCTIONS:
    raise ValueError(f'repshare.reduction = {reduction!r} is invalid: must be one of '
                     f'{prototypes.REDUCTIONS}')
  if partner not in PARTNERS:
    raise ValueError(f'repshare.partner = {partner!r} is invalid: must be one of {PARTNERS}')
  if init_prototypes not in INIT_PROTOTYPES:
    raise ValueError(f'repshare.init_prototypes = {init_prototypes!r} is invalid: must be one of '
                     f'{INIT_PROTOTYPES}')
  if n_avg < 1:
    raise ValueError(f'repshare.n_avg = {n_avg} is invalid: must be >= 1')

  def summarize(client, local):
    return class_summary(spec, variables_of(client), local, num_classes, upload_batch,
                         n_avg=n_avg)

  def init(key, num_clients):
    if num_clients < 2:
      raise ValueError(f'num_clients = {num_clients} is invalid for repshare: a client distils '
                       "from another user's prototypes, need >= 2")
    clients = independent_clients(spec, key, num_clients)
    shape = (num_clients, num_classes, feature_dim)
    if init_prototypes == 'random':
      # One random global prototype per class (every client's row holds it, so the weighted mean
      # is that draw, not a shrunken average of N draws) and random relayed prototypes.
      k1, k2 = jax.random.split(jax.random.fold_in(key, INIT_STREAM))
      means = jnp.broadcast_to(jax.random.uniform(k1, shape[1:], minval=-1.0, maxval=1.0), shape)
      navg = jax.random.uniform(k2, shape, minval=-1.0, maxval=1.0)
    else:  # filled from the initial models by the first `prepare`
      means, navg = jnp.zeros(shape), jnp.zeros(shape)
    server = {'means': means, 'counts': jnp.ones(shape[:2]), 'navg': navg,
              'partners': jnp.zeros(shape[:2], jnp.int32)}
    return clients, server

  def prepare(state, data, ids, key):
    del ids
    partners = prototypes.relay_partners(jax.random.fold_in(rng.server_key(key), PARTNER_STREAM),
                                         data.n.shape[0], num_classes,
                                         per_class=partner == 'per_class')
    return dict(state.server, partners=partners)

  def prepare_upload_bytes(state, server):
    # Round 0: every client uploads the summary of its untrained model inside `prepare`.
    if init_prototypes != 'model':
      return jnp.zeros((), jnp.float32)
    row = comm.tree_bytes({k: server[k][0] for k in ('means', 'counts', 'navg')})
    return jnp.where(state.round == 0, float(server['means'].shape[0] * row), 0.0)

  def broadcast(server):
    return {'global': prototypes.global_prototypes(server['means'], server['counts']),
            'navg': server['navg'], 'partners': server['partners']}

  def personalize(msg, cid):
    # What client cid downloads: the global prototypes and its partner's n_avg-prototypes.
    teacher = msg['navg'][msg['partners'][cid], jnp.arange(num_classes)]
    return {'global': msg['global'], 'teacher': teacher}

  def begin(client, msg, key):
    del msg, key
    return fedavg.mark_participated(ssl_client.begin_round(spec, client))

  def loss_fn(params, client, batch, key, msg):
    x = augment.normalize(augment.augment_batch(key, batch['x'], spec.aug), spec.mean, spec.std)
    s, bs = train_features(spec, params, client['batch_stats'], x)
    z = head_apply(params, s)
    y = batch['y']
    sq = (s - msg['global'][y]) ** 2
    kd = jnp.mean(sq) if reduction == 'mean' else jnp.mean(jnp.sum(sq, axis=-1))
    h = prototypes.prob_product(z, head_apply(params, msg['teacher']))
    disc = prototypes.disc_bce(h, y, reduction)
    ce = losses.cross_entropy_loss(z, y)
    return ce + lambda_kd * kd + lambda_disc * disc, bs

  def local_step(client, batch, key, msg, lr):
    (loss, bs), grads = jax.value_and_grad(loss_fn, has_aux=True)(client['params'], client, batch,
                                                                  key, msg)
    return ssl_client.apply_gradients(spec, client, grads, lr, batch_stats=bs), loss

  return Algorithm(
      name='repshare', init=init, broadcast=broadcast, begin=begin, local_step=local_step,
     
      upload=lambda client, msg, local: summarize(client, local),
      aggregate=store_uploads,
      eval_variables=lambda state: (variables_of(state.clients), True),
      encoder_apply=lambda v, x: spec.model.encoder.apply(ssl_client.encoder_variables(v), x,
                                                          train=False),
      classifier_apply=lambda v, x: spec.model.apply(v, x, train=False),
      personalized=True, personalize=personalize,
      prepare=Prepare(prepare, upload_bytes=prepare_upload_bytes,
                      **(dict(summarize=summaries_from_models(summarize), absorb=take_summaries,
                              summarize_reads_data=True) if init_prototypes == 'model' else {})))


def config_block() -> ml_collections.ConfigDict:
  """Representation sharing's keys, `config.repshare`; defaults: docs/notes/repshare.md (the paper's
  lambda_kd = 10, lambda_disc = 1, n_avg = 10)."""
  r = ml_collections.ConfigDict()
  r.lambda_kd = 10.0
  r.lambda_disc = 1.0
  r.n_avg = 10                    # samples per relayed n_avg-prototype
  r.reduction = 'mean'            # mean (author code: MSE / BCE means, A1) | sum (paper's sums)
  r.partner = 'user'              # user (one other user, all classes, A6) | per_class
  r.init_prototypes = 'model'     # model (from the untrained models, A8) | random U(-1, 1)
  r.upload_batch = 500            # images per eval forward when summarising (memory only)
  return r


def validate_relay(config: ml_collections.ConfigDict) -> None:
  """What representation sharing and FD share: at least two clients; warnings where the setting
  departs from the paper's (persistent Adam, no augmentation)."""
  name = config.algorithm
  if config.num_clients < 2:
    raise cv.ConfigError(f'config.num_clients = {config.num_clients} is invalid for algorithm '
                         f"{name!r}: clients distil from the other clients' averages, need >= 2")
  if config.reset_optimizer:
    logging.warning('config.reset_optimizer = True with algorithm %r: the paper keeps each '
                    "client's Adam state across rounds (reset_optimizer = False)", name)
  if config.augmentation != 'none':
    logging.warning("config.augmentation = %r with algorithm %r: the paper uses none ('none')",
                    config.augmentation, name)


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  """The relay's rules and the ranges of `config.repshare`."""
  del dataset_info
  validate_relay(config)
  r = config.repshare
  cv.check_float_range('repshare.lambda_kd', r.lambda_kd, 0.0, None)
  cv.check_float_range('repshare.lambda_disc', r.lambda_disc, 0.0, None)
  cv.check_int_range('repshare.n_avg', r.n_avg, 1, 1_000_000)
  cv.check_choice('repshare.reduction', r.reduction, ('mean', 'sum'))
  cv.check_choice('repshare.partner', r.partner, PARTNERS)
  cv.check_choice('repshare.init_prototypes', r.init_prototypes, INIT_PROTOTYPES)
  cv.check_int_range('repshare.upload_batch', r.upload_batch, 1, 10_000_000)


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  r = config.repshare
  return make(ssl_client.spec_from_config(config, info), num_classes=info.num_classes,
              feature_dim=models.feature_dim(config.encoder), lambda_kd=r.lambda_kd,
              lambda_disc=r.lambda_disc, n_avg=r.n_avg, reduction=r.reduction, partner=r.partner,
              init_prototypes=r.init_prototypes, upload_batch=r.upload_batch)


registry.register('repshare', build, defaults=config_block, validate=validate,
                  methods=('supervised',), methods_note='it trains classifiers',
                  doc='contrastive distillation through per-class prototypes, relay server',
                  global_model=False)
