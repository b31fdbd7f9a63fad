"""FedX (Han et al., "FedX: Unsupervised Federated Learning with Cross Knowledge Distillation",
ECCV 2022), as FedU2's FedX-SimCLR / -BYOL and FedSC Table 2's FedX baselines.

FedAvg of the whole online network (encoder + projector + predictor, BatchNorm statistics included,
data-size weights) whose local loss distils knowledge locally and from the frozen global model
(the broadcast of the round, never trained: stop_gradient, inference-mode BatchNorm). With
z = projector(encoder(x)), p = predictor(z), views v0, v1 of the batch and a different batch r of
the same client as relational anchors:

  L = L_ssl(v0, v1)                                           local contrastive: NT-Xent(z0, z1; tau)
                                                              (simclr), BYOL's loss (byol) or
                                                              alignment + uniformity (align_uniform,
                                                              the SSD paper's FedX baseline)
    + global_weight     * NT-Xent(p0, z1^glob; tau)           global contrastive
    + relational_weight * (JS(p0, p1; z_r^glob; tau, tt)      global relational
                           + JS(z0, z1; z_r; tau, ts))        local relational

with JS = `ops.relational.relational_js` and tau = 0.1, tt = ts = 0.01, all weights 1 (the authors'
code). The anchors r are the previous local step's batch (re-augmented), kept in the client state
across steps and rounds: the engine hands a step one batch, and the previous one is a different
random batch of the same client (the code draws one from a second shuffled loader); the relational
terms are off (weight 0) on a client's very first step, before any batch was seen.
docs/notes/fedu2.md#fedu2-fedx.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple

import jax
import jax.numpy as jnp
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl import models
from fedjax_ssl.algorithms import fedavg, registry, ssl_client
from fedjax_ssl.core.algorithm import Algorithm, Stateless, replicate
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.ops import relational
from fedjax_ssl.ssl import losses

METHODS = ('simclr', 'byol', 'align_uniform')
# Every module is averaged and broadcast (the code averages the whole state dict).
SHARED = ('encoder', 'projector', 'predictor')
# fold_in tag of the anchors' augmentation key inside a step key (the views use the key itself).
ANCHOR_STREAM = 0xfed5


@dataclasses.dataclass(frozen=True)
class FedXConfig:
  """FedX's loss settings (config.fedx; module docstring)."""
  temperature: float = 0.1
  local_target_temperature: float = 0.01
  global_target_temperature: float = 0.01
  global_weight: float = 1.0
  relational_weight: float = 1.0


def _subset(client) -> dict:
  return {'params': {k: client['params'][k] for k in SHARED if k in client['params']},
          'batch_stats': {k: client['batch_stats'][k] for k in SHARED
                          if k in client['batch_stats']}}


def _split3(a, b):
  return a[:b], a[b:2 * b], a[2 * b:]


def loss_fn(spec: ssl_client.ClientSpec, fx: FedXConfig, params, client, batch, key, glob
            ) -> Tuple[jax.Array, Tuple[Any, Any, Dict[str, jax.Array]]]:
  """FedX's loss of one local step: (total, (online batch_stats, target batch_stats, terms)).

  The online network sees [v0; v1; anchors] in ONE train-mode forward (BatchNorm statistics over
  the 3B rows, as the code's `net(cat(x1, x2, random_x))`); the global model `glob`
  ({'params', 'batch_stats'}, the broadcast) the same rows in inference mode, under stop_gradient.
  `terms` holds the four unweighted terms ('local', 'global', 'rel_global', 'rel_local').
  """
  b = batch['x'].shape[0]
  v0, v1 = ssl_client._views(spec, key, batch['x'], 2)  # pylint: disable=protected-access
  anchor = client['anchor']
  va = augment.normalize(
      augment.augment_batch(jax.random.fold_in(key, ANCHOR_STREAM), anchor['x'], spec.aug),
      spec.mean, spec.std)
  x = jnp.concatenate([v0, v1, va], axis=0)
  out, bs = ssl_client.apply_train(spec.model, params, client['batch_stats'], x,
                                   with_predictor=True)
  z0, z1, za = _split3(out['z'], b)
  p0, p1, _ = _split3(out['p'], b)
  g = spec.model.apply({'params': glob['params'], 'batch_stats': glob['batch_stats']}, x,
                       train=False, with_predictor=False)
  _, g1, ga = _split3(jax.lax.stop_gradient(g['z']), b)
  tbs = None
  if spec.method == 'byol':
    target = client['target']
    t, tbs = ssl_client.apply_train(spec.model, target['params'], target['batch_stats'],
                                    x[:2 * b], with_predictor=False)
    t0, t1 = jnp.split(jax.lax.stop_gradient(t['z']), 2)
    local = losses.byol_loss(p0, p1, t0, t1)
  elif spec.method == 'align_uniform':  # the SSD paper's FedX row: its base objective locally
    local = losses.align_uniform(z0, z1, t=spec.hparams['t'],
                                 uniform_weight=spec.hparams['uniform_weight'])
  else:
    local = losses.nt_xent(z0, z1, fx.temperature)
  terms = {'local': local,
           'global': losses.nt_xent(p0, g1, fx.temperature),
           'rel_global': relational.relational_js(p0, p1, ga, fx.temperature,
                                                  fx.global_target_temperature),
           'rel_local': relational.relational_js(z0, z1, za, fx.temperature,
                                                 fx.local_target_temperature)}
  total = (local + fx.global_weight * terms['global']
           + fx.relational_weight * anchor['valid'] * (terms['rel_global'] + terms['rel_local']))
  return total, (bs, tbs, terms)


