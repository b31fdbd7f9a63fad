"""The generic round step: sample participants, broadcast, train locally, upload, aggregate, scatter.

`make_round_step` returns ONE jitted pure function `round_step(state, fed_data, key)` with the state
donated. Two slower baselines give the same numbers, for the benchmark:
  * `make_stepwise_round_step` runs clients the way FedJAX's `for_each_client` (jit backend) and the
    official PyTorch codes do: a Python loop over participants and, inside, over local steps, with
    each batch gathered on the host and one jitted step call per batch;
  * `make_sequential_round_step` is the strongest per-client loop: one jitted call per participant
    that runs that client's whole local training as a scan.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl.algorithms.base import (Algorithm, Cohort, CohortSlots, LocalData, persist_client,
                                        restore_client)
from fedjax_ssl.core import comm, local, rng, strategies
from fedjax_ssl.core.state import FedState
from fedjax_ssl.data.types import FedData


@dataclasses.dataclass(frozen=True)
class RoundConfig:
  """Static settings of a round.

  Attributes:
    clients_per_round: m, participants per round (m == C means full participation).
    local_epochs: E, passes over each participant's own data.
    batch_size: B.
    lr_fn: round index (int32 scalar) -> learning rate (float32 scalar).
    strategy: 'vmap' | 'map' | 'shard' | 'auto' (see strategies.py).
    map_chunk_size: clients per chunk for 'map'.
    drop_last: False keeps each epoch's ragged last batch (core/local.py); only for algorithms
      with `ragged_batches`.
  """
  clients_per_round: int
  local_epochs: int
  batch_size: int
  lr_fn: Callable[[jax.Array], jax.Array]
  strategy: str = 'auto'
  map_chunk_size: int = 1
  drop_last: bool = True


def init_state(algo: Algorithm, key: jax.Array, num_clients: int) -> FedState:
  """Initial state: stacked client states and the server state, round 0."""
  clients, server = algo.init(key, num_clients)
  # One buffer per leaf: the round step donates the state, and XLA refuses a buffer donated twice
  # (an init that reuses one zeros array for two leaves would otherwise fail on the first round).
  state = FedState(clients=clients, server=server, round=jnp.zeros((), jnp.int32))
  return jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), state)


def sample_participants(rkey: jax.Array, num_clients: int, m: int) -> jax.Array:
  """int32 [m] sorted ids, uniformly without replacement (all clients when m == C)."""
  if m == num_clients:
    return jnp.arange(num_clients, dtype=jnp.int32)
  ids = jax.random.choice(rng.sampling_key(rkey), num_clients, (m,), replace=False)
  return jnp.sort(ids).astype(jnp.int32)


def client_round_fn(algo: Algorithm, cfg: RoundConfig, client_algo: Algorithm | None = None
                    ) -> Callable:
  """One participant's whole round: begin -> local training -> end -> upload.

  `client_algo` (default `algo`) supplies the client-side functions: a cohort's own Algorithm in a
  multi-cohort run, where `algo` (the parent) supplies the server-side `personalize`.
  Returns fn(stored, x, y, n, ckey, cid, msg, lr) -> (stored, payload, mean loss), where `stored`
  is the part of the client's state kept between rounds (the whole state unless the algorithm
  declares `persist`/`restore`).
  """
  ca = client_algo or algo

  def fn(stored, x, y, n, ckey, cid, msg, lr):
    if algo.personalize is not None:
      msg = algo.personalize(msg, cid)
    start = ca.begin(restore_client(ca, stored, msg), msg, rng.begin_key(ckey))
    trained, loss = local.train_client(ca.local_step, start, x, y, n, ckey, msg, lr,
                                       batch_size=cfg.batch_size, local_epochs=cfg.local_epochs,
                                       drop_last=cfg.drop_last)
    trained = ca.end(start, trained, msg)
    payload = ca.upload(trained, msg, LocalData(x, y, n, rng.upload_key(ckey)))
    return persist_client(ca, trained), payload, loss
  return fn


def cohorts(algo: Algorithm, num_clients: int) -> Tuple[Cohort, ...]:
  """The algorithm's cohorts; a plain algorithm is one cohort holding every client."""
  if algo.cohorts:
    return algo.cohorts
  return (Cohort(algo.name, tuple(range(num_clients)), algo),)


def cohort_stacks(algo: Algorithm, clients) -> Tuple:
  """`FedState.clients` as a tuple of per-cohort stacks (a 1-tuple for a plain algorithm)."""
  return tuple(clients) if algo.cohorts else (clients,)


