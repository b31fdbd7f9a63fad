"""MoCo v2 (He et al., CVPR 2020; Chen et al., arXiv:2003.04297): InfoNCE of the online projection
against the momentum encoder's projection of the other view and a queue of earlier keys
(`losses.moco_infonce`, `losses.moco_enqueue`).

The queue is per-client state, stored with the client: it survives the rounds a client sits out,
stateless clients and `client_state='host'`, as a client's own memory of its earlier batches would.
`moco.reset_state = True` empties it at the start of every round instead (a queue of this round's
keys only). Two deviations from the released code, both for exactness: the queue starts empty,
with unfilled slots masked out of the negatives (the release fills it with random unit vectors,
which are negatives until overwritten), and a step's keys are written with wrap-around, so the
queue size need not be a multiple of the batch. The queue may not be longer than the smallest
client's data (a longer one holds keys of all of that client's images, so each query meets its own
image among its negatives) nor shorter than one step's keys; both are refused once the partition is
known (`check_clients`). `symmetric` is the CIFAR demo's two-way loss (sum
of both directions, both views' keys enqueued); the default is MoCo v2's one-way loss.
"""
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl.ssl import losses
from fedjax_ssl.ssl import registry


def _pairs(hparams, online, target):
  """(queries, keys) of the loss: view 1 against view 2, and the reverse when symmetric."""
  pairs = [(online[0]['z'], target[1]['z'])]
  if hparams['symmetric']:
    pairs.append((online[1]['z'], target[0]['z']))
  return pairs


def loss(hparams, online, target, batch, shared, state):
  del batch, shared
  valid = jnp.arange(state['queue'].shape[0]) < state['count']
  return sum(losses.moco_infonce(q, k, state['queue'], valid, hparams['temperature'])
             for q, k in _pairs(hparams, online, target))


def update_state(hparams, state, online, target):
  keys = jnp.concatenate([k for _, k in _pairs(hparams, online, target)], axis=0)
  queue, ptr, count = losses.moco_enqueue(state['queue'], state['ptr'], state['count'], keys)
  return {'queue': queue, 'ptr': ptr, 'count': count}


def state_init(hparams, z_dim: int):
  return {'queue': jnp.zeros((hparams['queue_size'], z_dim), jnp.float32),
          'ptr': jnp.zeros((), jnp.int32), 'count': jnp.zeros((), jnp.int32)}


def defaults() -> ml_collections.ConfigDict:
  block = ml_collections.ConfigDict()
  block.temperature = 0.2      # MoCo v2
  block.queue_size = 4096      # K: the CIFAR demo's (65536 on ImageNet)
  block.ema_tau = 0.99         # the momentum encoder's m (the CIFAR demo's; 0.999 on ImageNet)
  block.symmetric = False
  block.reset_state = False    # True: empty the queue at the start of every round
  return block


def check_clients(block: ml_collections.ConfigDict, sizes: np.ndarray, batch_size: int) -> None:
  """The queue against the clients' data: no longer than the smallest client's images (a longer
  queue holds keys of every image that client has, so each query meets its own image among its
  negatives), and no shorter than the keys one step enqueues."""
  step_keys = batch_size * (2 if block.symmetric else 1)
  smallest = int(np.argmin(sizes))
  if block.queue_size > sizes[smallest]:
    raise cv.ConfigError(
        f'moco.queue_size = {block.queue_size} is invalid for this partition: must be <= '
        f'{int(sizes[smallest])}, the images of its smallest client (client {smallest}); a longer '
        'queue holds keys of every image that client has, so each query meets its own image among '
        'its negatives' + (f'; and no queue fits: one step enqueues {step_keys} keys (batch_size '
                           f'= {batch_size}{" x 2, symmetric" if block.symmetric else ""})'
                           if step_keys > sizes[smallest] else ''))
  if block.queue_size < step_keys:
    raise cv.ConfigError(
        f'moco.queue_size = {block.queue_size} is invalid: must be >= {step_keys}, the keys one '
        f'step enqueues (batch_size = {batch_size}{" x 2, symmetric" if block.symmetric else ""})')


def validate(block: ml_collections.ConfigDict) -> None:
  cv.check_float_range('moco.temperature', block.temperature, 0.0, None, inclusive=(False, True))
  cv.check_int_range('moco.queue_size', block.queue_size, 1, 10_000_000)
  cv.check_float_range('moco.ema_tau', block.ema_tau, 0.0, 1.0)


OBJECTIVE = registry.register(registry.Objective(
    name='moco', loss=loss, target=True, defaults=defaults, validate=validate,
    state_init=state_init, update_state=update_state, check_clients=check_clients,
    doc='MoCo v2: InfoNCE against a per-client queue of momentum keys'))