def local_step(spec: ssl_client.ClientSpec, fx: FedXConfig, client, batch, key, msg, lr):
  """One step on FedX's loss (the BYOL target's EMA after it); the batch becomes the anchors of
  the next step."""
  def total(p):
    loss, (bs, tbs, _) = loss_fn(spec, fx, p, client, batch, key, msg)
    return loss, (bs, tbs)
  (loss, (bs, tbs)), grads = jax.value_and_grad(total, has_aux=True)(client['params'])
  new = ssl_client.apply_gradients(spec, client, grads, lr, batch_stats=bs)
  if spec.method == 'byol':
    online = ssl_client.target_from_online(new['params'], bs)
    new['target'] = {'params': losses.ema_update(client['target']['params'], online['params'],
                                                 ssl_client.target_rate(spec, lr)),
                     'batch_stats': tbs}
  # In the stored flag's dtype (float64 when a test runs the state in float64).
  new['anchor'] = {'x': batch['x'], 'valid': jnp.ones_like(client['anchor']['valid'])}
  return new, loss


def with_predictor(spec: ssl_client.ClientSpec, predictor: models.MLPHead
                   ) -> ssl_client.ClientSpec:
  """`spec` whose SSLModel has `predictor` where it has none (SimCLR: FedX adds one)."""
  if spec.model.predictor is not None:
    return spec
  model = models.SSLModel(spec.model.encoder, spec.model.projector, predictor)
  return dataclasses.replace(spec, model=model)


def make(spec: ssl_client.ClientSpec, *, batch_size: int, fx: FedXConfig = FedXConfig(),
         byol_target_sync: str = 'keep', stateless: bool = True) -> Algorithm:
  """FedX over `spec` (an SSLModel with a predictor), clients stateless (module docstring) unless
  `stateless` is False: then every client's whole state is stored (the same numbers; the reference
  loop of tests/core/test_round_equivalence.py runs that twin)."""
  if spec.method not in METHODS:
    raise ValueError(f'FedX: ssl_method = {spec.method!r} is invalid, must be one of {METHODS}')
  if spec.model.predictor is None:
    raise ValueError('FedX: the model needs a predictor (use fedx.with_predictor)')
  if byol_target_sync not in fedavg.BYOL_TARGET_SYNC:
    raise ValueError(f'byol_target_sync = {byol_target_sync!r} is invalid: must be one of '
                     f'{fedavg.BYOL_TARGET_SYNC}')
  empty_anchor = {'x': jnp.zeros((batch_size,) + tuple(spec.input_shape), jnp.uint8),
                  'valid': jnp.zeros((), jnp.float32)}

  def persist(client):
    # FedX averages the whole network (predictor included), so no module stays private.
    return {'anchor': client['anchor'],
            **fedavg.kept_local_state(spec, client, byol_target_sync)}

  def restore(stored, msg):
    client = fedavg.rebuild_client(spec, {k: v for k, v in stored.items() if k != 'anchor'}, msg)
    return dict(client, anchor=stored['anchor'])

  def init(key, num_clients):
    client = dict(ssl_client.init_client(spec, key), anchor=empty_anchor)
    return replicate(persist(client) if stateless else client, num_clients), _subset(client)

  def begin(client, msg, key):
    del key
    first = client['extras']['participated'] == 0
    client = fedavg.adopt_global(spec, ssl_client.begin_round(spec, client), msg, SHARED)
    client = fedavg.sync_target(spec, client, first | (byol_target_sync == 'reset'))
    return fedavg.mark_participated(client)

  algo = fedavg.global_model_algorithm(spec, name='fedx', init=init, begin=begin)
  return dataclasses.replace(
      algo, local_step=lambda c, b, k, msg, lr: local_step(spec, fx, c, b, k, msg, lr),
      upload=lambda client, msg, local: _subset(client),
      update_reference=None,  # its upload is not the server's form: no DP-FedAvg
      stateless=Stateless(persist, restore) if stateless else None)


def config_block() -> ml_collections.ConfigDict:
  """FedX's keys, `config.fedx` (the authors' defaults)."""
  return ml_collections.ConfigDict(dataclasses.asdict(FedXConfig()))


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  del dataset_info
  f = config.fedx
  for key in ('temperature', 'local_target_temperature', 'global_target_temperature'):
    cv.check_float_range(f'fedx.{key}', f[key], 0.0, None, inclusive=(False, True))
  for key in ('global_weight', 'relational_weight'):
    cv.check_float_range(f'fedx.{key}', f[key], 0.0, None)
  if config.heads == 'custom' and config.pred_out != config.proj_out:
    raise cv.ConfigError(f'config.pred_out = {config.pred_out} is invalid for algorithm fedx: '
                         f'it must equal proj_out = {config.proj_out} (the global contrastive '
                         'term compares the predictor output with the global projector output)')


def _predictor(config: ml_collections.ConfigDict) -> models.MLPHead:
  return ssl_client.heads_from_config(config, True)[1]


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  f = config.fedx
  fx = FedXConfig(**{k: float(f[k]) for k in config_block().keys()})
  spec = with_predictor(ssl_client.spec_from_config(config, info), _predictor(config))
  return make(spec, batch_size=int(config.batch_size), fx=fx,
              byol_target_sync=config.byol_target_sync)


registry.register('fedx', build, defaults=config_block, validate=validate, methods=METHODS,
                  methods_note='the SSL methods FedU2 / FedSC / SSD pair it with (FedX-SimCLR, '
                               'FedX-BYOL, FedX on alignment + uniformity); the others are not '
                               'wired',
                  doc='FedAvg + local and global relational distillation (Han et al., ECCV 2022)')
