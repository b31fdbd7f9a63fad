"""The field's frozen-feature evaluation protocol: L-BFGS linear probe, weighted kNN, label fractions.

Linear probe (`logistic_probe`; Kornblith et al. 2019, SimCLR, BYOL): every feature is standardised
with the mean and std of the labelled training features (the same transform is applied to the test
features; a constant feature keeps scale 1, as in sklearn's StandardScaler); a multinomial logistic
regression with an L2 penalty on the weights (sklearn's C parameterisation, intercept unpenalised;
`fedjax_ssl.eval.logistic`) is fitted full-batch to convergence by L-BFGS. C is chosen from a grid
(default 10 log-spaced values, 1e-4 to 1e2) by the accuracy on a stratified held-out 10% of the
labelled split (ties: the smallest C, i.e. the strongest penalty), and the model is refitted on the
whole labelled split with that C, warm-started from the grid fit. Convergence: ||grad f||_2 < tol
(1e-4, on the mean-form objective; stricter than sklearn's max-abs 1e-4) or max_iter (1000)
iterations, per fit; `converged` and the iteration counts are returned. The standardisation
statistics are those of the labelled split being fitted (at a label fraction, the subset, its
held-out part included: features only, no labels). The orchestration (subsets, splits) is numpy on
the host; each probe is one jitted program (`logistic.select_and_refit`), compiled once per subset
size and reused by every draw.

kNN (`knn_accuracy`): the weighted cosine kNN of InstDisc (Wu et al. 2018) as in
`fedjax_ssl.eval.knn.knn_predict` (k = 200, T = 0.1, neighbour weight exp(cos / T)), on the raw
features (L2-normalised, not standardised: the field's convention), the memory bank being the
labelled images only. k is capped at the bank size; the k used is reported.

Label fractions (`stratified_subset`): a fraction f in (0, 1] of the labelled split is drawn
stratified by class: round(f N) images (half up), class c receiving floor(f N_c) or one more
(largest remainders first, ties to the smaller class id), its images drawn uniformly without
replacement. Each fraction is drawn `draws` times from its own seed sequence (seed, draw, f), so a
fraction's subsets do not depend on which other fractions are evaluated. The whole split (f = 1) is
evaluated once: its only randomness is the held-out split that picks C.

`evaluate_features` runs both over the label fractions and returns flat metric names, for a
fraction tag F ('' for 100%, '_10pct' for 0.1, '_1pct' for 0.01, '_0p5pct' for 0.005) and a k tag
K ('' for the first value of knn_k, '_k20' for another k = 20):

  probe_acc{F}       mean test accuracy of the L-BFGS probe over the draws
  probe_acc{F}_std   its std over the draws (ddof=0; fractions < 1 only)
  probe_C{F}         the median of the chosen C over the draws
  knn_acc{F}{K}      mean kNN test accuracy over the draws (bank = the labelled subset)
  knn_acc{F}{K}_std  its std over the draws (fractions < 1 only)
  knn_k{F}{K}        the k used: min(requested k, subset size)
  labelled{F}        the number of labelled images in each subset

e.g. probe_acc, probe_acc_10pct, probe_acc_1pct_std, knn_acc, knn_acc_k20, knn_acc_1pct_k20.

Bad arguments raise a one-line ValueError naming the value and what is allowed, before any compute.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, List, Optional, Sequence, Tuple

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl.eval import knn as knn_lib
from fedjax_ssl.eval import logistic

DEFAULT_CS = tuple(float(c) for c in np.logspace(-4, 2, 10))
DEFAULT_FRACTIONS = (1.0, 0.1, 0.01)
DEFAULT_HOLDOUT = 0.1


# ----------------------------------------------------------------------------------------------
# Argument checks (all cheap, all before any compute)
# ----------------------------------------------------------------------------------------------
def _is_int(v) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_features(train_f, train_y, test_f, test_y, num_classes) -> None:
  tf, ty, sf, sy = (np.shape(a) for a in (train_f, train_y, test_f, test_y))
  if len(tf) != 2 or len(sf) != 2 or tf[1] != sf[1]:
    raise ValueError(f'features must be train_f [N, d] and test_f [M, d] with the same d, got '
                     f'{tf} and {sf}')
  if ty != tf[:1] or sy != sf[:1]:
    raise ValueError(f'labels must be train_y [N] and test_y [M] matching the features, got '
                     f'{ty} for {tf} and {sy} for {sf}')
  if not _is_int(num_classes) or num_classes < 2:
    raise ValueError(f'num_classes = {num_classes!r} is invalid: must be an integer >= 2')
  if sf[0] < 1:
    raise ValueError(f'test set is empty (test_f {sf}): need at least one test image')
  for name, y in (('train_y', train_y), ('test_y', test_y)):
    y = np.asarray(y)
    if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0
                   or y.max() >= num_classes):
      raise ValueError(f'{name} must be integers in [0, {num_classes}), got dtype {y.dtype}, '
                       f'range [{y.min()}, {y.max()}]')
  for name, f in (('train_f', train_f), ('test_f', test_f)):
    bad = int(np.size(f) - np.count_nonzero(np.isfinite(np.asarray(f))))
    if bad:
      raise ValueError(f'{name} has {bad} non-finite values (NaN or inf): features must be finite')


def _check_fraction(fraction) -> None:
  if (isinstance(fraction, bool) or not isinstance(fraction, numbers.Real)
      or not 0.0 < fraction <= 1.0):
    raise ValueError(f'label fraction {fraction!r} is invalid: must be a number in (0, 1]')


def _check_cs(cs) -> np.ndarray:
  arr = np.asarray(cs, np.float64).reshape(-1) if np.size(cs) else np.zeros((0,))
  if arr.size == 0:
    raise ValueError(f'regularisation grid cs = {tuple(np.reshape(cs, -1))!r} is empty: need at '
                     'least one value C > 0')
  if not np.all(np.isfinite(arr) & (arr > 0)) or np.unique(arr).size != arr.size:
    raise ValueError(f'regularisation grid cs = {tuple(arr.tolist())} is invalid: every C must be '
                     'a distinct finite number > 0')
  return arr


def _check_k(k) -> None:
  if not _is_int(k) or k < 1:
    raise ValueError(f'kNN k = {k!r} is invalid: must be an integer >= 1')


def _check_holdout(holdout) -> None:
  if isinstance(holdout, bool) or not isinstance(holdout, numbers.Real) or not 0 < holdout < 1:
    raise ValueError(f'holdout = {holdout!r} is invalid: must be a number in (0, 1)')


# ----------------------------------------------------------------------------------------------
# Stratified subsets
# ----------------------------------------------------------------------------------------------
def apportion(sizes: np.ndarray, fraction: float, total: Optional[int] = None) -> np.ndarray:
  """Largest-remainder apportionment of `total` (default round-half-up(fraction * sum)) items.

  Args:
    sizes: int [K] class sizes N_c.
    fraction: in (0, 1].
    total: items to hand out (<= sum(sizes)).
  Returns:
    int [K] counts, count_c in {floor(f N_c), floor(f N_c) + 1}, summing to total; the extra ones
    go to the largest remainders f N_c - floor(f N_c), ties to the smaller class id.
  """
  sizes = np.asarray(sizes, np.int64)
  quota = fraction * sizes.astype(np.float64)
  if total is None:
    total = int(math.floor(fraction * int(sizes.sum()) + 0.5))
  base = np.minimum(np.floor(quota + 1e-9).astype(np.int64), sizes)  # 1e-9: 0.3 * 10 -> 3
  remainder = quota - base
  extra = total - int(base.sum())
  order = np.lexsort((np.arange(sizes.size), -remainder))  # largest remainder, then smaller id
  counts = base.copy()
  eligible = [c for c in order if counts[c] < sizes[c]]
  for c in eligible[:max(extra, 0)]:
    counts[c] += 1
  return counts


def subset_counts(train_y: Any, num_classes: int, fraction: float) -> np.ndarray:
  """int [K] images per class in a stratified subset at `fraction` (ValueError if unusable).

  Raises ValueError when the subset has fewer images than classes, or when a class present in the
  labelled split gets no image.
  """
  _check_fraction(fraction)
  sizes = np.bincount(np.asarray(train_y), minlength=num_classes)
  n = int(sizes.sum())
  counts = apportion(sizes, fraction)
  m = int(counts.sum())
  if m < num_classes:
    raise ValueError(f'label fraction {fraction:g} of {n} labelled images gives {m} images, fewer '
                     f'than the {num_classes} classes: need fraction >= '
                     f'{min(1.0, num_classes / max(n, 1)):.3g}')
  empty = np.flatnonzero((counts == 0) & (sizes > 0))
  if empty.size:
    c = int(empty[np.argmin(sizes[empty])])
    raise ValueError(f'label fraction {fraction:g} leaves class {c} ({sizes[c]} of {n} labelled '
                     f'images) with no example in the stratified subset: need fraction >= '
                     f'{1.0 / sizes[empty].min():.3g}')
  return counts


def _draw(labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Sorted indices: counts[c] images of each class c, uniformly without replacement."""
  picked = [rng.choice(np.flatnonzero(labels == c), size=int(k), replace=False)
            for c, k in enumerate(counts) if k]
  return np.sort(np.concatenate(picked)) if picked else np.zeros((0,), np.int64)


