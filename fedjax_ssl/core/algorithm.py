"""The contract between an algorithm and the generic round step (the engine's only view of a method).

An algorithm is a handful of pure functions over ONE client's state (the engine maps them over the
stacked client axis) plus a server aggregation over the stacked uploads of the round's participants.
Every method provides:

  init(key, num_clients)                 -> (clients [C, ...], server)
  broadcast(server)                      -> msg            (what every participant receives)
  begin(client, msg, key)                -> client         (adopt/mix global model, reset optimizer)
  local_step(client, batch, key, msg, lr)-> (client, loss) (one optimisation step; batch = dict(x=uint8
                                                             [B,H,W,C], y=int32 [B]))
  upload(client, msg, local)             -> payload        (what the server receives; `local` is
                                                             the participant's LocalData, for
                                                             payloads computed from its own data,
                                                             e.g. per-class feature means)
  aggregate(server, payloads [m, ...], weights [m], ids [m]) -> server   (weights sum to 1; ids
                                                             are the participants' client ids;
                                                             weight 0 marks an absent one, below)
  eval_variables(state)                  -> (variables, per_client: bool) for evaluating encoders
  encoder_apply(variables, x)            -> [B, d]         (backbone features in inference mode)

and may override `end(client_start, client, msg) -> client` (post-training bookkeeping, e.g. FedU's
divergence; the default keeps the trained client). The optional hooks are grouped by what they
serve; an algorithm without them computes exactly what it did before they existed:

* `Prepare` (`prepare=`): a step once per round, before `broadcast`, inside the jitted round and
  seeing the whole FedState (FedSC's DP-CalR uploads, representation sharing's round-0 prototypes):
    fn(state, data, ids, key)             -> server
    upload_bytes(state, server_after)     -> bytes   (what clients sent inside `fn`, float32 scalar)
    reads_clients: bool                              (`fn` reads FedState.clients: such an algorithm
                                                      needs client_state='device')
    reads_data: bool                                 (`fn` reads the data of clients other than the
                                                      round's participants: such an algorithm
                                                      needs placement='replicated')
    summarize(server, stacks, data, ids, key) -> rows  (optional, with `absorb`: at round 0, or
    absorb(server, rows)                  -> server     at the rounds `summarize_when(round)` says,
    summarize_when(round)                 -> bool       before `fn`, the server takes in one row
                                                      per client of each cohort's stack given
                                                      (ids: int32 [n_c] per cohort, the rows'
                                                      client ids; data holds their rows; key the
                                                      round key), row i from the server and
                                                      client ids[i]'s state and data alone
                                                      (Hetero-SSFL's initial representations,
                                                      representation sharing's and FD's initial
                                                      prototypes, FedSC's first share round).
                                                      Rows are computed where the states are: per block
                                                      and gathered under placement 'divided', row
                                                      by row for host-resident states, so neither
                                                      needs every client on a device)
    summarize_reads_data: bool                       (`summarize` reads the clients' own rows,
                                                      not only the public set: with cohorts,
                                                      whose blocks are cut by member rank and the
                                                      rows by id, 'divided' refuses it)
* `Stateless` (`stateless=`): the part of a client's state that survives a round, the only part
  kept in FedState.clients:
    persist(client)                       -> stored
    restore(stored, msg)                  -> client  (the whole state before `begin`, the rest
                                                      rebuilt from the broadcast)
  The contract is begin(restore(persist(c), msg), msg) == begin(c, msg) for every state c the
  algorithm produces, so a stateless algorithm computes what its stateful twin does while memory
  holds the server and the round's m participants only.
* `cohorts`: several architectures in one federation (Hetero-SSFL), below.
* `GlobalModel` (`global_model=`): where the server keeps the global trainable parameters, for a
  server optimizer (core/server_opt.py) that steps them along the pseudo-gradient
  `get(server before aggregate) - get(server after aggregate)`:
    get(server)                           -> params  (a pytree of float arrays)
    set(server, params)                   -> server
  None for algorithms without a global model (personalised ones).
* `update_reference(server) -> payload` (one participant's upload form, no leading axis): the
  global model a participant's update is measured from, u_k - update_reference(server), for
  user-level DP-FedAvg (ops/dp_fedavg.py); set only where `aggregate` is a weighted mean of every
  upload, so that aggregating the DP release as one upload of weight 1 sets the model to it.
* Per-participant and evaluation extras: `personalize(msg, client_id) -> msg` (a participant's own
  view of the broadcast, e.g. the aggregate without its own matrix), `host_metrics(state) -> dict`
  (host-side scalars logged after every round, e.g. the privacy ledger's epsilon),
  `classifier_apply(variables, x) -> logits` (supervised clients, for test accuracy), `personalized`
  (clients keep personal models, evaluated one by one), `ragged_batches` (local_step honours
  batch['mask'], for drop_last=False), `uses_public` (the engine adds FedData.public_x to the
  broadcast as msg['public_x']: Hetero-SSFL's RAD).

A participant whose upload failed (not finite) or was lost (a dropout) is *absent* (core/faults.py):
the engine gives it weight 0 and zeros its payload, and `aggregate` must then return what it would
return had that participant not taken part (a weighted mean does so by itself; a uniform mean, a
scatter into per-client server buffers, a clustering or a min-norm solve use `present`,
`uniform_weights` and `present_ids` below). When nobody is present the engine keeps the server of
`prepare` and does not call on the result of `aggregate`.

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


def keep_trained(client_start: Any, client: Any, msg: Any) -> Any:
  """The default `end`: the trained client as it is."""
  del client_start, msg
  return client


@dataclasses.dataclass(frozen=True)
class Prepare:
  """A step of the server once per round, before `broadcast` (see the module docstring)."""
  fn: Callable[..., Any]
  upload_bytes: Optional[Callable[..., Any]] = None
  reads_clients: bool = False
  reads_data: bool = False
  summarize: Optional[Callable[..., Any]] = None
  absorb: Optional[Callable[..., Any]] = None
  summarize_reads_data: bool = False
  summarize_when: Optional[Callable[..., Any]] = None


@dataclasses.dataclass(frozen=True)
class Stateless:
  """What of a client survives a round (`persist`) and how the rest is rebuilt (`restore`)."""
  persist: Callable[[Any], Any]
  restore: Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class GlobalModel:
  """Where an algorithm's server keeps its global trainable parameters (module docstring)."""
  get: Callable[[Any], Any]
  set: Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """A federated method as pure functions (module docstring); `name` labels logs and errors."""
  name: str
  init: Callable[..., Any]
  broadcast: Callable[..., Any]
  begin: Callable[..., Any]
  local_step: Callable[..., Any]
  upload: Callable[..., Any]
  aggregate: Callable[..., Any]
  eval_variables: Callable[..., Any]
  encoder_apply: Callable[..., Any]
  end: Callable[..., Any] = keep_trained
  # Optional hooks, grouped by what they serve.
  prepare: Optional[Prepare] = None
  stateless: Optional[Stateless] = None
  cohorts: Tuple['Cohort', ...] = ()
  global_model: Optional[GlobalModel] = None
  personalize: Optional[Callable[..., Any]] = None
  host_metrics: Optional[Callable[..., Dict[str, float]]] = None
  classifier_apply: Optional[Callable[..., Any]] = None
  personalized: bool = False
  ragged_batches: bool = False
  uses_public: bool = False
  update_reference: Optional[Callable[..., Any]] = None


