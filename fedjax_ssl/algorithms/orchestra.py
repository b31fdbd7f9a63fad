"""Orchestra (Lubana et al., "Orchestra: Unsupervised Federated Learning via Globally Consistent
Clustering", ICML 2022), as the authors released it (ekdeepslubana/OrchestraFL: `models.py`,
`client.py`, `myfedavg.py`, `config.py`), FedU2's Orchestra baseline (Tables 1-2).
docs/notes/fedu2.md#fedu2-orchestra.

Model: the backbone, the release's projector (Linear(d, P) -> BN -> ReLU -> Linear(P, P) -> BN
without affine, no biases, P = `orchestra.projector_dim` = 512), a rotation head Linear(P, 4) on
the projector output, and an EMA target of backbone + projector. Clients are stateless, as the
release's Flower clients (a fresh model every round, loaded from the server): the server keeps the
online network, the target, the global centroids C [K, P] and the count of finished rounds.

Round 0 is the setup round (the release's `rounds_done == 0`): no training; each participant
fills its memory bank with the target's projections of the first m augmented images (one view, its
local batches in order) and clusters the bank; the server clusters the local centroids into the
first global centroids. Every later round, per participant:

  begin:  adopt the online network, the target and C; a fresh optimizer; a fresh memory bank
          [m, P] of U(+-1/sqrt(m)) rows (the release's untrained `mem_projections`).
  step:   target <- tau target + (1 - tau) online                  (before the forward, ema 0.996)
          views x1, x2, x3 of the batch, x3 rotated by 90 r degrees, r ~ U{0, 1, 2, 3} per image
          L = cluster_loss(z_online(x2), z_target(x1), C; T = 0.1)
              + deg_weight * CE(rotation_head(z_online(x3)), r)
          (the online network also sees x1, unused by the loss: its BatchNorm statistics, as the
          release's forward); the bank receives z_target(x1) (FIFO).
  upload: online network, target, local centroids = local_clustering(bank) (16 rows).
  server: data-weighted mean of online network and target; C <- global_clustering(all local
          centroids, from C; T) (500 SGD steps on Sinkhorn targets); rounds_done + 1.
Evaluation: the global online backbone.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl import models
from fedjax_ssl.algorithms import fedavg, registry, ssl_client
from fedjax_ssl.core.algorithm import Algorithm, Stateless, present, replicate, weighted_mean
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.models import layers
from fedjax_ssl.ops import orchestra as ops
from fedjax_ssl.ssl import losses

METHODS = ('byol',)
TARGETS = ('softmax', 'sinkhorn')
# The modules of the online network (uploaded, averaged, broadcast); the target has the first two.
ONLINE = ('encoder', 'projector', 'deg')
TARGET = ('encoder', 'projector')
# fold_in tag of the rotation labels inside a step key (the three views use the key's split).
ROTATION_STREAM = 0x0c4e


@dataclasses.dataclass(frozen=True)
class OrchestraConfig:
  """Orchestra's settings (config.orchestra; the release's `config.py` defaults)."""
  global_clusters: int = 128          # num_global_clusters
  local_clusters: int = 16            # num_local_clusters
  memory_size: int = 128              # cluster_m_size
  temperature: float = 0.1            # main_T
  ema_tau: float = 0.996              # ema_value
  projector_dim: int = 512            # projection_MLP_orchestra's hidden and output sizes
  deg_weight: float = 1.0             # L = L_cluster + L_deg
  targets: str = 'softmax'            # the release; 'sinkhorn': equal-size targets per batch
  sinkhorn_lambda: float = ops.SINKHORN_LAMBDA
  global_iters: int = ops.GLOBAL_ITERS
  local_iters: int = ops.LOCAL_ITERS


class Projector(nn.Module):
  """The release's `projection_MLP_orchestra`: Dense(P, no bias) -> BatchNorm -> ReLU ->
  Dense(P, no bias) -> BatchNorm without scale and bias; [B, d] -> [B, P]."""
  dim: int = 512

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    x = layers.Dense(self.dim, use_bias=False, name='fc1')(x)
    x = nn.relu(layers.BatchNorm(use_running_average=not train, name='bn1')(x))
    x = layers.Dense(self.dim, use_bias=False, name='fc2')(x)
    return layers.BatchNorm(use_running_average=not train, use_scale=False, use_bias=False,
                            name='bn2')(x)


# The degeneracy regulariser's rotation classifier, Linear(P, 4) (the release's `deg_layer`).
ROTATION_HEAD = layers.Dense(4)


def model_of(spec: ssl_client.ClientSpec, projector_dim: int) -> models.SSLModel:
  """`spec`'s backbone with Orchestra's projector and no predictor."""
  return models.SSLModel(spec.model.encoder, Projector(projector_dim), None)


def _modules(tree: Dict[str, Any], names) -> Dict[str, Any]:
  return {k: tree[k] for k in names if k in tree}


def _online(client) -> Dict[str, Any]:
  return {'params': client['params'], 'batch_stats': client['batch_stats']}


def loss_fn(spec: ssl_client.ClientSpec, oc: OrchestraConfig, params, client, batch, key, msg):
  """One training step's loss: (total, (online batch_stats, target params, target batch_stats,
  target projections [B, P], terms {'cluster', 'deg'})).

  The target is first moved towards the current online network (EMA, as the release does inside
  its forward), then projects view 1 in train mode; the online network sees views 1, 2 and the
  rotated view 3 in three train-mode forwards (BatchNorm running statistics updated after each).
  """
  model = spec.model
  v1, v2, v3 = ssl_client._views(spec, key, batch['x'], 3)  # pylint: disable=protected-access
  rot = jax.random.randint(jax.random.fold_in(key, ROTATION_STREAM), (v3.shape[0],), 0, 4)
  x3 = ops.rotate90(v3, rot)
  tparams = losses.ema_update(client['target']['params'], _modules(client['params'], TARGET),
                              oc.ema_tau)
  t, tbs = ssl_client.apply_train(model, tparams, client['target']['batch_stats'], v1,
                                  with_predictor=False)
  tz = jax.lax.stop_gradient(t['z'])
  mp = _modules(params, TARGET)
  _, bs = ssl_client.apply_train(model, mp, client['batch_stats'], v1, with_predictor=False)
  o2, bs = ssl_client.apply_train(model, mp, bs, v2, with_predictor=False)
  o3, bs = ssl_client.apply_train(model, mp, bs, x3, with_predictor=False)
  terms = {'cluster': ops.cluster_loss(o2['z'], tz, msg['centroids'], oc.temperature, oc.targets,
                                       oc.sinkhorn_lambda),
           'deg': losses.cross_entropy_loss(ROTATION_HEAD.apply({'params': params['deg']},
                                                                o3['z']), rot)}
  total = terms['cluster'] + oc.deg_weight * terms['deg']
  return total, (bs, tparams, tbs, losses.l2_normalize(tz), terms)


def train_step(spec: ssl_client.ClientSpec, oc: OrchestraConfig, client, batch, key, msg, lr):
  """One optimisation step on Orchestra's loss; the bank receives the target projections."""
  def total(p):
    loss, aux = loss_fn(spec, oc, p, client, batch, key, msg)
    return loss, aux
  (loss, (bs, tparams, tbs, tz, _)), grads = jax.value_and_grad(total, has_aux=True)(
      client['params'])
  new = ssl_client.apply_gradients(spec, client, grads, lr, batch_stats=bs)
  new['target'] = {'params': tparams, 'batch_stats': tbs}
  new['memory'] = ops.memory_push(client['memory'], tz)
  return new, loss.astype(jnp.float32)


