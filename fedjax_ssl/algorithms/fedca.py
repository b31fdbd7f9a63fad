"""FedCA (Zhang et al., "Federated unsupervised representation learning", FITEE 2023,
arXiv:2010.08982: Federated Contrastive Averaging with dictionary and alignment), as FedSC Table 2's
FedCA baseline.

FedAvg of the SimCLR online network (encoder + projector, BatchNorm statistics included, data-size
weights) plus the two modules of `ops.fedca`:

  dictionary  after training, each participant uploads, with its model, the mean of the projector
              outputs of two augmented views of each of its examples (inference mode); the server
              keeps one entry per example of every client, L2-normalised, an EMA (`dict_momentum`
              0.5) over that client's participations, and broadcasts the whole dictionary. In the
              local loss the other clients' valid entries (at most `dict_size` per step) are the
              dictionary's negatives: `dict_loss='code'` is the FedSC authors' `Client_CA` loss
              (0.8 InfoNCE + 0.2 dictionary CE, τ 0.1), 'negatives' the paper's extra negatives in
              SimCLR's NT-Xent; before any entry exists the loss is the plain contrastive one.
  alignment   (`align_weight` > 0; needs `config.public_size` > 0) each step adds align_weight ×
              (1/b) Σ ‖ẑ_i − ẑ_i^glob‖² on `align_batch` un-augmented public images drawn per step,
              ẑ the client's projector output (train mode, BatchNorm statistics not updated) and
              ẑ^glob the round's global model's (inference mode, no gradient).

The defaults follow the spec's A18 (`Client_CA`: code loss, no alignment module — the released code
has none); the paper's forms are the flags above. docs/notes/fedsc.md#fedsc-fedca.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl import ssl
from fedjax_ssl.algorithms import fedavg, hetero_ssfl, registry, ssl_client
from fedjax_ssl.core.algorithm import (Algorithm, Stateless, present_ids, replicate,
                                        weighted_mean)
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.ops import fedca as ops

METHODS = ('simclr',)
DICT_LOSSES = ('code', 'negatives')
SHARED = ssl.get('simclr').shared
# fold_in tags inside a step key (the views use the key itself) and inside the upload key.
NEGATIVES_STREAM = 0xfca0
ALIGN_STREAM = 0xfca1
ENTRY_STREAM = 0xfca2


@dataclasses.dataclass(frozen=True)
class FedCAConfig:
  """FedCA's settings (config.fedca; module docstring)."""
  temperature: float = 0.1
  dict_loss: str = 'code'
  dict_weight: float = 0.2
  dict_momentum: float = 0.5
  dict_size: int = 65536
  align_weight: float = 0.0
  align_batch: int = 128
  align_normalize: bool = True
  upload_batch: int = 500


def _model(tree) -> dict:
  return {'params': tree['params'], 'batch_stats': tree['batch_stats']}


def entry_keys(key: jax.Array, n: int) -> jax.Array:
  """[2, n] augmentation keys of the dictionary views: view v of row r from fold_in(fold_in(key, v),
  r), so the entries do not depend on `upload_batch`."""
  key = jax.random.fold_in(key, ENTRY_STREAM)
  return jax.vmap(lambda v: jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, v), r))(
      jnp.arange(n)))(jnp.arange(2))


def upload_entries(spec: ssl_client.ClientSpec, variables, x_uint8: jax.Array, key: jax.Array,
                   chunk: int) -> jax.Array:
  """`ops.fedca.dictionary_entries` of every row of x uint8 [n, H, W, C]: two augmented views per
  row through the model in inference mode, `chunk` rows per pass (memory only); [n, d], no
  gradient."""
  variables = jax.lax.stop_gradient(variables)
  n = x_uint8.shape[0]
  keys = entry_keys(key, n)
  chunk = max(1, min(chunk, n))
  pad = (-n) % chunk
  xs = jnp.concatenate([x_uint8, jnp.zeros((pad,) + x_uint8.shape[1:], x_uint8.dtype)])
  ks = jnp.concatenate([keys, jnp.broadcast_to(keys[:, :1], (2, pad) + keys.shape[2:])], axis=1)

  def one(args):
    xc, kc = args

    def z(k):
      v = jax.vmap(lambda kk, im: augment.augment(kk, im, spec.aug))(k, xc)
      v = augment.normalize(v, spec.mean, spec.std)
      return spec.model.apply(variables, v, train=False, with_predictor=False)['z']
    return ops.dictionary_entries(z(kc[0]), z(kc[1]))

  xs = xs.reshape((-1, chunk) + x_uint8.shape[1:])
  ks = jnp.moveaxis(ks.reshape((2, -1, chunk) + keys.shape[2:]), 1, 0)
  out = jax.lax.map(one, (xs, ks))
  return out.reshape((n + pad,) + out.shape[2:])[:n]


