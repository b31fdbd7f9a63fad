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

from fedjax_ssl.algorithms.base import Algorithm
from fedjax_ssl.core import local, rng, strategies
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


def client_round_fn(algo: Algorithm, cfg: RoundConfig) -> Callable:
  """One participant's whole round: begin -> local training -> end -> upload.

  Returns fn(client, x, y, n, ckey, cid, msg, lr) -> (client, payload, mean loss).
  """
  def fn(client, x, y, n, ckey, cid, msg, lr):
    if algo.personalize is not None:
      msg = algo.personalize(msg, cid)
    start = algo.begin(client, msg, rng.begin_key(ckey))
    trained, loss = local.train_client(algo.local_step, start, x, y, n, ckey, msg, lr,
                                       batch_size=cfg.batch_size, local_epochs=cfg.local_epochs,
                                       drop_last=cfg.drop_last)
    trained = algo.end(start, trained, msg)
    return trained, algo.upload(trained), loss
  return fn


def _prepare(algo: Algorithm, state: FedState, data: FedData, ids, key):
  """The server state after the algorithm's `prepare` hook (unchanged without one)."""
  if algo.prepare is None:
    return state.server
  return algo.prepare(state.server, data, ids, state.round, key)


def _finish_round(algo: Algorithm, state: FedState, server, ids, n_sel, new_sel, payloads, losses,
                  lr):
  # float32 normally; float64 when x64 is enabled, so a float64 state is averaged in float64.
  fdtype = jax.dtypes.canonicalize_dtype(jnp.float64)
  weights = n_sel.astype(fdtype) / jnp.sum(n_sel).astype(fdtype)
  server = algo.aggregate(server, payloads, weights)
  clients = jax.tree_util.tree_map(lambda a, b: a.at[ids].set(b), state.clients, new_sel)
  metrics = {'loss': jnp.mean(losses), 'lr': lr}
  return FedState(clients=clients, server=server, round=state.round + 1), metrics


def validate(cfg: RoundConfig, num_clients: int, algo: Algorithm | None = None) -> None:
  """Raises a ValueError naming the bad setting, before anything is compiled."""
  if algo is not None and not cfg.drop_last and not algo.ragged_batches:
    raise ValueError(f'drop_last = False is invalid for algorithm {algo.name!r}: its local step '
                     "ignores batch['mask'], so the ragged last batch would train on filler rows")
  if not 1 <= cfg.clients_per_round <= num_clients:
    raise ValueError(f'clients_per_round = {cfg.clients_per_round} is invalid: must be in '
                     f'[1, num_clients={num_clients}]')
  if cfg.local_epochs < 1:
    raise ValueError(f'local_epochs = {cfg.local_epochs} is invalid: must be >= 1')
  if cfg.batch_size < 1:
    raise ValueError(f'batch_size = {cfg.batch_size} is invalid: must be >= 1')
  strategies.check_participants(strategies.resolve_strategy(cfg.strategy), cfg.clients_per_round,
                                cfg.map_chunk_size)


def make_round_step(algo: Algorithm, cfg: RoundConfig, num_clients: int, *, donate: bool = True
                    ) -> Callable[[FedState, FedData, jax.Array], Tuple[FedState, Dict[str, jax.Array]]]:
  """Builds the jitted `round_step(state, fed_data, round_key) -> (state, metrics)`.

  `round_key` should be `rng.round_key(root_key, round_idx)`; everything random in the round derives
  from it. The incoming state's buffers are donated (no second copy of the stacked client state).
  """
  validate(cfg, num_clients, algo)
  strategy = strategies.resolve_strategy(cfg.strategy)
  per_client = client_round_fn(algo, cfg)
  m = cfg.clients_per_round

  def round_step(state: FedState, data: FedData, key: jax.Array):
    ids = sample_participants(key, data.num_clients, m)
    server = _prepare(algo, state, data, ids, key)
    msg = algo.broadcast(server)
    lr = cfg.lr_fn(state.round)
    sel = jax.tree_util.tree_map(lambda a: a[ids], state.clients)
    ckeys = jax.vmap(lambda c: rng.client_key(key, c))(ids)
    n_sel = data.n[ids]
    new_sel, payloads, losses = strategies.map_clients(
        per_client, (sel, data.x[ids], data.y[ids], n_sel, ckeys, ids), (msg, lr),
        strategy=strategy, chunk_size=cfg.map_chunk_size)
    return _finish_round(algo, state, server, ids, n_sel, new_sel, payloads, losses, lr)

  return jax.jit(round_step, donate_argnums=(0,) if donate else ())


def _loop_prepare_finish(algo: Algorithm, cfg: RoundConfig) -> Tuple[Callable, Callable]:
  """The jitted round start (participants, broadcast, lr) and end (aggregate, scatter) shared by the
  two Python-loop baselines."""
  @jax.jit
  def prepare(state, data, key):
    ids = sample_participants(key, data.num_clients, cfg.clients_per_round)
    server = _prepare(algo, state, data, ids, key)
    return ids, server, algo.broadcast(server), cfg.lr_fn(state.round)

  @jax.jit
  def finish(state, server, ids, n_sel, new_sel, payloads, losses, lr):
    return _finish_round(algo, state, server, ids, n_sel, new_sel, payloads, losses, lr)

  return prepare, finish


def make_sequential_round_step(algo: Algorithm, cfg: RoundConfig, num_clients: int) -> Callable:
  """Same round, clients one at a time from Python: one jitted call per participant, then a jitted
  aggregation. Used as the benchmark baseline (the FedJAX `for_each_client` / PyTorch-loop way)."""
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
    return finish(state, server, ids, data.n[ids], *stacked, lr)

  return round_step


def make_stepwise_round_step(algo: Algorithm, cfg: RoundConfig, num_clients: int) -> Callable:
  """Same round, the FedJAX `for_each_client` way: for each participant a jitted `begin`, then a
  Python loop over its real local steps (E * steps_per_epoch(n)), each batch gathered from host memory
  with numpy and passed to one jitted step call, then a jitted `end`/`upload`; a jitted aggregation
  last. Batches and keys are those of `local.train_client`, so the numbers are the same."""
  validate(dataclasses.replace(cfg, strategy='vmap'), num_clients, algo)
  bsz, epochs = cfg.batch_size, cfg.local_epochs
  prepare, finish = _loop_prepare_finish(algo, cfg)
  personalize = jax.jit(algo.personalize or (lambda msg, cid: msg))

  @functools.partial(jax.jit, static_argnames='n_max')
  def begin(client, msg, ckey, n, n_max):
    perms = local.epoch_permutations(ckey, n, n_max, epochs)
    return algo.begin(client, msg, rng.begin_key(ckey)), perms

  @jax.jit
  def step(client, batch, ckey, s, msg, lr):
    return algo.local_step(client, batch, rng.step_key(ckey, s), msg, lr)

  @jax.jit
  def end(start, trained, msg):
    trained = algo.end(start, trained, msg)
    return trained, algo.upload(trained)

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
      trained, payload = end(start, trained, msg)
      outs.append((trained, payload, jnp.mean(jnp.stack(losses))))
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
    return finish(state, server, ids, data.n[ids], *stacked, lr)

  return round_step