def fraction_rng(seed: int, draw: int, fraction: float) -> np.random.Generator:
  """The generator of draw `draw` at `fraction`: independent of the other fractions evaluated."""
  return np.random.default_rng([int(seed), int(draw), int(round(fraction * 1e9))])


def stratified_subset(train_y: Any, num_classes: int, fraction: float,
                      rng: np.random.Generator) -> np.ndarray:
  """Sorted int indices [m] of a stratified subset of train_y [N] (counts: `subset_counts`).

  fraction = 1 returns every index, in order.
  """
  counts = subset_counts(train_y, num_classes, fraction)
  labels = np.asarray(train_y)
  if fraction == 1:
    return np.arange(labels.size)
  return _draw(labels, counts, rng)


def holdout_counts(y: Any, num_classes: int, holdout: float = DEFAULT_HOLDOUT) -> np.ndarray:
  """int [K] held-out images per class: `apportion` of holdout * m, capped at N_c - 1.

  Every class keeps at least one image in the fitted part. ValueError if nothing is held out.
  """
  _check_holdout(holdout)
  sizes = np.bincount(np.asarray(y), minlength=num_classes)
  counts = np.minimum(apportion(sizes, holdout), np.maximum(sizes - 1, 0))
  if counts.sum() == 0:
    m = int(sizes.sum())
    raise ValueError(f'holdout = {holdout:g} of {m} labelled images holds out none (a class keeps '
                     'at least one image to fit): need more labelled images, a larger holdout, '
                     'or a one-value grid cs')
  return counts