def setup_step(spec: ssl_client.ClientSpec, oc: OrchestraConfig, client, batch, key, msg, lr):
  """The setup round's step: no training; until the bank is full, it receives the target's
  projections of view 1 (train-mode BatchNorm, running statistics left unchanged, as the release's
  `reset_memory` restores them)."""
  del msg, lr

  def fill(c):
    v1 = ssl_client._views(spec, key, batch['x'], 3)[0]  # pylint: disable=protected-access
    t, _ = ssl_client.apply_train(spec.model, c['target']['params'], c['target']['batch_stats'],
                                  v1, with_predictor=False)
    memory, filled = ops.memory_fill(c['memory'], c['filled'], losses.l2_normalize(t['z']))
    return dict(c, memory=memory, filled=filled)

  client = jax.lax.cond(client['filled'] < oc.memory_size, fill, lambda c: dict(c), client)
  return client, jnp.zeros((), jnp.float32)


def local_step(spec: ssl_client.ClientSpec, oc: OrchestraConfig, client, batch, key, msg, lr):
  """The setup step in round 0 (`msg['rounds_done'] == 0`), a training step afterwards."""
  return jax.lax.cond(msg['rounds_done'] == 0,
                      lambda *a: setup_step(spec, oc, *a), lambda *a: train_step(spec, oc, *a),
                      client, batch, key, msg, lr)


