"""Self-supervised and supervised losses used by the federated methods.

All losses are pure `jax.numpy` functions of row-major batches (rows are samples) and return a scalar that
is a mean over the batch. Inputs in a lower precision than float32 (bf16/f16 model outputs) are promoted to
float32 before any reduction; float64 inputs stay float64.

Conventions follow the authors' code where the papers leave them open (docs/notes/evaluation.md#losses-and-evaluation):
  * BYOL: EasyFL `loss_one + loss_two`, each `2 - 2 cos` averaged over the batch (EasyFL = the FedU/FedEMA code; the
    FedU2 code uses the same loss).
  * SimSiam: `½ D(p1, sg z2) + ½ D(p2, sg z1)`, `D = -cos` (EasyFL).
  * SimCLR: NT-Xent over 2B samples; `zero_diagonal=True` reproduces the FedU2 code's quirk (off by default).
  * Spectral contrastive: FedSC "loss as implemented" (FedSC official code, `Client_SPECshare.loss`), i.e. 2 x the
    batch loss of the paper's §5.2 (FedSC, ICML 2024), with NormClip (paper Alg. 2) applied inside the loss.
  * VICReg and Barlow Twins: as in the authors' released code (facebookresearch/vicreg `main_vicreg.py`,
    facebookresearch/barlowtwins `main.py`), with their default weights.
"""
from __future__ import annotations

import numbers
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import optax

from fedjax_ssl.ops.correlation import norm_clip
from fedjax_ssl.ops.numerics import as_float, check_positive, l2_normalize  # noqa: F401 (public here too)

def _check_same_2d(names: Tuple[str, ...], *arrays: jax.Array) -> None:
  shapes = [jnp.shape(a) for a in arrays]
  if any(len(s) != 2 for s in shapes) or len(set(shapes)) != 1:
    desc = ', '.join(f'{n}={s}' for n, s in zip(names, shapes))
    raise ValueError(f'expected equal 2-D shapes [B, d]; got {desc}')


def _cosine(a: jax.Array, b: jax.Array) -> jax.Array:
  """Row-wise cosine similarity, [B]."""
  return jnp.sum(l2_normalize(a) * l2_normalize(b), axis=-1)


def byol_loss(p1: jax.Array, p2: jax.Array, t1: jax.Array, t2: jax.Array) -> jax.Array:
  """Symmetrised BYOL regression loss (EasyFL): mean_b(2 - 2cos(p1, sg t2)) + mean_b(2 - 2cos(p2, sg t1)).

  Args:
    p1, p2: float [B, d], online predictions of views 1 and 2.
    t1, t2: float [B, d], target projections of views 1 and 2 (gradients are stopped).
  Returns:
    scalar in [0, 8].
  """
  _check_same_2d(('p1', 'p2', 't1', 't2'), p1, p2, t1, t2)
  t1, t2 = jax.lax.stop_gradient(t1), jax.lax.stop_gradient(t2)
  return jnp.mean(2.0 - 2.0 * _cosine(p1, t2)) + jnp.mean(2.0 - 2.0 * _cosine(p2, t1))


def simsiam_loss(p1: jax.Array, p2: jax.Array, z1: jax.Array, z2: jax.Array) -> jax.Array:
  """SimSiam loss ½ D(p1, sg z2) + ½ D(p2, sg z1) with D(p, z) = -mean_b cos(p_b, z_b).

  Args:
    p1, p2: float [B, d], predictor outputs of views 1 and 2.
    z1, z2: float [B, d], projector outputs of views 1 and 2 (gradients are stopped).
  Returns:
    scalar in [-1, 1].
  """
  _check_same_2d(('p1', 'p2', 'z1', 'z2'), p1, p2, z1, z2)
  z1, z2 = jax.lax.stop_gradient(z1), jax.lax.stop_gradient(z2)
  return -0.5 * jnp.mean(_cosine(p1, z2)) - 0.5 * jnp.mean(_cosine(p2, z1))


