"""Buffered asynchronous aggregation, FedBuff (Nguyen et al., AISTATS 2022, "Federated Learning
with Buffered Asynchronous Aggregation"), simulated on a virtual clock.

`concurrency` (P) clients train at once, each from the model version it started from; the server
updates when `buffer_size` (B) updates have arrived, weighting each by its staleness s (server
versions since the client started):

  x_{t+1} = x_t + eta_g sum_k w_k s(tau_k) (u_k - x_{v_k}),   w_k = n_k / sum_{k in buffer} n_k

with x_{v_k} the model client k started from, u_k its upload and eta_g the server learning rate
(`config.server_lr` through the server optimizer, core/server_opt.py). The paper averages with
1 / B; the data weights w_k are the engine's synchronous FedAvg weights, equal to 1 / B on
equal-sized clients, so that B = P = clients_per_round with constant latency IS synchronous FedAvg.
Staleness functions (`STALENESS`): 'constant' 1, 'polynomial' (1 + s)^-a (the paper's default,
a = 1/2), 'hinge' 1 for s <= b else 1 / (a (s - b) + 1) (FedAsync, Xie et al. 2019).

Latency (`LATENCIES`): client c's j-th training lasts speed_c xi, speed_c ~ LogNormal(0,
speed_sigma) drawn once per client from the run's init key, xi ~ LogNormal(0, latency_sigma) drawn
per training ('lognormal', heavy-tailed) or xi = 1 ('constant'). Time has no unit: a median
client's training lasts 1.

Vectorised schedule (docs/notes/engine.md#fedbuff): when the server creates version t, exactly B
idle clients start from it, all trained at once by the engine's round machinery (vmap over
clients), and their deltas u - x_t go into a pool of P pending updates with their finish times;
the B earliest finished pending updates (ties: lower start version, then lower client id) are
popped, weighted and applied, and the clock moves to the last of their finish times. At step 0 the
other P - B clients start from x_0 too (`prefill`). Everything random is a function of the step's
round key, and the whole simulator (pending deltas, finish times, start versions, client ids, the
clock, the speed factors) lives in the server state {'algorithm': ..., 'fedbuff': Pool}, so a
checkpoint holds it and a resume is bit-exact.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from fedjax_ssl.core import comm, rng, strategies
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import Algorithm, CohortSlots, GlobalModel
from fedjax_ssl.core.state import FedState

LATENCIES = ('lognormal', 'constant')
STALENESS = ('constant', 'polynomial', 'hinge')
# fold_in constants of FedBuff's own streams, distinct from core/rng.py's and DP's.
LATENCY_STREAM = 0x4C415459
SPEED_STREAM = 0x53504544
PREFILL_STREAM = 0x50524546


def _real(key: str, value, allowed: str, ok: Callable[[float], bool]) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
      or not ok(float(value)):
    raise ValueError(f'fedbuff.{key} = {value!r} is invalid: must be {allowed}')
  return float(value)


@dataclasses.dataclass(frozen=True)
class FedBuffConfig:
  """FedBuff's settings (`config.fedbuff`, module docstring).

  Attributes:
    concurrency: P, clients training at once (<= num_clients).
    buffer_size: B, arrived updates that trigger a server update (<= P).
    latency: one of LATENCIES.
    latency_sigma: sigma of the per-training LogNormal factor ('lognormal'), >= 0.
    speed_sigma: sigma of the per-client LogNormal speed factor, >= 0 (0: all clients alike).
    staleness: one of STALENESS.
    staleness_exponent: a of 'polynomial', >= 0.
    hinge_a, hinge_b: a and b of 'hinge', >= 0.
  """
  concurrency: int
  buffer_size: int
  latency: str = 'lognormal'
  latency_sigma: float = 1.0
  speed_sigma: float = 0.0
  staleness: str = 'polynomial'
  staleness_exponent: float = 0.5
  hinge_a: float = 10.0
  hinge_b: float = 4.0

  def __post_init__(self):
    check(self)


def check(fb: FedBuffConfig, num_clients: Optional[int] = None) -> None:
  """ValueError naming the first bad setting (one line), before anything is compiled."""
  for key in ('concurrency', 'buffer_size'):
    value = getattr(fb, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'fedbuff.{key} = {value!r} is invalid: must be an integer >= 1')
  if fb.buffer_size > fb.concurrency:
    raise ValueError(f'fedbuff.buffer_size = {fb.buffer_size} is invalid: must be <= '
                     f'fedbuff.concurrency = {fb.concurrency} (a buffer fills from the clients '
                     'in flight)')
  if num_clients is not None and fb.concurrency > num_clients:
    raise ValueError(f'fedbuff.concurrency = {fb.concurrency} is invalid: must be <= '
                     f'num_clients = {num_clients} (a client trains one update at a time)')
  if fb.latency not in LATENCIES:
    raise ValueError(f'fedbuff.latency = {fb.latency!r} is invalid: must be one of {LATENCIES}')
  if fb.staleness not in STALENESS:
    raise ValueError(f'fedbuff.staleness = {fb.staleness!r} is invalid: must be one of '
                     f'{STALENESS}')
  for key in ('latency_sigma', 'speed_sigma', 'staleness_exponent', 'hinge_a', 'hinge_b'):
    _real(key, getattr(fb, key), 'a finite number >= 0', lambda v: v >= 0.0)


class Pool(NamedTuple):
  """The simulator's state, checkpointed inside the server (P = concurrency, B = buffer_size).

  Attributes:
    delta: pytree in the upload's form with leaves [P, ...]: u - x_v of each pending update.
    finish: float32 [P], virtual time at which each pending update arrives.
    version: int32 [P], the server version (step) its client started from.
    cid: int32 [P], its client.
    present: bool [P], the update reaches the server (False: failed or dropped, core/faults.py).
    free: int32 [B], the slots the next step's new clients fill.
    clock: float32 scalar, the virtual time of the current server version.
    speed: float32 [C], each client's speed factor (drawn once per client).
  """
  delta: Any
  finish: jax.Array
  version: jax.Array
  cid: jax.Array
  present: jax.Array
  free: jax.Array
  clock: jax.Array
  speed: jax.Array


def staleness_weight(fb: FedBuffConfig, s: jax.Array) -> jax.Array:
  """s(tau) of the module docstring, float32 [...] for int staleness tau [...] (>= 0)."""
  s = jnp.asarray(s, jnp.float32)
  if fb.staleness == 'constant':
    return jnp.ones_like(s)
  if fb.staleness == 'polynomial':
    return (1.0 + s) ** jnp.float32(-fb.staleness_exponent)
  return jnp.where(s <= fb.hinge_b, 1.0, 1.0 / (fb.hinge_a * (s - fb.hinge_b) + 1.0))


def speed_factors(key: jax.Array, num_clients: int, fb: FedBuffConfig) -> jax.Array:
  """float32 [C]: exp(speed_sigma N(0, 1)), from the init key (one draw per client and seed)."""
  z = jax.random.normal(jax.random.fold_in(key, SPEED_STREAM), (num_clients,), jnp.float32)
  return jnp.exp(jnp.float32(fb.speed_sigma) * z)


def latencies(rkey: jax.Array, ids: jax.Array, speed: jax.Array, fb: FedBuffConfig) -> jax.Array:
  """float32 [k]: how long the trainings of clients `ids` (int32 [k]) started in the step of round
  key `rkey` last; client c's draw comes from fold_in(client_key(rkey, c), LATENCY_STREAM)."""
  if fb.latency == 'constant':
    return speed[ids]
  z = jax.vmap(lambda c: jax.random.normal(
      jax.random.fold_in(rng.client_key(rkey, c), LATENCY_STREAM), (), jnp.float32))(ids)
  return speed[ids] * jnp.exp(jnp.float32(fb.latency_sigma) * z)


