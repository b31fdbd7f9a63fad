"""Representation sharing through prototypes (Berdoz et al., "Scalable Collaborative Learning via
Representation Sharing", 2022).

Clients never share weights. Each client u summarises its data by per-class averages of its
last-hidden-layer features ("prototypes") and uploads them to a relay server:

  * `class_means`: the mean feature of every class over all of a client's valid rows, with the
    number of rows behind it (the weights of the server's averages);
  * `navg_prototypes`: the mean of at most n_avg rows per class drawn without replacement, the
    paper's privacy-motivated "n_avg-prototypes" (a prototype of n_avg samples reveals less about
    any one sample than a single feature vector does);
  * `global_prototypes` / `leave_one_out_prototypes`: the sample-weighted average over clients (all
    of them, or all but the one receiving it, e.g. the FD teacher of per-class mean logits);
  * `relay_partners`: which other user's n_avg-prototypes each client downloads this round.

A client distils from the downloaded prototypes with a discriminator built from its own classifier
(Eq. 5): for a student sample i and a teacher prototype k, h_ik = <softmax(s_i / T),
softmax(t_k / T)> (`prob_product`), trained with binary cross-entropy towards "same class"
(`disc_bce`; PyTorch's nn.BCELoss, whose logs are clamped at -100).

Everything is a small pure function of arrays: jittable, vmappable over a client axis (no Python
control flow on traced values; class counts, n_avg and client counts are static Python ints), and
computed in the inputs' float dtype (float32, or float64 under x64).
"""
from __future__ import annotations

import operator
from typing import Tuple

import jax
import jax.numpy as jnp

from fedjax_ssl.ops.numerics import as_float

REDUCTIONS = ('mean', 'sum')

# Sums of features against one-hot weights are exact selections; the default matmul precision of
# accelerators (bf16 passes on TPU, TF32 on recent GPUs) would round the features themselves to ~3
# significant digits, so every contraction here asks for full precision. On CPU it changes nothing.
_HIGHEST = jax.lax.Precision.HIGHEST

# nn.BCELoss clamps each log at -100 so that h = 0 or 1 gives a finite loss.
_LOG_CLAMP = -100.0


def _safe_divide(sums: jax.Array, totals: jax.Array) -> jax.Array:
  """sums [C, d] / totals [C] row-wise, exactly 0 (with zero gradients) where totals == 0.

  The denominator is replaced by 1 before dividing rather than masked afterwards, so an empty class
  never evaluates 0/0 (whose NaN would leak into gradients through the unselected branch)."""
  nonzero = totals > 0
  quotient = sums / jnp.where(nonzero, totals, 1.0)[:, None]
  return jnp.where(nonzero[:, None], quotient, 0.0)


def _class_weights(labels: jax.Array, valid: jax.Array, num_classes: int, dtype) -> jax.Array:
  """one_hot(labels) masked by valid: [n, C] in dtype. Labels outside [0, C) get an all-zero row."""
  return jax.nn.one_hot(labels, num_classes, dtype=dtype) * jnp.asarray(valid, dtype)[:, None]


def class_means(features: jax.Array, labels: jax.Array, valid: jax.Array, num_classes: int
                ) -> Tuple[jax.Array, jax.Array]:
  """Per-class mean feature over the valid rows, and the number of rows behind each mean.

  Args:
    features: float [n, d] (e.g. the last hidden layer of a client's batch or dataset).
    labels: int [n]; a valid row with a label outside [0, C) is counted in no class.
    valid: bool [n]; False marks padding rows, which count nowhere whatever their features/labels.
    num_classes: C, static.
  Returns:
    means [C, d] (exactly 0 for a class without valid rows) and counts [C] (float, the features'
    dtype: they become weights of the server's averages).
  """
  features = as_float(features)
  labels = jnp.asarray(labels)
  used = jnp.asarray(valid, bool) & (labels >= 0) & (labels < num_classes)
  weights = _class_weights(labels, used, num_classes, features.dtype)
  counts = jnp.sum(weights, axis=0)
  # Padding rows may hold anything (even inf/nan from an unused buffer): zeroing unused rows before
  # the contraction keeps 0 * inf = nan out of every class's sum.
  features = jnp.where(used[:, None], features, 0.0)
  sums = jnp.einsum('nc,nd->cd', weights, features, precision=_HIGHEST)
  return _safe_divide(sums, counts), counts


