"""Containers shared by data sources, partitioners and the federated engine."""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Optional, Sequence, Tuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


class Rows:
  """uint8 images [N, H, W, C] left in their source and read by row on demand: the training split
  of a run under placement 'divided', where each process reads only the rows of its clients
  (core/placement.py `divide_rows`) and the public set.

  Indexing with integers (any order, repeats) reads those rows and returns a numpy array; a slice
  with step 1 returns the Rows of that range, reading nothing; `np.asarray(rows)` reads every row.
  `chunks` streams the split in order (statistics, a digest) without holding it.

  Args:
    shape: (N, H, W, C) of the split.
    read: sorted unique int64 rows [k] -> iterator of (j, uint8 [b, H, W, C]): the images of
      rows[j:j + b], blocks in order covering the k rows (a read never holds them twice).
    chunks: size -> iterator over the split in order, uint8 arrays of up to `size` rows.
    start: the first source row of this view (a slice of the source's Rows).
  """
  dtype = np.dtype(np.uint8)

  def __init__(self, shape: Tuple[int, ...],
               read: Callable[[np.ndarray], Iterator[Tuple[int, np.ndarray]]],
               chunks: Callable[[int], Iterator[np.ndarray]], start: int = 0):
    self.shape = tuple(int(s) for s in shape)
    self._read, self._chunks, self._start = read, chunks, int(start)

  ndim = property(lambda self: len(self.shape))
  size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))

  def __len__(self) -> int:
    return self.shape[0]

  def __getitem__(self, key) -> 'np.ndarray | Rows':
    if isinstance(key, slice):
      start, stop, step = key.indices(len(self))
      if step != 1:
        return self[np.arange(start, stop, step)]
      return Rows((max(stop - start, 0),) + self.shape[1:], self._read, self._chunks,
                  self._start + start)
    rows = np.asarray(key)
    if rows.dtype.kind not in 'iu':
      raise TypeError(f'Rows are indexed by integers or a slice, got {rows.dtype} {rows.shape}')
    if rows.size and (rows.min() < -len(self) or rows.max() >= len(self)):
      raise IndexError(f'row {int(rows.min()) if rows.min() < 0 else int(rows.max())} is out of '
                       f'range for {len(self)} rows')
    rows = np.where(rows < 0, rows + len(self), rows).astype(np.int64).ravel()
    unique, inverse = np.unique(rows, return_inverse=True)
    out = np.empty((rows.size,) + self.shape[1:], np.uint8)
    # Each block goes straight to its output positions: the rows are held once, in `out`.
    order = np.argsort(inverse, kind='stable')
    first = np.searchsorted(inverse[order], np.arange(unique.size + 1))
    if unique.size:
      for j, block in self._read(unique + self._start):
        at = order[first[j]:first[j + len(block)]]
        out[at] = block[inverse[at] - j]
    return out.reshape(np.shape(key) + self.shape[1:])

  def chunks(self, size: int) -> Iterator[np.ndarray]:
    """The rows in order, in chunks of at most `size` rows (a view's first and last chunks are
    cut from the source's)."""
    left, skip = len(self), self._start
    for chunk in self._chunks(size):
      if skip >= len(chunk):
        skip -= len(chunk)
        continue
      chunk = chunk[skip:skip + left]
      skip, left = 0, left - len(chunk)
      if len(chunk):
        yield chunk
      if not left:
        return

  def __array__(self, dtype=None, copy=None):
    del copy  # a new array either way
    out = np.empty(self.shape, np.uint8)
    at = 0
    for chunk in self.chunks(4096):
      out[at:at + len(chunk)] = chunk
      at += len(chunk)
    return out if dtype is None else out.astype(dtype)


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A labelled image dataset held in host memory.

  Attributes:
    name: catalog name, e.g. 'fashion_mnist'.
    train_x: uint8 [N_train, H, W, C] (NHWC; grayscale has C=1): an array, or `Rows` read from the
      source on demand (`sources.load_dataset(..., rows_on_demand=True)`).
    train_y: int32 [N_train].
    test_x: uint8 [N_test, H, W, C].
    test_y: int32 [N_test].
    num_classes: number of label values (labels lie in [0, num_classes)).
    mean, std: per-channel statistics of the clients' images (train_x, or unlabeled_x when given)
      scaled to [0, 1], len C; used by `augment.normalize`.
    unlabeled_x: uint8 [U, H, W, C] or None: images without labels that the clients train on
      instead of train_x (STL-10's unlabelled split); train_x / train_y then serve only the
      evaluation (probe, kNN memory bank).
  """
  name: str
  train_x: np.ndarray
  train_y: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray
  num_classes: int
  mean: Tuple[float, ...]
  std: Tuple[float, ...]
  unlabeled_x: Optional[np.ndarray] = None

  @property
  def image_shape(self) -> Tuple[int, int, int]:
    return tuple(self.train_x.shape[1:])


@dataclasses.dataclass(frozen=True)
class DataInfo:
  """What an algorithm's `build` needs to know of the loaded data (no arrays of images).

  Attributes:
    name: dataset name.
    image_shape: (H, W, C) of the stored images.
    num_classes: number of label values.
    mean, std: per-channel normalisation statistics (those of `Dataset`).
    client_sizes: int [C] examples per client (`FedData.n`), or None before partitioning; FedSC
      with DP needs it (its noise level and privacy ledger depend on |D_j|).
  """
  name: str
  image_shape: Tuple[int, int, int]
  num_classes: int
  mean: Tuple[float, ...]
  std: Tuple[float, ...]
  client_sizes: Optional[np.ndarray] = None

  @classmethod
  def of(cls, dataset: Dataset, client_sizes: Optional[np.ndarray] = None) -> 'DataInfo':
    return cls(dataset.name, tuple(int(s) for s in dataset.image_shape), int(dataset.num_classes),
               tuple(dataset.mean), tuple(dataset.std),
               None if client_sizes is None else np.asarray(client_sizes))


@flax.struct.dataclass
class FedData:
  """Device-resident federated data: every client's real rows in one flat array.

  Client c owns rows offsets[c] .. offsets[c] + n[c] - 1 of `x` and `y`, so the arrays hold the
  Σ n real rows and nothing else: a skewed partition costs no padding (a padded [C, n_max] layout
  held n_max · C rows, 6.4x Σ n for 100 Fashion-MNIST clients at Dirichlet alpha = 0.1). Batches
  are gathered on the device inside the round from these rows (core/local.py); `client` gives the
  padded view of one client for the functions that read its whole data (upload, prepare).

  Attributes:
    x: uint8 [R, H, W, ch], R = max(Σ n, 1) (one zero row when every client is empty).
    y: int32 [R]. Used only by supervised methods and evaluation.
    n: int32 [C], true number of examples of each client.
    offsets: int32 [C], first row of each client (the exclusive cumulative sum of n).
    n_max: static int, max(n) (at least 1): the length of a client's padded view and of its
      per-epoch permutation (core/local.py), so the random order of a client's rows depends only on
      its own key and n_max.
    public_x: uint8 [L, H, W, ch] public/RAD set carved out before partitioning, or None.
    n_min: static int, min(n), or 0 when not known. When every client runs the same number of local
      steps (steps of n_min = steps of n_max) a vmapped round trains them in one phase instead of
      phases of shrinking width (core/local.py): each phase is another copy of the training step
      in the compiled program.
  """
  x: jax.Array
  y: jax.Array
  n: jax.Array
  offsets: jax.Array
  n_max: int = flax.struct.field(pytree_node=False)
  public_x: Optional[jax.Array] = None
  n_min: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def num_clients(self) -> int:
    return self.n.shape[0]

  def client(self, cid: jax.Array) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """One client's padded view (traceable, cid an int32 scalar).

    Returns:
      x uint8 [n_max, H, W, ch] (zeros past n), y int32 [n_max] (-1 past n), n int32 scalar.
    """
    n = self.n[cid]
    valid = jnp.arange(self.n_max) < n
    rows = jnp.minimum(self.offsets[cid] + jnp.arange(self.n_max), self.x.shape[0] - 1)
    x = jnp.where(valid.reshape((-1,) + (1,) * (self.x.ndim - 1)), self.x[rows], 0)
    return x.astype(self.x.dtype), jnp.where(valid, self.y[rows], -1), n

  def padded(self) -> Tuple[np.ndarray, np.ndarray]:
    """Host copies in the padded layout: x uint8 [C, n_max, H, W, ch], y int32 [C, n_max]."""
    x, y = np.asarray(self.x), np.asarray(self.y)
    n, off = np.asarray(self.n), np.asarray(self.offsets)
    px = np.zeros((len(n), self.n_max) + x.shape[1:], x.dtype)
    py = np.full((len(n), self.n_max), -1, y.dtype)
    for c, (o, k) in enumerate(zip(off, n)):
      px[c, :k], py[c, :k] = x[o:o + k], y[o:o + k]
    return px, py

  @classmethod
  def from_clients(cls, xs: Sequence[np.ndarray], ys: Sequence[np.ndarray],
                   public_x: Optional[np.ndarray] = None, n_max: Optional[int] = None,
                   on_host: bool = False) -> 'FedData':
    """Builds the flat layout from per-client arrays xs[c] [n_c, H, W, ch] and ys[c] [n_c].

    n_max: the padded view's length (default max n_c); a larger value only lengthens each client's
      permutation draw, as a wider padding did in a padded layout.
    on_host: numpy arrays instead of device arrays (placement 'divided' keeps a block of them,
      core/placement.py, and never puts the whole federation on a device).
    """
    if len(xs) != len(ys) or not xs:
      raise ValueError(f'need one label array per client and at least one client; got {len(xs)} '
                       f'image arrays and {len(ys)} label arrays')
    sizes = np.array([len(a) for a in xs], np.int64)
    for c, (a, b) in enumerate(zip(xs, ys)):
      if len(b) != len(a):
        raise ValueError(f'client {c} has {len(a)} images but {len(b)} labels')
    largest = max(int(sizes.max()), 1)
    if n_max is not None and n_max < largest:
      raise ValueError(f'n_max = {n_max} is invalid: the largest client holds {largest} rows')
    x, y = np.concatenate(xs), np.concatenate(ys).astype(np.int32)
    if not len(x):  # keep one (never read) row so that gathers have something to clamp to
      x, y = np.zeros((1,) + np.asarray(xs[0]).shape[1:], np.uint8), np.full((1,), -1, np.int32)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    to = np.asarray if on_host else jnp.asarray
    return cls(x=to(x), y=to(y), n=to(sizes.astype(np.int32)),
               offsets=to(offsets.astype(np.int32)), n_max=n_max or largest,
               public_x=None if public_x is None else to(public_x), n_min=int(sizes.min()))

  @classmethod
  def from_padded(cls, x, y, n, public_x=None) -> 'FedData':
    """Builds the flat layout from padded arrays x [C, n_max, H, W, ch], y [C, n_max], n [C]."""
    x, y, n = np.asarray(x), np.asarray(y), np.asarray(n)
    return cls.from_clients([x[c, :k] for c, k in enumerate(n)],
                            [y[c, :k] for c, k in enumerate(n)], public_x, n_max=x.shape[1])
