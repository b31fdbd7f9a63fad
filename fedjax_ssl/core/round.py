"""The generic round step: sample participants, broadcast, train locally, upload, screen (a failed
or dropped upload leaves the aggregate: core/faults.py), aggregate, scatter.

`make_round_step` returns ONE jitted pure function `round_step(state, fed_data, key)` with the state
donated. `experiments/baselines.py` runs the same round as Python loops over clients, for the
benchmark.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl.core.algorithm import (Algorithm, Cohort, CohortSlots, LocalData, persist_client,
                                        restore_client)
from fedjax_ssl.core import comm, faults, local, placement, rng, strategies
from fedjax_ssl.core.state import FedState
from fedjax_ssl.data.types import FedData
from fedjax_ssl.ops import dp_fedavg


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
    vmap_shrink: under vmap, participants still training are regrouped into a batch this many
      times narrower whenever that few are left (core/local.py, `lane_widths`), so a round costs
      about its real steps; 0 runs every participant as long as the longest one.
    client_state: 'device' keeps the stacked client state on the accelerator; 'host' keeps it in
      host memory and moves only the round's participants (`make_round_step`).
    dropout_rate: probability that a participant's upload is lost after it trained (core/faults.py);
      each participant draws independently, from the round key and its id.
    inject_faults: (round index from 0, client id) pairs whose upload and trained state are made
      non-finite in that round, to exercise the isolation of failed clients (core/faults.py).
    dp: user-level DP-FedAvg (ops/dp_fedavg.py): the uploads are clipped updates averaged with the
      fixed denominator m plus Gaussian noise, replacing the algorithm's weights; None: off.
    placement: 'replicated' (every process holds every client) or 'divided' (each process holds
      its block of clients, core/placement.py; the round step then takes the process's
      `LocalClients` in place of the whole FedData).
  """
  clients_per_round: int
  local_epochs: int
  batch_size: int
  lr_fn: Callable[[jax.Array], jax.Array]
  strategy: str = 'auto'
  map_chunk_size: int = 1
  drop_last: bool = True
  vmap_shrink: float = 2.0
  client_state: str = 'device'
  dropout_rate: float = 0.0
  inject_faults: Tuple[Tuple[int, int], ...] = ()
  dp: Optional[dp_fedavg.DpAggregation] = None
  placement: str = 'replicated'


CLIENT_STATES = ('device', 'host')


def init_state(algo: Algorithm, key: jax.Array, num_clients: int, client_state: str = 'device',
               *, init_fn: Callable | None = None, process: Tuple[int, int] | None = None
               ) -> FedState:
  """Initial state: stacked client states and the server state, round 0.

  client_state='host' returns the client stacks as numpy arrays (computed on the CPU backend, so
  the accelerator never holds all C clients; same threefry draws, so the same numbers on CPU).
  With `process` = (index, count) (placement 'divided', core/placement.py) only that process's
  block of each cohort's stack is returned (`state_blocks`), sliced inside one jitted init so
  that an init that broadcasts one client's state never builds the other rows; with
  client_state='device' they stay on the default device (this process's first).
  init_fn(key) -> (clients, server) replaces `algo.init(key, num_clients)` on the device path:
  `compiled_init` gives the same numbers as one program.
  """
  if client_state not in CLIENT_STATES:
    raise ValueError(f'client_state = {client_state!r} is invalid: must be one of {CLIENT_STATES}')
  held = functools.partial(_held_rows, algo, num_clients, process)
  if process is not None and client_state == 'device':
    clients, server = jax.jit(lambda k: held(algo.init(k, num_clients)))(key)
  elif client_state == 'host':
    with jax.default_device(jax.local_devices(backend='cpu')[0]):
      if process is None:
        clients, server = algo.init(key, num_clients)
      else:
        clients, server = jax.jit(lambda k: held(algo.init(k, num_clients)))(key)
    clients = jax.tree_util.tree_map(lambda a: np.array(a, copy=True), clients)
    # Through numpy, so that the server lands uncommitted on the default device below (an array
    # committed to one device cannot enter a round sharded over several).
    server = jax.device_get(server)
  else:
    clients, server = init_fn(key) if init_fn is not None else algo.init(key, num_clients)
  # One buffer per leaf: the round step donates the state, and XLA refuses a buffer donated twice
  # (an init that reuses one zeros array for two leaves would otherwise fail on the first round).
  server, rnd = jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True),
                                       (server, jnp.zeros((), jnp.int32)))
  if client_state == 'device':
    clients = jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), clients)
  return FedState(clients=clients, server=server, round=rnd)