def sample_idle(rkey: jax.Array, busy: jax.Array, count: int) -> jax.Array:
  """int32 [count] sorted ids drawn uniformly without replacement among the clients not `busy`
  (bool [C]; at least `count` must be idle): the `count` smallest of one uniform per client, busy
  ones pushed past 1. With nobody busy and count = C: every client, as `rd.sample_participants`."""
  u = jax.random.uniform(rng.sampling_key(rkey), busy.shape, jnp.float32)
  score = jnp.where(busy, 2.0, u)
  return jnp.sort(jnp.argsort(score)[:count]).astype(jnp.int32)


def pop_order(pool: Pool, count: int) -> jax.Array:
  """int32 [count]: the slots of the `count` earliest finished pending updates (ties: lower start
  version, then lower client id)."""
  return jnp.lexsort((pool.cid, pool.version, pool.finish))[:count].astype(jnp.int32)


def busy_clients(pool: Pool, num_clients: int) -> jax.Array:
  """bool [C]: the clients with an update in flight (in a pool slot that is not free)."""
  in_flight = jnp.ones(pool.finish.shape, bool).at[pool.free].set(False)
  return jnp.zeros((num_clients,), bool).at[pool.cid].max(in_flight)


def advance(pool: Pool, order: jax.Array) -> Pool:
  """The pool after popping the slots `order`: they are the next step's free slots, and the clock
  is the last of their finish times."""
  return pool._replace(free=order, clock=jnp.max(pool.finish[order]),
                       present=pool.present.at[order].set(False))