def navg_prototypes(key: jax.Array, features: jax.Array, labels: jax.Array, valid: jax.Array,
                    num_classes: int, n_avg: int) -> jax.Array:
  """n_avg-prototypes: per class, the mean of min(n_avg, n_c) valid rows drawn without replacement.

  Every subset of min(n_avg, n_c) valid rows of class c is equally likely (n_c = its number of
  valid rows); an empty class gives 0. Classes are drawn independently given the key.

  Implementation: one sort of the rows by (class, random key), padding rows and out-of-range labels
  last, lays each class out in a uniformly random order; a row's rank within its class is its
  sorted position minus the class's start, and rows of rank < n_avg are averaged. O(n log n), no
  per-class loop. The random key is 64 bits (two uint32 words): two rows tie with probability
  2^-64, so ties (broken by row index, a bias) are negligible for any n (n² 2^-65 per call).

  Args:
    key: PRNG key.
    features: float [n, d]; labels: int [n]; valid: bool [n] (as in `class_means`).
    num_classes: C, static.
    n_avg: static Python int >= 1.
  Returns:
    float [C, d].
  """
  try:
    ok = operator.index(n_avg) >= 1
  except TypeError:
    ok = False
  if not ok:
    raise ValueError(f'n_avg must be a static int >= 1; got {n_avg!r}')
  n_avg = operator.index(n_avg)
  labels = jnp.asarray(labels)
  valid = jnp.asarray(valid, bool)
  n = labels.shape[0]
  in_range = valid & (labels >= 0) & (labels < num_classes)
  # Class C collects padding rows and out-of-range labels: sorted after every real class.
  sort_key = jnp.where(in_range, labels, num_classes).astype(jnp.int32)
  words = jax.random.bits(key, (2, n), jnp.uint32)
  rows = jnp.arange(n, dtype=jnp.int32)
  *_, order = jax.lax.sort((sort_key, words[0], words[1], rows), num_keys=3)
  position = jnp.zeros(n, jnp.int32).at[order].set(rows)   # the inverse permutation of order
  sizes = jnp.zeros(num_classes + 1, jnp.int32).at[sort_key].add(1)
  starts = jnp.cumsum(sizes) - sizes
  rank = position - starts[sort_key]
  chosen = in_range & (rank < n_avg)
  return class_means(features, labels, chosen, num_classes)[0]


def global_prototypes(means: jax.Array, counts: jax.Array) -> jax.Array:
  """Sample-weighted average of the clients' class means: Σ_u n_uc m_uc / Σ_u n_uc.

  Args:
    means: float [N, C, d], per-client class means (`class_means`).
    counts: float [N, C], rows behind each mean (non-negative).
  Returns:
    float [C, d]; exactly 0 for a class with zero total count.
  """
  means = as_float(means)
  counts = jnp.asarray(counts, means.dtype)
  # A client's mean of an empty class is 0 by construction, but callers may pass anything there:
  # masking by count > 0 keeps a stray nan/inf of a zero-weight client out of the sum.
  means = jnp.where((counts > 0)[..., None], means, 0.0)
  sums = jnp.einsum('uc,ucd->cd', counts, means, precision=_HIGHEST)
  return _safe_divide(sums, jnp.sum(counts, axis=0))


def leave_one_out_prototypes(means: jax.Array, counts: jax.Array, u: jax.Array) -> jax.Array:
  """`global_prototypes` over every client except u (the FD teacher for client u).

  Client u's weights are masked to zero rather than subtracted from the totals, so the result is
  the plain average over the others (no cancellation) and exactly 0 for a class only u has.

  Args:
    means: float [N, C, d]; counts: float [N, C] (as in `global_prototypes`).
    u: int scalar in [0, N), may be traced (e.g. vmapped over clients).
  Returns:
    float [C, d].
  """
  counts = jnp.asarray(counts)
  others = jnp.arange(counts.shape[0]) != u
  return global_prototypes(means, counts * others[:, None].astype(counts.dtype))