def _held_rows(algo: Algorithm, num_clients: int, process: Tuple[int, int], init_out):
  clients, server = init_out
  stacks = tuple(jax.tree_util.tree_map(lambda a, b=b: a[b.lo:b.hi], stack) for stack, b in
                 zip(cohort_stacks(algo, clients), state_blocks(algo, num_clients, *process)))
  return _unstack(algo, stacks), server


def state_blocks(algo: Algorithm, num_clients: int, process_index: int, process_count: int
                 ) -> Tuple[placement.StateBlock, ...]:
  """Per cohort, the rows of its stack that process `process_index` holds under placement
  'divided': each cohort's members (in member order) cut over the processes on their own, so
  every process holds about 1/P of every cohort whatever the client ids."""
  return tuple(placement.StateBlock.of(len(c.members), process_index, process_count)
               for c in cohorts(algo, num_clients))


def compiled_init(algo: Algorithm, num_clients: int) -> Callable:
  """`algo.init(key, num_clients)` as one jitted program, for `init_state(init_fn=...)`.

  Run eagerly, an init compiles one small program per operation and parameter shape, each below
  the persistent cache's threshold, so every run paid them again before its first round
  (docs/notes/performance.md#perf-62); one program is compiled once and cached. The draws are the
  same threefry bits (tested bit-identical)."""
  return jax.jit(lambda key: algo.init(key, num_clients))


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
  Returns fn(stored, ckey, cid, data, msg, lr) -> (stored, payload, mean loss), where `stored`
  is the part of the client's state kept between rounds (the whole state unless the algorithm
  declares `persist`/`restore`) and `data` the whole FedData.
  """
  ca = client_algo or algo

  def fn(stored, ckey, cid, data, msg, lr):
    if algo.personalize is not None:
      msg = algo.personalize(msg, cid)
    start = ca.begin(restore_client(ca, stored, msg), msg, rng.begin_key(ckey))
    trained, loss = local.train_client(
        ca.local_step, start, data.x, data.y, data.offsets[cid], data.n[cid], ckey, msg, lr,
        n_max=data.n_max, batch_size=cfg.batch_size, local_epochs=cfg.local_epochs,
        drop_last=cfg.drop_last, shrink=cfg.vmap_shrink, n_min=data.n_min)
    trained = ca.end(start, trained, msg)
    # The padded view is gathered only if `upload` reads it (XLA drops it otherwise).
    payload = ca.upload(trained, msg, LocalData(*data.client(cid), rng.upload_key(ckey)))
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


def prepare_server(algo: Algorithm, state: FedState, data: FedData, ids, key,
                   absorb: bool = True):
  """The server state after the algorithm's `prepare` hook (unchanged without one); at a round of
  `summaries_due`, with `state.clients` present and `absorb`, after `absorb`ing every client's
  `summarize` row first (the 'host' and 'divided' round steps, whose device program holds no
  client stack, absorb them before it: `absorb_summaries`)."""
  p = algo.prepare
  if p is None:
    return state.server
  if p.summarize is not None and state.clients is not None and absorb:
    members = tuple(jnp.asarray(c.members, jnp.int32) for c in cohorts(algo, data.n.shape[0]))
    state = state.replace(server=jax.lax.cond(
        summaries_due(algo, state.round),
        lambda: p.absorb(state.server, p.summarize(state.server, cohort_stacks(algo, state.clients),
                                                   data, members, key)),
        lambda: state.server))
  return p.fn(state, data, ids, key)


def summaries_due(algo: Algorithm, round_idx):
  """Whether round `round_idx` (0-based; an int or traced) absorbs the clients' `summarize` rows
  before `prepare.fn`: `summarize_when(round_idx)`, by default round 0."""
  p = algo.prepare
  return p.summarize_when(round_idx) if p.summarize_when is not None else round_idx == 0


def absorb_summaries(algo: Algorithm, server, stacks: Tuple, blocks: Tuple, data: FedData,
                     key: jax.Array):
  """`prepare.absorb(server, rows)` with every client's `summarize` row, computed where the client
  states are (the 'host' and 'divided' round steps, at a round of `summaries_due`): a block on a
  device in one program, host-resident rows one client at a time (a device never holds more than
  one client of each cohort), then gathered from every process's block (`placement.exchange`,
  rows moved, never summed).

  Args:
    stacks: per cohort, this process's block of the stack (leaves [hi - lo, ...]).
    blocks: per cohort, its `placement.StateBlock`.
    data: holds the rows of the block's clients (`placement.held_data` under 'divided').
    key: the round key.
  """
  p = algo.prepare
  summarize = jax.jit(p.summarize)
  ids = [np.asarray(c.members[b.lo:b.hi], np.int32)
         for c, b in zip(cohorts(algo, data.n.shape[0]), blocks)]
  data = jax.device_put(data)  # once, not with every client's call below
  if placement.on_device(stacks):
    held = jax.device_get(summarize(server, stacks, data, tuple(ids), key))
  else:
    # Call j takes row j of every cohort's block (its last row again once a smaller block is
    # done); cohort c keeps the rows of its first n_c calls.
    sizes = [b.hi - b.lo for b in blocks]
    per_row = []
    for j in range(max(sizes)):
      picks = [min(j, n - 1) for n in sizes]
      one = tuple(jax.tree_util.tree_map(lambda a, i=i: a[i:i + 1], st)
                  for st, i in zip(stacks, picks))
      per_row.append(jax.device_get(summarize(
          server, one, data, tuple(i_c[i:i + 1] for i_c, i in zip(ids, picks)), key)))
    held = tuple(jax.tree_util.tree_map(lambda *r: np.concatenate(r),
                                        *[row[c] for row in per_row[:n]])
                 for c, n in enumerate(sizes))
  summaries = tuple(placement.exchange(h, placement.owners(np.arange(b.num), b.num,
                                                           b.process_count), b.process_count)
                    for h, b in zip(held, blocks))
  if strategies.multi_process():
    summaries = strategies.replicate(summaries)
  return strategies.jit_replicated(p.absorb)(server, summaries)


def round_message(algo: Algorithm, server, data: FedData):
  """The round's message: `broadcast(server)`, plus the public set for `uses_public` algorithms."""
  msg = algo.broadcast(server)
  if algo.uses_public:
    if data.public_x is None:
      raise ValueError(f'algorithm {algo.name!r} needs the public set FedData.public_x; build the '
                       'federated data with public_size > 0')
    msg = dict(msg, public_x=data.public_x)
  return msg