def nt_xent(z1: jax.Array, z2: jax.Array, temperature: float, zero_diagonal: bool = False) -> jax.Array:
  """SimCLR NT-Xent over the 2B L2-normalised samples [z1; z2].

  Anchor i's positive is the other view of the same image (i <-> i + B); every other sample is a negative.
  The self-similarity is excluded from the softmax (logit -inf) by default. With `zero_diagonal=True`
  the self-similarity logit is multiplied by 0 instead, as in the FedU2 code, so exp(0) = 1 stays in the
  denominator (FedU2 official code, github.com/XeniaLLL/FedU2).

  Args:
    z1, z2: float [B, d], projector outputs of views 1 and 2 (B >= 1).
    temperature: softmax temperature (FedU2: 0.07), > 0.
    zero_diagonal: reproduce the FedU2 zero-diagonal quirk.
  Returns:
    scalar, the cross-entropy averaged over the 2B anchors.
  """
  _check_same_2d(('z1', 'z2'), z1, z2)
  check_positive('temperature', temperature)
  b = jnp.shape(z1)[0]
  z = l2_normalize(jnp.concatenate([z1, z2], axis=0))
  logits = (z @ z.T) / temperature
  diag = jnp.eye(2 * b, dtype=bool)
  logits = jnp.where(diag, 0.0 if zero_diagonal else -jnp.inf, logits)
  positive = (jnp.arange(2 * b) + b) % (2 * b)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, positive))


def spectral_contrastive_loss(z0: jax.Array,
                              z1: jax.Array,
                              *,
                              alpha: float = 1.0,
                              r_global: Optional[jax.Array] = None,
                              mu: Optional[float] = None,
                              mask: Optional[jax.Array] = None) -> jax.Array:
  """FedSC spectral contrastive batch loss exactly as implemented (FedSC official code, `Client_SPECshare.loss`).

      (optional) z_v <- NormClip(z_v, sqrt(mu))
      posloss  = -(2/B) Σ_b z1_b · z0_b                         (= -2 Tr R̂⁺)
      R̂        = (z1ᵀz1 + z0ᵀz0) / (2B)
      negaloss = alpha ||R̂||_F² + 2 (1 - alpha) Tr(R̂ R_global)  if r_global is given, else ||R̂||_F²
      loss     = posloss + negaloss                             (= 2 x the paper's L̂_j with q_j -> alpha)

  Without `r_global` (FedAvg+SC, or FedSC before the first share) `alpha` is not used, as in the code,
  where the shared-matrix term only exists once a matrix was received (docs/notes/evaluation.md#losses-and-evaluation).

  Args:
    z0, z1: float [B, H], projector outputs of the two views.
    alpha: weight of the intra-client contrast term (FedSC: alpha_t = 1 - 0.8 (t - 1) / T, t = 1..T).
    r_global: float [H, H], the received R̃_{-j} (treated as a constant: gradients are stopped), or None.
    mu: NormClip level (rows clipped to norm sqrt(mu)), > 0, or None for no clipping.
    mask: optional bool [B]: only True rows count and B is their number (FedSC's ragged last batch,
      `drop_last=False`: the loss uses the real batch size).
  Returns:
    scalar.
  """
  _check_same_2d(('z0', 'z1'), z0, z1)
  h = jnp.shape(z0)[1]
  if r_global is not None and jnp.shape(r_global) != (h, h):
    raise ValueError(f'r_global must have shape {(h, h)} (H = feature dim of z), got {jnp.shape(r_global)}')
  if mu is not None:
    check_positive('mu', mu)
    z0, z1 = norm_clip(z0, jnp.sqrt(mu)), norm_clip(z1, jnp.sqrt(mu))
  z0, z1 = as_float(z0), as_float(z1)
  b = jnp.shape(z0)[0]
  if mask is not None:
    m = mask[:, None].astype(z0.dtype)
    z0, z1, b = z0 * m, z1 * m, jnp.sum(m)
  posloss = -2.0 / b * jnp.sum(z1 * z0)
  r_hat = (z1.T @ z1 + z0.T @ z0) / (2 * b)
  frob_sq = jnp.sum(r_hat * r_hat)
  if r_global is None:
    return posloss + frob_sq
  r_global = jax.lax.stop_gradient(as_float(r_global))
  # R̂ is symmetric, so Tr(R̂ R_global) = Σ_ik R̂_ik R_global_ik, also for a non-symmetric (DP-noised) R_global.
  return posloss + alpha * frob_sq + 2.0 * (1.0 - alpha) * jnp.sum(r_hat * r_global)


def _off_diagonal_sq_sum(m: jax.Array) -> jax.Array:
  """Σ_{i≠j} m_ij² of a square matrix."""
  off = jnp.where(jnp.eye(m.shape[0], dtype=bool), 0.0, m)  # masked, not Σ m² - Σ diag²: no cancellation
  return jnp.sum(off * off)