def init_pool(reference: Any, key: jax.Array, num_clients: int, fb: FedBuffConfig) -> Pool:
  """The empty pool: no pending update, clock 0; slots 0..B-1 are the first step's."""
  p = fb.concurrency
  return Pool(delta=jax.tree_util.tree_map(lambda a: jnp.zeros((p,) + a.shape, a.dtype), reference),
              finish=jnp.zeros((p,), jnp.float32), version=jnp.zeros((p,), jnp.int32),
              cid=jnp.zeros((p,), jnp.int32), present=jnp.zeros((p,), bool),
              free=jnp.arange(fb.buffer_size, dtype=jnp.int32), clock=jnp.zeros((), jnp.float32),
              speed=speed_factors(key, num_clients, fb))


def push(pool: Pool, slots, delta, finish, version, ids, present) -> Pool:
  """The pool with new pending updates written into `slots` (int32 [k]; the rest as given [k])."""
  return pool._replace(
      delta=jax.tree_util.tree_map(lambda a, d: a.at[slots].set(d.astype(a.dtype)), pool.delta,
                                   delta),
      finish=pool.finish.at[slots].set(finish), version=pool.version.at[slots].set(version),
      cid=pool.cid.at[slots].set(ids), present=pool.present.at[slots].set(present))


@dataclasses.dataclass(frozen=True)
class FedBuffAlgorithm(Algorithm):
  """An Algorithm whose server is {'algorithm': the inner algorithm's server, 'fedbuff': Pool}
  (`wrap`); every function that reads the server sees the inner one's."""
  inner: Optional[Algorithm] = None
  fedbuff: Optional[FedBuffConfig] = None


def refusal(algo: Algorithm) -> Optional[str]:
  """Why `algo` cannot run under FedBuff (None: it can): the pending updates are differences to
  the model a client started from, so the aggregate must be a weighted mean of the uploads with
  `update_reference` (the registry's `dp` mark, the same criterion as DP-FedAvg's)."""
  if algo.cohorts:
    return 'its clients hold several architectures (cohorts)'
  if algo.update_reference is None:
    return ('its Algorithm declares no update_reference (its aggregate is not a weighted mean '
            'of the uploads)')
  if algo.prepare is not None:
    return 'its server runs a `prepare` step that reads every round'
  return None


def wrap(algo: Algorithm, fb: FedBuffConfig, num_clients: int) -> FedBuffAlgorithm:
  """`algo` with FedBuff's pool in its server (module docstring); ValueError when `refusal`."""
  check(fb, num_clients)
  why = refusal(algo)
  if why is not None:
    raise ValueError(f'fedbuff is invalid for algorithm {algo.name!r}: {why}')

  def inner_state(state):
    return state.replace(server=state.server['algorithm'])

  def init(key, c):
    clients, server = algo.init(key, c)
    return clients, {'algorithm': server,
                     'fedbuff': init_pool(algo.update_reference(server), key, c, fb)}

  gm = algo.global_model
  fields = {f.name: getattr(algo, f.name) for f in dataclasses.fields(Algorithm)}
  fields.update(
      init=init, broadcast=lambda server: algo.broadcast(server['algorithm']),
      aggregate=lambda server, *a: dict(server, algorithm=algo.aggregate(server['algorithm'], *a)),
      eval_variables=lambda state: algo.eval_variables(inner_state(state)),
      host_metrics=(None if algo.host_metrics is None else
                    lambda state: algo.host_metrics(inner_state(state))),
      update_reference=lambda server: algo.update_reference(server['algorithm']),
      global_model=(None if gm is None else GlobalModel(
          lambda s: gm.get(s['algorithm']), lambda s, p: dict(s, algorithm=gm.set(s['algorithm'], p)))))
  return FedBuffAlgorithm(**fields, inner=algo, fedbuff=fb)