def aggregate_round(algo: Algorithm, state: FedState, server, ids, n_sel, payloads, present,
                    loss, lr, msg, *, dp: Optional[dp_fedavg.DpAggregation] = None, key=None):
  """(server after `aggregate`, round metrics) of a single-cohort round.

  `present` (bool [m]) and `loss` come from the round's fault `screen`: absent participants weigh
  0, and a round without any present participant keeps the server of `prepare`.

  With `dp` (and the round `key`) the algorithm aggregates the one row `dp_aggregate` releases.
  """
  # float32 normally; float64 when x64 is enabled, so a float64 state is averaged in float64.
  fdtype = jax.dtypes.canonicalize_dtype(jnp.float64)
  prepared = server
  if dp is not None:
    server = dp_aggregate(algo, server, ids, payloads, present, key, dp)
  else:
    counts = jnp.where(present, n_sel, 0).astype(fdtype)
    total = jnp.sum(counts)
    server = algo.aggregate(server, payloads, counts / jnp.where(total > 0, total, 1), ids)
    server = _keep_if_nobody(present, server, prepared)
  metrics = {'loss': loss, 'lr': lr,
             **comm.round_metrics(algo, msg, (payloads,), (ids.shape[0],), state, prepared)}
  return server, metrics


def dp_aggregate(algo: Algorithm, server, ids, payloads, present, key, dp):
  """The server after DP-FedAvg's aggregation (ops/dp_fedavg.py).

  The noisy mean ū = g + (Σ clip(u_k - g) + noise) / m, g = `update_reference(server)`, is handed
  to the algorithm's own `aggregate` as a single upload of weight 1: for an algorithm whose
  aggregate is a weighted mean of its uploads (the registry's `dp` mark) that sets the global model
  to ū, through a server optimizer if one wraps it. m is the number of slots (clients_per_round):
  failed or dropped participants add nothing and still count. The release happens even when nobody
  is present, since skipping it would depend on every participant's data at once.
  """
  reference = algo.update_reference(server)
  mean = dp_fedavg.noisy_mean(reference, payloads, present,
                              jax.random.fold_in(key, dp_fedavg.NOISE_STREAM), dp, ids.shape[0])
  one = jax.tree_util.tree_map(lambda a: a[None], mean)
  weight = jnp.ones((1,), jax.tree_util.tree_leaves(mean)[0].dtype)
  return algo.aggregate(server, one, weight, ids[:1])


