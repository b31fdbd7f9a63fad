"""Orchestra's clustering primitives (Lubana et al., "Orchestra: Unsupervised Federated Learning
via Globally Consistent Clustering", ICML 2022), as the authors released them
(ekdeepslubana/OrchestraFL: `models.py` `sknopp`, `orchestra.local_clustering`,
`.global_clustering`, `.forward`, `.update_memory`). docs/notes/fedu2.md#fedu2-orchestra.

  sinkhorn_knopp(scores [N, K], lam, max_iters, tol) -> Q [N, K]   equal-size soft assignments
  memory_push(memory [m, D], z [B, D]) -> [m, D]                    FIFO bank of target projections
  memory_fill(memory, filled, z) -> (memory, filled)                the setup round's bank
  local_clustering(memory [m, D], key, L) -> [L, D]                 a client's equal-size K-means
  global_clustering(local [N, D], centroids [K, D], T) -> [K, D]    the server's clustering
  cluster_loss(z_online [B, D], z_target [B, D], centroids [K, D], T) -> scalar
  rotate90(x [B, H, W, C], k [B]) -> [B, H, W, C]                   the degeneracy term's inputs

Every function is pure, works in the inputs' float dtype (at least float32; float64 stays float64)
and can be jitted and vmapped.
"""
from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

from fedjax_ssl.ops.numerics import as_float
from fedjax_ssl.ops.numerics import l2_normalize

# The release's constants (models.py): Sinkhorn's multiplier `lamd`, its iteration caps (global
# clustering 100, local clustering 10), its stopping rule (|c / c_new - 1| summed < 1e-2, checked
# every 10th iteration), 5 local K-means iterations, and the server's SGD on the global centroids
# (lr 0.01, momentum 0.9, weight decay 1e-4, 500 steps, rows renormalised after every step).
SINKHORN_LAMBDA = 25.0
SINKHORN_TOL = 1e-2
SINKHORN_CHECK_EVERY = 10
GLOBAL_SINKHORN_ITERS = 100
LOCAL_SINKHORN_ITERS = 10
LOCAL_ITERS = 5
GLOBAL_ITERS = 500
GLOBAL_LR = 0.01
GLOBAL_MOMENTUM = 0.9
GLOBAL_WEIGHT_DECAY = 1e-4
# torch.nn.functional.cosine_similarity's eps.
COSINE_EPS = 1e-8