def cohort_slots(ids: jax.Array, cohort: Cohort, num_clients: int, m: int) -> CohortSlots:
  """The round's participants that belong to `cohort`, in min(m, C_c) static slots.

  Args:
    ids: int32 [m] sorted participant ids of the round.
  Returns:
    CohortSlots; the filled slots come first, in increasing client id.
  """
  members = np.asarray(cohort.members, np.int64)
  if len(members) == num_clients:  # every client: the slots are the participants themselves
    return CohortSlots(ids, ids, jnp.ones(ids.shape, bool))
  size = min(m, len(members))
  local_of = np.full(num_clients, -1, np.int32)
  local_of[members] = np.arange(len(members), dtype=np.int32)
  loc = jnp.asarray(local_of)[ids]
  pos = jnp.nonzero(loc >= 0, size=size, fill_value=0)[0]
  valid = jnp.arange(size) < jnp.sum(loc >= 0)
  # Unfilled slots point past the stack: their gather is clamped (a real client, trained and then
  # discarded) and their scatter dropped, so they can never overwrite a participant's state.
  return CohortSlots(jnp.where(valid, loc[pos], len(members)).astype(jnp.int32), ids[pos], valid)


def _prepare(algo: Algorithm, state: FedState, data: FedData, ids, key):
  """The server state after the algorithm's `prepare` hook (unchanged without one)."""
  if algo.prepare is None:
    return state.server
  return algo.prepare(state, data, ids, key)


def _broadcast(algo: Algorithm, server, data: FedData):
  """The round's message: `broadcast(server)`, plus the public set for `uses_public` algorithms."""
  msg = algo.broadcast(server)
  if algo.uses_public:
    if data.public_x is None:
      raise ValueError(f'algorithm {algo.name!r} needs the public set FedData.public_x; build the '
                       'federated data with public_size > 0')
    msg = dict(msg, public_x=data.public_x)
  return msg


def _finish_round(algo: Algorithm, state: FedState, server, ids, n_sel, new_sel, payloads, losses,
                  lr, msg):
  # float32 normally; float64 when x64 is enabled, so a float64 state is averaged in float64.
  fdtype = jax.dtypes.canonicalize_dtype(jnp.float64)
  weights = n_sel.astype(fdtype) / jnp.sum(n_sel).astype(fdtype)
  prepared = server
  server = algo.aggregate(server, payloads, weights, ids)
  clients = jax.tree_util.tree_map(lambda a, b: a.at[ids].set(b), state.clients, new_sel)
  metrics = {'loss': jnp.mean(losses), 'lr': lr,
             **comm.round_metrics(algo, msg, (payloads,), (ids.shape[0],), state, prepared)}
  return FedState(clients=clients, server=server, round=state.round + 1), metrics


def _finish_cohort_round(algo: Algorithm, state: FedState, server, slots, n_sel, new_sel,
                         payloads, losses, lr, m: int, msg):
  """Aggregate and scatter of a multi-cohort round (per-cohort tuples; unfilled slots weigh 0)."""
  fdtype = jax.dtypes.canonicalize_dtype(jnp.float64)
  prepared = server
  counts = tuple(jnp.where(s.valid, n, 0).astype(fdtype) for s, n in zip(slots, n_sel))
  total = sum(jnp.sum(c) for c in counts)
  server = algo.aggregate(server, payloads, tuple(c / total for c in counts), slots)
  clients = tuple(
      jax.tree_util.tree_map(lambda a, b, s=s: a.at[s.local].set(b, mode='drop'), stack, new)
      for stack, new, s in zip(state.clients, new_sel, slots))
  loss = sum(jnp.sum(jnp.where(s.valid, l, 0.0)) for s, l in zip(slots, losses)) / m
  metrics = {'loss': loss, 'lr': lr,
             **comm.round_metrics(algo, msg, payloads, tuple(jnp.sum(s.valid) for s in slots), state,
                                 prepared)}
  return FedState(clients=clients, server=server, round=state.round + 1), metrics


def validate(cfg: RoundConfig, num_clients: int, algo: Algorithm | None = None) -> None:
  """Raises a ValueError naming the bad setting, before anything is compiled."""
  if algo is not None and not cfg.drop_last and not all(
      c.client.ragged_batches for c in cohorts(algo, num_clients)):
    raise ValueError(f'drop_last = False is invalid for algorithm {algo.name!r}: its local step '
                     "ignores batch['mask'], so the ragged last batch would train on filler rows")
  if not 1 <= cfg.clients_per_round <= num_clients:
    raise ValueError(f'clients_per_round = {cfg.clients_per_round} is invalid: must be in '
                     f'[1, num_clients={num_clients}]')
  if cfg.local_epochs < 1:
    raise ValueError(f'local_epochs = {cfg.local_epochs} is invalid: must be >= 1')
  if cfg.batch_size < 1:
    raise ValueError(f'batch_size = {cfg.batch_size} is invalid: must be >= 1')
  strategy = strategies.resolve_strategy(cfg.strategy)
  if algo is not None and algo.cohorts:
    members = sorted(i for c in algo.cohorts for i in c.members)
    if members != list(range(num_clients)):
      raise ValueError(f'the cohorts of algorithm {algo.name!r} hold clients {members}: they must '
                       f'hold each of the {num_clients} clients exactly once')
    for c in algo.cohorts:
      strategies.check_participants(strategy, min(cfg.clients_per_round, len(c.members)),
                                    cfg.map_chunk_size)
  else:
    strategies.check_participants(strategy, cfg.clients_per_round, cfg.map_chunk_size)


