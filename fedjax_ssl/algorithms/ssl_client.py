"""What every SSL (or supervised) client does locally, shared by the FedAvg family, FedU, FedEMA,
FedU2, FedSC, independent and centralized training: the model, the two-view augmentation, the loss, one
optimiser step, and the BYOL EMA target.

A client state is a dict:
  params       online parameters {'encoder', 'projector', 'predictor'} (SSL) or {'encoder', 'head'}
  batch_stats  BatchNorm running statistics of the same modules ({} for BN-free encoders)
  opt_state    optax state of `spec.tx` over `params`
  target       BYOL only: {'params': {'encoder', 'projector'}, 'batch_stats': ...}, EMA of online
  extras       algorithm bookkeeping (e.g. 'participated', 'divergence', 'scaler'), float32 scalars
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_ssl import models
from fedjax_ssl.core import optim
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.ssl import losses

SSL_METHODS = ('byol', 'simsiam', 'simclr', 'sc', 'supervised')

# Top-level parameter groups each method averages across clients (FedAvg) — the online network.
SHARED_MODULES = {
    'byol': ('encoder', 'projector', 'predictor'),
    'simsiam': ('encoder', 'projector', 'predictor'),
    'simclr': ('encoder', 'projector'),
    'sc': ('encoder', 'projector'),
    'supervised': ('encoder', 'head'),
}


@dataclasses.dataclass(frozen=True, eq=False)
class ClientSpec:
  """Static description of a client's local learning problem (closed over by the jitted step).

  Attributes:
    method: one of SSL_METHODS.
    model: flax module; SSLModel for SSL methods, Classifier for 'supervised'.
    tx: unit-learning-rate optax transformation (core.optim.make_optimizer).
    aug: augmentation applied to each view (supervised: to the single view).
    mean, std: per-channel normalisation after augmentation.
    input_shape: (H, W, C) of the model input (after augmentation).
    temperature: NT-Xent temperature (SimCLR).
    nt_xent_zero_diagonal: the FedU2 code's zero-diagonal NT-Xent quirk.
    ema_tau: BYOL target EMA rate, target <- tau * target + (1 - tau) * online after every step.
    reset_optimizer: re-create the optimiser state at the start of every round (EasyFL, FedSC).
    feature_regularizer: optional (z [B, dz], key) -> scalar, already weighted, added to an SSL
      loss once per view on the online representation `regularized` (FedU2's lambda_u * FUR,
      FedDecorr's beta * decorrelation). Its keys come from a stream of the step key that the views
      do not use, so a spec without one computes exactly what it did before.
    regularized: which online output feature_regularizer sees: 'z' the projector output (FUR) or
      'h' the backbone features (FedDecorr).
    sc_mu: NormClip level mu of the spectral contrastive loss ('sc'; the FedSC code clips inside
      the training loss, A4), or None for no clip.
    sc_scale: factor on the SC loss: 1 = the FedSC code's scale (2 x the paper's batch loss), 0.5 =
      the paper's.
  """
  method: str
  model: nn.Module
  tx: optax.GradientTransformation
  aug: augment.AugmentConfig
  mean: Tuple[float, ...]
  std: Tuple[float, ...]
  input_shape: Tuple[int, int, int]
  temperature: float = 0.5
  nt_xent_zero_diagonal: bool = False
  ema_tau: float = 0.99
  reset_optimizer: bool = True
  feature_regularizer: Optional[Callable[[jax.Array, jax.Array], jax.Array]] = None
  regularized: str = 'z'
  sc_mu: Optional[float] = None
  sc_scale: float = 1.0

# fold_in tag of the feature regularizer's keys inside a step key.
REGULARIZER_STREAM = 0x5e6


def init_client(spec: ClientSpec, key: jax.Array) -> Dict[str, Any]:
  """Fresh client state (no client axis)."""
  x = jnp.zeros((2,) + tuple(spec.input_shape), jnp.float32)
  variables = spec.model.init(key, x, train=False)
  params = variables['params']
  batch_stats = variables.get('batch_stats', {})
  state = {'params': params, 'batch_stats': batch_stats, 'opt_state': spec.tx.init(params),
           'extras': {'participated': jnp.zeros((), jnp.float32)}}
  if spec.method == 'byol':
    state['target'] = target_from_online(params, batch_stats)
  return state


def target_from_online(params, batch_stats) -> Dict[str, Any]:
  """BYOL target network = copy of the online encoder + projector (no predictor)."""
  keep = ('encoder', 'projector')
  return {'params': {k: params[k] for k in keep if k in params},
          'batch_stats': {k: batch_stats[k] for k in keep if k in batch_stats}}


def _views(spec: ClientSpec, key: jax.Array, x_uint8: jax.Array, num_views: int):
  keys = jax.random.split(key, num_views)
  return [augment.normalize(augment.augment_batch(k, x_uint8, spec.aug), spec.mean, spec.std)
          for k in keys]


def apply_train(model, params, batch_stats, x, **kw):
  """Train-mode forward; returns (outputs, new batch_stats). Each call updates the running
  statistics once, as each PyTorch forward in train mode does."""
  out, updates = model.apply({'params': params, 'batch_stats': batch_stats}, x, train=True,
                             mutable=['batch_stats'], **kw)
  return out, updates.get('batch_stats', {})


def loss_fn(spec: ClientSpec, params, client, batch, key, sc_shared=None
            ) -> Tuple[jax.Array, Tuple[Any, Any]]:
  """Scalar loss of one local step, with the updated (online batch_stats, target batch_stats).

  sc_shared: for 'sc', None (FedAvg+SC: the local SC loss) or (alpha scalar, R_other [H, H]), the
  FedSC inter-client term (alpha = 1 with R_other = 0 is the local loss, exactly).
  """
  bs = client['batch_stats']
  if spec.method == 'supervised':
    (x,) = _views(spec, key, batch['x'], 1)
    logits, bs = apply_train(spec.model, params, bs, x)
    return losses.cross_entropy_loss(logits, batch['y']), (bs, None)
  v1, v2 = _views(spec, key, batch['x'], 2)
  with_pred = spec.method in ('byol', 'simsiam')
  o1, bs = apply_train(spec.model, params, bs, v1, with_predictor=with_pred)
  o2, bs = apply_train(spec.model, params, bs, v2, with_predictor=with_pred)
  reg = _view_regularizer(spec, (o1[spec.regularized], o2[spec.regularized]), key)
  if spec.method == 'sc':
    alpha, r_other = sc_shared if sc_shared is not None else (1.0, None)
    sc = losses.spectral_contrastive_loss(o1['z'], o2['z'], alpha=alpha, r_global=r_other,
                                          mu=spec.sc_mu, mask=batch.get('mask'))
    return reg + spec.sc_scale * sc, (bs, None)
  if spec.method == 'simclr':
    return reg + losses.nt_xent(o1['z'], o2['z'], spec.temperature,
                                zero_diagonal=spec.nt_xent_zero_diagonal), (bs, None)
  if spec.method == 'simsiam':
    return reg + losses.simsiam_loss(o1['p'], o2['p'], o1['z'], o2['z']), (bs, None)
  target = client['target']
  tbs = target['batch_stats']
  t1, tbs = apply_train(spec.model, target['params'], tbs, v1, with_predictor=False)
  t2, tbs = apply_train(spec.model, target['params'], tbs, v2, with_predictor=False)
  t1, t2 = jax.lax.stop_gradient(t1['z']), jax.lax.stop_gradient(t2['z'])
  return reg + losses.byol_loss(o1['p'], o2['p'], t1, t2), (bs, tbs)


def _view_regularizer(spec: ClientSpec, zs, key: jax.Array) -> jax.Array:
  """Sum over the views of spec.feature_regularizer(z_v, key_v) (0 without one)."""
  if spec.feature_regularizer is None:
    return jnp.zeros((), jnp.float32)
  keys = jax.random.split(jax.random.fold_in(key, REGULARIZER_STREAM), len(zs))
  return sum(spec.feature_regularizer(z, k) for z, k in zip(zs, keys))


def local_step(spec: ClientSpec, client, batch, key, msg, lr, sc_shared=None,
               extra_loss: Optional[Callable[[Any], jax.Array]] = None
               ) -> Tuple[Dict[str, Any], jax.Array]:
  """One SGD/Adam step on one batch (and the BYOL target EMA update after it).

  extra_loss: optional params -> scalar added to the loss inside the gradient (Hetero-SSFL's
    mu * CKA term on the RAD); the step is otherwise the method's own.
  """
  del msg

  def total(p):
    loss, aux = loss_fn(spec, p, client, batch, key, sc_shared)
    return (loss if extra_loss is None else loss + extra_loss(p)), aux
  (loss, (bs, tbs)), grads = jax.value_and_grad(total, has_aux=True)(client['params'])
  new = apply_gradients(spec, client, grads, lr, batch_stats=bs)
  if spec.method == 'byol':
    online = target_from_online(new['params'], bs)
    new['target'] = {'params': losses.ema_update(client['target']['params'], online['params'],
                                                 spec.ema_tau),
                     'batch_stats': tbs}
  return new, loss


def apply_gradients(spec: ClientSpec, client, grads, lr, **fields) -> Dict[str, Any]:
  """The client after one optimiser step on `grads` at learning rate lr (spec.tx is unit-rate),
  with `fields` (e.g. the new batch_stats) replaced."""
  updates, opt_state = spec.tx.update(grads, client['opt_state'], client['params'])
  params = jax.tree_util.tree_map(lambda p, u: p - lr * u, client['params'], updates)
  return dict(client, params=params, opt_state=opt_state, **fields)


def begin_round(spec: ClientSpec, client) -> Dict[str, Any]:
  """Start-of-round bookkeeping every algorithm shares: the optimiser reset."""
  if spec.reset_optimizer:
    client = dict(client, opt_state=spec.tx.init(client['params']))
  return client


def replace_modules(tree: Dict[str, Any], source: Dict[str, Any], names) -> Dict[str, Any]:
  """Copy of `tree` with the top-level entries `names` taken from `source` (where present)."""
  return dict(tree, **{k: source[k] for k in names if k in source})


def encoder_variables(variables: Dict[str, Any]) -> Dict[str, Any]:
  """{'params', 'batch_stats'} of the backbone alone, from full-model variables."""
  out = {'params': variables['params']['encoder']}
  if 'encoder' in variables.get('batch_stats', {}):
    out['batch_stats'] = variables['batch_stats']['encoder']
  return out


def encoder_from_config(config: ml_collections.ConfigDict, encoder: str = '') -> nn.Module:
  """The backbone `encoder` (default config.encoder) with the run's conv_impl and precision: the one
  place where config.precision becomes the modules' compute dtype."""
  return models.get_encoder(encoder or config.encoder, conv_impl=config.conv_impl,
                            dtype=models.compute_dtype(config.precision))