def sinkhorn_knopp(scores: jax.Array, lam: float = SINKHORN_LAMBDA,
                   max_iters: int = GLOBAL_SINKHORN_ITERS, tol: float = SINKHORN_TOL,
                   check_every: int = SINKHORN_CHECK_EVERY, rows: jax.Array | None = None
                   ) -> jax.Array:
  """Equal-size soft assignments of N samples to K clusters (the release's `sknopp`).

  With P0 = softmax(lam * scores) row-wise, transposed to [K, N], and r = 1/K, c = 1/N:
    repeat up to max_iters times (iteration i = 0, 1, ...):
      r_k = (1/K) / sum_n P0[k, n] c_n
      c'_n = (1/N) / sum_k r_k P0[k, n]
      if i % check_every == 0: err = sum_n |c_n / c'_n - 1|      (nan terms skipped)
      c = c'
      stop if err < tol                                          (err is the last checked value)
    Q[n, k] = N * c_n * P0[k, n] * r_k
  Every row of Q sums to 1 exactly (up to rounding); every column sums to N/K at the fixed point
  (an equal-size split: each cluster receives N/K samples' worth of mass). `tol = 0` runs all
  max_iters iterations. No gradient flows through Q (the release computes it under no_grad).

  Args:
    scores: float [N, K] similarities (samples x centroids), N, K >= 1.
    lam: multiplier of the scores inside the softmax (> 0; the release's `lamd` = 25).
    max_iters: iteration cap (>= 1).
    tol: stopping tolerance on the checked err (>= 0).
    check_every: err is recomputed at iterations i with i % check_every == 0 (>= 1).
    rows: optional bool [N] (at least one True): the samples that take part; the others get c_n = 0
      and a zero row of Q, and N counts the True rows only (the assignment of those rows alone).
  Returns:
    float [N, K] soft assignments (rows sum to 1, columns to N/K at convergence).
  """
  if scores.ndim != 2:
    raise ValueError(f'sinkhorn_knopp: scores {scores.shape} must be [N, K]')
  if not (lam > 0 and max_iters >= 1 and tol >= 0 and check_every >= 1):
    raise ValueError(f'sinkhorn_knopp: lam = {lam} must be > 0, max_iters = {max_iters} and '
                     f'check_every = {check_every} >= 1, tol = {tol} >= 0')
  scores = jax.lax.stop_gradient(as_float(scores))
  n, k = scores.shape
  dtype = scores.dtype
  p = jax.nn.softmax(lam * scores, axis=1).T                       # [K, N]
  if rows is None:
    c0, inv_n = jnp.full((n,), 1.0 / n, dtype), 1.0 / n
  else:
    live = rows.astype(dtype)
    n = jnp.sum(live)
    c0 = inv_n = live / n  # 0 off the rows, so they weigh nothing in r and stay 0 in c

  def body(i, carry):
    r, c, err, done = carry
    r_new = (1.0 / k) / (p @ c)
    c_new = inv_n / (r_new @ p)
    ratio = jnp.abs(c / c_new - 1.0)
    err_new = jnp.where(i % check_every == 0, jnp.sum(jnp.where(jnp.isnan(ratio), 0.0, ratio)), err)
    keep = lambda old, new: jnp.where(done, old, new)
    r, c, err = keep(r, r_new), keep(c, c_new), keep(err, err_new)
    return r, c, err, done | (err < tol)

  init = (jnp.full((k,), 1.0 / k, dtype), c0, jnp.asarray(1e3, dtype), jnp.zeros((), bool))
  r, c, _, _ = jax.lax.fori_loop(0, max_iters, body, init)
  return n * (p.T * c[:, None]) * r[None, :]


def memory_push(memory: jax.Array, z: jax.Array) -> jax.Array:
  """The bank after one step (the release's `update_memory`): the oldest B rows leave, z's rows
  enter last, in order.

  Args:
    memory: float [m, D], oldest row first.
    z: float [B, D], the step's target projections. For B >= m the bank becomes z's last m rows
      (the release supports B <= m only).
  Returns:
    float [m, D] = concat(memory, z)[-m:], in memory's dtype.
  """
  m = memory.shape[0]
  return jnp.concatenate([memory, z.astype(memory.dtype)], axis=0)[-m:]


def memory_fill(memory: jax.Array, filled: jax.Array, z: jax.Array
                ) -> Tuple[jax.Array, jax.Array]:
  """The setup round's bank (the release's `reset_memory`: the first m projections, in order).

  Args:
    memory: float [m, D]; rows >= filled are still the initial ones.
    filled: int32 scalar, the rows written so far (0 <= filled <= m).
    z: float [B, D] the next projections.
  Returns:
    (memory with rows filled .. min(filled + B, m) - 1 set to z's first rows, min(filled + B, m)).
  """
  m, b = memory.shape[0], z.shape[0]
  rows = filled + jnp.arange(b)
  memory = memory.at[rows].set(z.astype(memory.dtype), mode='drop')   # rows >= m are dropped
  return memory, jnp.minimum(filled + b, m).astype(filled.dtype)