def vicreg(z_a: jax.Array, z_b: jax.Array, *, sim_coeff: float = 25.0, std_coeff: float = 25.0,
           cov_coeff: float = 1.0) -> jax.Array:
  """VICReg loss (Bardes et al., ICLR 2022) as in the authors' code (`main_vicreg.py`):

      invariance  = mean_{b,k} (z_a - z_b)²                                  (MSE)
      variance    = ½ mean_k relu(1 - sqrt(var_a,k + 1e-4)) + the same for z_b  (unbiased variance)
      covariance  = Σ_{i≠j} C_a,ij² / d + Σ_{i≠j} C_b,ij² / d,  C = z̄ᵀ z̄ / (B - 1), z̄ centred
      loss        = sim_coeff · invariance + std_coeff · variance + cov_coeff · covariance

  Args:
    z_a, z_b: float [B, d] projector outputs (expander) of the two views, B >= 2.
    sim_coeff, std_coeff, cov_coeff: the weights (the paper's λ, μ, ν = 25, 25, 1), >= 0.
  Returns:
    scalar.
  """
  _check_same_2d(('z_a', 'z_b'), z_a, z_b)
  b, d = jnp.shape(z_a)
  if b < 2:
    raise ValueError(f'vicreg needs a batch of at least 2 rows (the unbiased variance), got B = {b}')
  z_a, z_b = as_float(z_a), as_float(z_b)
  invariance = jnp.mean((z_a - z_b) ** 2)
  z_a, z_b = z_a - jnp.mean(z_a, axis=0), z_b - jnp.mean(z_b, axis=0)

  def variance(z):
    std = jnp.sqrt(jnp.sum(z * z, axis=0) / (b - 1) + 1e-4)
    return jnp.mean(jax.nn.relu(1.0 - std)) / 2

  def covariance(z):
    return _off_diagonal_sq_sum(z.T @ z / (b - 1)) / d

  return (sim_coeff * invariance + std_coeff * (variance(z_a) + variance(z_b))
          + cov_coeff * (covariance(z_a) + covariance(z_b)))


def barlow_twins(z_a: jax.Array, z_b: jax.Array, *, off_diagonal_weight: float = 0.0051
                 ) -> jax.Array:
  """Barlow Twins loss (Zbontar et al., ICML 2021) as in the authors' code (`main.py`):

      ẑ       = (z - mean_b z) / sqrt(var_b z + 1e-5)    per dimension (affine-free BatchNorm: biased var)
      c       = ẑ_aᵀ ẑ_b / B                             [d, d] cross-correlation
      loss    = Σ_i (1 - c_ii)² + off_diagonal_weight · Σ_{i≠j} c_ij²

  Args:
    z_a, z_b: float [B, d] projector outputs of the two views.
    off_diagonal_weight: λ of the redundancy-reduction term (the paper's 0.0051), >= 0.
  Returns:
    scalar.
  """
  _check_same_2d(('z_a', 'z_b'), z_a, z_b)
  b = jnp.shape(z_a)[0]

  def standardise(z):
    z = as_float(z)
    z = z - jnp.mean(z, axis=0)
    return z / jnp.sqrt(jnp.mean(z * z, axis=0) + 1e-5)

  c = standardise(z_a).T @ standardise(z_b) / b
  return jnp.sum((1.0 - jnp.diagonal(c)) ** 2) + off_diagonal_weight * _off_diagonal_sq_sum(c)


def moco_infonce(q: jax.Array, k: jax.Array, queue: jax.Array, valid: jax.Array,
                 temperature: float) -> jax.Array:
  """MoCo's InfoNCE (He et al., CVPR 2020; v2: Chen et al., arXiv:2003.04297): each query against
  its own key (the positive) and the queue's keys (the negatives), cross-entropy with label 0.

      logits_b = [q̂_b · k̂_b, q̂_b · queue_j for valid j] / temperature,  loss = mean_b CE(logits_b, 0)

  Args:
    q: float [B, d], online projections (queries; L2-normalised here).
    k: float [B, d], momentum-encoder projections of the other view (keys; normalised here,
      gradients stopped).
    queue: float [K, d], earlier keys (unit rows; gradients stopped).
    valid: bool [K], which queue rows hold a key (an unfilled slot is no negative).
    temperature: > 0 (MoCo v2: 0.2).
  Returns:
    scalar.
  """
  _check_same_2d(('q', 'k'), q, k)
  check_positive('temperature', temperature)
  q = l2_normalize(as_float(q))
  k = jax.lax.stop_gradient(l2_normalize(as_float(k)))
  positive = jnp.sum(q * k, axis=-1, keepdims=True)
  negatives = jnp.where(valid[None, :], q @ jax.lax.stop_gradient(as_float(queue)).T, -jnp.inf)
  logits = jnp.concatenate([positive, negatives], axis=1) / temperature
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits, jnp.zeros(logits.shape[0], jnp.int32)))


