"""Communication accounting, measured from the pytrees an algorithm actually exchanges.

A participant sends its `upload` payload and receives the round's broadcast (its `personalize`d view
when the algorithm has one). The public set an algorithm may receive (`uses_public`, msg['public_x'])
is sent once before training, not every round, so it is left out. Uploads that happen inside
`prepare` (FedSC's correlation matrices) are reported by the algorithm's `Prepare.upload_bytes`.

Sizes are static (shapes x dtype item sizes), so the per-participant figures are exact Python ints
(`message_bytes`); a round's totals scale them by the round's participants and are logged as the
float32 metrics 'bytes_up' and 'bytes_down' (exact up to float32 rounding, 6e-8 relative).
"""
from __future__ import annotations

from typing import Any, Dict, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PUBLIC_KEY = 'public_x'


def tree_bytes(tree: Any) -> int:
  """Total bytes of a pytree's leaves (arrays or ShapeDtypeStructs): sum of size x itemsize."""
  return int(sum(int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
                 for leaf in jax.tree_util.tree_leaves(tree)))


def downlink_message(algo, msg: Any, client_id=0) -> Any:
  """What one participant receives: its personalised broadcast without the public set."""
  if algo.personalize is not None:
    msg = jax.eval_shape(algo.personalize, msg, jnp.int32(client_id))
  if isinstance(msg, dict) and PUBLIC_KEY in msg:
    msg = {k: v for k, v in msg.items() if k != PUBLIC_KEY}
  return msg


class MessageBytes(NamedTuple):
  """Per-participant bytes of one cohort (a plain algorithm has one).

  Attributes:
    up: bytes of one participant's upload payload.
    down: bytes of one participant's downlink message.
  """
  up: int
  down: int


def per_slot_bytes(stacked_payloads: Any) -> int:
  """Bytes of one participant's payload, from the payloads stacked over S slots [S, ...]."""
  leaves = jax.tree_util.tree_leaves(stacked_payloads)
  if not leaves:
    return 0
  return tree_bytes(stacked_payloads) // int(leaves[0].shape[0])


def round_metrics(algo, msg: Any, payloads, participants, state, server_after
                  ) -> Dict[str, jax.Array]:
  """{'bytes_up', 'bytes_down'} float32 totals of one round (traced, inside the round step).

  Args:
    algo: the Algorithm.
    msg: the round's broadcast (before personalisation).
    payloads: per cohort, the uploads stacked over that cohort's slots.
    participants: per cohort, the number of real participants (int scalar, may be traced).
    state: the round's incoming FedState; server_after: the server state after `prepare` (both
      for `algo.prepare.upload_bytes`).
  """
  down = tree_bytes(downlink_message(algo, msg))
  up = sum(jnp.asarray(k, jnp.float32) * per_slot_bytes(p) for p, k in zip(payloads, participants))
  total = sum(jnp.asarray(k, jnp.float32) for k in participants)
  if algo.prepare is not None and algo.prepare.upload_bytes is not None:
    up = up + algo.prepare.upload_bytes(state, server_after)
  return {'bytes_up': jnp.asarray(up, jnp.float32), 'bytes_down': total * float(down)}