def restore_client(algo: Algorithm, stored: Any, msg: Any) -> Any:
  """A participant's whole state before `begin` (the stored state itself when not stateless)."""
  return stored if algo.stateless is None else algo.stateless.restore(stored, msg)


def persist_client(algo: Algorithm, client: Any) -> Any:
  """What of a trained client is stored until its next round (all of it when not stateless)."""
  return client if algo.stateless is None else algo.stateless.persist(client)


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
  sum over axis 0 of the weighted leaf: XLA:CPU reduces a leading axis far slower than it runs the
  same work as a GEMV, which made the aggregation of a 50-participant round cost as much as many
  local steps (docs/notes/performance.md#perf-22).
  Precision HIGHEST keeps accelerators from rounding the operands to TF32/bf16.
  """
  def avg(leaf):
    acc = (jnp.promote_types(leaf.dtype, weights.dtype)
           if jnp.issubdtype(leaf.dtype, jnp.floating) else weights.dtype)
    out = jnp.tensordot(weights.astype(acc), leaf.astype(acc), axes=(0, 0),
                        precision=jax.lax.Precision.HIGHEST)
    return out.astype(leaf.dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else jnp.round(out).astype(leaf.dtype)
  return jax.tree_util.tree_map(avg, stacked)


def present(weights: jax.Array) -> jax.Array:
  """bool [m]: the participants present in the aggregate (weight > 0; absent ones weigh 0)."""
  return weights > 0


def uniform_weights(weights: jax.Array) -> jax.Array:
  """[m] 1/m' over the m' present participants, 0 for the absent (all 0 when none is present)."""
  p = present(weights).astype(weights.dtype)
  total = jnp.sum(p)
  return p / jnp.where(total > 0, total, 1)


def present_ids(ids: jax.Array, weights: jax.Array, size: int) -> jax.Array:
  """int32 [m]: `ids` with absent participants sent past the end (`size`), so that a scatter
  `buffer.at[present_ids(...)].set(rows, mode='drop')` leaves their rows of the buffer as they were."""
  return jnp.where(present(weights), ids, size).astype(jnp.int32)


def replicate(tree: Any, num_clients: int) -> Any:
  """Stack `num_clients` copies of every leaf along a new leading axis."""
  return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (num_clients,) + a.shape), tree)
