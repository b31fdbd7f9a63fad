"""Execution strategies for the client axis. All compute the same function; they differ in how XLA
sees the client axis:

* 'vmap'  — one fused program over all participants (batched GEMMs; best on accelerators).
* 'map'   — `lax.map` over chunks of `chunk_size` clients, each chunk vmapped (bounded memory; with
            chunk 1 clients run one after another inside ONE compiled program, no Python dispatch).
* 'shard' — the participant axis split over a 1-D device mesh named 'clients' (`jax.shard_map`),
            each device running its local clients in chunks of `chunk_size` (one vmap when the
            chunk covers them all). On a CPU host with one XLA device per core
            (`--xla_force_host_platform_device_count`) this runs clients on all cores at once.

Several processes (`jax.distributed.initialize()`, JAX's multi-controller runtime): the mesh holds
every process's devices. Every process holds the whole data and state, replicated over the mesh
(`replicate`), and the round's outputs are kept replicated (`jit_replicated`), so each process can
read metrics and state without a collective; only the participants' work is split.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

STRATEGIES = ('vmap', 'map', 'shard')


def default_strategy(backend: str | None = None) -> str:
  """Default per backend, chosen by measurement (docs/notes/performance.md#execution-strategies)."""
  backend = backend or jax.default_backend()
  return 'map' if backend == 'cpu' else 'vmap'


def resolve_strategy(strategy: str) -> str:
  if strategy == 'auto':
    return default_strategy()
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy = {strategy!r} is invalid: must be 'auto' or one of {STRATEGIES}")
  return strategy


def check_participants(strategy: str, num_participants: int, chunk_size: int) -> None:
  """Raises before compilation if the participant count does not fit the strategy."""
  if strategy in ('map', 'shard') and chunk_size < 1:
    raise ValueError(f'map_chunk_size = {chunk_size} is invalid: must be >= 1')
  if strategy == 'shard':
    ndev = jax.device_count()
    if num_participants % ndev:
      raise ValueError(
          f'clients_per_round = {num_participants} is invalid for strategy "shard": it must be a '
          f'multiple of the device count {ndev}')


def _batched(fn: Callable, shared: tuple) -> Callable:
  """vmap of fn over the leading axis of its client arguments — except for an axis of size 1, where
  fn is applied to the squeezed arguments. jax 0.10.2 / XLA:CPU miscompiles our local-training scan
  when it is vmapped over a size-1 axis inside an outer scan or shard_map (results off by O(1); see
  docs/notes/performance.md#execution-strategies); never creating such an axis avoids it and costs nothing."""
  def run(*per_client):
    size = jax.tree_util.tree_leaves(per_client)[0].shape[0]
    if size == 1:
      out = fn(*jax.tree_util.tree_map(lambda a: a[0], per_client), *shared)
      return jax.tree_util.tree_map(lambda a: a[None], out)
    return jax.vmap(lambda *a: fn(*a, *shared))(*per_client)
  return run


def _chunked_map(batched_fn: Callable, per_client: tuple, chunk_size: int) -> Any:
  """`lax.map` over chunks of `chunk_size` clients (the last, smaller chunk separately), each chunk
  through `batched_fn`. Written out instead of `lax.map(batch_size=...)`, which vmaps even chunks of
  size 1 (see `_batched`)."""
  m = jax.tree_util.tree_leaves(per_client)[0].shape[0]
  full = (m // chunk_size) * chunk_size
  outs = []
  if full:
    chunks = jax.tree_util.tree_map(
        lambda a: a[:full].reshape((full // chunk_size, chunk_size) + a.shape[1:]), per_client)
    ys = jax.lax.map(lambda c: batched_fn(*c), chunks)
    outs.append(jax.tree_util.tree_map(lambda a: a.reshape((full,) + a.shape[2:]), ys))
  if full < m:
    outs.append(batched_fn(*jax.tree_util.tree_map(lambda a: a[full:], per_client)))
  if len(outs) == 1:
    return outs[0]
  return jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), *outs)


def map_clients(fn: Callable, per_client: Sequence[Any], shared: Sequence[Any], *, strategy: str,
                chunk_size: int = 1) -> Any:
  """Applies fn(*client_args, *shared) to every client.

  Args:
    fn: function of one client's arguments followed by the shared (broadcast) arguments.
    per_client: pytrees whose leaves have a leading participant axis [m, ...].
    shared: pytrees passed unchanged to every call.
    strategy: one of STRATEGIES.
    chunk_size: clients per chunk for 'map' and, per device, for 'shard'.
  Returns:
    fn's outputs stacked over the participant axis.
  """
  per_client, shared = tuple(per_client), tuple(shared)
  if strategy == 'vmap':
    return _batched(fn, shared)(*per_client)
  if strategy == 'map':
    return _chunked_map(_batched(fn, shared), per_client, chunk_size)
  if strategy == 'shard':
    mesh = Mesh(np.array(jax.devices()), ('clients',))

    def local(pc, sh):
      return _chunked_map(_batched(fn, sh), pc, chunk_size)
    # Shared arguments are replicated; outputs keep the sharded client axis, so the server
    # reduction afterwards is one all-reduce.
    return jax.shard_map(local, mesh=mesh, in_specs=(P('clients'), P()), out_specs=P('clients'),
                         check_vma=False)(per_client, shared)
  raise ValueError(f'strategy = {strategy!r} is invalid: must be one of {STRATEGIES}')


def multi_process() -> bool:
  """True under `jax.distributed` with more than one process."""
  return jax.process_count() > 1


def _replicated_sharding() -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(Mesh(np.array(jax.devices()), ('clients',)), P())


def replicate(tree: Any) -> Any:
  """`tree` as global arrays replicated on every device of every process (each process passes the
  same values; no cross-process traffic). Single process: `tree` unchanged."""
  if not multi_process():
    return tree
  sharding = _replicated_sharding()
  return jax.tree_util.tree_map(
      lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a), np.shape(a)), tree)


def jit_replicated(fn: Callable, **jit_kw) -> Callable:
  """`jax.jit(fn)` whose outputs are replicated over every process's devices when there are
  several processes (so they can be read on each one and fed back in)."""
  if multi_process():
    jit_kw['out_shardings'] = _replicated_sharding()
  return jax.jit(fn, **jit_kw)