def _aggregate_cohort_round(algo: Algorithm, state: FedState, server, slots, n_sel, payloads,
                            screened, lr, msg):
  """(server, metrics) of a multi-cohort round (per-cohort tuples; unfilled slots and absent
  participants weigh 0)."""
  fdtype = jax.dtypes.canonicalize_dtype(jnp.float64)
  prepared = server
  counts = tuple(jnp.where(p, n, 0).astype(fdtype) for p, n in zip(screened.present, n_sel))
  total = sum(jnp.sum(c) for c in counts)
  safe = jnp.where(total > 0, total, 1)
  server = algo.aggregate(server, payloads, tuple(c / safe for c in counts), slots)
  server = _keep_if_nobody(jnp.concatenate(screened.present), server, prepared)
  metrics = {'loss': screened.loss, 'lr': lr,
             **comm.round_metrics(algo, msg, payloads, tuple(jnp.sum(s.valid) for s in slots), state,
                                 prepared)}
  return server, metrics


def _keep_if_nobody(present: jax.Array, server, prepared):
  """`server`, or `prepared` (the server before `aggregate`) when no participant is present."""
  anyone = jnp.any(present)
  return jax.tree_util.tree_map(lambda a, b: jnp.where(anyone, a, b), server, prepared)


class Screened(NamedTuple):
  """A round's participants after the fault screen (per cohort tuples over its slots).

  Attributes:
    present: bool [S] per cohort: the upload reaches the aggregate.
    failed: bool [S] per cohort: upload or loss not finite (state rolled back).
    dropped: bool [S] per cohort: upload lost after training (state kept).
    loss: float32 scalar, the mean loss over the participants that did not fail (NaN if all did).
  """
  present: Tuple
  failed: Tuple
  dropped: Tuple
  loss: jax.Array


def screen(cfg: RoundConfig, round_idx, key, slots, old, new, payloads, losses):
  """The fault screen of a round (core/faults.py), per cohort.

  Args:
    slots: per cohort CohortSlots. old / new: per cohort stored states [S, ...] before and after
      the round. payloads: per cohort uploads [S, ...]. losses: per cohort mean losses [S].
  Returns:
    (new stored states with failed participants rolled back, payloads with absent ones zeroed,
     Screened).
  """
  out_new, out_pay, present, failed, dropped = [], [], [], [], []
  loss_sum, loss_n = 0.0, 0
  for sl, o, n, p, l in zip(slots, old, new, payloads, losses):
    size = sl.ids.shape[0]
    if cfg.inject_faults:
      flag = faults.injected(cfg.inject_faults, round_idx, sl.ids) & sl.valid
      n, p = faults.poison_rows(flag, n), faults.poison_rows(flag, p)
      l = jnp.where(flag, jnp.nan, l)
    fail = sl.valid & ~(faults.finite_rows(p, size) & jnp.isfinite(l))
    drop = faults.dropped(key, sl.ids, cfg.dropout_rate) & sl.valid & ~fail
    pres = sl.valid & ~fail & ~drop
    out_new.append(faults.select_rows(~fail, n, o))
    out_pay.append(faults.zero_rows(pres, p))
    trained_ok = sl.valid & ~fail
    loss_sum = loss_sum + jnp.sum(jnp.where(trained_ok, l, 0.0))
    loss_n = loss_n + jnp.sum(trained_ok)
    present.append(pres)
    failed.append(fail)
    dropped.append(drop)
  loss = loss_sum / jnp.asarray(loss_n, jnp.float32)
  return tuple(out_new), tuple(out_pay), Screened(tuple(present), tuple(failed), tuple(dropped),
                                                  loss)