def validate(cfg: rd.RoundConfig, num_clients: int, algo: FedBuffAlgorithm) -> None:
  """ValueError naming a setting the FedBuff step cannot run (one line, before compute)."""
  fb = algo.fedbuff
  check(fb, num_clients)
  if cfg.dp is not None:
    raise ValueError('dp is invalid with fedbuff: DP-FedAvg accounts synchronous rounds of a fixed '
                     'cohort; turn one of them off')
  if cfg.client_state != 'device':
    raise ValueError(f"client_state = {cfg.client_state!r} is invalid with fedbuff: the pending "
                     "pool and the clients live on the device; use 'device'")
  rd.validate(dataclasses.replace(cfg, clients_per_round=fb.buffer_size), num_clients, algo.inner)
  if fb.concurrency > fb.buffer_size:
    strategies.check_participants(strategies.resolve_strategy(cfg.strategy),
                                  fb.concurrency - fb.buffer_size, cfg.map_chunk_size)


def make_step(algo: FedBuffAlgorithm, cfg: rd.RoundConfig, num_clients: int, *,
              donate: bool = True
              ) -> Callable[[FedState, Any, jax.Array], Tuple[FedState, Dict[str, jax.Array]]]:
  """Builds `step(state, fed_data, round_key) -> (state, metrics)`, one FedBuff server step as ONE
  jitted function (the state donated), a drop-in for `rd.make_round_step`'s round.

  `cfg.clients_per_round` is not read: B clients train per step. Metrics: the round's ('loss' of
  the B new clients, 'lr', 'bytes_up' of the B popped updates, 'bytes_down' of the clients started,
  fault counts) plus 'virtual_time' (the clock of the new version), 'staleness_mean' and
  'staleness_max' of the popped updates.
  """
  validate(cfg, num_clients, algo)
  inner, fb = algo.inner, algo.fedbuff
  p, b = fb.concurrency, fb.buffer_size
  cfg_b = dataclasses.replace(cfg, clients_per_round=b)
  strategy = strategies.resolve_strategy(cfg.strategy)
  fn = rd.client_round_fn(inner, cfg_b)
  fdtype = jax.dtypes.canonicalize_dtype(jnp.float64)

  def train(clients, server, ids, data, key, lr, t):
    """The clients `ids` (int32 [k]) trained from `server`: (clients, deltas [k, ...], present [k],
    payloads, msg, slots, screened)."""
    msg = rd.round_message(inner, server, data)
    ckeys = jax.vmap(lambda c: rng.client_key(key, c))(ids)
    sel = jax.tree_util.tree_map(lambda a: a[ids], clients)
    new, payloads, losses = strategies.map_clients(fn, (sel, ckeys, ids), (data, msg, lr),
                                                   strategy=strategy,
                                                   chunk_size=cfg.map_chunk_size)
    slots = CohortSlots(ids, ids, jnp.ones(ids.shape, bool))
    (new,), (payloads,), screened = rd.screen(cfg_b, t, key, (slots,), (sel,), (new,),
                                              (payloads,), (losses,))
    present = screened.present[0]
    reference = inner.update_reference(server)
    delta = jax.tree_util.tree_map(
        lambda u, g: jnp.where(present.reshape((-1,) + (1,) * g.ndim), u - g[None],
                               jnp.zeros((), u.dtype)), payloads, reference)
    clients = jax.tree_util.tree_map(lambda a, n: a.at[ids].set(n), clients, new)
    return clients, delta, present, payloads, msg, slots, screened

  def start(clients, pool, server, ids, slots_in_pool, data, key, lr, t):
    clients, delta, present, payloads, msg, slots, screened = train(clients, server, ids, data,
                                                                    key, lr, t)
    finish = pool.clock + latencies(key, ids, pool.speed, fb)
    pool = push(pool, slots_in_pool, delta, finish, t, ids, present)
    return clients, pool, payloads, msg, slots, screened

  def step(state: FedState, data, key):
    server, pool, t = state.server['algorithm'], state.server['fedbuff'], state.round
    lr = cfg.lr_fn(t)
    clients = state.clients
    if p > b:  # step 0: the other P - B clients start from x_0 too
      def prefill(args):
        c, pl = args
        pkey = jax.random.fold_in(key, PREFILL_STREAM)
        ids = sample_idle(pkey, jnp.zeros((num_clients,), bool), p - b)
        c, pl, *_ = start(c, pl, server, ids, jnp.arange(b, p, dtype=jnp.int32), data, pkey, lr,
                          t)
        return c, pl
      clients, pool = jax.lax.cond(t == 0, prefill, lambda a: a, (clients, pool))
    ids = sample_idle(key, busy_clients(pool, num_clients), b)
    clients, pool, payloads, msg, slots, screened = start(clients, pool, server, ids, pool.free,
                                                         data, key, lr, t)
    order = pop_order(pool, b)
    stale = t - pool.version[order]
    present = pool.present[order]
    counts = jnp.where(present, data.n[pool.cid[order]], 0).astype(fdtype)
    total = jnp.sum(counts)
    weights = counts / jnp.where(total > 0, total, 1) * staleness_weight(fb, stale).astype(fdtype)
    reference = inner.update_reference(server)
    proposal = jax.tree_util.tree_map(
        lambda g, d: g + jnp.tensordot(weights, d[order].astype(fdtype), axes=1).astype(g.dtype),
        reference, pool.delta)
    aggregated = inner.aggregate(server, jax.tree_util.tree_map(lambda a: a[None], proposal),
                                 jnp.ones((1,), fdtype), pool.cid[order][:1])
    new_server = rd._keep_if_nobody(present, aggregated, server)
    pool = advance(pool, order)
    clock = pool.clock
    metrics = {'loss': screened.loss, 'lr': lr,
               **comm.round_metrics(inner, msg, (payloads,), (b,), state, server),
               'virtual_time': clock, 'staleness_mean': jnp.mean(stale.astype(jnp.float32)),
               'staleness_max': jnp.max(stale).astype(jnp.float32),
               **rd.fault_metrics(cfg_b, (slots,), screened)}
    if p > b:  # the prefill's downloads
      metrics['bytes_down'] = metrics['bytes_down'] + jnp.where(
          t == 0, metrics['bytes_down'] * ((p - b) / b), 0.0)
    return FedState(clients=clients, server={'algorithm': new_server, 'fedbuff': pool},
                    round=t + 1), metrics

  return strategies.jit_replicated(step, donate_argnums=(0,) if donate else ())