def make(spec: ssl_client.ClientSpec, *, oc: OrchestraConfig = OrchestraConfig(),
         stateless: bool = True) -> Algorithm:
  """Orchestra over `spec`'s backbone, optimizer and augmentation (module docstring). `spec.model`
  is replaced by the backbone with Orchestra's projector. `stateless=False` stores every client's
  whole state (the same numbers; for the reference loop of the tests)."""
  if spec.method not in METHODS:
    raise ValueError(f'Orchestra: ssl_method = {spec.method!r} is invalid, must be one of '
                     f'{METHODS}')
  h, w, _ = spec.input_shape
  if h != w:
    raise ValueError(f'Orchestra: input {spec.input_shape} must be square (the rotation term)')
  if not 1 <= oc.local_clusters <= oc.memory_size:
    raise ValueError(f'orchestra.local_clusters = {oc.local_clusters} is invalid: must be in '
                     f'[1, memory_size = {oc.memory_size}]')
  if oc.targets not in TARGETS:
    raise ValueError(f'orchestra.targets = {oc.targets!r} is invalid: must be one of {TARGETS}')
  spec = dataclasses.replace(spec, model=model_of(spec, oc.projector_dim))
  m, dim = oc.memory_size, oc.projector_dim

  def init_client(key):
    k_model, k_deg = jax.random.split(key)
    variables = spec.model.init(k_model, jnp.zeros((2,) + tuple(spec.input_shape), jnp.float32),
                                train=False, with_predictor=False)
    params = dict(variables['params'],
                  deg=ROTATION_HEAD.init(k_deg, jnp.zeros((2, dim), jnp.float32))['params'])
    bs = variables.get('batch_stats', {})
    return {'params': params, 'batch_stats': bs, 'opt_state': spec.tx.init(params),
            'target': {'params': _modules(params, TARGET), 'batch_stats': _modules(bs, TARGET)},
            'memory': jnp.zeros((m, dim), jnp.float32), 'filled': jnp.zeros((), jnp.int32)}

  def persist(client):
    return {} if spec.reset_optimizer else {'opt_state': client['opt_state']}

  def restore(stored, msg):
    return {'params': msg['params'], 'batch_stats': msg['batch_stats'],
            'opt_state': (stored['opt_state'] if 'opt_state' in stored
                          else spec.tx.init(msg['params'])),
            'target': msg['target'], 'memory': jnp.zeros((m, dim), msg['centroids'].dtype),
            'filled': jnp.zeros((), jnp.int32)}

  def init(key, num_clients):
    k_client, k_centroids = jax.random.split(key)
    client = init_client(k_client)
    # The release's `centroids` = nn.Linear(P, K, bias=False): rows ~ U(+-1/sqrt(P)).
    bound = 1.0 / float(dim) ** 0.5
    centroids = jax.random.uniform(k_centroids, (oc.global_clusters, dim), jnp.float32, -bound,
                                   bound)
    server = dict(_online(client), target=client['target'], centroids=centroids,
                  rounds_done=jnp.zeros((), jnp.int32))
    return replicate(persist(client) if stateless else client, num_clients), server

  def broadcast(server):
    return server

  def begin(client, msg, key):
    # A fresh bank each participation: the release's client model is built anew every round and
    # its `mem_projections` (Linear(m, P)) is never loaded from the server.
    bound = 1.0 / float(m) ** 0.5
    memory = jax.random.uniform(key, (m, dim), msg['centroids'].dtype, -bound, bound)
    client = dict(client, params=msg['params'], batch_stats=msg['batch_stats'],
                  target=msg['target'], memory=memory, filled=jnp.zeros((), jnp.int32))
    return ssl_client.begin_round(spec, client)

  def upload(client, msg, local):
    del msg
    return dict(_online(client), target=client['target'],
                local_centroids=ops.local_clustering(
                    client['memory'], local.key, oc.local_clusters, oc.local_iters,
                    oc.sinkhorn_lambda))

  def aggregate(server, payloads, weights, ids):
    del ids
    model = weighted_mean({k: payloads[k] for k in ('params', 'batch_stats', 'target')}, weights)
    local = payloads['local_centroids']
    per_client = local.shape[1]
    local = local.reshape((-1, local.shape[-1]))                  # [m * L, P]
    cluster = lambda rows: ops.global_clustering(local, server['centroids'], oc.temperature,
                                                 iters=oc.global_iters, lam=oc.sinkhorn_lambda,
                                                 rows=rows)
    here = present(weights)
    # An absent participant's local centroids leave the clustering; with everyone present, the
    # unmasked clustering (the same arithmetic as before absences existed).
    centroids = jax.lax.cond(jnp.all(here), lambda: cluster(None),
                             lambda: cluster(jnp.repeat(here, per_client)))
    return dict(model, centroids=centroids, rounds_done=server['rounds_done'] + 1)

  return Algorithm(
      name='orchestra', init=init, broadcast=broadcast, begin=begin,
      local_step=lambda c, b, k, msg, lr: local_step(spec, oc, c, b, k, msg, lr),
      upload=upload, aggregate=aggregate,
      eval_variables=lambda state: (state.server, False),
      encoder_apply=lambda v, x: spec.model.encoder.apply(ssl_client.encoder_variables(v), x,
                                                          train=False),
      stateless=Stateless(persist, restore) if stateless else None,
      global_model=fedavg.ONLINE_PARAMS)


