"""The contract between an algorithm and the generic round step.

An algorithm is a handful of pure functions over ONE client's state (the engine maps them over the
stacked client axis) plus a server aggregation over the stacked uploads of the round's participants:

  init(key, num_clients)                 -> (clients [C, ...], server)
  broadcast(server)                      -> msg            (what every participant receives)
  begin(client, msg, key)                -> client         (adopt/mix global model, reset optimizer)
  local_step(client, batch, key, msg, lr)-> (client, loss) (one optimisation step; batch = dict(x=uint8
                                                             [B,H,W,C], y=int32 [B]))
  end(client_start, client, msg)         -> client         (post-training bookkeeping, e.g. divergence)
  upload(client, msg, local)             -> payload        (what the server receives; `local` is
                                                             the participant's LocalData, for
                                                             payloads computed from its own data,
                                                             e.g. per-class feature means)
  aggregate(server, payloads [m, ...], weights [m], ids [m]) -> server   (weights sum to 1; ids
                                                             are the participants' client ids)
  eval_variables(state)                  -> (variables, per_client: bool) for evaluating encoders

Optional hooks, for methods whose round has more structure (FedSC); an algorithm without them
computes exactly what it did before they existed:

  prepare(state, data, ids, key)         -> server  (once per round, before `broadcast`, inside the
                                                      jitted round, seeing the whole FedState: e.g.
                                                      uploads that every participant needs before
                                                      local training)
  personalize(msg, client_id)            -> msg     (a participant's own view of the broadcast,
                                                      e.g. the aggregate without its own matrix)
  host_metrics(state)                    -> dict    (host-side scalars logged after every round,
                                                      e.g. the privacy ledger's epsilon)
  uses_public: bool                                 (the engine adds the server's public set,
                                                      FedData.public_x, to the broadcast dict as
                                                      msg['public_x']: Hetero-SSFL's RAD)
  classifier_apply(variables, x)         -> logits  (supervised clients: the whole classifier in
                                                      inference mode, for test accuracy)
  prepare_upload_bytes(state, new_server) -> bytes  (what `prepare` received from clients this
                                                      round, for algorithms whose uploads happen
                                                      there: FedSC's matrices; float32 scalar)
  persist(client)                        -> stored  (stateless clients: the part of a client's
                                                      state that persists between rounds, the only
                                                      part kept in FedState.clients)
  restore(stored, msg)                   -> client  (a participant's whole state before `begin`,
                                                      the rest rebuilt from the broadcast)
  prepare_reads_clients: bool                       (`prepare` reads FedState.clients, e.g. the
                                                      initial models of every client at round 0;
                                                      such an algorithm needs client_state='device')

Stateless clients: without `persist`/`restore` a client's whole state is stored per client. An
algorithm whose `begin` overwrites most of it (FedAvg: the global model is adopted and the optimizer
reset) declares what survives a round; then `init` returns the stacked *stored* states, and the engine
runs `begin(restore(stored, msg))` and stores `persist(trained)`. The contract is
begin(restore(persist(c), msg), msg) == begin(c, msg) for every state c the algorithm produces, so a
stateless algorithm computes what its stateful twin does while memory holds the server and the round's
m participants only (plus what persists: e.g. nothing for supervised FedAvg, the Adam moments for
representation sharing's FL, the local target for FedBYOL).

Communication (core/comm.py) is measured from these pytrees: a participant sends its `upload`
payload and receives its (personalised) broadcast, less the public set, which is sent once.

Several architectures in one federation (Hetero-SSFL): an algorithm with `cohorts` holds one
stacked client pytree per architecture, `FedState.clients = (cohort_0 [C_0, ...], ...)`. Each
`Cohort` names its members (global client ids) and an Algorithm whose client-side functions (init
of its stack, begin, local_step, end, upload, encoder_apply) train them; the parent's server
functions (init's server, prepare, broadcast, aggregate) see every cohort. Its aggregate receives
per-cohort tuples:

  aggregate(server, payloads (per cohort [S_c, ...]), weights (per cohort [S_c]), slots) -> server

where `slots` is a tuple of `CohortSlots` (which clients filled the cohort's S_c = min(m, C_c)
static slots this round; slots a round does not fill have valid = False and weight 0). An algorithm
without cohorts is the one-cohort case: its clients and aggregate keep the plain form above.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Algorithm:
  name: str
  init: Callable[..., Any]
  broadcast: Callable[..., Any]
  begin: Callable[..., Any]
  local_step: Callable[..., Any]
  end: Callable[..., Any]
  upload: Callable[..., Any]
  aggregate: Callable[..., Any]
  eval_variables: Callable[..., Any]
  # The encoder module and how to apply it to evaluation images (float32, normalised):
  # encoder_apply(variables, x) -> [B, d] backbone features, in inference mode.
  encoder_apply: Callable[..., Any]
  # True when clients keep personal models that must be evaluated one by one.
  personalized: bool = False
  prepare: Optional[Callable[..., Any]] = None
  personalize: Optional[Callable[..., Any]] = None
  host_metrics: Optional[Callable[..., Dict[str, float]]] = None
  # True when local_step honours batch['mask'] (the ragged last batch of `drop_last=False`).
  ragged_batches: bool = False
  uses_public: bool = False
  cohorts: Tuple['Cohort', ...] = ()
  classifier_apply: Optional[Callable[..., Any]] = None
  prepare_upload_bytes: Optional[Callable[..., Any]] = None
  persist: Optional[Callable[..., Any]] = None
  restore: Optional[Callable[..., Any]] = None
  prepare_reads_clients: bool = False


def restore_client(algo: Algorithm, stored: Any, msg: Any) -> Any:
  """A participant's whole state before `begin` (the stored state itself without `restore`)."""
  return stored if algo.restore is None else algo.restore(stored, msg)