def relay_partners(key: jax.Array, num_clients: int, num_classes: int, per_class: bool = False
                   ) -> jax.Array:
  """For every client u, the user v != u whose n_avg-prototypes u downloads from the relay.

  v = (u + 1 + r) mod N with r uniform on {0, ..., N-2} is uniform over the N-1 other users.

  Args:
    key: PRNG key.
    num_clients: N >= 2, static; num_classes: C, static.
    per_class: False: one partner per client, repeated over the C columns; True: an independent
      partner per (client, class).
  Returns:
    int32 [N, C].
  """
  if num_clients < 2:
    raise ValueError(f'relay_partners needs num_clients >= 2 (a partner other than oneself); '
                     f'got num_clients={num_clients}')
  shape = (num_clients, num_classes) if per_class else (num_clients, 1)
  offset = jax.random.randint(key, shape, 0, num_clients - 1, dtype=jnp.int32)
  partners = (jnp.arange(num_clients, dtype=jnp.int32)[:, None] + 1 + offset) % num_clients
  return jnp.broadcast_to(partners, (num_clients, num_classes))


def prob_product(student_logits: jax.Array, teacher_logits: jax.Array, temperature: float = 1.0
                 ) -> jax.Array:
  """The discriminator of Eq. 5: h_ik = <softmax(s_i / T), softmax(t_k / T)>.

  h_ik is the probability that the classifier assigns sample i and prototype k the same class when
  drawing each independently from its softmax; it lies in [0, 1] (up to rounding: a value of
  1 + ulp is treated as 1 by `disc_bce`).

  Args:
    student_logits: float [b, C]; teacher_logits: float [K, C] (logits of the K prototypes under
      the client's own classifier head).
    temperature: T > 0 (may be traced).
  Returns:
    float [b, K].
  """
  student = jax.nn.softmax(as_float(student_logits) / temperature, axis=-1)
  teacher = jax.nn.softmax(as_float(teacher_logits) / temperature, axis=-1)
  return jnp.einsum('bc,kc->bk', student, teacher, precision=_HIGHEST)


def _clamped_log(h: jax.Array) -> jax.Array:
  """max(log h, -100), -100 for h <= 0, with a finite gradient everywhere.

  log is evaluated at 1 where h <= 0, so neither the value nor the gradient of the unselected
  branch is -inf/nan (a bare where(h > 0, log(h), ...) would still give 0 * inf = nan gradients)."""
  defined = h > 0
  log = jnp.log(jnp.where(defined, h, 1.0))
  return jnp.maximum(jnp.where(defined, log, _LOG_CLAMP), _LOG_CLAMP)


def _clamped_log1m(h: jax.Array) -> jax.Array:
  """max(log(1 - h), -100), -100 for h >= 1, with a finite gradient everywhere.

  log1p(-h), as PyTorch computes it: accurate for small h, where 1 - h would round (in float32,
  log(1 - 1e-8) = 0 but log1p(-1e-8) = -1e-8). Evaluated at 0 where h >= 1 (see `_clamped_log`)."""
  defined = h < 1
  log = jnp.log1p(-jnp.where(defined, h, 0.0))
  return jnp.maximum(jnp.where(defined, log, _LOG_CLAMP), _LOG_CLAMP)


def disc_bce(h: jax.Array, labels: jax.Array, reduction: str = 'mean') -> jax.Array:
  """Binary cross-entropy of the discriminator towards "sample i is of prototype k's class".

  Per entry -(t_ik max(log h_ik, -100) + (1 - t_ik) max(log(1 - h_ik), -100)), t = one_hot(labels),
  as PyTorch's nn.BCELoss computes it (log(1 - h) as log1p(-h)). The gradient is that of this
  clamped function: finite at h = 0 or 1, and zero through a clamped log. (PyTorch's backward is
  (h - t) / max(h (1 - h), 1e-12) instead, up to 1e12 at h = 0 or 1; the two agree wherever
  h (1 - h) >= 1e-12.)

  Args:
    h: float [b, K], probabilities (e.g. `prob_product`); entries in [0, 1].
    labels: int [b] in [0, K): the prototype of sample i's own class.
    reduction: 'mean' over all b K entries (nn.BCELoss's default, the authors' code) or 'sum' over
      the K prototypes then mean over the b samples (Alg. 2 of the paper).
  Returns:
    float scalar.
  """
  if reduction not in REDUCTIONS:
    raise ValueError(f'reduction must be one of {REDUCTIONS}; got {reduction!r}')
  h = as_float(h)
  targets = jax.nn.one_hot(labels, h.shape[-1], dtype=h.dtype)
  # Clamping before multiplying by the target keeps 0 * (-inf) out of the loss.
  loss = -(targets * _clamped_log(h) + (1.0 - targets) * _clamped_log1m(h))
  if reduction == 'mean':
    return jnp.mean(loss)
  return jnp.mean(jnp.sum(loss, axis=-1))
