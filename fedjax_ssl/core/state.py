"""The federated training state: one stacked pytree of client states plus the server state."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class FedState:
  """Everything a run carries from one round to the next.

  Attributes:
    clients: pytree whose every leaf has a leading client axis [C, ...] (params, batch stats,
      optimizer state, EMA targets, method-specific extras). One cohort: all clients share one
      architecture.
    server: pytree kept centrally (global params, statistics, ...); no client axis.
    round: int32 scalar, number of completed rounds.
  """
  clients: Any
  server: Any
  round: jax.Array