def config_block() -> ml_collections.ConfigDict:
  """Orchestra's keys, `config.orchestra` (the release's defaults)."""
  return ml_collections.ConfigDict(dataclasses.asdict(OrchestraConfig()))


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  o = config.orchestra
  for key in ('global_clusters', 'local_clusters', 'memory_size', 'projector_dim', 'global_iters',
              'local_iters'):
    cv.check_int_range(f'orchestra.{key}', o[key], 1, None)
  cv.check_float_range('orchestra.temperature', o.temperature, 0.0, None, inclusive=(False, True))
  cv.check_float_range('orchestra.sinkhorn_lambda', o.sinkhorn_lambda, 0.0, None,
                       inclusive=(False, True))
  cv.check_float_range('orchestra.ema_tau', o.ema_tau, 0.0, 1.0)
  cv.check_float_range('orchestra.deg_weight', o.deg_weight, 0.0, None)
  cv.check_choice('orchestra.targets', o.targets, TARGETS)
  if o.local_clusters > o.memory_size:
    raise cv.ConfigError(f'config.orchestra.local_clusters = {o.local_clusters} is invalid: it '
                         f'must be <= orchestra.memory_size = {o.memory_size} (a client clusters '
                         'its memory bank, starting from local_clusters distinct rows of it)')
  centroids = config.clients_per_round * o.local_clusters
  if o.global_clusters > centroids:
    raise cv.ConfigError(f'config.orchestra.global_clusters = {o.global_clusters} is invalid: it '
                         f'must be <= clients_per_round x local_clusters = '
                         f'{config.clients_per_round} x {o.local_clusters} = {centroids} (the '
                         "server splits a round's local centroids into equal-size global clusters)")
  if o.targets == 'sinkhorn' and o.global_clusters > config.batch_size:
    raise cv.ConfigError(f'config.orchestra.global_clusters = {o.global_clusters} is invalid with '
                         f"orchestra.targets = 'sinkhorn': it must be <= batch_size = "
                         f'{config.batch_size} (each batch is split into equal-size clusters)')
  shape = getattr(dataset_info, 'image_shape', None)
  if shape is not None and shape[0] != shape[1]:
    raise cv.ConfigError(f'config.dataset = {config.dataset!r} is invalid for algorithm '
                         f"'orchestra': its images {tuple(shape)} are not square (the rotation "
                         'term rotates them by multiples of 90 degrees)')


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  o = config.orchestra
  oc = OrchestraConfig(**{k: type(getattr(OrchestraConfig, k))(o[k])
                          for k in config_block().keys()})
  return make(ssl_client.spec_from_config(config, info), oc=oc)


registry.register('orchestra', build, defaults=config_block, validate=validate, methods=METHODS,
                  methods_note="Orchestra's own loss (clustering + rotation) with a BYOL-style EMA "
                               'target; FedU2 groups it with the BYOL methods',
                  doc='clustering-based FL with local and global Sinkhorn-Knopp clustering '
                      '(Lubana et al., ICML 2022)')
