"""Federated distillation (FD, Jeong et al. 2018, "Communication-efficient on-device machine
learning"), the logit-sharing baseline of the representation-sharing paper (its A5 decisions).

Supervised; every client keeps its own classifier and Adam state. Up: the client's per-class mean
logits [C, C] over all its samples (eval mode, after the local epoch) with its class counts. Down:
the teacher of client u, the count-weighted per-class mean logits of the OTHER clients (Jeong et
al.'s global average excludes the client's own). Local loss per mini-batch:

  CE(z, y) + weight * T^2 * CE(softmax(teacher[y] / T), softmax(z / T))

(cross-entropy to the teacher's soft label of the sample's class; T = 1 in the paper, the T^2 factor
keeps the gradient scale when T != 1, as in Hinton et al.). As for the representation-sharing
method, round 1 uses the logits of the untrained models, and the relay keeps every client's latest
upload.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl.algorithms import fedavg, registry, repshare, ssl_client
from fedjax_ssl.core.algorithm import Algorithm, Prepare
from fedjax_ssl.core import comm
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.ops import prototypes
from fedjax_ssl.ssl import losses


def distillation_loss(logits: jax.Array, teacher_logits: jax.Array, temperature: float
                      ) -> jax.Array:
  """Mean over the batch of T^2 * CE(softmax(teacher / T), softmax(logits / T)); [B, C] each."""
  p = jax.nn.softmax(teacher_logits / temperature, axis=-1)
  logq = jax.nn.log_softmax(logits / temperature, axis=-1)
  return temperature ** 2 * jnp.mean(-jnp.sum(p * logq, axis=-1))


def make(spec: ssl_client.ClientSpec, *, num_classes: int, weight: float = 1.0,
         temperature: float = 1.0, upload_batch: int = 500) -> Algorithm:
  """The FD algorithm ('fd').

  Args:
    spec: a supervised ClientSpec (Classifier model; persistent optimiser).
    num_classes: C.
    weight: distillation weight (1, A5).
    temperature: softmax temperature T (1, A5).
    upload_batch: images per eval forward when computing the mean logits (memory only).
  """
  repshare.check_supervised(spec, 'fd')
  if not temperature > 0:
    raise ValueError(f'fd.temperature = {temperature} is invalid: must be > 0')

  def summarize(client, local):
    return repshare.class_summary(spec, repshare.variables_of(client), local, num_classes,
                                  upload_batch, kind='logits')

  def init(key, num_clients):
    if num_clients < 2:
      raise ValueError(f'num_clients = {num_clients} is invalid for fd: the teacher is the other '
                       'clients\' mean logits, need >= 2')
    shape = (num_clients, num_classes, num_classes)
    return (repshare.independent_clients(spec, key, num_clients),
            {'means': jnp.zeros(shape), 'counts': jnp.zeros(shape[:2])})

  def prepare_upload_bytes(state, server):
    # Round 0: every client uploads the mean logits of its untrained model inside `prepare`.
    row = comm.tree_bytes({k: server[k][0] for k in ('means', 'counts')})
    return jnp.where(state.round == 0, float(server['means'].shape[0] * row), 0.0)

  def personalize(msg, cid):
    return {'teacher': prototypes.leave_one_out_prototypes(msg['means'], msg['counts'], cid)}

  def begin(client, msg, key):
    del msg, key
    return fedavg.mark_participated(ssl_client.begin_round(spec, client))

  def loss_fn(params, client, batch, key, msg):
    x = augment.normalize(augment.augment_batch(key, batch['x'], spec.aug), spec.mean, spec.std)
    z, bs = ssl_client.apply_train(spec.model, params, client['batch_stats'], x)
    y = batch['y']
    loss = losses.cross_entropy_loss(z, y)
    return loss + weight * distillation_loss(z, msg['teacher'][y], temperature), bs

  def local_step(client, batch, key, msg, lr):
    (loss, bs), grads = jax.value_and_grad(loss_fn, has_aux=True)(client['params'], client, batch,
                                                                  key, msg)
    return ssl_client.apply_gradients(spec, client, grads, lr, batch_stats=bs), loss

  return Algorithm(
      name='fd', init=init, broadcast=lambda server: server, begin=begin, local_step=local_step,
     
      upload=lambda client, msg, local: summarize(client, local),
      aggregate=repshare.store_uploads,
      eval_variables=lambda state: (repshare.variables_of(state.clients), True),
      encoder_apply=lambda v, x: spec.model.encoder.apply(ssl_client.encoder_variables(v), x,
                                                          train=False),
      classifier_apply=lambda v, x: spec.model.apply(v, x, train=False),
      personalized=True, personalize=personalize,
      # Round 0's mean logits from every client's untrained model; nothing else before a round.
      prepare=Prepare(lambda state, data, ids, key: state.server,
                      upload_bytes=prepare_upload_bytes,
                      summarize=repshare.summaries_from_models(summarize),
                      absorb=repshare.take_summaries, summarize_reads_data=True))


def config_block() -> ml_collections.ConfigDict:
  """Federated distillation's keys, `config.fd` (Jeong et al.; docs/notes/repshare.md)."""
  f = ml_collections.ConfigDict()
  f.weight = 1.0                  # distillation weight
  f.temperature = 1.0
  f.upload_batch = 500            # images per eval forward when averaging logits (memory only)
  return f


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  """The relay's rules and the ranges of `config.fd`."""
  del dataset_info
  repshare.validate_relay(config)
  cv.check_float_range('fd.weight', config.fd.weight, 0.0, None)
  cv.check_float_range('fd.temperature', config.fd.temperature, 0.0, None, inclusive=(False, True))
  cv.check_int_range('fd.upload_batch', config.fd.upload_batch, 1, 10_000_000)


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  return make(ssl_client.spec_from_config(config, info), num_classes=info.num_classes,
              weight=config.fd.weight, temperature=config.fd.temperature,
              upload_batch=config.fd.upload_batch)


registry.register('fd', build, defaults=config_block, validate=validate, methods=('supervised',),
                  methods_note='it trains classifiers',
                  doc='federated distillation: per-class mean logits through the relay',
                  global_model=False)