def stratified_holdout(y: Any, num_classes: int, rng: np.random.Generator,
                       holdout: float = DEFAULT_HOLDOUT) -> Tuple[np.ndarray, np.ndarray]:
  """(fit indices, held-out indices), both sorted, into y [m]; counts as `holdout_counts`."""
  y = np.asarray(y)
  val = _draw(y, holdout_counts(y, num_classes, holdout), rng)
  mask = np.ones(y.size, bool)
  mask[val] = False
  return np.flatnonzero(mask), val


# ----------------------------------------------------------------------------------------------
# Linear probe
# ----------------------------------------------------------------------------------------------
def standardize(train_f: Any, *others: Any, dtype=np.float32) -> Tuple[np.ndarray, ...]:
  """(train_f - mean) / std with the mean and std (ddof=0, accumulated in float64) of train_f [N, d].

  Returns:
    (standardised train_f, each of others [M, d] with the same transform), as dtype. A feature
    with std 0 (or < 1e-12 relative to its scale) keeps scale 1, like sklearn's StandardScaler.
  """
  x = np.asarray(train_f)
  mean = x.mean(axis=0, dtype=np.float64)
  std = np.sqrt(np.mean(np.square(x - mean.astype(x.dtype), dtype=np.float64), axis=0))
  scale = np.where(std > 1e-12 * np.maximum(1.0, np.abs(mean)), std, 1.0)
  mean, inv = mean.astype(dtype), (1.0 / scale).astype(dtype)
  return tuple((np.asarray(a, dtype) - mean) * inv for a in (train_f,) + others)


def _edge_warning(grid: np.ndarray, val_acc: Sequence[float], best: int, held_out: int) -> str:
  """Says why the held-out choice of C fell on an edge of the grid (docs/notes/evaluation.md,
  EVAL-21): every C tied (collapsed features, or a held-out split too small to tell them apart:
  ties go to the smallest C), or the accuracy still rising at the edge (at C = max(grid) a plateau
  in practice)."""
  where = (f'the chosen C = {grid[best]:g} is at the edge of the grid '
           f'[{grid[0]:g}, {grid[-1]:g}]')
  if max(val_acc) == min(val_acc):
    why = (f'every C ties at held-out accuracy {val_acc[0]:.3f} on {held_out} images (features '
           'that do not separate the classes, or too few held-out images); ties take the '
           'smallest C')
  elif best == 0:
    why = f'the strongest penalty scores best (or ties) on {held_out} held-out images'
  else:
    why = f'the held-out accuracy still rises at the weakest penalty ({held_out} held-out images)'
  return f'logistic_probe: {where}: {why}'