def make_round_step(algo: Algorithm, cfg: RoundConfig, num_clients: int, *, donate: bool = True
                    ) -> Callable[[FedState, FedData, jax.Array], Tuple[FedState, Dict[str, jax.Array]]]:
  """Builds the jitted `round_step(state, fed_data, round_key) -> (state, metrics)`.

  `round_key` should be `rng.round_key(root_key, round_idx)`; everything random in the round derives
  from it. The incoming state's buffers are donated (no second copy of the stacked client state).

  Participants are sampled over all clients. With cohorts, each cohort trains its own participants
  in min(m, C_c) static slots under the same strategy; a participant's keys depend only on its
  global id, so grouping clients into cohorts changes no random number.
  """
  validate(cfg, num_clients, algo)
  strategy = strategies.resolve_strategy(cfg.strategy)
  m = cfg.clients_per_round
  groups = cohorts(algo, num_clients)
  fns = tuple(client_round_fn(algo, cfg, c.client) for c in groups)

  def train(fn, stack, slots, data, key, msg, lr):
    sel = jax.tree_util.tree_map(lambda a: a[slots.local], stack)
    ckeys = jax.vmap(lambda c: rng.client_key(key, c))(slots.ids)
    n_sel = data.n[slots.ids]
    out = strategies.map_clients(
        fn, (sel, data.x[slots.ids], data.y[slots.ids], n_sel, ckeys, slots.ids), (msg, lr),
        strategy=strategy, chunk_size=cfg.map_chunk_size)
    return (n_sel,) + tuple(out)

  def round_step(state: FedState, data: FedData, key: jax.Array):
    ids = sample_participants(key, data.num_clients, m)
    server = _prepare(algo, state, data, ids, key)
    msg = _broadcast(algo, server, data)
    lr = cfg.lr_fn(state.round)
    if not algo.cohorts:
      slots = cohort_slots(ids, groups[0], num_clients, m)
      n_sel, new_sel, payloads, losses = train(fns[0], state.clients, slots, data, key, msg, lr)
      return _finish_round(algo, state, server, ids, n_sel, new_sel, payloads, losses, lr, msg)
    slots = tuple(cohort_slots(ids, c, num_clients, m) for c in groups)
    outs = [train(f, st, s, data, key, msg, lr) for f, st, s in zip(fns, state.clients, slots)]
    n_sel, new_sel, payloads, losses = (tuple(o[i] for o in outs) for i in range(4))
    return _finish_cohort_round(algo, state, server, slots, n_sel, new_sel, payloads, losses, lr,
                                m, msg)

  return jax.jit(round_step, donate_argnums=(0,) if donate else ())


def message_bytes(algo: Algorithm, cfg: RoundConfig, num_clients: int, state: FedState,
                  data: FedData) -> Tuple[comm.MessageBytes, ...]:
  """Exact bytes one participant of each cohort uploads and downloads in a round (static: the
  round's pieces are traced with `jax.eval_shape`, nothing is computed)."""
  groups = cohorts(algo, num_clients)

  def shapes(state, data, key):
    ids = sample_participants(key, num_clients, cfg.clients_per_round)
    server = _prepare(algo, state, data, ids, key)
    msg = _broadcast(algo, server, data)
    payloads = []
    for cohort, stack in zip(groups, cohort_stacks(algo, state.clients)):
      cid = cohort.members[0]
      client = jax.tree_util.tree_map(lambda a: a[0], stack)
      fn = client_round_fn(algo, cfg, cohort.client)
      payloads.append(fn(client, data.x[cid], data.y[cid], data.n[cid], rng.client_key(key, cid),
                         jnp.int32(cid), msg, cfg.lr_fn(state.round))[1])
    return msg, payloads

  msg, payloads = jax.eval_shape(shapes, state, data, jax.random.PRNGKey(0))
  down = comm.tree_bytes(comm.downlink_message(algo, msg))
  return tuple(comm.MessageBytes(comm.tree_bytes(p), down) for p in payloads)


def _check_plain(algo: Algorithm, what: str) -> None:
  if algo.cohorts:
    raise ValueError(f'{what} runs single-architecture algorithms; {algo.name!r} has '
                     f'{len(algo.cohorts)} cohorts (use make_round_step)')


