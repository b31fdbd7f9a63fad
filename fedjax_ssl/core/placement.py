"""Placement of the client axis over processes: who holds which clients' data and state.

* 'replicated' (the default): every process holds every client's rows (`FedData`) and, with
  `client_state='host'`, every client's stored state; only the participants' work is split
  (strategies.py).
* 'divided': the C clients are cut into P contiguous blocks, block p held by process p
  (`owned_range`): its clients' rows (`LocalClients`) and their stored states, in host memory
  (`client_state='host'`: numpy) or on the process's first device (`'device'`); with cohorts
  each cohort's stack is cut on its own, by member rank (`StateBlock`, `round.state_blocks`), so
  a client's state and rows may sit on different processes. A process's resident client data
  and state are about 1/P of the whole.

Under 'divided' each round's participants reach every process by one JAX all-gather
(`exchange`, `multihost_utils.process_allgather`) of the rows their owners hold; the round then
runs the same traced program as 'replicated' on a `FedData` holding only the participants' rows
(`participant_data`, same `n`, `n_max`, `n_min`): the offsets point into the smaller array and the
rows read are the same bytes, so a run's numbers do not depend on the process count
(tests/core/test_placement.py). The evaluation gathers the held rows' features the same way
(`gather_rows`; run_setup.TrainFeatures).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from fedjax_ssl.data.types import FedData

PLACEMENTS = ('replicated', 'divided')


def owned_range(num_clients: int, process_index: int, process_count: int) -> Tuple[int, int]:
  """[lo, hi): the clients process `process_index` of `process_count` holds (np.array_split's cut:
  the first C mod P blocks one client longer)."""
  if not 1 <= process_count <= num_clients:
    raise ValueError(f'process count {process_count} is invalid for placement "divided": must be in '
                     f'[1, num_clients={num_clients}] (each process holds at least one client)')
  base, extra = divmod(num_clients, process_count)
  lo = process_index * base + min(process_index, extra)
  return lo, lo + base + (process_index < extra)


def owners(ids: np.ndarray, num_clients: int, process_count: int) -> np.ndarray:
  """int [m]: the process holding each client of `ids`."""
  bounds = np.array([owned_range(num_clients, p, process_count)[1] for p in range(process_count)])
  return np.searchsorted(bounds, np.asarray(ids), side='right')


@dataclasses.dataclass(frozen=True)
class LocalClients:
  """The clients one process holds under 'divided' (host numpy).

  Attributes:
    lo, hi: this process holds global clients lo .. hi - 1.
    x: uint8 [Σ_{lo<=c<hi} n_c, H, W, ch], the held clients' rows, flat (FedData's layout).
    y: int32 [same rows].
    offsets: int64 [hi - lo], first row of each held client in `x`.
    n: int32 [C], every client's size (known to every process: the partition is drawn from the
      labels of all rows).
    n_max, n_min: max(n) (at least 1) and min(n) over all clients, as FedData's.
    public_x: uint8 [L, H, W, ch] or None; every process holds the public set.
    process_count: P.
  """
  lo: int
  hi: int
  x: np.ndarray
  y: np.ndarray
  offsets: np.ndarray
  n: np.ndarray
  n_max: int
  n_min: int
  public_x: Optional[np.ndarray]
  process_count: int

  @property
  def num_clients(self) -> int:
    return int(self.n.shape[0])

  @property
  def process_index(self) -> int:
    """The process holding this block."""
    return int(owners(np.array([self.lo]), self.num_clients, self.process_count)[0])

  def client_rows(self, cid: int) -> Tuple[np.ndarray, np.ndarray]:
    """The held client `cid`'s padded view: x uint8 [n_max, ...] (zeros past n), y int32 [n_max]
    (-1 past n), as FedData.client."""
    if not self.lo <= cid < self.hi:
      raise ValueError(f'client {cid} is not held by this process: it holds [{self.lo}, {self.hi})')
    start, k = int(self.offsets[cid - self.lo]), int(self.n[cid])
    x = np.zeros((self.n_max,) + self.x.shape[1:], self.x.dtype)
    y = np.full((self.n_max,), -1, np.int32)
    x[:k], y[:k] = self.x[start:start + k], self.y[start:start + k]
    return x, y


def divide(fed: FedData, process_index: int, process_count: int) -> LocalClients:
  """The share of a whole `FedData` that process `process_index` holds (host copies of its rows;
  the caller drops `fed` afterwards)."""
  n = np.asarray(jax.device_get(fed.n)).astype(np.int32)
  offsets = np.asarray(jax.device_get(fed.offsets)).astype(np.int64)
  lo, hi = owned_range(len(n), process_index, process_count)
  start = int(offsets[lo])
  stop = int(offsets[hi - 1] + n[hi - 1])
  x, y = np.asarray(jax.device_get(fed.x)), np.asarray(jax.device_get(fed.y))
  public = None if fed.public_x is None else np.asarray(jax.device_get(fed.public_x))
  return LocalClients(lo=lo, hi=hi, x=x[start:stop].copy(), y=y[start:stop].astype(np.int32),
                      offsets=offsets[lo:hi] - start, n=n, n_max=int(fed.n_max),
                      n_min=int(n.min()) if len(n) else 0, public_x=public,
                      process_count=process_count)


def divide_rows(train_x, train_y: np.ndarray, indices, public_idx: np.ndarray,
                process_index: int, process_count: int) -> LocalClients:
  """The share process `process_index` holds, read from the training split: only its clients'
  rows and the public set's are read (one read of `train_x`, a `types.Rows` left in its source or
  an array). Equals `divide` of the whole federation built from the same rows.

  Args:
    train_x: uint8 [N, H, W, ch] (`Rows` or array); train_y: int [N].
    indices: C int arrays, each client's rows of the split (`partition.draw_rows`).
    public_idx: int [L], the public set's rows (every process holds them).
  """
  n = np.array([len(i) for i in indices], np.int32)
  offsets = np.concatenate([[0], np.cumsum(n[:-1], dtype=np.int64)])
  lo, hi = owned_range(len(n), process_index, process_count)
  held = np.concatenate([np.asarray(i, np.int64) for i in indices[lo:hi]]
                        + [np.asarray(public_idx, np.int64)])
  rows = train_x[held]
  x, public = rows[:len(held) - len(public_idx)], rows[len(held) - len(public_idx):]
  return LocalClients(lo=lo, hi=hi, x=x, y=np.asarray(train_y)[held[:len(x)]].astype(np.int32),
                      offsets=offsets[lo:hi] - offsets[lo], n=n, n_max=max(int(n.max()), 1),
                      n_min=int(n.min()), public_x=public if len(public_idx) else None,
                      process_count=process_count)


def federation_shapes(local: LocalClients) -> FedData:
  """The whole federation's `FedData` with its rows as `jax.ShapeDtypeStruct`s (sizes and offsets
  real): what `round.message_bytes` traces, known on every process without the other blocks."""
  rows = max(int(np.sum(local.n)), 1)
  offsets = np.concatenate([[0], np.cumsum(local.n[:-1])]).astype(np.int32)
  shape = lambda n, a: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype)
  return FedData(x=shape(rows, local.x), y=shape(rows, local.y), n=local.n, offsets=offsets,
                 n_max=local.n_max, n_min=local.n_min,
                 public_x=None if local.public_x is None else shape(len(local.public_x),
                                                                    local.public_x))


def exchange(held: Any, owner: np.ndarray, process_count: int) -> Any:
  """Every participant's rows on every process, from the rows their owners hold.

  Args:
    held: pytree of numpy arrays [k, ...]: this process's participants' rows, in slot order
      (k = the number of slots whose owner is this process).
    owner: int [m], the process holding each slot's client.
    process_count: P.
  Returns:
    the pytree with leaves [m, ...] in slot order, equal on every process. One all-gather of
    P · max_p k_p rows per leaf; exact (rows are moved, never summed).
  """
  if process_count == 1:
    return held
  owner = np.asarray(owner)
  k_max = int(np.bincount(owner, minlength=process_count).max())
  padded = jax.tree_util.tree_map(
      lambda a: np.concatenate([a, np.zeros((k_max - a.shape[0],) + a.shape[1:], a.dtype)]), held)
  gathered = multihost_utils.process_allgather(padded)  # leaves [P, k_max, ...]
  rank = np.zeros(len(owner), np.int64)  # slot j's position among its owner's slots
  for p in np.unique(owner):
    rank[owner == p] = np.arange(np.sum(owner == p))
  return jax.tree_util.tree_map(lambda g: np.asarray(g)[owner, rank], gathered)


def gather_rows(held: np.ndarray, local: LocalClients) -> np.ndarray:
  """Every client's rows of a per-row array, on every process, from the rows each process holds.

  Args:
    held: [Σ_{lo<=c<hi} n_c, ...], one row per row of `local.x` (their features, say).
    local: this process's `LocalClients`.
  Returns:
    [Σ_c n_c, ...] in the whole federation's row order (client by client, FedData's flat
    layout), equal on every process: one `exchange`, rows moved and never summed.
  """
  n = np.asarray(local.n, np.int64)
  owner = np.repeat(owners(np.arange(len(n)), len(n), local.process_count), n)
  return exchange(held, owner, local.process_count)


def participant_data(local: LocalClients, ids: np.ndarray) -> FedData:
  """A FedData (host numpy) holding only the participants' rows, for the round of `ids`.

  Participant j's padded view occupies rows j·n_max .. (j+1)·n_max - 1 of `x` and
  offsets[ids[j]] = j·n_max; `n`, `n_max` and `n_min` are the whole federation's, so a round on it
  reads the same rows a round on the whole FedData reads. Offsets of non-participants are 0: a
  round reads no one else's rows (an algorithm whose `prepare` does is refused, round.validate).

  Args:
    ids: int [m], the round's participants (every process passes the same).
  """
  ids = np.asarray(ids)
  owner = owners(ids, local.num_clients, local.process_count)
  rows = [local.client_rows(int(c)) for c in ids[owner == local.process_index]]
  empty = (np.zeros((0, local.n_max) + local.x.shape[1:], local.x.dtype),
           np.zeros((0, local.n_max), np.int32))
  held = tuple(np.stack(r) for r in zip(*rows)) if rows else empty
  x, y = exchange(held, owner, local.process_count)
  offsets = np.zeros((local.num_clients,), np.int32)
  offsets[ids] = np.arange(len(ids), dtype=np.int32) * local.n_max
  return FedData(x=x.reshape((-1,) + x.shape[2:]), y=y.reshape(-1), n=local.n, offsets=offsets,
                 n_max=local.n_max, public_x=local.public_x, n_min=local.n_min)


def held_data(local: LocalClients) -> FedData:
  """A FedData (host numpy) of the held clients' rows: `client(c)` reads client c's rows for
  lo <= c < hi (offsets into `local.x`; the others' offsets are 0, their rows absent). No
  collective: each process builds its own."""
  offsets = np.zeros((local.num_clients,), np.int32)
  offsets[local.lo:local.hi] = local.offsets
  return FedData(x=local.x, y=local.y, n=local.n, offsets=offsets, n_max=local.n_max,
                 public_x=local.public_x, n_min=local.n_min)


def local_rows(stack: Any, lo: int, hi: int) -> Any:
  """The rows lo .. hi - 1 of a stacked client pytree (host numpy), copied."""
  return jax.tree_util.tree_map(lambda a: np.array(a[lo:hi], copy=True), stack)


@dataclasses.dataclass(frozen=True)
class StateBlock:
  """The rows of a stack of `num` client states (one cohort's, in member order; a plain
  algorithm's: every client) that one process holds under 'divided': rows lo .. hi - 1
  (`owned_range` of `num` over `process_count` processes)."""
  lo: int
  hi: int
  num: int
  process_count: int

  @classmethod
  def of(cls, num: int, process_index: int, process_count: int) -> 'StateBlock':
    return cls(*owned_range(num, process_index, process_count), num, process_count)


def block_rows(block: StateBlock, rows: np.ndarray, valid: Optional[np.ndarray] = None
               ) -> np.ndarray:
  """int32 [m]: each slot's row in this process's block (`rows` [m] are rows of the whole stack),
  or hi - lo (one past the block) for a row another process holds (or a slot not `valid`): a
  gather clamps it, a scatter drops it."""
  rows = np.asarray(rows)
  put = (rows >= block.lo) & (rows < block.hi)
  if valid is not None:
    put &= np.asarray(valid)
  return np.where(put, rows - block.lo, block.hi - block.lo).astype(np.int32)


@jax.jit
def _take_rows(stack: Any, rows: jax.Array) -> Any:
  return jax.tree_util.tree_map(lambda a: a.at[rows].get(mode='clip'), stack)


def _put_rows(stack: Any, rows: jax.Array, new: Any) -> Any:
  return jax.tree_util.tree_map(lambda a, b: a.at[rows].set(b, mode='drop'), stack, new)


_PUT_ROWS = {True: jax.jit(_put_rows, donate_argnums=0), False: jax.jit(_put_rows)}


def participant_states(stack: Any, block: StateBlock, rows: np.ndarray) -> Any:
  """The stored states [m, ...] (host numpy) of the stack's `rows` [m] (every process passes the
  same), from the held block (leaves [hi - lo, ...], numpy or on one device), via `exchange`. On a
  device, one fixed-shape gather of m rows (one program whatever the number held), then the held
  ones leave the device."""
  local = block_rows(block, rows)
  mine = local < block.hi - block.lo
  if on_device(stack):
    taken = jax.device_get(_take_rows(stack, jax.device_put(local, _device(stack))))
    held = jax.tree_util.tree_map(lambda a: a[mine], taken)
  else:
    held = jax.tree_util.tree_map(lambda a: a[local[mine]], stack)
  return exchange(held, owners(rows, block.num, block.process_count), block.process_count)


def store_states(stack: Any, new: Any, block: StateBlock, rows: np.ndarray, valid: np.ndarray,
                 donate: bool = True) -> Any:
  """The held stack with the new states (leaves [m, ...]) of the held, valid slots' `rows`
  written in: numpy in place; on a device by one scatter that donates the stack unless not
  `donate`."""
  local = block_rows(block, rows, valid)
  if on_device(stack):
    device = _device(stack)
    # One process: `new` may be sharded over its devices (strategy 'shard'), gathered here;
    # several: the round's outputs are replicated (strategies.jit_replicated), a local copy read.
    new = jax.tree_util.tree_map(
        lambda b: jax.device_put(b if b.is_fully_addressable else b.addressable_shards[0].data,
                                 device), new)
    return _PUT_ROWS[donate](stack, jax.device_put(local, device), new)
  put = local < block.hi - block.lo
  new = jax.device_get(new)

  def write(a, b):
    a[local[put]] = b[put]
  jax.tree_util.tree_map(write, stack, new)
  return stack


def on_device(stack: Any) -> bool:
  """Whether a client stack's leaves are jax arrays (device-resident), not host numpy."""
  leaves = jax.tree_util.tree_leaves(stack)
  return bool(leaves) and isinstance(leaves[0], jax.Array)


def _device(stack: Any) -> jax.Device:
  (device,) = jax.tree_util.tree_leaves(stack)[0].devices()
  return device


def check_processes(num_clients: int, process_count: int, stateful: bool,
                    cohorts: Sequence[Tuple[str, int]] = ()) -> None:
  """Raises before compute when `process_count` processes cannot divide the clients: each must
  hold one at least, and when the clients keep a state the same number (a checkpoint stores the
  held states as one array cut evenly over the processes, `to_global`). With cohorts ((name,
  size) each: each cohort's states are cut over the processes on their own, `StateBlock`), the
  same of every cohort."""
  owned_range(num_clients, 0, process_count)
  if stateful and num_clients % process_count:
    raise ValueError(f"num_clients = {num_clients} is invalid for placement 'divided' on "
                     f'{process_count} processes with a client state: must be a multiple of the '
                     'process count (each process holds and checkpoints an equal block of '
                     'clients)')
  for name, size in cohorts:
    if size < process_count or (stateful and size % process_count):
      need, why = (('a multiple of', 'holds and checkpoints an equal block') if stateful else
                   ('at least', 'holds a block'))
      raise ValueError(f"cohort {name!r} of {size} clients is invalid for placement 'divided' on "
                       f'{process_count} processes: its size must be {need} the process count '
                       f'(each process {why} of every cohort)')


def _process_sharding() -> jax.sharding.NamedSharding:
  """The client axis cut over the processes: one device of each (its first), in process order."""
  firsts = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
            for p in range(jax.process_count())]
  mesh = jax.sharding.Mesh(np.array(firsts), ('processes',))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('processes'))


def to_global(held: Any, num_clients: int) -> Any:
  """The held rows (leaves [C / P, ...], host numpy) as global arrays [C, ...] cut over the
  processes, each process contributing its rows (no transfer): what a checkpoint saves, each
  process writing its own block."""
  sharding = _process_sharding()
  return jax.tree_util.tree_map(
      lambda a: jax.make_array_from_process_local_data(sharding, a, (num_clients,) + a.shape[1:]),
      held)


def global_template(held: Any, num_clients: int) -> Any:
  """`jax.ShapeDtypeStruct`s of `to_global(held)` under this run's process count: a checkpoint
  written under another count is read back cut for this one."""
  sharding = _process_sharding()
  return jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct((num_clients,) + a.shape[1:], a.dtype, sharding=sharding),
      held)


def to_held(global_tree: Any) -> Any:
  """This process's rows of global arrays cut over the processes, as host numpy."""
  return jax.tree_util.tree_map(lambda a: np.array(a.addressable_shards[0].data, copy=True),
                                global_tree)