def negatives(msg, key: jax.Array, entry_mask: jax.Array, fc: FedCAConfig):
  """(rows [K', d], valid [K']) of one step: the dictionary entries of the other clients' real
  examples that hold an upload, flattened in (client, example) order, at most dict_size of them
  (`ops.fedca.select_negatives`: the first ones in order for 'code', a uniform draw otherwise)."""
  d = msg['dict']
  num_clients = d.shape[0]
  valid = (entry_mask & (msg['seen'] > 0)[:, None]
           & (jnp.arange(num_clients) != msg['self'])[:, None])
  return ops.select_negatives(jax.random.fold_in(key, NEGATIVES_STREAM),
                              d.reshape((-1, d.shape[-1])), valid.reshape(-1), fc.dict_size,
                              ordered=fc.dict_loss == 'code')


def loss_fn(spec: ssl_client.ClientSpec, fc: FedCAConfig, entry_mask, params, client, batch,
            key, msg):
  """FedCA's loss of one local step: (total, (batch_stats, terms)) with terms 'dict' (the
  dictionary-contrastive loss) and 'align' (unweighted; 0 when the module is off)."""
  v0, v1 = ssl_client._views(spec, key, batch['x'], 2)  # pylint: disable=protected-access
  o0, bs = ssl_client.apply_train(spec.model, params, client['batch_stats'], v0,
                                  with_predictor=False)
  o1, bs = ssl_client.apply_train(spec.model, params, bs, v1, with_predictor=False)
  rows, valid = negatives(msg, key, entry_mask, fc)
  if fc.dict_loss == 'code':
    dict_loss = ops.code_dictionary_loss(o0['z'], o1['z'], rows, valid, fc.temperature,
                                         fc.dict_weight)
  else:
    dict_loss = ops.dictionary_nt_xent(o0['z'], o1['z'], rows, valid, fc.temperature)
  terms = {'dict': dict_loss, 'align': jnp.zeros((), dict_loss.dtype)}
  total = dict_loss
  if fc.align_weight > 0:
    public = msg['public_x']
    pick = hetero_ssfl.rad_indices(jax.random.fold_in(key, ALIGN_STREAM), public.shape[0],
                                   fc.align_batch)
    xa = augment.normalize(augment.to_float(public[pick]), spec.mean, spec.std)
    # Train mode as the local views; the running statistics are not updated by the public batch.
    oa, _ = ssl_client.apply_train(spec.model, params, bs, xa, with_predictor=False)
    ga = spec.model.apply(_model(msg), xa, train=False, with_predictor=False)['z']
    terms['align'] = ops.alignment_loss(oa['z'], ga, fc.align_normalize)
    total = total + fc.align_weight * terms['align']
  return total, (bs, terms)


