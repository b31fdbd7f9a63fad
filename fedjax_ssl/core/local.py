"""Local training of ONE client as a `lax.while_loop` over its real steps.

A client with n examples runs E * steps_per_epoch(n) real steps, steps_per_epoch(n) = max(n // B, 1)
(drop_last, as the EasyFL / FedU2 codes do; a client with fewer than B examples makes one step per epoch
over a wrapped-around batch). With drop_last=False (the FedSC code's DataLoader) an epoch has
ceil(n / B) steps; the last batch is filled by wrapping around and carries batch['mask'] (bool [B],
False on the filler rows) so the loss can use the real batch size. E local epochs always mean E passes
over that client's own data. Batches are read through a fresh permutation of the client's valid rows
every epoch; padding rows are never read.

The loop runs the client's own step count. Clients run one at a time (strategy 'map' with chunk 1)
therefore cost their real steps only. Under `vmap` JAX turns the loop into one that runs until the
longest participant is done, and a finished client keeps its state bit-for-bit (a select on the
carry). The step is not wrapped in a `lax.cond` inside a `scan`: XLA does not merge identical work
inside such a branch (BUILD_NOTES, "Scan vs top-level step").
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

import jax
import jax.numpy as jnp

from fedjax_ssl.core import rng


def steps_per_epoch(n: jax.Array, batch_size: int, drop_last: bool = True) -> jax.Array:
  """int32 number of batches in one epoch of a client with n examples (at least one)."""
  if drop_last:
    return jnp.maximum(n // batch_size, 1)
  return jnp.maximum((n + batch_size - 1) // batch_size, 1)


def epoch_permutations(ckey: jax.Array, n: jax.Array, n_max: int, local_epochs: int) -> jax.Array:
  """int32 [E, n_max]: for each epoch a random order whose first n entries permute range(n).

  Padding rows get sort key 2 (> any uniform draw), so they sort to the end and are never read.
  """
  def one(epoch):
    u = jax.random.uniform(rng.epoch_permutation_key(ckey, epoch), (n_max,))
    u = jnp.where(jnp.arange(n_max) < n, u, 2.0)
    return jnp.argsort(u).astype(jnp.int32)
  return jax.vmap(one)(jnp.arange(local_epochs))


def batch_positions(step: jax.Array, n: jax.Array, batch_size: int, drop_last: bool = True
                    ) -> jax.Array:
  """int32 [B] positions in the epoch's order read by local step `step`, before wrapping at n
  (positions >= n are the filler rows of a ragged last batch)."""
  spe = steps_per_epoch(n, batch_size, drop_last)
  return (step % spe) * batch_size + jnp.arange(batch_size)


def batch_indices(perms: jax.Array, step: jax.Array, n: jax.Array, batch_size: int,
                  drop_last: bool = True) -> jax.Array:
  """int32 [B] row indices of local step `step` (epoch = step // spe, batch = step % spe)."""
  spe = steps_per_epoch(n, batch_size, drop_last)
  epoch = jnp.minimum(step // spe, perms.shape[0] - 1)
  return perms[epoch, batch_positions(step, n, batch_size, drop_last) % n]


def train_client(local_step: Callable, client: Any, x: jax.Array, y: jax.Array, n: jax.Array,
                 ckey: jax.Array, msg: Any, lr: jax.Array, *, batch_size: int,
                 local_epochs: int, drop_last: bool = True) -> Tuple[Any, jax.Array]:
  """Runs one client's local training.

  Args:
    local_step: algorithm step, (client, batch, key, msg, lr) -> (client, loss scalar).
    client: the client's state pytree (no client axis).
    x: uint8 [n_max, H, W, C]; y: int32 [n_max]; n: int32 scalar true size.
    ckey: the client's round key.
    msg: server broadcast.
    lr: float32 scalar learning rate of this round.
    drop_last: False adds batch['mask'] and the ragged last batch (module docstring).
  Returns:
    (client state after training, mean loss over the real steps).
  """
  n_max = x.shape[0]
  num_steps = local_epochs * steps_per_epoch(n, batch_size, drop_last)
  perms = epoch_permutations(ckey, n, n_max, local_epochs)

  def step(carry):
    s, client, loss_sum = carry
    idx = batch_indices(perms, s, n, batch_size, drop_last)
    batch = {'x': x[idx], 'y': y[idx]}
    if not drop_last:
      batch['mask'] = batch_positions(s, n, batch_size, drop_last) < n
    client, loss = local_step(client, batch, rng.step_key(ckey, s), msg, lr)
    # The loss is a metric, kept in float32 whatever the state's dtype (float64 under x64).
    return s + 1, client, loss_sum + loss.astype(jnp.float32)

  init = (jnp.zeros((), jnp.int32), client, jnp.zeros((), jnp.float32))
  _, client, loss_sum = jax.lax.while_loop(lambda carry: carry[0] < num_steps, step, init)
  return client, loss_sum / num_steps