def fault_metrics(cfg: RoundConfig, slots, screened: Screened) -> Dict[str, jax.Array]:
  """The round's fault counts: 'failed_clients' (float32), 'failed_ids' (int32 [sum S], the failed
  participants' ids, -1 elsewhere) and, with dropouts on, 'dropped_clients'."""
  out = {'failed_clients': sum(jnp.sum(f) for f in screened.failed).astype(jnp.float32),
         'failed_ids': jnp.concatenate([jnp.where(f, s.ids, -1).astype(jnp.int32)
                                        for f, s in zip(screened.failed, slots)])}
  if cfg.dropout_rate > 0:
    out['dropped_clients'] = sum(jnp.sum(d) for d in screened.dropped).astype(jnp.float32)
  return out


def _gather(stacks: Tuple, slots: Tuple[CohortSlots, ...]) -> Tuple:
  """Per cohort, the stored states of its slots (an unfilled slot's index is clamped: a real
  client, trained and then discarded)."""
  return tuple(jax.tree_util.tree_map(lambda a, s=s: a[s.local], stack)
               for stack, s in zip(stacks, slots))


def _scatter(stacks: Tuple, slots: Tuple[CohortSlots, ...], new: Tuple) -> Tuple:
  """Per cohort, the stacks with the participants' new stored states (unfilled slots dropped)."""
  return tuple(jax.tree_util.tree_map(lambda a, b, s=s: a.at[s.local].set(b, mode='drop'), st, nw)
               for st, nw, s in zip(stacks, new, slots))


