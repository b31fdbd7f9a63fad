"""Faults inside a round: which participants' uploads reach the server, and what the rest keep.

A participant is *absent* from a round's aggregate when

  * it **failed**: its upload (or its mean loss) is not finite, e.g. its local training diverged;
    its stored state is rolled back to the start of the round, so that it does not fail again from
    a non-finite state in every later round;
  * it **dropped out** (`RoundConfig.dropout_rate`): it trained, but its upload was lost on the way;
    its stored state advances (it trained), only the server never sees the upload.

The engine (core/round.py) gives an absent participant weight 0 and zeros its payload before
`aggregate`, and keeps the server state of `prepare` when nobody is present. Every registered
aggregate honours weight 0 as "not there" (core/algorithm.py), so the server state equals that of
the same round without the absent participants, up to the rounding of a longer reduction.

All functions are pure and traced inside the jitted round; shapes are per cohort, over its S
static slots (S = m for a plain algorithm).
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple

import jax
import jax.numpy as jnp

# The dropout draw uses a tag that no client id reaches (rng.py keeps 0xFFFFFFFF / 0xFFFFFFFE).
_DROPOUT_TAG = 0xFFFFFFFD


def _floating(a) -> bool:
  return jnp.issubdtype(a.dtype, jnp.floating)


def finite_rows(tree: Any, num: int) -> jax.Array:
  """bool [S]: whether every float entry of row s of every leaf [S, ...] is finite.

  The per-leaf counts of non-finite entries [L, S] are summed by a matrix product, not by a chain
  of L `and`s or a reduction (which XLA's simplifier turns into that chain): every leaf's select
  and zeroing in the round consumes this mask, and XLA copied the cheap elementwise chain into
  each consumer's fusion, L x 2L ops (ResNet-18 FedU2-BYOL, L = 224: 118k `and`s; the matrix
  product cut XLA:CPU's compile of that round, the results bit-identical;
  docs/notes/testing.md#test-17).
  The counts are exact integers in float32 below 2^24 entries a leaf row, and a sum of
  non-negative counts is 0 only if each is.
  """
  bad = [jnp.sum(~jnp.isfinite(leaf.reshape(num, -1)), axis=1, dtype=jnp.float32)
         for leaf in jax.tree_util.tree_leaves(tree) if _floating(leaf)]
  if not bad:
    return jnp.ones((num,), bool)
  return jnp.ones((len(bad),), jnp.float32) @ jnp.stack(bad) == 0


def select_rows(keep: jax.Array, new: Any, old: Any) -> Any:
  """Per leaf [S, ...]: row s of `new` where keep[s], else row s of `old`."""
  def one(a, b):
    return jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
  return jax.tree_util.tree_map(one, new, old)


def zero_rows(keep: jax.Array, tree: Any) -> Any:
  """Per float leaf [S, ...]: row s zeroed where not keep[s] (integer leaves unchanged)."""
  def one(a):
    if not _floating(a):
      return a
    return jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a, jnp.zeros((), a.dtype))
  return jax.tree_util.tree_map(one, tree)


def poison_rows(flag: jax.Array, tree: Any) -> Any:
  """Per float leaf [S, ...]: row s set to NaN where flag[s] (the injected fault)."""
  def one(a):
    if not _floating(a):
      return a
    return jnp.where(flag.reshape((-1,) + (1,) * (a.ndim - 1)), jnp.asarray(jnp.nan, a.dtype), a)
  return jax.tree_util.tree_map(one, tree)


def injected(faults: Sequence[Tuple[int, int]], round_idx: jax.Array, ids: jax.Array
             ) -> jax.Array:
  """bool [S]: which slots' clients are told to fail in this round.

  Args:
    faults: static (round, client id) pairs, rounds counted from 0 (`config.inject_client_faults`).
    round_idx: int32 scalar, the round being run (FedState.round).
    ids: int32 [S] the slots' global client ids.
  """
  if not faults:
    return jnp.zeros(ids.shape, bool)
  rounds = jnp.asarray([r for r, _ in faults], jnp.int32)
  clients = jnp.asarray([c for _, c in faults], jnp.int32)
  hit = (rounds[None, :] == round_idx) & (clients[None, :] == ids[:, None])
  return jnp.any(hit, axis=1)


def dropped(rkey: jax.Array, ids: jax.Array, rate: float) -> jax.Array:
  """bool [S]: which slots lose their upload, each independently with probability `rate`.

  A client's draw depends only on the round key and its id, so it does not change with the other
  participants, the strategy or the cohort grouping (as every key of rng.py).
  """
  if rate <= 0:
    return jnp.zeros(ids.shape, bool)
  key = jax.random.fold_in(rkey, _DROPOUT_TAG)
  u = jax.vmap(lambda c: jax.random.uniform(jax.random.fold_in(key, c)))(ids)
  return u < rate


def parse(spec: str) -> Tuple[Tuple[int, int], ...]:
  """`config.inject_client_faults` ('ROUND:CLIENT,ROUND:CLIENT', rounds from 1 as logged) as
  sorted (round index from 0, client id) pairs; '' is none.

  Raises ValueError naming the bad entry.
  """
  out = []
  for part in (p.strip() for p in spec.split(',')):
    if not part:
      continue
    try:
      r, c = (int(v) for v in part.split(':'))
    except ValueError:
      raise ValueError(f'config.inject_client_faults entry {part!r} is invalid: write ROUND:CLIENT '
                       "pairs separated by commas, e.g. '2:0,3:5' (round 2 client 0, round 3 "
                       'client 5; rounds from 1)') from None
    if r < 1 or c < 0:
      raise ValueError(f'config.inject_client_faults entry {part!r} is invalid: the round must be '
                       '>= 1 and the client id >= 0')
    out.append((r - 1, c))
  return tuple(sorted(set(out)))