def heads_from_config(config: ml_collections.ConfigDict, with_predictor: bool
                      ) -> Tuple[models.MLPHead, Optional[models.MLPHead]]:
  """(projector, predictor or None): the configured preset or custom sizes, at the run's
  precision."""
  dtype = models.compute_dtype(config.precision)
  if config.heads != 'custom':
    return models.make_heads(config.heads, with_predictor, dtype)
  projector = models.MLPHead(config.proj_hidden, config.proj_out, config.head_bn, dtype)
  predictor = models.MLPHead(config.pred_hidden, config.pred_out, config.head_bn, dtype)
  return projector, predictor if with_predictor else None


def model_from_config(config: ml_collections.ConfigDict, num_classes: int, encoder: str = ''
                      ) -> nn.Module:
  """The client model around `encoder` (default config.encoder): an SSLModel with the configured
  heads, or a Classifier for ssl_method 'supervised'."""
  module = encoder_from_config(config, encoder)
  if config.ssl_method == 'supervised':
    return models.Classifier(module, num_classes, dtype=models.compute_dtype(config.precision))
  with_predictor = config.ssl_method in ('byol', 'simsiam')
  return models.SSLModel(module, *heads_from_config(config, with_predictor))


def spec_from_config(config: ml_collections.ConfigDict, info: DataInfo, encoder: str = ''
                     ) -> ClientSpec:
  """The local learning problem of a client with `encoder` (default config.encoder), from the
  run's generic keys (method, model, optimiser, augmentation, loss settings). Algorithms that add a
  term (FedU2's FUR) or change a scale (FedSC's paper scale) replace those fields."""
  h, w, c = info.image_shape
  tx = optim.make_optimizer(config.optimizer, momentum=config.momentum, nesterov=config.nesterov,
                            weight_decay=config.weight_decay, grad_clip_norm=config.grad_clip_norm)
  return ClientSpec(
      method=config.ssl_method, model=model_from_config(config, info.num_classes, encoder), tx=tx,
      aug=augment.preset(config.augmentation, h), mean=tuple(info.mean), std=tuple(info.std),
      input_shape=(h, w, c), temperature=config.temperature,
      nt_xent_zero_diagonal=config.nt_xent_zero_diagonal, ema_tau=config.ema_tau,
      reset_optimizer=config.reset_optimizer, sc_mu=float(config.sc_mu) or None)