def _unstack(algo: Algorithm, stacks: Tuple):
  """The inverse of `cohort_stacks`."""
  return stacks if algo.cohorts else stacks[0]


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
  if cfg.client_state not in CLIENT_STATES:
    raise ValueError(f'client_state = {cfg.client_state!r} is invalid: must be one of '
                     f'{CLIENT_STATES}')
  if not 0 <= cfg.dropout_rate < 1:
    raise ValueError(f'dropout_rate = {cfg.dropout_rate} is invalid: must be in [0, 1)')
  for r, c in cfg.inject_faults:
    if r < 0 or not 0 <= c < num_clients:
      raise ValueError(f'inject_faults entry (round {r}, client {c}) is invalid: rounds count '
                       f'from 0 and client ids lie in [0, {num_clients})')
  if cfg.dp is not None and algo is not None and (algo.cohorts or algo.update_reference is None):
    raise ValueError(f'dp is invalid for algorithm {algo.name!r}: DP-FedAvg needs a single-cohort '
                     'algorithm whose Algorithm declares update_reference (its aggregate a '
                     'weighted mean of the uploads)')
  if cfg.placement not in placement.PLACEMENTS:
    raise ValueError(f'placement = {cfg.placement!r} is invalid: must be one of '
                     f'{placement.PLACEMENTS}')
  if cfg.placement == 'divided' and algo is not None:
    if algo.prepare is not None and (algo.prepare.reads_clients or algo.prepare.reads_data):
      raise ValueError(f"placement = 'divided' is invalid for algorithm {algo.name!r}: its "
                       "`prepare` reads clients other than the round's participants; use "
                       "'replicated'")
    if algo.prepare is not None and algo.prepare.summarize_reads_data and algo.cohorts:
      raise ValueError(f"placement = 'divided' is invalid for algorithm {algo.name!r}: its "
                       "summaries before a round read each client's rows, which a process holds by "
                       "client id while it holds its cohorts' states by member rank; use "
                       "'replicated'")
  local.lane_widths(cfg.clients_per_round, cfg.vmap_shrink)  # raises on a bad vmap_shrink
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
  """Builds `round_step(state, fed_data, round_key) -> (state, metrics)`.

  `round_key` should be `rng.round_key(root_key, round_idx)`; everything random in the round derives
  from it.

  With cfg.client_state = 'device' it is ONE jitted function and the incoming state's buffers are
  donated (no second copy of the stacked client state). With 'host' the stacked client state is a
  pytree of numpy arrays (`init_state(..., client_state='host')`): the participants are drawn by a
  small jitted call, their stored states copied to the device, the round (the same traced function
  as 'device') run on them, and their new states written back into the host arrays in place (the
  host counterpart of donation). The device then holds m participants' states, never C.
  With cfg.placement = 'divided' the step takes this process's `placement.LocalClients` in place of
  `fed_data` and `state.clients` holds its block of each cohort's clients only (`state_blocks`),
  on the host or the device as `client_state` says: a host-side wrapper
  gathers the round's participants' rows and states from the processes that hold them and runs
  the same traced round on them (core/placement.py).

  Participants are sampled over all clients. With cohorts, each cohort trains its own participants
  in min(m, C_c) static slots under the same strategy; a participant's keys depend only on its
  global id, so grouping clients into cohorts changes no random number.
  """
  validate(cfg, num_clients, algo)
  strategy = strategies.resolve_strategy(cfg.strategy)
  m = cfg.clients_per_round
  groups = cohorts(algo, num_clients)
  fns = tuple(client_round_fn(algo, cfg, c.client) for c in groups)

  def participants(key):
    ids = sample_participants(key, num_clients, m)
    return ids, tuple(cohort_slots(ids, c, num_clients, m) for c in groups)

  def train(fn, sel, slots, data, key, msg, lr):
    ckeys = jax.vmap(lambda c: rng.client_key(key, c))(slots.ids)
    n_sel = data.n[slots.ids]
    out = strategies.map_clients(fn, (sel, ckeys, slots.ids), (data, msg, lr), strategy=strategy,
                                 chunk_size=cfg.map_chunk_size)
    return (n_sel,) + tuple(out)

  def trained(state: FedState, sel: Tuple, data: FedData, key: jax.Array):
    """The round given its participants' stored states `sel` (per cohort): (server, new stored
    states per cohort, metrics). `state.clients` is not read unless `prepare` reads it."""
    ids, slots = participants(key)
    server = prepare_server(algo, state, data, ids, key)
    msg = round_message(algo, server, data)
    lr = cfg.lr_fn(state.round)
    outs = [train(f, st, sl, data, key, msg, lr) for f, st, sl in zip(fns, sel, slots)]
    n_sel, new_sel, payloads, losses = (tuple(o[i] for o in outs) for i in range(4))
    new_sel, payloads, screened = screen(cfg, state.round, key, slots, sel, new_sel, payloads,
                                         losses)
    if algo.cohorts:
      server, metrics = _aggregate_cohort_round(algo, state, server, slots, n_sel, payloads,
                                                screened, lr, msg)
    else:
      server, metrics = aggregate_round(algo, state, server, ids, n_sel[0], payloads[0],
                                         screened.present[0], screened.loss, lr, msg, dp=cfg.dp,
                                         key=key)
    return server, new_sel, dict(metrics, **fault_metrics(cfg, slots, screened))

  if cfg.placement == 'divided':
    return _divided_round_step(algo, num_clients, strategies.jit_replicated(participants),
                               strategies.jit_replicated(trained), donate)
  if cfg.client_state == 'host':
    if algo.prepare is not None and algo.prepare.reads_clients:
      raise ValueError(f"client_state = 'host' is invalid for algorithm {algo.name!r}: its "
                       "`prepare` reads every client's state on the device; use 'device'")
    return _host_round_step(algo, num_clients, strategies.jit_replicated(participants),
                            strategies.jit_replicated(trained))

  def round_step(state: FedState, data: FedData, key: jax.Array):
    _, slots = participants(key)
    stacks = cohort_stacks(algo, state.clients)
    server, new_sel, metrics = trained(state, _gather(stacks, slots), data, key)
    clients = _unstack(algo, _scatter(stacks, slots, new_sel))
    return FedState(clients=clients, server=server, round=state.round + 1), metrics

  return strategies.jit_replicated(round_step, donate_argnums=(0,) if donate else ())


def _round_data(local_clients: placement.LocalClients, ids: np.ndarray) -> FedData:
  """The participants' FedData (placement.participant_data), replicated on every process."""
  data = placement.participant_data(local_clients, ids)
  return strategies.replicate(data) if strategies.multi_process() else data