def persist_client(algo: Algorithm, client: Any) -> Any:
  """What of a trained client is stored until its next round (all of it without `persist`)."""
  return client if algo.persist is None else algo.persist(client)


class LocalData(NamedTuple):
  """A participant's own data as the engine holds it, passed to `upload`.

  Attributes:
    x: uint8 [n_max, H, W, C] images; rows >= n are padding.
    y: int32 [n_max] labels.
    n: int32 scalar, the number of real rows.
    key: the participant's upload key (rng.upload_key of its round key).
  """
  x: jax.Array
  y: jax.Array
  n: jax.Array
  key: jax.Array


@dataclasses.dataclass(frozen=True)
class Cohort:
  """One architecture's clients in a multi-cohort algorithm.

  Attributes:
    name: label used in logs and results (e.g. the encoder name).
    members: sorted global client ids of the cohort.
    client: the Algorithm whose client-side functions train this cohort; its `init(key, C_c)`
      gives the cohort's stacked initial states.
  """
  name: str
  members: Tuple[int, ...]
  client: Algorithm


class CohortSlots(NamedTuple):
  """A cohort's participants of one round, in S_c static slots.

  Attributes:
    local: int32 [S_c] index into the cohort's stack (C_c, out of range, in unfilled slots).
    ids: int32 [S_c] global client ids (undefined in unfilled slots).
    valid: bool [S_c] whether the slot holds a participant.
  """
  local: jax.Array
  ids: jax.Array
  valid: jax.Array


def weighted_mean(stacked: Any, weights: jax.Array) -> Any:
  """Weighted average over the leading axis of every leaf.

  Args:
    stacked: pytree with leaves [m, ...].
    weights: float [m], summing to 1 (float32; float64 under x64).
  Returns:
    pytree with leaves [...]; integer leaves keep their dtype (rounded average). Floating leaves are
    accumulated in the wider of their dtype and the weights' (a float64 state stays float64).

  The average is a contraction (`tensordot` of the weights with the leaf's leading axis), not a
  sum over axis 0 of the weighted leaf: XLA:CPU reduces a leading axis ~50x slower than it runs the
  same work as a GEMV (BUILD_NOTES, "Cross-device round": 197 ms vs 3.6 ms for 50 x 524k floats,
  which made the aggregation of a 50-participant round cost as much as 40 local steps).
  Precision HIGHEST keeps accelerators from rounding the operands to TF32/bf16.
  """
  def avg(leaf):
    acc = (jnp.promote_types(leaf.dtype, weights.dtype)
           if jnp.issubdtype(leaf.dtype, jnp.floating) else weights.dtype)
    out = jnp.tensordot(weights.astype(acc), leaf.astype(acc), axes=(0, 0),
                        precision=jax.lax.Precision.HIGHEST)
    return out.astype(leaf.dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else jnp.round(out).astype(leaf.dtype)
  return jax.tree_util.tree_map(avg, stacked)


def replicate(tree: Any, num_clients: int) -> Any:
  """Stack `num_clients` copies of every leaf along a new leading axis."""
  return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (num_clients,) + a.shape), tree)