def local_clustering(memory: jax.Array, key: jax.Array, num_clusters: int,
                     iters: int = LOCAL_ITERS, lam: float = SINKHORN_LAMBDA,
                     sinkhorn_iters: int = LOCAL_SINKHORN_ITERS) -> jax.Array:
  """A client's local centroids: K-means with Sinkhorn-Knopp equal-size assignments on its bank
  (the release's `local_clustering`).

  centroids <- num_clusters distinct rows of the bank, drawn uniformly; then `iters` times:
    Q = sinkhorn_knopp(memory @ centroids^T, lam, sinkhorn_iters)      [m, L]
    a_n = argmax_l Q[n, l]                                             (first maximum)
    centroid_l = normalize(mean of the rows n with a_n = l)
                 or normalize(a uniformly drawn row of the bank) if no row has a_n = l.

  Args:
    memory: float [m, D] the bank (rows are l2-normalised target projections, or initial rows).
    key: PRNG key (initial rows, then one draw per iteration for the empty clusters' rows).
    num_clusters: L, 1 <= L <= m.
    iters: K-means iterations (>= 1; the release: 5).
    lam, sinkhorn_iters: Sinkhorn's multiplier and iteration cap (the release: 25, 10).
  Returns:
    float [L, D] unit-norm centroids.
  """
  m = memory.shape[0]
  if not 1 <= num_clusters <= m:
    raise ValueError(f'local_clustering: num_clusters = {num_clusters} must be in [1, m = {m}] '
                     '(the initial centroids are distinct rows of the bank)')
  memory = as_float(memory)
  k_init, k_loop = jax.random.split(key)
  centroids = memory[jax.random.choice(k_init, m, (num_clusters,), replace=False)]

  def body(i, centroids):
    q = sinkhorn_knopp(memory @ centroids.T, lam, sinkhorn_iters)
    onehot = jax.nn.one_hot(jnp.argmax(q, axis=1), num_clusters, dtype=memory.dtype)   # [m, L]
    counts = jnp.sum(onehot, axis=0)
    means = (onehot.T @ memory) / jnp.maximum(counts, 1.0)[:, None]
    fallback = memory[jax.random.randint(jax.random.fold_in(k_loop, i), (num_clusters,), 0, m)]
    return l2_normalize(jnp.where(counts[:, None] > 0, means, fallback))

  return jax.lax.fori_loop(0, iters, body, centroids)


def global_clustering_loss(centroids: jax.Array, local_centroids: jax.Array, targets: jax.Array,
                           temperature: float, rows: jax.Array | None = None) -> jax.Array:
  """The server's clustering objective for fixed targets (the release's `global_clustering` loss):

    p_n = softmax(normalize(z_n) @ centroids^T / T)          [N, K]
    L   = -(1/N) sum_n cos(targets_n, p_n),   cos(a, b) = a.b / max(|a| |b|, 1e-8)

  Args:
    centroids: float [K, D] global centroids (the variable).
    local_centroids: float [N, D] the round's local centroids z_n.
    targets: float [N, K] Sinkhorn-Knopp assignments (constants).
    temperature: T > 0.
    rows: optional bool [N]: average over these rows only (the others' z_n are not there).
  Returns:
    scalar.
  """
  probs = jax.nn.softmax(l2_normalize(local_centroids) @ centroids.T / temperature, axis=1)
  targets = jax.lax.stop_gradient(targets)
  dots = jnp.sum(targets * probs, axis=1)
  norms = jnp.linalg.norm(targets, axis=1) * jnp.linalg.norm(probs, axis=1)
  cos = dots / jnp.maximum(norms, COSINE_EPS)
  if rows is None:
    return -jnp.mean(cos)
  return -jnp.sum(jnp.where(rows, cos, 0)) / jnp.sum(rows).astype(cos.dtype)