def _cap_warning(c: float, max_iter: int, grad_norm: float, tol: float, train_acc: float) -> str:
  """Says that the reported fit ran into max_iter, and why when the features are separable
  (EVAL-23: the fit is not stopped at 100 % training accuracy, which would change the probe's
  numbers; it is only named, so that a user whose probe grinds knows the cause). Fits of the C
  path that end capped are not named: at the grid's large C they routinely do, and only the refit
  at the chosen C is the result."""
  where = (f'logistic_probe: the fit at the chosen C = {c:g} stopped at max_iter = {max_iter} '
           f'with ||grad|| = {grad_norm:.3g}, not under tol = {tol:g}')
  if train_acc == 1.0:
    return (f'{where}; training accuracy 100 %: the features are linearly separable, so the '
            'weights keep growing towards the large-C optimum; the result is the capped fit. A '
            'grid without the largest C, or probe = "adam", ends sooner')
  return f'{where}; training accuracy {train_acc:.4f}; the result is the capped fit'


def logistic_probe(train_f: Any, train_y: Any, test_f: Any, test_y: Any, num_classes: int, *,
                   cs: Sequence[float] = DEFAULT_CS, holdout: float = DEFAULT_HOLDOUT,
                   seed: int = 0, rng: Optional[np.random.Generator] = None, tol: float = 1e-4,
                   max_iter: int = 1000, precondition: bool = True,
                   dtype=np.float32) -> Dict[str, Any]:
  """The L-BFGS linear probe (module docstring) on one labelled split.

  Args:
    train_f: float [N, d] labelled training features; train_y: int [N] in [0, num_classes).
    test_f: float [M, d]; test_y: int [M].
    num_classes: K.
    cs: the grid of C (sklearn's inverse L2 strength); one value = no held-out selection.
    holdout: fraction of the labelled split held out (stratified) to choose C.
    seed / rng: the held-out split's randomness (rng, when given, wins).
    tol, max_iter, precondition: `logistic.fit_logistic`.
    dtype: float32 (default) or float64 (needs jax_enable_x64).
  Returns:
    dict: test_acc, train_acc (whole labelled split), c (chosen), cs (sorted grid, list),
    val_acc (list over cs; [] for a one-value grid), path_num_iter (list), num_iter, grad_norm,
    converged (grad_norm < tol) of the final fit, and weights [K, d] / bias [K] (numpy; on the
    standardised features; logits = x W^T + b).
  """
  _check_features(train_f, train_y, test_f, test_y, num_classes)
  grid = np.sort(_check_cs(cs))
  if np.shape(train_y)[0] < num_classes:
    raise ValueError(f'{np.shape(train_y)[0]} labelled images are fewer than the {num_classes} '
                     'classes')
  if grid.size > 1:
    holdout_counts(train_y, num_classes, holdout)
  if not _is_int(max_iter) or max_iter < 1 or not tol > 0:
    raise ValueError(f'max_iter = {max_iter!r} / tol = {tol!r} are invalid: need an integer '
                     'max_iter >= 1 and tol > 0')
  if np.dtype(dtype) == np.float64 and not jax.config.jax_enable_x64:
    raise ValueError('dtype = float64 is invalid without jax_enable_x64: set '
                     "jax.config.update('jax_enable_x64', True) or use float32")
  rng = np.random.default_rng(seed) if rng is None else rng
  y = np.asarray(train_y).astype(np.int32)
  x, xt = standardize(train_f, test_f, dtype=dtype)
  kw = dict(num_classes=num_classes, tol=tol, max_iter=max_iter, precondition=precondition)
  val_acc, path_iter = [], []
  best = 0
  if grid.size > 1:
    fit_idx, val_idx = stratified_holdout(y, num_classes, rng, holdout)
    fit_mask = np.zeros(y.size, dtype)
    fit_mask[fit_idx] = 1
    out = logistic.select_and_refit(x, y, grid, fit_mask, 1 - fit_mask, **kw)
    val_acc = [float(a) for a in np.asarray(out.val_acc)]
    path_iter = [int(i) for i in np.asarray(out.path.num_iter)]
    best = int(out.best)
    fit = out.final
    if grid.size > 2 and best in (0, grid.size - 1):
      logging.warning(_edge_warning(grid, val_acc, best, int(val_idx.size)))
  else:
    fit = logistic.fit_logistic(x, y, grid[0], **kw)
  w, b = fit.weights, fit.bias
  train_acc = float(logistic.accuracy(w, b, x, y))
  if not fit.grad_norm < tol:
    logging.warning(_cap_warning(float(grid[best]), max_iter, float(fit.grad_norm), tol,
                                 train_acc))
  return {
      'test_acc': float(logistic.accuracy(w, b, xt, jnp.asarray(test_y))),
      'train_acc': train_acc,
      'c': float(grid[best]), 'cs': grid.tolist(), 'val_acc': val_acc, 'path_num_iter': path_iter,
      'num_iter': int(fit.num_iter), 'grad_norm': float(fit.grad_norm),
      'converged': bool(fit.grad_norm < tol),
      'weights': np.asarray(w), 'bias': np.asarray(b),
  }