def moco_enqueue(queue: jax.Array, ptr: jax.Array, count: jax.Array, keys: jax.Array
                 ) -> Tuple[jax.Array, jax.Array, jax.Array]:
  """MoCo's ring buffer: `keys` (L2-normalised) written at `ptr`, wrapping around.

  Args:
    queue: float [K, d]; ptr: int32 scalar, the next slot; count: int32 scalar, slots filled so far
      (rows 0..count-1 hold keys while count < K: the ring fills in order).
    keys: float [n, d], n <= K.
  Returns:
    (queue, ptr, count) after the write.
  """
  size, n = queue.shape[0], keys.shape[0]
  if n > size:
    raise ValueError(f'a step enqueues {n} keys into a queue of {size}: the queue must hold at '
                     'least one step\'s keys (batch size x views)')
  rows = (ptr + jnp.arange(n)) % size
  queue = queue.at[rows].set(jax.lax.stop_gradient(l2_normalize(as_float(keys))))
  return queue, (ptr + n) % size, jnp.minimum(count + n, size)


def ema_update(target: Any, online: Any, tau: float) -> Any:
  """Exponential moving average of a pytree: tau * target + (1 - tau) * online, leaf by leaf.

  Args:
    target: pytree of arrays (the EMA / target network).
    online: pytree with the same structure and leaf shapes (the online network).
    tau: decay in [0, 1] (BYOL: 0.99); 1 keeps the target, 0 copies the online network.
  Returns:
    pytree like `target`.
  """
  if isinstance(tau, numbers.Real) and not 0.0 <= tau <= 1.0:
    raise ValueError(f'tau must lie in [0, 1], got {tau!r}')
  return jax.tree_util.tree_map(lambda t, o: tau * t + (1.0 - tau) * o, target, online)


