"""Local training of ONE client as a `lax.while_loop` over its real steps.

A client with n examples runs E * steps_per_epoch(n) real steps, steps_per_epoch(n) = max(n // B, 1)
(drop_last, as the EasyFL / FedU2 codes do; a client with fewer than B examples makes one step per epoch
over a wrapped-around batch). With drop_last=False (the FedSC code's DataLoader) an epoch has
ceil(n / B) steps; the last batch is filled by wrapping around and carries batch['mask'] (bool [B],
False on the filler rows) so the loss can use the real batch size. E local epochs always mean E passes
over that client's own data. Batches are read through a fresh permutation of the client's valid rows
every epoch; padding rows are never read.

The loop runs the client's own step count, so clients run one at a time (strategy 'map' with chunk 1)
cost their real steps only. Under `vmap` a plain batched while-loop would run every participant
until the longest one is done (masked no-op steps for the others). `train_client` has its own
batching rule instead (`jax.custom_batching.custom_vmap`, `_lanes_rule`): the participants are
sorted by step count and trained in phases of shrinking static width (`lane_widths`); a phase runs
until so few clients are left that the next, narrower phase holds them all. The batched step is
the same step, so the numbers are those of the unbatched loop. A model with conv_impl='packed'
has the batched step evaluated in the client-packed layout (core/packing.py). The step is not wrapped in a
`lax.cond` inside a `scan`: XLA does not merge identical work inside such a branch (docs/notes/
performance.md#scan-vs-step).

Rows are read from the federation's flat arrays (`FedData`): client rows offset .. offset + n - 1.
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from fedjax_ssl.core import packing, rng


def steps_per_epoch(n: jax.Array, batch_size: int, drop_last: bool = True) -> jax.Array:
  """int32 number of batches in one epoch of a client with n examples (at least one)."""
  if drop_last:
    return jnp.maximum(n // batch_size, 1)
  return jnp.maximum((n + batch_size - 1) // batch_size, 1)


def _static_steps(n: int, batch_size: int, drop_last: bool) -> int:
  """`steps_per_epoch` of a Python int, at trace time (jnp would stage it)."""
  return max(n // batch_size if drop_last else -(-n // batch_size), 1)


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


def lane_widths(num_lanes: int, shrink: float) -> Tuple[int, ...]:
  """Decreasing static widths of the phases of a batched local training, ending at 1.

  Each width is the previous one divided by `shrink` (rounded up), so a phase's lanes are never more
  than `shrink` times the clients still training in it. shrink = 0 gives one phase of all lanes
  (every participant runs as many steps as the longest one).
  """
  if shrink == 0:
    return (num_lanes,)
  if shrink <= 1:
    raise ValueError(f'vmap_shrink = {shrink} is invalid: must be 0 (no shrinking) or > 1')
  widths = [num_lanes]
  while widths[-1] > 1:
    widths.append(min(widths[-1] - 1, -(-widths[-1] // shrink)))
  return tuple(int(w) for w in widths)


class _TracedOnce:
  """Calls a function through the jaxpr of its first trace at the same argument types.

  `custom_vmap` traces `train_client`'s unbatched loop before its batching rule traces the batched
  one, so under `vmap` the algorithm's step was traced in Python twice (Flax modules, autodiff) and
  the first trace thrown away: about half of a ResNet-18 round's trace time, which a compilation
  cache hit still pays (docs/notes/performance.md#perf-51). The rule's batched step instead
  batches the jaxpr of the unbatched trace (the same primitives, so the same program).
  """

  def __init__(self):
    self._jaxprs = {}

  def __call__(self, fn: Callable, *args):
    flat, tree = jax.tree_util.tree_flatten(args)
    key = (fn, tree, tuple(jax.typeof(a) for a in flat))
    if key not in self._jaxprs:
      closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
      self._jaxprs[key] = (closed, jax.tree_util.tree_structure(shape))
    closed, out_tree = self._jaxprs[key]
    return jax.tree_util.tree_unflatten(out_tree, jax_core.jaxpr_as_fun(closed)(*flat))

  def packed(self) -> bool:
    """Whether a traced step has a client-packed convolution (core/packing.py)."""
    return any(packing.has_call(closed, packing.PACKED_CONV)
               or packing.has_call(closed, packing.MEASURED_CONV)
               for closed, _ in self._jaxprs.values())


def train_client(local_step: Callable, client: Any, x: jax.Array, y: jax.Array, offset: jax.Array,
                 n: jax.Array, ckey: jax.Array, msg: Any, lr: jax.Array, *, n_max: int,
                 batch_size: int, local_epochs: int, drop_last: bool = True,
                 shrink: float = 2.0, n_min: int = 0) -> Tuple[Any, jax.Array]:
  """Runs one client's local training.

  Args:
    local_step: algorithm step, (client, batch, key, msg, lr) -> (client, loss scalar).
    client: the client's state pytree (no client axis).
    x: uint8 [R, H, W, C]; y: int32 [R]: the federation's flat rows (`FedData.x`, `FedData.y`).
    offset: int32 scalar, the client's first row; n: int32 scalar, its number of rows.
    ckey: the client's round key.
    msg: server broadcast.
    lr: float32 scalar learning rate of this round.
    n_max: static length of the epoch permutations (`FedData.n_max`).
    drop_last: False adds batch['mask'] and the ragged last batch (module docstring).
    shrink: under vmap, the phase-width ratio of `lane_widths` (0: no phases).
    n_min: static lower bound of every client's n (`FedData.n_min`; 0: unknown). When it gives as
      many steps as n_max, every participant runs the same steps and a vmapped round trains them in
      one phase: the narrower phases would never run, yet each is one more copy of the step to
      compile (ResNet-18 under vmap compiled several times longer than under map with the 5
      phases of 10 participants, docs/notes/performance.md#perf-46).
  Returns:
    (client state after training, mean loss over the real steps). Under vmap every output is
    batched.
  """
  def num_steps_of(n):
    return local_epochs * steps_per_epoch(n, batch_size, drop_last)

  traced_once = _TracedOnce()

  def step(carry, x, y, offset, n, ckey, perms, msg, lr):
    """One real step of one client: carry (s, client, loss_sum) -> the same."""
    s, client, loss_sum = carry
    idx = offset + batch_indices(perms, s, n, batch_size, drop_last)
    batch = {'x': x[idx], 'y': y[idx]}
    if not drop_last:
      batch['mask'] = batch_positions(s, n, batch_size, drop_last) < n
    client, loss = traced_once(local_step, client, batch, rng.step_key(ckey, s), msg, lr)
    # The loss is a metric, kept in float32 whatever the state's dtype (float64 under x64).
    return s + 1, client, loss_sum + loss.astype(jnp.float32)

  @jax.custom_batching.custom_vmap
  def run(client, x, y, offset, n, ckey, msg, lr):
    perms = epoch_permutations(ckey, n, n_max, local_epochs)
    init = (jnp.zeros((), jnp.int32), client, jnp.zeros((), jnp.float32))
    body = lambda carry: step(carry, x, y, offset, n, ckey, perms, msg, lr)
    _, client, loss_sum = jax.lax.while_loop(lambda c: c[0] < num_steps_of(n), body, init)
    return client, loss_sum / num_steps_of(n)

  @run.def_vmap
  def _lanes_rule(axis_size, in_batched, client, x, y, offset, n, ckey, msg, lr):
    """Batched training of `axis_size` clients in phases of shrinking width (module docstring)."""
    def own(tree, batched):  # every lane's own copy of a per-client argument
      return jax.tree_util.tree_map(
          lambda a, b: a if b else jnp.broadcast_to(a, (axis_size,) + jnp.shape(a)), tree, batched)

    def rows(tree, batched, idx):  # lanes idx of the batched leaves; unbatched leaves are shared
      return jax.tree_util.tree_map(lambda a, b: a[idx] if b else a, tree, batched)

    client, offset, n, ckey = (own(t, b) for t, b in zip(
        (client, offset, n, ckey), (in_batched[0],) + tuple(in_batched[3:6])))
    steps = num_steps_of(n)
    order = jnp.argsort(-steps)  # the clients still training always form a prefix of the lanes
    perms = jax.vmap(lambda k, c: epoch_permutations(k, c, n_max, local_epochs))(ckey, n)
    every = lambda tree: jax.tree_util.tree_map(lambda _: True, tree)
    per_lane = (offset, n, ckey, perms)
    per_lane = rows(per_lane, every(per_lane), order)
    other = (x, y, msg, lr)
    other_batched = (in_batched[1], in_batched[2], in_batched[6], in_batched[7])
    other = rows(other, other_batched, order)
    other_axes = jax.tree_util.tree_map(lambda b: 0 if b else None, other_batched)
    sorted_steps = steps[order]
    full = (jnp.zeros((axis_size,), jnp.int32), rows(client, every(client), order),
            jnp.zeros((axis_size,), jnp.float32))

    def lane_step(carry, lane, shared):
      x, y, msg, lr = shared
      return step(carry, x, y, *lane, msg, lr)

    uniform = n_min > 0 and _static_steps(n_min, batch_size, drop_last) == _static_steps(
        n_max, batch_size, drop_last)
    widths = lane_widths(axis_size, 0 if uniform else shrink)
    for width, next_width in zip(widths, widths[1:] + (0,)):
      head = slice(0, width)
      lane, shared = rows(per_lane, every(per_lane), head), rows(other, other_batched, head)
      todo = sorted_steps[head]

      def body(carry, lane=lane, shared=shared, todo=todo):
        # The client-packed layout for conv_impl='packed' / 'measured' (packing.py), else jax.vmap
        # (decided on the step's unbatched trace, so the default path traces nothing more).
        vmap = packing.vmap if traced_once.packed() else jax.vmap
        new = vmap(lane_step, in_axes=(0, 0, other_axes))(carry, lane, shared)
        live = carry[0] < todo  # a finished client keeps its state bit for bit
        return jax.tree_util.tree_map(
            lambda a, b: jnp.where(live.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, carry)

      def more(carry, todo=todo, next_width=next_width):
        return jnp.sum(carry[0] < todo) > next_width

      done = jax.lax.while_loop(more, body, rows(full, every(full), head))
      full = jax.tree_util.tree_map(lambda f, d: f.at[head].set(d), full, done)
    _, client, loss_sum = rows(full, every(full), jnp.argsort(order))
    out = (client, loss_sum / steps)
    return out, every(out)

  return run(client, x, y, offset, n, ckey, msg, lr)