# ----------------------------------------------------------------------------------------------
# kNN
# ----------------------------------------------------------------------------------------------
def knn_accuracy(train_f: Any, train_y: Any, test_f: Any, test_y: Any, num_classes: int, *,
                 k: int = 200, temperature: float = 0.1, batch_size: int = 256
                 ) -> Dict[str, Any]:
  """Weighted cosine kNN (`knn.knn_predict`) with the bank train_f [N, d] on raw features.

  Returns:
    {'acc': test accuracy, 'k': the k used, min(k, N)}.
  """
  _check_k(k)
  _check_features(train_f, train_y, test_f, test_y, num_classes)
  k_used = min(k, int(np.shape(train_y)[0]))
  if k_used < 1:
    raise ValueError('the kNN memory bank is empty: need at least one labelled image')
  preds = knn_lib.knn_predict(train_f, np.asarray(train_y), test_f, num_classes, k=k_used,
                              temperature=temperature, batch_size=batch_size)
  return {'acc': float(np.mean(preds == np.asarray(test_y))), 'k': k_used}


# ----------------------------------------------------------------------------------------------
# Everything over label fractions
# ----------------------------------------------------------------------------------------------
def fraction_tag(fraction: float) -> str:
  """'' for 1, '_10pct' for 0.1, '_1pct' for 0.01, '_0p5pct' for 0.005."""
  if fraction == 1:
    return ''
  pct = f'{fraction * 100:.6g}'.replace('.', 'p')
  return f'_{pct}pct'


def _mean_std(values: List[float], prefix: str, out: Dict[str, float], with_std: bool) -> None:
  out[prefix] = float(np.mean(values))
  if with_std:
    out[f'{prefix}_std'] = float(np.std(values))


def fraction_plans(train_y: Any, num_classes: int, fractions: Sequence[float], *,
                   probe: bool = True, cs: Sequence[float] = DEFAULT_CS,
                   holdout: float = DEFAULT_HOLDOUT) -> List[Tuple[float, np.ndarray]]:
  """[(fraction, int [K] labelled images per class)] for train_y [N]; ValueError, before any
  features exist, when a fraction leaves the probe's held-out split (its C selection, used when cs
  holds more than one value) empty. Callers check this as soon as the labels are loaded."""
  labels = np.asarray(train_y)
  plans = []
  for f in fractions:
    counts = subset_counts(labels, num_classes, f)
    if probe and np.size(cs) > 1:
      try:
        holdout_counts(np.repeat(np.arange(num_classes), counts), num_classes, holdout)
      except ValueError as e:
        raise ValueError(f'label fraction {f:g}: {e}') from None
    plans.append((f, counts))
  return plans