def cross_entropy_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Softmax cross-entropy with integer labels, averaged over the batch.

  Args:
    logits: float [B, K].
    labels: int [B] in [0, K).
  Returns:
    scalar.
  """
  if jnp.ndim(logits) != 2 or jnp.shape(labels) != jnp.shape(logits)[:1]:
    raise ValueError(f'expected logits [B, K] and labels [B]; got logits {jnp.shape(logits)}, '
                     f'labels {jnp.shape(labels)}')
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(as_float(logits), labels))


def swav_codes(scores: jax.Array, *, epsilon: float = 0.05, iters: int = 3) -> jax.Array:
  """SwAV's codes (Caron et al., NeurIPS 2020): the release's `distributed_sinkhorn` on one device.

      Q = exp(scores / epsilon)ᵀ / Σ exp(scores / epsilon)                 [K, B]
      repeat iters times:  Q <- Q / (K · rowsum Q);  Q <- Q / (B · colsum Q)
      codes = B · Qᵀ                                                        [B, K], rows sum to 1

  an equal-partition assignment of the batch to the K prototypes. As in the release the exponent
  is not shifted: for cosine scores in [-1, 1] float32 holds exp(±1 / epsilon) for epsilon above
  about 0.012 (the release's 0.05 gives exp(±20)); shifting by the maximum would widen the range
  to exp(-2 / epsilon) and underflow from epsilon 0.023 down. Orchestra's `ops.orchestra.sinkhorn_knopp` is the same Sinkhorn-Knopp iteration from a
  row-softmax start with a stopping tolerance; after the release's 3 iterations the two differ, so
  SwAV keeps its own. No gradient flows through the codes (the release computes them under
  no_grad).

  Args:
    scores: float [B, K] prototype scores of one view (normalised features @ normalised prototypes).
    epsilon: the entropic regularisation (> 0; the release's 0.05).
    iters: Sinkhorn iterations (>= 1; the release's 3).
  Returns:
    float [B, K] codes, each row a distribution over the prototypes.
  """
  if jnp.ndim(scores) != 2:
    raise ValueError(f'swav_codes: scores {jnp.shape(scores)} must be [B, K]')
  check_positive('epsilon', epsilon)
  if not (isinstance(iters, numbers.Integral) and iters >= 1):
    raise ValueError(f'swav_codes: iters = {iters!r} is invalid: must be an integer >= 1')
  s = jax.lax.stop_gradient(as_float(scores)) / epsilon
  q = jnp.exp(s).T
  q = q / jnp.sum(q)
  k, b = q.shape
  for _ in range(iters):
    q = q / jnp.sum(q, axis=1, keepdims=True) / k
    q = q / jnp.sum(q, axis=0, keepdims=True) / b
  return (q * b).T


def swav(scores_a: jax.Array, scores_b: jax.Array, *, temperature: float = 0.1,
         epsilon: float = 0.05, sinkhorn_iters: int = 3) -> jax.Array:
  """SwAV's swapped prediction over two views (the release's `main_swav.py` without multi-crop):

      q_v    = swav_codes(scores_v)                         (constants)
      loss   = -½ [ mean_b Σ_k q_a log softmax(scores_b / T) + mean_b Σ_k q_b log softmax(scores_a / T) ]

  Args:
    scores_a, scores_b: float [B, K] prototype scores of the two views.
    temperature: T of the predicted assignments (> 0; the release's 0.1).
    epsilon, sinkhorn_iters: of `swav_codes`.
  Returns:
    scalar.
  """
  _check_same_2d(('scores_a', 'scores_b'), scores_a, scores_b)
  check_positive('temperature', temperature)
  scores_a, scores_b = as_float(scores_a), as_float(scores_b)
  q_a = swav_codes(scores_a, epsilon=epsilon, iters=sinkhorn_iters)
  q_b = swav_codes(scores_b, epsilon=epsilon, iters=sinkhorn_iters)

  def cross(q, s):
    return -jnp.mean(jnp.sum(q * jax.nn.log_softmax(s / temperature, axis=1), axis=1))
  return (cross(q_a, scores_b) + cross(q_b, scores_a)) / 2


def uniformity(z: jax.Array, t: float = 2.0) -> jax.Array:
  """Wang & Isola's uniformity of one batch, over its unique pairs (torch.pdist, the SSD code):

      log mean_{i<j} exp(-t ||ẑ_i - ẑ_j||²),  ẑ = z / ||z||

  Args:
    z: float [B, d] (B >= 2), normalised here.
    t: > 0 (the paper's 2).
  Returns:
    scalar <= 0 (lower = more uniform).
  """
  if jnp.ndim(z) != 2 or jnp.shape(z)[0] < 2:
    raise ValueError(f'uniformity needs z [B, d] with B >= 2 (pairs of rows); got shape '
                     f'{jnp.shape(z)}')
  check_positive('t', t)
  a = l2_normalize(as_float(z))
  b = a.shape[0]
  # Squared distances from the Gram matrix (B² D rather than pdist's B² D memory of differences);
  # the clamp removes the rounding below 0 of near-identical rows.
  sq = jnp.sum(a * a, axis=1)
  d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * (a @ a.T), 0.0)
  upper = jnp.triu(jnp.ones((b, b), dtype=bool), k=1)
  return jax.nn.logsumexp(jnp.where(upper, -t * d2, -jnp.inf)) - jnp.log(b * (b - 1) / 2)


def align_uniform(z_a: jax.Array, z_b: jax.Array, *, t: float = 2.0,
                  uniform_weight: float = 1.0) -> jax.Array:
  """Alignment + uniformity (Wang & Isola, ICML 2020; "FedAlignUniform" of the SSD paper), as the
  SSD code's `align_loss` + `uniform_loss`:

      align   = mean_b ||ẑ_a,b - ẑ_b,b||²                      (L2-normalised views)
      loss    = align + uniform_weight · ½ (uniformity(z_a, t) + uniformity(z_b, t))

  Args:
    z_a, z_b: float [B, d] projector outputs of the two views (B >= 2).
    t: uniformity temperature, > 0 (2).
    uniform_weight: weight of the uniformity term, >= 0 (1).
  Returns:
    scalar.
  """
  _check_same_2d(('z_a', 'z_b'), z_a, z_b)
  a, b = l2_normalize(as_float(z_a)), l2_normalize(as_float(z_b))
  align = jnp.mean(jnp.sum((a - b) ** 2, axis=1))
  return align + uniform_weight * (uniformity(z_a, t) + uniformity(z_b, t)) / 2
