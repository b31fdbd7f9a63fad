"""Client optimisers with a unit learning rate, so the round's learning rate is applied by the step.

The official codes re-create their optimiser every round with that round's learning rate (cosine over
rounds); scaling the unit-rate direction by lr_t is the same update for SGD with momentum (the momentum
buffer is linear in the gradients) and for Adam (whose direction does not depend on lr), and lets one
compiled step serve every round.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import optax

OPTIMIZERS = ('sgd', 'adam')
LR_SCHEDULES = ('constant', 'cosine')


def make_optimizer(name: str, *, momentum: float = 0.9, nesterov: bool = False,
                   weight_decay: float = 0.0, grad_clip_norm: float = 0.0) -> optax.GradientTransformation:
  """Unit-lr direction: params_new = params - lr * updates.

  PyTorch semantics: gradient-norm clipping happens before the step, and weight decay is L2 added to
  the (clipped) gradient before momentum / Adam moments (torch.optim.SGD / Adam `weight_decay`).
  """
  if name not in OPTIMIZERS:
    raise ValueError(f'optimizer.name = {name!r} is invalid: must be one of {OPTIMIZERS}')
  parts = []
  if grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(grad_clip_norm))
  if weight_decay > 0:
    parts.append(optax.add_decayed_weights(weight_decay))
  if name == 'sgd':
    if momentum > 0:
      parts.append(optax.trace(decay=momentum, nesterov=nesterov))
  else:
    parts.append(optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8))
  # Plain SGD has no transform at all; optax rejects an empty chain, so the direction is the gradient.
  return optax.chain(*parts) if parts else optax.identity()


def scale_module(tx: optax.GradientTransformation, module: str, factor: float
                 ) -> optax.GradientTransformation:
  """`tx` with the updates of the top-level params entry `module` multiplied by `factor`: that
  module trains at factor x the round's learning rate, weight decay included (a PyTorch parameter
  group with lr * factor; for SGD with momentum the same update, the buffer being linear in the
  gradients). factor 1 returns `tx` itself, so its state keeps its structure."""
  if factor == 1.0:
    return tx
  mask = lambda params: {name: name == module for name in params}
  return optax.chain(tx, optax.masked(optax.scale(factor), mask))


def round_lr(base_lr: float, schedule: str, round_idx, num_rounds: int):
  """Learning rate of round `round_idx` (0-based): constant, or EasyFL's cosine over rounds
  lr_t = base_lr * (1 + cos(pi * t / T)) / 2."""
  if schedule not in LR_SCHEDULES:
    raise ValueError(f'optimizer.lr_schedule = {schedule!r} is invalid: must be one of {LR_SCHEDULES}')
  if schedule == 'constant':
    return jnp.asarray(base_lr, jnp.float32)
  t = jnp.asarray(round_idx, jnp.float32)
  return jnp.float32(base_lr) * 0.5 * (1.0 + jnp.cos(math.pi * t / num_rounds))