def _loop_prepare_finish(algo: Algorithm, cfg: RoundConfig) -> Tuple[Callable, Callable]:
  """The jitted round start (participants, broadcast, lr) and end (aggregate, scatter) shared by the
  two Python-loop baselines."""
  @jax.jit
  def prepare(state, data, key):
    ids = sample_participants(key, data.num_clients, cfg.clients_per_round)
    server = _prepare(algo, state, data, ids, key)
    return ids, server, _broadcast(algo, server, data), cfg.lr_fn(state.round)

  @jax.jit
  def finish(state, server, ids, n_sel, new_sel, payloads, losses, lr, msg):
    return _finish_round(algo, state, server, ids, n_sel, new_sel, payloads, losses, lr, msg)

  return prepare, finish


def make_sequential_round_step(algo: Algorithm, cfg: RoundConfig, num_clients: int) -> Callable:
  """Same round, clients one at a time from Python: one jitted call per participant, then a jitted
  aggregation. Used as the benchmark baseline (the FedJAX `for_each_client` / PyTorch-loop way)."""
  _check_plain(algo, 'make_sequential_round_step')
  validate(dataclasses.replace(cfg, strategy='vmap'), num_clients, algo)
  per_client = jax.jit(client_round_fn(algo, cfg))
  prepare, finish = _loop_prepare_finish(algo, cfg)

  def round_step(state: FedState, data: FedData, key: jax.Array):
    ids, server, msg, lr = prepare(state, data, key)
    outs = []
    for cid in [int(i) for i in ids]:
      client = jax.tree_util.tree_map(lambda a: a[cid], state.clients)
      outs.append(per_client(client, data.x[cid], data.y[cid], data.n[cid],
                             rng.client_key(key, cid), jnp.int32(cid), msg, lr))
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
    return finish(state, server, ids, data.n[ids], *stacked, lr, msg)

  return round_step


def make_stepwise_round_step(algo: Algorithm, cfg: RoundConfig, num_clients: int) -> Callable:
  """Same round, the FedJAX `for_each_client` way: for each participant a jitted `begin`, then a
  Python loop over its real local steps (E * steps_per_epoch(n)), each batch gathered from host memory
  with numpy and passed to one jitted step call, then a jitted `end`/`upload`; a jitted aggregation
  last. Batches and keys are those of `local.train_client`, so the numbers are the same."""
  _check_plain(algo, 'make_stepwise_round_step')
  validate(dataclasses.replace(cfg, strategy='vmap'), num_clients, algo)
  bsz, epochs = cfg.batch_size, cfg.local_epochs
  prepare, finish = _loop_prepare_finish(algo, cfg)
  personalize = jax.jit(algo.personalize or (lambda msg, cid: msg))

  @functools.partial(jax.jit, static_argnames='n_max')
  def begin(stored, msg, ckey, n, n_max):
    perms = local.epoch_permutations(ckey, n, n_max, epochs)
    return algo.begin(restore_client(algo, stored, msg), msg, rng.begin_key(ckey)), perms

  @jax.jit
  def step(client, batch, ckey, s, msg, lr):
    return algo.local_step(client, batch, rng.step_key(ckey, s), msg, lr)

  @jax.jit
  def end(start, trained, msg, x, y, n, ckey):
    trained = algo.end(start, trained, msg)
    payload = algo.upload(trained, msg, LocalData(x, y, n, rng.upload_key(ckey)))
    return persist_client(algo, trained), payload

  def round_step(state: FedState, data: FedData, key: jax.Array):
    ids, server, msg_all, lr = prepare(state, data, key)
    x_host, y_host, n_host = np.asarray(data.x), np.asarray(data.y), np.asarray(data.n)
    outs = []
    for cid in [int(i) for i in ids]:
      msg = personalize(msg_all, jnp.int32(cid))
      client = jax.tree_util.tree_map(lambda a: a[cid], state.clients)
      ckey, n = rng.client_key(key, cid), int(n_host[cid])
      start, perms = begin(client, msg, ckey, n_host[cid], n_max=data.x.shape[1])
      perms = np.asarray(perms)
      spe = int(local.steps_per_epoch(n, bsz, cfg.drop_last))
      trained, losses = start, []
      for s in range(epochs * spe):
        pos = (s % spe) * bsz + np.arange(bsz)
        idx = perms[s // spe, pos % n]
        batch = {'x': x_host[cid, idx], 'y': y_host[cid, idx]}
        if not cfg.drop_last:
          batch['mask'] = pos < n
        trained, loss = step(trained, batch, ckey, s, msg, lr)
        losses.append(loss)
      trained, payload = end(start, trained, msg, data.x[cid], data.y[cid], data.n[cid], ckey)
      outs.append((trained, payload, jnp.mean(jnp.stack(losses))))
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
    return finish(state, server, ids, data.n[ids], *stacked, lr, msg_all)

  return round_step
