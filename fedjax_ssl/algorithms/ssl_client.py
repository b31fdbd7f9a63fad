"""What every SSL (or supervised) client does locally, shared by the FedAvg family, FedU, FedEMA,
FedU2, FedSC, independent and centralized training: the model, the two-view augmentation, the loss, one
optimiser step, and the momentum target (BYOL)'s EMA. The loss is the objective's (`fedjax_ssl.ssl`).

A client state is a dict:
  params       online parameters {'encoder', 'projector', 'predictor'} (SSL) or {'encoder', 'head'}
  batch_stats  BatchNorm running statistics of the same modules ({} for BN-free encoders)
  opt_state    optax state of `spec.tx` over `params`
  target       objectives with a momentum target (BYOL): {'params': {'encoder', 'projector'},
               'batch_stats': ...}, EMA of online
  objective    objectives with per-client state (MoCo's queue): that state
  extras       algorithm bookkeeping (e.g. 'participated', 'divergence', 'scaler'), float32 scalars
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from fedjax_ssl import models
from fedjax_ssl import ssl
from fedjax_ssl.core import optim
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.ssl import losses

@dataclasses.dataclass(frozen=True, eq=False)
class ClientSpec:
  """Static description of a client's local learning problem (closed over by the jitted step).

  Attributes:
    objective: the registered objective (`fedjax_ssl.ssl.registry.Objective`, or its name):
      views, heads, target network, shared modules and loss.
    model: flax module; SSLModel for SSL objectives, Classifier for a `classifier` objective.
    tx: unit-learning-rate optax transformation (core.optim.make_optimizer).
    aug: augmentation applied to each view (supervised: to the single view).
    mean, std: per-channel normalisation after augmentation.
    input_shape: (H, W, C) of the model input (after augmentation).
    hparams: the objective's hyper-parameters (`Objective.hyperparameters(config)`), over the
      defaults of its config block; a target objective's 'ema_tau' is the EMA rate,
      target <- tau * target + (1 - tau) * online after every step (with BYOL's
      'ema_schedule' = 'lr', a rate that follows the learning rate: `target_rate`).
    reset_optimizer: re-create the optimiser state at the start of every round (EasyFL, FedSC).
    feature_regularizer: optional (z [B, dz], key) -> scalar, already weighted, added to an SSL
      loss once per view on the online representation `regularized` (FedU2's lambda_u * FUR,
      FedDecorr's beta * decorrelation). Its keys come from a stream of the step key that the views
      do not use, so a spec without one computes exactly what it did before.
    regularized: which online output feature_regularizer sees: 'z' the projector output (FUR),
      'h' the backbone features (FedDecorr), or 'outputs' the view's whole output dict {'h', 'z',
      ...} (SSD's terms, which read both).
  """
  objective: ssl.Objective
  model: nn.Module
  tx: optax.GradientTransformation
  aug: augment.AugmentConfig
  mean: Tuple[float, ...]
  std: Tuple[float, ...]
  input_shape: Tuple[int, int, int]
  hparams: Optional[Mapping[str, Any]] = None
  reset_optimizer: bool = True
  feature_regularizer: Optional[Callable[[jax.Array, jax.Array], jax.Array]] = None
  regularized: str = 'z'

  def __post_init__(self):
    objective = ssl.get(self.objective) if isinstance(self.objective, str) else self.objective
    object.__setattr__(self, 'objective', objective)
    object.__setattr__(self, 'hparams',
                       {**objective.defaults().to_dict(), **dict(self.hparams or {})})
    if self.hparams.get('ema_schedule', 'constant') != 'constant' and not (
        self.hparams.get('base_lr', 0) > 0):
      raise ValueError(f"ema_schedule = {self.hparams['ema_schedule']!r} needs hparams['base_lr'] "
                       f"> 0 (the learning rate the schedule divides by), got "
                       f"{self.hparams.get('base_lr')!r}")

  @property
  def shared(self) -> Tuple[str, ...]:
    """The modules clients share: the objective's, for this run's hyper-parameters."""
    return self.objective.shared_modules(self.hparams)

  @property
  def method(self) -> str:
    """The objective's name (`config.ssl_method`)."""
    return self.objective.name

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
  if spec.objective.target:
    state['target'] = target_from_online(params, batch_stats)
  if spec.objective.state_init is not None:
    out = jax.eval_shape(lambda v: spec.model.apply(v, x, train=False, with_predictor=False),
                         variables)
    state['objective'] = spec.objective.state_init(spec.hparams, out['z'].shape[-1])
  return state


def target_from_online(params, batch_stats) -> Dict[str, Any]:
  """Momentum target network (BYOL) = copy of the online encoder + projector (no predictor)."""
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


def loss_fn(spec: ClientSpec, params, client, batch, key, shared=None
            ) -> Tuple[jax.Array, Tuple[Any, Any, Any]]:
  """Scalar loss of one local step, with the updated (online batch_stats, target batch_stats,
  objective state); the last two are None where the objective has no target or no state.

  The objective's views are forwarded through the online model in order (each forward updates the
  running statistics once), then through the momentum target when the objective has one.
  shared: what the algorithm hands the objective's loss (FedSC: (alpha scalar, R_other [H, H]);
  alpha = 1 with R_other = 0 is the local loss, exactly), or None.
  """
  objective = spec.objective
  bs = client['batch_stats']
  views = _views(spec, key, batch['x'], objective.views)
  if objective.classifier:
    outputs = []
    for v in views:
      logits, bs = apply_train(spec.model, params, bs, v)
      outputs.append(logits)
    return objective.loss(spec.hparams, outputs, None, batch, shared), (bs, None, None)
  outputs = []
  for v in views:
    out, bs = apply_train(spec.model, params, bs, v, with_predictor=objective.predictor)
    outputs.append(out)
  reg = _view_regularizer(
      spec, [o if spec.regularized == 'outputs' else o[spec.regularized] for o in outputs], key)
  if not objective.target:
    return reg + objective.loss(spec.hparams, outputs, None, batch, shared), (bs, None, None)
  target = client['target']
  tbs = target['batch_stats']
  targets = []
  for v in views:
    t, tbs = apply_train(spec.model, target['params'], tbs, v, with_predictor=False)
    targets.append({'z': jax.lax.stop_gradient(t['z'])})
  if objective.state_init is None:
    return reg + objective.loss(spec.hparams, outputs, targets, batch, shared), (bs, tbs, None)
  state = client['objective']
  after = objective.update_state(spec.hparams, state, jax.lax.stop_gradient(outputs), targets)
  return (reg + objective.loss(spec.hparams, outputs, targets, batch, shared, state),
          (bs, tbs, after))


def _view_regularizer(spec: ClientSpec, zs, key: jax.Array) -> jax.Array:
  """Sum over the views of spec.feature_regularizer(z_v, key_v) (0 without one)."""
  if spec.feature_regularizer is None:
    return jnp.zeros((), jnp.float32)
  keys = jax.random.split(jax.random.fold_in(key, REGULARIZER_STREAM), len(zs))
  return sum(spec.feature_regularizer(z, k) for z, k in zip(zs, keys))


def local_step(spec: ClientSpec, client, batch, key, msg, lr, shared=None,
               extra_loss: Optional[Callable[[Any], jax.Array]] = None
               ) -> Tuple[Dict[str, Any], jax.Array]:
  """One SGD/Adam step on one batch (and the momentum target's EMA update after it).

  shared: handed to the objective's loss (`loss_fn`).
  extra_loss: optional params -> scalar added to the loss inside the gradient (Hetero-SSFL's
    mu * CKA term on the RAD); the step is otherwise the method's own.
  """
  del msg
  if spec.objective.prototypes:  # SwAV's release: unit-norm prototypes before every step
    client = dict(client, params=normalize_prototypes(client['params']))

  def total(p):
    loss, aux = loss_fn(spec, p, client, batch, key, shared)
    return (loss if extra_loss is None else loss + extra_loss(p)), aux
  (loss, (bs, tbs, objective_state)), grads = jax.value_and_grad(total, has_aux=True)(
      client['params'])
  new = apply_gradients(spec, client, grads, lr, batch_stats=bs)
  if objective_state is not None:
    new['objective'] = objective_state
  if spec.objective.target:
    online = target_from_online(new['params'], bs)
    new['target'] = {'params': losses.ema_update(client['target']['params'], online['params'],
                                                 target_rate(spec, lr)),
                     'batch_stats': tbs}
  return new, loss


def target_rate(spec: ClientSpec, lr):
  """The momentum target's EMA rate tau for a step at learning rate lr (a scalar, traced or not).

  hparams['ema_tau'], or with hparams['ema_schedule'] == 'lr' (BYOL's block) ema_tau ** (lr /
  hparams['base_lr']): the EMA scaling rule of Busbridge et al. ("How to Scale Your EMA", NeurIPS
  2023), under which 1 - tau moves with the learning rate, ~(1 - ema_tau) lr / base_lr. A cosine
  learning rate then takes tau from ema_tau towards 1 as BYOL's cosine schedule of tau does (per
  round, as lr changes per round). Objectives without the key keep their constant rate.
  """
  tau = spec.hparams['ema_tau']
  if spec.hparams.get('ema_schedule', 'constant') == 'constant':
    return tau
  return jnp.power(jnp.float32(tau), lr / spec.hparams['base_lr'])


def normalize_prototypes(params):
  """params with the prototype layer's kernel [dz, K] scaled to unit columns (one prototype per
  column; the release's `normalize(w, dim=1)` of its [K, dz] weight)."""
  kernel = params['prototypes']['kernel']
  unit = losses.l2_normalize(kernel.T).T.astype(kernel.dtype)
  return dict(params, prototypes=dict(params['prototypes'], kernel=unit))


def apply_gradients(spec: ClientSpec, client, grads, lr, **fields) -> Dict[str, Any]:
  """The client after one optimiser step on `grads` at learning rate lr (spec.tx is unit-rate),
  with `fields` (e.g. the new batch_stats) replaced."""
  updates, opt_state = spec.tx.update(grads, client['opt_state'], client['params'])
  params = jax.tree_util.tree_map(lambda p, u: p - lr * u, client['params'], updates)
  return dict(client, params=params, opt_state=opt_state, **fields)


def begin_round(spec: ClientSpec, client) -> Dict[str, Any]:
  """Start-of-round bookkeeping every algorithm shares: the optimiser reset, and the objective
  state's when its `reset_state` asks."""
  if spec.reset_optimizer:
    client = dict(client, opt_state=spec.tx.init(client['params']))
  if 'objective' in client and spec.hparams.get('reset_state'):
    client = dict(client, objective=jax.tree_util.tree_map(jnp.zeros_like, client['objective']))
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
  heads, or a Classifier for a classifier objective (ssl_method 'supervised')."""
  module = encoder_from_config(config, encoder)
  objective = ssl.get(config.ssl_method)
  if objective.classifier:
    return models.Classifier(module, num_classes, dtype=models.compute_dtype(config.precision))
  prototypes = config[objective.name].num_prototypes if objective.prototypes else 0
  return models.SSLModel(module, *heads_from_config(config, objective.predictor),
                         prototypes=prototypes)


def spec_from_config(config: ml_collections.ConfigDict, info: DataInfo, encoder: str = ''
                     ) -> ClientSpec:
  """The local learning problem of a client with `encoder` (default config.encoder), from the
  run's generic keys (method, model, optimiser, augmentation, loss settings). Algorithms that add a
  term (FedU2's FUR) or change a scale (FedSC's paper scale) replace those fields."""
  h, w, c = info.image_shape
  tx = optim.make_optimizer(config.optimizer, momentum=config.momentum, nesterov=config.nesterov,
                            weight_decay=config.weight_decay, grad_clip_norm=config.grad_clip_norm)
  tx = optim.scale_module(tx, 'predictor', config.predictor_lr_scale)
  objective = ssl.get(config.ssl_method)
  return ClientSpec(
      objective=objective, model=model_from_config(config, info.num_classes, encoder), tx=tx,
      aug=augment.preset(config.augmentation, h), mean=tuple(info.mean), std=tuple(info.std),
      input_shape=(h, w, c), hparams=objective.hyperparameters(config),
      reset_optimizer=config.reset_optimizer)