def _divided_round_step(algo: Algorithm, num_clients: int, participants: Callable,
                        trained: Callable, donate: bool) -> Callable:
  """`round_step(state, local_clients, key)` of placement 'divided': `state.clients` holds this
  process's block of each cohort's stack only (`state_blocks`; leaves [hi - lo, ...], host numpy
  or on this process's first device); the participants' stored states and rows are gathered from
  their owners (one all-gather through the host, as 'host' moves them), the round run as with
  'host', and each process writes back the new states of the clients it holds (on a device,
  donating the block when `donate`)."""
  def round_step(state: FedState, local_clients: placement.LocalClients, key: jax.Array):
    ids, slots = jax.device_get(participants(key))
    blocks = state_blocks(algo, num_clients, local_clients.process_index,
                          local_clients.process_count)
    stacks = cohort_stacks(algo, state.clients)
    round_data = _round_data(local_clients, np.asarray(ids))
    if _absorbs(algo, state):
      state = state.replace(server=absorb_summaries(
          algo, state.server, stacks, blocks, placement.held_data(local_clients), key))
    # An unfilled slot reads the cohort's last member, as the device round's clamped gather does.
    rows = [np.minimum(sl.local, b.num - 1) for sl, b in zip(slots, blocks)]
    sel = tuple(placement.participant_states(st, b, r) for st, b, r in zip(stacks, blocks, rows))
    sel = strategies.replicate(sel) if strategies.multi_process() else jax.device_put(sel)
    server, new_sel, metrics = trained(state.replace(clients=None), sel, round_data, key)
    stacks = tuple(placement.store_states(st, new, b, r, sl.valid, donate)
                   for st, new, b, r, sl in zip(stacks, new_sel, blocks, rows, slots))
    return FedState(clients=_unstack(algo, stacks), server=server, round=state.round + 1), metrics
  round_step.device_program = trained
  return round_step


def _absorbs(algo: Algorithm, state: FedState) -> bool:
  """Whether a round step whose device program holds no client stack absorbs the clients'
  summaries first (`absorb_summaries`): a round of `summaries_due` of an algorithm with
  `Prepare.summarize`."""
  return (algo.prepare is not None and algo.prepare.summarize is not None
          and bool(summaries_due(algo, int(jax.device_get(state.round)))))


def _host_round_step(algo: Algorithm, num_clients: int, participants: Callable,
                     trained: Callable) -> Callable:
  """The 'host' placement of `make_round_step` around its jitted `participants` and `trained`."""
  def round_step(state: FedState, data: FedData, key: jax.Array):
    _, slots = jax.device_get(participants(key))
    stacks = cohort_stacks(algo, state.clients)
    if _absorbs(algo, state):
      state = state.replace(server=absorb_summaries(
          algo, state.server, stacks, state_blocks(algo, num_clients, 0, 1), data, key))
    sel = []
    for stack, sl in zip(stacks, slots):
      size = jax.tree_util.tree_leaves(stack)[0].shape[0] if jax.tree_util.tree_leaves(stack) else 1
      local = np.minimum(sl.local, size - 1)  # the device round's clamp of unfilled slots
      sel.append(jax.tree_util.tree_map(lambda a, i=local: a[i], stack))
    sel = strategies.replicate(tuple(sel)) if strategies.multi_process() else jax.device_put(
        tuple(sel))
    server, new_sel, metrics = trained(state.replace(clients=None), sel, data, key)
    for stack, new, sl in zip(stacks, jax.device_get(new_sel), slots):
      def put(a, b, sl=sl):
        a[sl.local[sl.valid]] = b[sl.valid]
      jax.tree_util.tree_map(put, stack, new)
    return FedState(clients=state.clients, server=server, round=state.round + 1), metrics
  # The device-side program, for memory analysis: trained(state less clients, sel, data, key).
  round_step.device_program = trained
  return round_step


def message_bytes(algo: Algorithm, cfg: RoundConfig, num_clients: int, state: FedState,
                  data: FedData) -> Tuple[comm.MessageBytes, ...]:
  """Exact bytes one participant of each cohort uploads and downloads in a round (static: the
  round's pieces are traced with `jax.eval_shape`, nothing is computed)."""
  groups = cohorts(algo, num_clients)

  def shapes(state, data, key):
    ids = sample_participants(key, num_clients, cfg.clients_per_round)
    # `absorb` keeps the server's shapes, and under 'divided' `state.clients` is a block: skipped.
    server = prepare_server(algo, state, data, ids, key, absorb=False)
    msg = round_message(algo, server, data)
    payloads = []
    for cohort, stack in zip(groups, cohort_stacks(algo, state.clients)):
      cid = cohort.members[0]
      client = jax.tree_util.tree_map(lambda a: a[0], stack)
      fn = client_round_fn(algo, cfg, cohort.client)
      payloads.append(fn(client, rng.client_key(key, cid), jnp.int32(cid), data, msg,
                         cfg.lr_fn(state.round))[1])
    return msg, payloads

  msg, payloads = jax.eval_shape(shapes, state, data, jax.random.PRNGKey(0))
  down = comm.tree_bytes(comm.downlink_message(algo, msg))
  return tuple(comm.MessageBytes(comm.tree_bytes(p), down) for p in payloads)