def virtual_times(fb: FedBuffConfig, init_key: jax.Array, run_key: jax.Array, num_clients: int,
                  steps: int) -> list:
  """The virtual clock after each of `steps` server steps, without training (the schedule does not
  depend on the model): for choosing the step count that reaches a given virtual time. The same
  draws and pool helpers as `make_step`, with one-float stand-ins for the deltas
  (tests/core/test_fedbuff.py checks it against a run's logged clock)."""
  check(fb, num_clients)
  p, b = fb.concurrency, fb.buffer_size
  ref = jnp.zeros((1,), jnp.float32)
  pool = init_pool(ref, init_key, num_clients, fb)

  @jax.jit
  def one(pool, t):
    key = rng.round_key(run_key, t)
    if p > b:
      def prefill(pl):
        pkey = jax.random.fold_in(key, PREFILL_STREAM)
        ids = sample_idle(pkey, jnp.zeros((num_clients,), bool), p - b)
        return push(pl, jnp.arange(b, p, dtype=jnp.int32), jnp.zeros((p - b, 1), jnp.float32),
                    pl.clock + latencies(pkey, ids, pl.speed, fb), t, ids,
                    jnp.ones((p - b,), bool))
      pool = jax.lax.cond(t == 0, prefill, lambda a: a, pool)
    ids = sample_idle(key, busy_clients(pool, num_clients), b)
    pool = push(pool, pool.free, jnp.zeros((b, 1), jnp.float32),
                pool.clock + latencies(key, ids, pool.speed, fb), t, ids, jnp.ones((b,), bool))
    return advance(pool, pop_order(pool, b))

  out = []
  for t in range(steps):
    pool = one(pool, jnp.int32(t))
    out.append(float(pool.clock))
  return out