def evaluate_features(train_f: Any, train_y: Any, test_f: Any, test_y: Any, num_classes: int, *,
                      fractions: Sequence[float] = DEFAULT_FRACTIONS, draws: int = 3,
                      seed: int = 0, knn_k: Sequence[int] = (200, 20),
                      knn_temperature: float = 0.1, probe: bool = True,
                      cs: Sequence[float] = DEFAULT_CS, holdout: float = DEFAULT_HOLDOUT,
                      tol: float = 1e-4, max_iter: int = 1000, return_draws: bool = False):
  """The linear probe and kNN over label fractions, as flat metrics (names: module docstring).

  Args:
    train_f: float [N, d] features of the labelled training split; train_y: int [N].
    test_f: float [M, d]; test_y: int [M]; num_classes: K.
    fractions: label fractions in (0, 1], distinct.
    draws: stratified subsets per fraction < 1 (fraction 1 is evaluated once).
    seed: seeds the subsets and the held-out splits (`fraction_rng`).
    knn_k: kNN neighbour counts (the first one untagged); () = no kNN.
    knn_temperature: kNN temperature T.
    probe: False = kNN only.
    cs, holdout, tol, max_iter: `logistic_probe`.
    return_draws: also return the per-draw records.
  Returns:
    dict of floats; with return_draws, (that dict, list of per-draw dicts with fraction, draw,
    labelled, the probe's result (without weights) under 'probe' and {k: kNN result} under 'knn').
  """
  _check_features(train_f, train_y, test_f, test_y, num_classes)
  fractions = tuple(fractions)
  if not fractions:
    raise ValueError('fractions = () is empty: need at least one label fraction in (0, 1]')
  for f in fractions:
    _check_fraction(f)
  if len({fraction_tag(f) for f in fractions}) != len(fractions):
    raise ValueError(f'fractions = {fractions!r} is invalid: the fractions must be distinct')
  if not _is_int(draws) or draws < 1:
    raise ValueError(f'draws = {draws!r} is invalid: must be an integer >= 1')
  knn_k = tuple(knn_k)
  for k in knn_k:
    _check_k(k)
  if len(set(knn_k)) != len(knn_k):
    raise ValueError(f'knn_k = {knn_k!r} is invalid: the values of k must be distinct')
  if not knn_temperature > 0:
    raise ValueError(f'knn_temperature = {knn_temperature!r} is invalid: must be > 0')
  if not (probe or knn_k):
    raise ValueError('probe = False with knn_k = () evaluates nothing')
  if probe:
    grid = _check_cs(cs)
    _check_holdout(holdout)
    if not _is_int(max_iter) or max_iter < 1 or not tol > 0:
      raise ValueError(f'max_iter = {max_iter!r} / tol = {tol!r} are invalid: need an integer '
                       'max_iter >= 1 and tol > 0')
  labels = np.asarray(train_y)
  plans = fraction_plans(labels, num_classes, fractions, probe=probe, cs=grid if probe else (1.0,),
                         holdout=holdout)

  out: Dict[str, float] = {}
  records = []
  test_y = np.asarray(test_y)
  train_f = np.asarray(train_f)
  for f, counts in plans:
    tag = fraction_tag(f)
    n_draws = 1 if f == 1 else draws
    probe_acc, probe_c, knn_acc = [], [], {k: [] for k in knn_k}
    knn_used = {}
    for draw in range(n_draws):
      rng = fraction_rng(seed, draw, f)
      idx = stratified_subset(labels, num_classes, f, rng)
      record: Dict[str, Any] = {'fraction': f, 'draw': draw, 'labelled': int(idx.size)}
      sub_f, sub_y = train_f[idx], labels[idx]
      if probe:
        res = logistic_probe(sub_f, sub_y, test_f, test_y, num_classes, cs=cs, holdout=holdout,
                             rng=rng, tol=tol, max_iter=max_iter)
        probe_acc.append(res['test_acc'])
        probe_c.append(res['c'])
        record['probe'] = {k: v for k, v in res.items() if k not in ('weights', 'bias')}
      record['knn'] = {}
      for k in knn_k:
        res = knn_accuracy(sub_f, sub_y, test_f, test_y, num_classes, k=k,
                           temperature=knn_temperature)
        knn_acc[k].append(res['acc'])
        knn_used[k] = res['k']
        record['knn'][k] = res
      records.append(record)
    if probe:
      _mean_std(probe_acc, f'probe_acc{tag}', out, f != 1)
      out[f'probe_C{tag}'] = float(np.median(probe_c))
    for i, k in enumerate(knn_k):
      ktag = '' if i == 0 else f'_k{k}'
      _mean_std(knn_acc[k], f'knn_acc{tag}{ktag}', out, f != 1)
      out[f'knn_k{tag}{ktag}'] = float(knn_used[k])
    out[f'labelled{tag}'] = float(counts.sum())
  return (out, records) if return_draws else out