def make(spec: ssl_client.ClientSpec, *, client_sizes, fc: FedCAConfig = FedCAConfig(),
         stateless: bool = True) -> Algorithm:
  """FedCA over a SimCLR `spec` for clients of `client_sizes` (int [C]; the dictionary has a row
  per example), clients stateless unless `stateless=False` (module docstring)."""
  if spec.method not in METHODS:
    raise ValueError(f'FedCA: ssl_method = {spec.method!r} is invalid, must be one of {METHODS}')
  if fc.dict_loss not in DICT_LOSSES:
    raise ValueError(f'fedca.dict_loss = {fc.dict_loss!r} is invalid: must be one of {DICT_LOSSES}')
  if fc.dict_size < 1:
    raise ValueError(f'fedca.dict_size = {fc.dict_size} is invalid: must be >= 1')
  if client_sizes is None:
    raise ValueError('FedCA needs the client sizes (DataInfo.client_sizes): its dictionary has one '
                     'row per example')
  sizes = np.asarray(client_sizes)
  num, n_max = len(sizes), int(sizes.max())
  entry_mask = jnp.asarray(np.arange(n_max)[None, :] < sizes[:, None])

  def persist(client):
    return fedavg.persistent_part(spec, client, 'keep')

  def init(key, num_clients):
    if num_clients != num:
      raise ValueError(f'FedCA was built for {num} clients (client_sizes), got {num_clients}')
    client = ssl_client.init_client(spec, key)
    x = jnp.zeros((1,) + tuple(spec.input_shape), jnp.float32)
    z = jax.eval_shape(lambda v: spec.model.apply(v, x, train=False, with_predictor=False)['z'],
                       _model(client))
    server = dict(fedavg.shared_subset(spec, client),
                  dict=jnp.zeros((num, n_max, z.shape[-1]),
                                 jnp.promote_types(z.dtype, jnp.float32)),
                  seen=jnp.zeros((num,), jnp.float32))
    return replicate(persist(client) if stateless else client, num_clients), server

  def begin(client, msg, key):
    del key
    client = fedavg.adopt_global(spec, ssl_client.begin_round(spec, client), msg, SHARED)
    return fedavg.mark_participated(client)

  def local_step(client, batch, key, msg, lr):
    def total(p):
      loss, (bs, _) = loss_fn(spec, fc, entry_mask, p, client, batch, key, msg)
      return loss, bs
    (loss, bs), grads = jax.value_and_grad(total, has_aux=True)(client['params'])
    return ssl_client.apply_gradients(spec, client, grads, lr, batch_stats=bs), loss

  def upload(client, msg, local):
    del msg
    return dict(fedavg.shared_subset(spec, client),
                dict=upload_entries(spec, _model(client), local.x, local.key, fc.upload_batch))

  def aggregate(server, payloads, weights, ids):
    model = weighted_mean(_model(payloads), weights)
    old, seen = server['dict'][ids], server['seen'][ids] > 0
    new = jax.vmap(lambda o, e, s: ops.update_dictionary(o, e, s, fc.dict_momentum))(
        old, payloads['dict'], seen)
    new = jnp.where(entry_mask[ids][..., None], new, 0).astype(server['dict'].dtype)
    # An absent participant (weight 0) leaves its dictionary rows and `seen` flag as they were.
    rows = present_ids(ids, weights, server['seen'].shape[0])
    return dict(server, **model, dict=server['dict'].at[rows].set(new, mode='drop'),
                seen=server['seen'].at[rows].set(1.0, mode='drop'))

  algo = fedavg.global_model_algorithm(spec, name='fedca', init=init, begin=begin)
  return dataclasses.replace(
      algo, local_step=local_step, upload=upload, aggregate=aggregate, update_reference=None,
      personalize=lambda msg, cid: dict(msg, self=jnp.asarray(cid, jnp.int32)),
      eval_variables=lambda state: (_model(state.server), False),
      uses_public=fc.align_weight > 0,
      stateless=Stateless(persist, lambda stored, msg: fedavg.rebuild_client(spec, stored, msg))
      if stateless else None)


def config_block() -> ml_collections.ConfigDict:
  """FedCA's keys, `config.fedca` (the FedSC authors' `Client_CA`; module docstring)."""
  return ml_collections.ConfigDict(dataclasses.asdict(FedCAConfig()))


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  del dataset_info
  f = config.fedca
  cv.check_float_range('fedca.temperature', f.temperature, 0.0, None, inclusive=(False, True))
  cv.check_choice('fedca.dict_loss', f.dict_loss, DICT_LOSSES)
  cv.check_float_range('fedca.dict_weight', f.dict_weight, 0.0, 1.0)
  if f.dict_loss != 'code' and f.dict_weight != FedCAConfig.dict_weight:
    raise cv.ConfigError(f'config.fedca.dict_weight = {f.dict_weight} is invalid with '
                         f"fedca.dict_loss = {f.dict_loss!r}: only 'code' reads it")
  cv.check_float_range('fedca.dict_momentum', f.dict_momentum, 0.0, 1.0, inclusive=(True, False))
  cv.check_int_range('fedca.dict_size', f.dict_size, 1, None)
  cv.check_float_range('fedca.align_weight', f.align_weight, 0.0, None)
  cv.check_int_range('fedca.align_batch', f.align_batch, 1, None)
  cv.check_int_range('fedca.upload_batch', f.upload_batch, 1, None)
  if not isinstance(f.align_normalize, bool):
    raise cv.ConfigError(f'config.fedca.align_normalize = {f.align_normalize!r} is invalid: must '
                         'be True or False')
  if f.align_weight > 0:
    if config.public_size < 1:
      raise cv.ConfigError(f'config.public_size = {config.public_size} is invalid with '
                           f'fedca.align_weight = {f.align_weight}: the alignment module needs a '
                           'public set; set public_size >= 1 (or align_weight = 0)')
    if f.align_batch > config.public_size:
      raise cv.ConfigError(f'config.fedca.align_batch = {f.align_batch} is invalid: must be in '
                           f'[1, {config.public_size}], the public set (config.public_size)')


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  f = config.fedca
  fc = FedCAConfig(**{k: (type(getattr(FedCAConfig, k)))(f[k]) for k in config_block().keys()})
  return make(ssl_client.spec_from_config(config, info), client_sizes=info.client_sizes, fc=fc)


registry.register('fedca', build, defaults=config_block, validate=validate, methods=METHODS,
                  methods_note='FedCA is a SimCLR method (its dictionary negatives)',
                  doc='FedAvg + a shared dictionary of representations as negatives and an '
                      'optional alignment on public data (Zhang et al., FITEE 2023)')
