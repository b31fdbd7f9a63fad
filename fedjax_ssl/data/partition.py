"""Partitioning a labelled training set over clients, and stacking it into the on-device `FedData`.

Schemes (`partition(labels, num_clients, scheme, ...)`), all deterministic given `seed`:
  'iid'        uniform random split into num_clients parts whose sizes differ by at most one.
  'dirichlet'  label skew of Hsu et al. (2019) as used by FedEMA / FedU2: for every class, client
               proportions p ~ Dir(alpha * 1_C); the class's shuffled examples are split by
               floor(p * n_class) with the remainder going to the largest fractional parts (FedU2's
               fedbox `split_dirichlet_label`). The whole draw is repeated until every client has at
               least `min_size` examples (the common NIID-Bench re-draw loop; docs/notes/data.md#data).
  'classes'    k = classes_per_client classes per client.
               * num_clients * k <= num_classes: disjoint classes, client i gets every example of
                 classes order[i*k : (i+1)*k] (Hetero-SSFL; FedSC: client i gets {k i, ..., k i + k-1}).
                 Classes beyond num_clients * k are left unused.
               * num_clients * k > num_classes (shards, Hetero-SSFL's 100-client rule): requires
                 num_clients * k % num_classes == 0; client i gets classes
                 order[(i*k + t) % num_classes], t < k (k distinct classes), so every class is held by
                 r = num_clients * k / num_classes clients and its shuffled examples are split into r
                 near-equal parts (sizes differ by at most one), in client order.
               `order` is the identity (the papers' assignment) unless shuffle_classes=True, which
               uses a seeded permutation of the classes.
Each client's index array is returned in a random order.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from fedjax_ssl.data.types import Dataset, FedData

SCHEMES = ('iid', 'dirichlet', 'classes')
DEFAULT_MIN_SIZE = 2  # every client needs >= 2 examples (BatchNorm, SSL pairs); docs/notes/data.md#data.
DEFAULT_MAX_DRAWS = 1000
_SCHEME_KWARGS = ('alpha', 'classes_per_client', 'min_size', 'shuffle_classes', 'max_draws')

# Separate streams, so the public carve-out and the partition of one seed are independent draws.
_PARTITION_STREAM = 0
_PUBLIC_STREAM = 1
_TEST_STREAM = 2  # the per-client held-out splits of the test set (`held_out_splits`)


def _rng(seed: int, stream: int) -> np.random.Generator:
  return np.random.default_rng([int(seed), stream])


def _as_labels(labels) -> np.ndarray:
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f'labels must be a 1-D integer array, got {labels.dtype} {labels.shape}')
  if labels.size and labels.min() < 0:
    raise ValueError(f'labels must be >= 0, got minimum {labels.min()}')
  return labels


def _check_int(name: str, value, low: int, high: Optional[int] = None) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f'{name} must be an integer, got {value!r}')
  if value < low or (high is not None and value > high):
    allowed = f'[{low}, {high}]' if high is not None else f'>= {low}'
    raise ValueError(f'{name}={value} out of range; allowed: {allowed}')


def validate_partition_args(num_examples: int, num_classes: int, num_clients: int, scheme: str, *,
                            alpha=None, classes_per_client=None, min_size=DEFAULT_MIN_SIZE,
                            shuffle_classes=False, max_draws=DEFAULT_MAX_DRAWS) -> None:
  """Raises ValueError for any argument `partition` cannot honour (called before any compute)."""
  if scheme not in SCHEMES:
    raise ValueError(f'unknown partition scheme {scheme!r}; allowed: {SCHEMES}')
  _check_int('num_clients', num_clients, 1, num_examples)
  if scheme != 'dirichlet' and alpha is not None:
    raise ValueError(f'alpha={alpha} is only used by scheme="dirichlet", got scheme={scheme!r}')
  if scheme != 'classes' and classes_per_client is not None:
    raise ValueError(f'classes_per_client={classes_per_client} is only used by scheme="classes", '
                     f'got scheme={scheme!r}')
  if scheme != 'classes' and shuffle_classes:
    raise ValueError(f'shuffle_classes is only used by scheme="classes", got scheme={scheme!r}')
  if scheme == 'dirichlet':
    if alpha is None or not np.isfinite(alpha) or alpha <= 0:
      raise ValueError(f'scheme="dirichlet" needs a finite alpha > 0, got alpha={alpha}')
    _check_int('min_size', min_size, 0, num_examples // num_clients)
    _check_int('max_draws', max_draws, 1)
  if scheme == 'classes':
    if classes_per_client is None:
      raise ValueError('scheme="classes" needs classes_per_client')
    _check_int('classes_per_client', classes_per_client, 1, num_classes)
    slots = num_clients * classes_per_client
    if slots > num_classes and slots % num_classes:
      raise ValueError(
          f'num_clients * classes_per_client = {num_clients} * {classes_per_client} = {slots} '
          f'exceeds num_classes={num_classes} (shard mode) and must then be a multiple of it, so '
          f'that every class is shared by the same number of clients')


def _split_iid(n: int, num_clients: int, rng: np.random.Generator) -> List[np.ndarray]:
  return np.array_split(rng.permutation(n), num_clients)


def _dirichlet_counts(class_sizes: np.ndarray, num_clients: int, alpha: float,
                      rng: np.random.Generator) -> np.ndarray:
  """int64 [num_classes, num_clients]: floor(p * n_class) plus largest-remainder rounding."""
  counts = np.zeros((class_sizes.size, num_clients), np.int64)
  for c, n_c in enumerate(class_sizes):
    if n_c == 0:
      continue
    raw = rng.dirichlet(np.full(num_clients, alpha)) * n_c
    counts[c] = np.floor(raw)
    short = n_c - counts[c].sum()
    counts[c, np.argsort(-(raw - counts[c]), kind='stable')[:short]] += 1
  return counts


def _split_dirichlet(labels, num_classes, num_clients, alpha, min_size, max_draws, rng):
  class_sizes = np.bincount(labels, minlength=num_classes)
  for _ in range(max_draws):
    counts = _dirichlet_counts(class_sizes, num_clients, alpha, rng)
    if counts.sum(axis=0).min() >= min_size:
      break
  else:
    raise ValueError(
        f'no Dirichlet(alpha={alpha}) draw in {max_draws} gave every one of {num_clients} clients '
        f'>= min_size={min_size} examples; lower min_size, raise alpha or use fewer clients')
  parts = [[] for _ in range(num_clients)]
  for c in range(num_classes):
    idx = rng.permutation(np.flatnonzero(labels == c))
    for client, chunk in enumerate(np.split(idx, np.cumsum(counts[c])[:-1])):
      parts[client].append(chunk)
  return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts]


def client_classes(num_clients: int, classes_per_client: int, num_classes: int,
                   order: np.ndarray) -> np.ndarray:
  """int [num_clients, k]: the classes of each client under scheme='classes' (see module doc)."""
  k = classes_per_client
  slots = np.arange(num_clients)[:, None] * k + np.arange(k)[None, :]
  return order[slots % num_classes]


def _split_classes(labels, num_classes, num_clients, k, shuffle_classes, rng):
  order = rng.permutation(num_classes) if shuffle_classes else np.arange(num_classes)
  assignment = client_classes(num_clients, k, num_classes, order)
  parts = [[] for _ in range(num_clients)]
  for c in range(num_classes):
    holders = np.flatnonzero((assignment == c).any(axis=1))
    if holders.size == 0:
      continue
    idx = rng.permutation(np.flatnonzero(labels == c))
    for client, chunk in zip(holders, np.array_split(idx, holders.size)):
      parts[client].append(chunk)
  parts = [np.concatenate(p) for p in parts]
  empty = [c for c, p in enumerate(parts) if p.size == 0]
  if empty:
    raise ValueError(f'scheme="classes" leaves clients {empty} without examples: their classes '
                     f'{sorted(set(assignment[empty].ravel().tolist()))} have fewer examples than '
                     f'clients holding them')
  return parts


def partition(labels, num_clients: int, scheme: str, *, seed: int, alpha: Optional[float] = None,
              classes_per_client: Optional[int] = None, min_size: int = DEFAULT_MIN_SIZE,
              shuffle_classes: bool = False, max_draws: int = DEFAULT_MAX_DRAWS,
              num_classes: Optional[int] = None) -> List[np.ndarray]:
  """Splits example indices 0..N-1 over clients.

  Args:
    labels: int [N] class labels in [0, num_classes).
    num_clients: C, 1 <= C <= N.
    scheme: one of SCHEMES (module docstring).
    seed: the split is a pure function of the arguments and this seed.
    alpha: Dirichlet concentration (> 0), scheme='dirichlet' only; smaller = more skewed.
    classes_per_client: k in [1, num_classes], scheme='classes' only.
    min_size: 'dirichlet': minimum examples per client enforced by re-drawing (at most max_draws).
    shuffle_classes: 'classes': use a seeded class permutation instead of the identity order.
    num_classes: defaults to max(labels) + 1.

  Returns:
    C int64 index arrays into `labels`, pairwise disjoint, in random order within each client.
  """
  labels = _as_labels(labels)
  if labels.size == 0:
    raise ValueError('labels is empty; partition needs at least one example')
  num_classes = int(labels.max()) + 1 if num_classes is None else num_classes
  if labels.size and labels.max() >= num_classes:
    raise ValueError(f'labels must lie in [0, num_classes={num_classes}), got max {labels.max()}')
  validate_partition_args(labels.size, num_classes, num_clients, scheme, alpha=alpha,
                          classes_per_client=classes_per_client, min_size=min_size,
                          shuffle_classes=shuffle_classes, max_draws=max_draws)
  rng = _rng(seed, _PARTITION_STREAM)
  if scheme == 'iid':
    parts = _split_iid(labels.size, num_clients, rng)
  elif scheme == 'dirichlet':
    parts = _split_dirichlet(labels, num_classes, num_clients, float(alpha), min_size, max_draws,
                             rng)
  else:
    parts = _split_classes(labels, num_classes, num_clients, classes_per_client, shuffle_classes,
                           rng)
  return [rng.permutation(p).astype(np.int64) for p in parts]


def carve_public(labels, size: int, seed: int, *, stratified: bool = False
                 ) -> Tuple[np.ndarray, np.ndarray]:
  """Sets aside a public (RAD) set of `size` examples before partitioning.

  Random without replacement; with stratified=True each class contributes size * n_c / N examples
  (floor plus largest remainder), i.e. the public set follows the label distribution.

  Returns:
    (public_idx, remaining_idx): sorted int64 arrays partitioning range(N).
  """
  labels = _as_labels(labels)
  _check_int('public size', size, 0, labels.size - 1)
  rng = _rng(seed, _PUBLIC_STREAM)
  if not stratified:
    public = rng.permutation(labels.size)[:size]
  else:
    class_sizes = np.bincount(labels)
    raw = class_sizes * size / labels.size
    take = np.floor(raw).astype(np.int64)
    take[np.argsort(-(raw - take), kind='stable')[:size - take.sum()]] += 1
    public = np.concatenate([rng.choice(np.flatnonzero(labels == c), t, replace=False)
                             for c, t in enumerate(take)])
  public = np.sort(public).astype(np.int64)
  remaining = np.setdiff1d(np.arange(labels.size), public).astype(np.int64)
  return public, remaining


def apportion_rows(weights: np.ndarray, total: int) -> np.ndarray:
  """int64 [C]: `total` items split in proportion to integer weights [C] (>= 0, positive sum):
  floor of each share plus one more for the largest remainders (ties to the lower index), so the
  counts sum to `total` and a zero weight gets nothing. Integer arithmetic, so equal remainders
  are exact ties (float shares would break them by rounding)."""
  num = int(total) * np.asarray(weights, np.int64)
  whole = int(np.sum(weights))
  counts, rem = num // whole, num % whole
  counts[np.argsort(-rem, kind='stable')[:int(total - counts.sum())]] += 1
  return counts


def held_out_splits(test_labels, class_weights, *, seed: int) -> List[np.ndarray]:
  """Each client's held-out split of the test set, drawn like its training partition.

  For every class k, the class's test examples, in a seeded random order, are split over the
  clients in proportion to class_weights[:, k] (`apportion_rows`): a client receives the share of
  class k's test images that it holds of class k's training images, so its split follows its own
  label distribution (Dirichlet, classes or IID alike) and the splits are disjoint. Test images of a
  class no client trains on are in no split. The draw is a pure function of the arguments; its
  random stream is apart from the partition's and the public set's.

  Args:
    test_labels: int [M] labels of the test split, in [0, K).
    class_weights: int [C, K] >= 0, the clients' training class histogram (`class_histogram`).
    seed: the run's seed.
  Returns:
    C sorted int64 index arrays into the test split, pairwise disjoint.
  """
  labels = _as_labels(test_labels)
  weights = np.asarray(class_weights)
  if (weights.ndim != 2 or not np.issubdtype(weights.dtype, np.integer)
      or np.any(weights < 0)):
    raise ValueError(f'class_weights must be an integer [C, K] array >= 0, got {weights.dtype} '
                     f'{weights.shape}')
  if labels.size and labels.max() >= weights.shape[1]:
    raise ValueError(f'test labels reach {labels.max()} but class_weights has only '
                     f'{weights.shape[1]} classes')
  rng = _rng(seed, _TEST_STREAM)
  parts = [[] for _ in range(weights.shape[0])]
  for k in range(weights.shape[1]):
    idx = rng.permutation(np.flatnonzero(labels == k))
    if idx.size == 0 or weights[:, k].sum() == 0:
      continue
    counts = apportion_rows(weights[:, k], idx.size)
    for client, chunk in enumerate(np.split(idx, np.cumsum(counts)[:-1])):
      parts[client].append(chunk)
  return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64)
          for p in parts]


def class_histogram(labels, parts, num_classes: int) -> np.ndarray:
  """int64 [C, num_classes]: per-client class counts of the index arrays `parts`."""
  labels = np.asarray(labels)
  return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts]).astype(np.int64)


def _check_scheme_kwargs(scheme_kw: Dict) -> None:
  unknown = sorted(set(scheme_kw) - set(_SCHEME_KWARGS))
  if unknown:
    raise ValueError(f'unknown partition keyword(s) {unknown}; allowed: {list(_SCHEME_KWARGS)}')


def draw_rows(dataset: Dataset, num_clients: int, scheme: str, *, seed: int,
              public_size: int = 0, public_stratified: bool = False, **scheme_kw) -> Dict:
  """Which training rows each client and the public set get, drawn from the labels alone (no
  image is read: a `types.Rows` split stays in its source).

  Args: as `build_fed_data`, for a labelled training split (dataset.unlabeled_x None).
  Returns:
    dict(histogram=int64 [C, num_classes], indices=list of C int64 arrays into train_x,
    public_idx=int64 [L]).
  """
  _check_scheme_kwargs(scheme_kw)
  num_train = dataset.train_y.shape[0]
  _check_int('public_size', public_size, 0, num_train - 1)
  validate_partition_args(num_train - public_size, dataset.num_classes, num_clients, scheme,
                          **scheme_kw)
  public_idx, remaining = carve_public(dataset.train_y, public_size, seed,
                                       stratified=public_stratified)
  parts = partition(dataset.train_y[remaining], num_clients, scheme, seed=seed,
                    num_classes=dataset.num_classes, **scheme_kw)
  indices = [remaining[p] for p in parts]
  return dict(histogram=class_histogram(dataset.train_y, indices, dataset.num_classes),
              indices=indices, public_idx=public_idx)


def build_fed_data(dataset: Dataset, num_clients: int, scheme: str, *, seed: int,
                   public_size: int = 0, public_stratified: bool = False, on_host: bool = False,
                   **scheme_kw) -> Tuple[FedData, Dict]:
  """Carves the public set (if any) from dataset.train, partitions the rest and stacks it.

  Args:
    dataset: the `Dataset` whose training split is federated.
    num_clients, scheme, seed, **scheme_kw: as in `partition` (alpha, classes_per_client, min_size,
      shuffle_classes, max_draws).
    public_size: L examples carved out first (`carve_public`) and excluded from every client;
      0 = no public set.
    public_stratified: class-stratified public set.
    on_host: numpy arrays instead of device arrays (`FedData.from_clients`).

  Returns:
    fed_data: FedData in the flat layout (x uint8 [Σ n, H, W, ch], y int32 [Σ n], n and offsets
      int32 [C]), public_x uint8 [L, H, W, ch] or None.
    info: `draw_rows`' dict (histogram, indices into train_x, public_idx).
  """
  _check_scheme_kwargs(scheme_kw)
  if dataset.unlabeled_x is not None:
    return _build_unlabelled(dataset, num_clients, scheme, seed=seed, public_size=public_size,
                             on_host=on_host, **scheme_kw)
  info = draw_rows(dataset, num_clients, scheme, seed=seed, public_size=public_size,
                   public_stratified=public_stratified, **scheme_kw)
  indices, public_idx = info['indices'], info['public_idx']
  public_x = dataset.train_x[public_idx] if public_size else None
  fed = FedData.from_clients([dataset.train_x[idx] for idx in indices],
                             [dataset.train_y[idx] for idx in indices], public_x, on_host=on_host)
  return fed, info


def _build_unlabelled(dataset: Dataset, num_clients: int, scheme: str, *, seed: int,
                      public_size: int, on_host: bool, **scheme_kw) -> Tuple[FedData, Dict]:
  """build_fed_data for a dataset whose clients train on `unlabeled_x`: an IID split (there are no
  labels to skew by), labels -1; the histogram has one column (the unlabelled images);
  info['indices'] index unlabeled_x."""
  if scheme != 'iid':
    raise ValueError(f'partition scheme {scheme!r} is invalid for {dataset.name}: its clients train '
                     'on unlabelled images, which only scheme="iid" can split')
  count = dataset.unlabeled_x.shape[0]
  _check_int('public_size', public_size, 0, count - 1)
  validate_partition_args(count - public_size, 1, num_clients, scheme, **scheme_kw)
  no_labels = np.zeros(count, np.int64)
  public_idx, remaining = carve_public(no_labels, public_size, seed)
  parts = partition(no_labels[remaining], num_clients, scheme, seed=seed, num_classes=1,
                    **scheme_kw)
  indices = [remaining[p] for p in parts]
  public_x = dataset.unlabeled_x[public_idx] if public_size else None
  fed = FedData.from_clients([dataset.unlabeled_x[idx] for idx in indices],
                             [np.full(len(idx), -1, np.int32) for idx in indices], public_x,
                             on_host=on_host)
  return fed, dict(histogram=class_histogram(no_labels, indices, 1), indices=indices,
                   public_idx=public_idx)


def format_histogram(hist, max_columns: int = 20) -> str:
  """Readable per-client class-count table of an int [C, num_classes] histogram.

  Up to `max_columns` classes are shown as one column each; beyond that, each client's non-zero
  classes are listed as `class:count`.
  """
  hist = np.asarray(hist)
  if hist.ndim != 2:
    raise ValueError(f'hist must be [num_clients, num_classes], got shape {hist.shape}')
  num_clients, num_classes = hist.shape
  sizes = hist.sum(axis=1)
  cw = max(len('client'), len(str(num_clients - 1)))
  nw = max(1, len(str(int(sizes.max(initial=0)))), len(str(int(sizes.sum()))))
  present = (hist > 0).sum(axis=1)
  if num_classes <= max_columns:
    vw = max(len(str(num_classes - 1)), len(str(int(hist.sum(axis=0).max(initial=0)))))
    header = f'{"client":>{cw}}  {"n":>{nw}}  ' + ' '.join(f'{k:>{vw}}' for k in range(num_classes))
    rows = [f'{c:>{cw}}  {sizes[c]:>{nw}}  ' + ' '.join(f'{v:>{vw}}' for v in hist[c])
            for c in range(num_clients)]
    total = (f'{"total":>{cw}}  {sizes.sum():>{nw}}  ' +
             ' '.join(f'{v:>{vw}}' for v in hist.sum(axis=0)))
  else:
    header = f'{"client":>{cw}}  {"n":>{nw}}  #cls  class:count'
    rows = [f'{c:>{cw}}  {sizes[c]:>{nw}}  {present[c]:>4}  ' +
            ' '.join(f'{k}:{hist[c, k]}' for k in np.flatnonzero(hist[c]))
            for c in range(num_clients)]
    total = f'{"total":>{cw}}  {sizes.sum():>{nw}}'
  rule = '-' * max(len(header), len(total))
  return '\n'.join([header, rule] + rows + [rule, total])