def global_clustering(local_centroids: jax.Array, centroids: jax.Array, temperature: float,
                      iters: int = GLOBAL_ITERS, lr: float = GLOBAL_LR,
                      momentum: float = GLOBAL_MOMENTUM, weight_decay: float = GLOBAL_WEIGHT_DECAY,
                      lam: float = SINKHORN_LAMBDA,
                      sinkhorn_iters: int = GLOBAL_SINKHORN_ITERS,
                      rows: jax.Array | None = None) -> jax.Array:
  """The server's global centroids from the round's local centroids (the release's
  `global_clustering`: Genevay et al.'s stochastic OT clustering with Sinkhorn targets).

  From W = centroids and a zero momentum buffer, `iters` times:
    Q = sinkhorn_knopp(local_centroids @ W^T, lam, sinkhorn_iters)     [N, K], constant
    g = d global_clustering_loss(W, local_centroids, Q, T) / dW + weight_decay * W
    buf = momentum * buf + g;  W = W - lr * buf                       (torch SGD, no dampening)
    W = W with l2-normalised rows
  (a fresh optimizer per call, as the release creates one per round).

  Args:
    local_centroids: float [N, D], every participant's local centroids stacked (N = m * L).
    centroids: float [K, D] the previous global centroids (the start point).
    temperature: T > 0 of the predicted assignments.
    iters, lr, momentum, weight_decay: the SGD run (the release: 500, 0.01, 0.9, 1e-4).
    lam, sinkhorn_iters: Sinkhorn's multiplier and cap (25, 100).
    rows: optional bool [N]: the local centroids that take part (those of the round's present
      participants, core/faults.py); the clustering of those rows alone.
  Returns:
    float [K, D] unit-norm global centroids.
  """
  local_centroids = as_float(local_centroids)
  w0 = as_float(centroids).astype(jnp.promote_types(centroids.dtype, local_centroids.dtype))
  grad = jax.grad(global_clustering_loss)

  def body(_, carry):
    w, buf = carry
    q = sinkhorn_knopp(local_centroids @ w.T, lam, sinkhorn_iters, rows=rows)
    g = grad(w, local_centroids, q, temperature, rows) + weight_decay * w
    buf = momentum * buf + g
    return l2_normalize(w - lr * buf), buf

  w, _ = jax.lax.fori_loop(0, iters, body, (w0, jnp.zeros_like(w0)))
  return w.astype(centroids.dtype)


def cluster_loss(z_online: jax.Array, z_target: jax.Array, centroids: jax.Array,
                 temperature: float, targets: str = 'softmax', lam: float = SINKHORN_LAMBDA,
                 sinkhorn_iters: int = GLOBAL_SINKHORN_ITERS) -> jax.Array:
  """Orchestra's clustering loss of one step (the release's `forward`, `L_cluster`).

    s_online = normalize(z_online) @ centroids^T,   s_target = normalize(z_target) @ centroids^T
    q = softmax(s_target / T)                       (targets='softmax', the release)
      = sinkhorn_knopp(s_target, lam, sinkhorn_iters) (targets='sinkhorn', equal-size targets)
    L = -(1/B) sum_n sum_k q[n, k] log softmax(s_online / T)[n, k]
  The targets and the centroids get no gradient.

  Args:
    z_online: float [B, D] the online projector output of one view (the release: view 2).
    z_target: float [B, D] the target projector output of the other view (view 1).
    centroids: float [K, D] the global centroids (unit rows after the server's clustering).
    temperature: T > 0 (the release: 0.1).
    targets: 'softmax' or 'sinkhorn'.
  Returns:
    scalar.
  """
  if targets not in ('softmax', 'sinkhorn'):
    raise ValueError(f"cluster_loss: targets = {targets!r} must be 'softmax' or 'sinkhorn'")
  c = jax.lax.stop_gradient(as_float(centroids))
  logp = jax.nn.log_softmax(l2_normalize(z_online) @ c.T / temperature, axis=1)
  s_target = jax.lax.stop_gradient(l2_normalize(z_target) @ c.T)
  if targets == 'softmax':
    q = jax.nn.softmax(s_target / temperature, axis=1)
  else:
    q = sinkhorn_knopp(s_target, lam, sinkhorn_iters)
  return -jnp.mean(jnp.sum(q * logp, axis=1))


def rotate90(x: jax.Array, k: jax.Array) -> jax.Array:
  """Each image rotated counter-clockwise by 90 * k[i] degrees (torchvision's `rotate` by a
  multiple of 90 on a square image; the degeneracy term's inputs).

  Args:
    x: [B, H, W, C] with H == W.
    k: int [B] in {0, 1, 2, 3}.
  Returns:
    [B, H, W, C].
  """
  if x.ndim != 4 or x.shape[1] != x.shape[2]:
    raise ValueError(f'rotate90: x {x.shape} must be square images [B, H, H, C]')
  rotations = jnp.stack([jnp.rot90(x, r, axes=(1, 2)) for r in range(4)])   # [4, B, H, W, C]
  return rotations[k, jnp.arange(x.shape[0])]
