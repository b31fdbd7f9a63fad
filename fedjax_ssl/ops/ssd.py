"""SSD's primitives (Fang, Lin, King, Zhang, "Soft Separation and Distillation: Toward Global
Uniformity in Federated Unsupervised Learning", ICCV 2025; official code github:hc-fang/ssd).

  dsr_loss           Dimension-Scaled Regularisation of one view: pull the L2-normalised
                     embedding towards a stop-gradient copy whose client-specific dimensions are
                     scaled up (Q diag(d_k) Qᵀ), in the code's form (re-normalised target,
                     unsquared Frobenius norm / B) or the paper's (squared, un-normalised, mean)
  distillation_loss  Projector Distillation of one view: KL between the softmaxes at temperature
                     tau of the projector output z and the encoder output h (batch mean)
  scaling_vectors    the per-client vectors d_k: alpha on floor(D/K) disjoint dimensions, 1 elsewhere
                     (soft separation, SSD); or 1 on the block and 0 elsewhere (hard separation,
                     HSD: the target is the embedding's projection onto the client's subspace)
  orthogonal_basis   the shared random orthogonal basis Q (QR of a Gaussian), or the identity

The decisions, with the paper's and the code's alternatives: docs/notes/ssd.md.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl.ops.numerics import as_float, check_positive, l2_normalize

DSR_FORMS = ('code', 'paper')
PD_DIRECTIONS = ('code', 'paper')
BASES = ('random_orthogonal', 'identity')
SEPARATIONS = ('soft', 'hard')


def _check_dsr_inputs(z, q, d) -> None:
  if jnp.ndim(z) != 2:
    raise ValueError(f'dsr_loss: z {jnp.shape(z)} must be [B, D]')
  dim = jnp.shape(z)[1]
  if jnp.shape(q) != (dim, dim) or jnp.shape(d) != (dim,):
    raise ValueError(f'dsr_loss: q {jnp.shape(q)} must be [D, D] and d {jnp.shape(d)} must be [D] '
                     f'with D = {dim} (z {jnp.shape(z)})')


def _safe_norm(sq: jax.Array) -> jax.Array:
  """sqrt(sq) with gradient 0 at sq = 0 (||.||_F has none there; jnp.sqrt's would be inf x 0 = NaN)."""
  positive = sq > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)


def dsr_target(z: jax.Array, q: jax.Array, d: jax.Array) -> jax.Array:
  """z M_k with M_k = Q diag(d) Qᵀ, written as z + ((z Q) ⊙ (d - 1)) Qᵀ so that d = 1 returns z
  itself, bit for bit (the loss is then exactly 0 and so is its gradient).

  Args:
    z: float [B, D]; q: [D, D] orthogonal; d: [D].
  Returns:
    float [B, D] (no gradient is stopped here).
  """
  z = as_float(z)
  hi = jax.lax.Precision.HIGHEST  # accelerators would otherwise round the operands to TF32 / bf16
  return z + jnp.matmul(jnp.matmul(z, q, precision=hi) * (d - 1.0), q.T, precision=hi)


def dsr_loss(z: jax.Array, q: jax.Array, d: jax.Array, *, form: str = 'code') -> jax.Array:
  """DSR of one view.

      ẑ = z / ||z||                                      rows, [B, D]
      code:  T = sg(normalise(ẑ Q diag(d) Qᵀ)),  L = ||ẑ - T||_F / B        (`subspace_loss`)
      paper: T = sg(ẑ Q diag(d) Qᵀ),             L = mean_b ||ẑ_b - T_b||²  (Q = I: ẑ ⊙ d)

  The code's target is computed from z rather than ẑ (normalisation makes them equal): then d = 1
  gives T = ẑ exactly, and the loss and its gradient are exactly 0 rather than rounding noise
  amplified by the norm's 1 / ||ẑ - T||.

  Args:
    z: float [B, D] raw projector output.
    q: float [D, D] the shared orthogonal basis.
    d: float [D] the client's dimension-scaling vector.
    form: 'code' (the official code's; default) or 'paper' (the paper's squared form).
  Returns:
    scalar >= 0.
  """
  _check_dsr_inputs(z, q, d)
  if form not in DSR_FORMS:
    raise ValueError(f'dsr_loss: form = {form!r} is invalid: must be one of {DSR_FORMS}')
  zhat = l2_normalize(z)
  b = zhat.shape[0]
  if form == 'paper':
    t = jax.lax.stop_gradient(dsr_target(zhat, q, d))
    return jnp.mean(jnp.sum((zhat - t) ** 2, axis=1))
  t = jax.lax.stop_gradient(l2_normalize(dsr_target(z, q, d)))
  return _safe_norm(jnp.sum((zhat - t) ** 2)) / b


def _log_softmax(x: jax.Array, tau: float) -> jax.Array:
  return jax.nn.log_softmax(as_float(x) / tau, axis=-1)


def distillation_loss(h: jax.Array, z: jax.Array, tau: float = 0.5, *, direction: str = 'code',
                      stop_gradient_z: bool = False) -> jax.Array:
  """Projector Distillation of one view, batch mean of a KL over the feature dimension.

      code:  mean_b KL(softmax(z_b / tau) || softmax(h_b / tau))   (F.kl_div(log_softmax(h / tau),
                                                                    softmax(z / tau), 'batchmean'))
      paper: mean_b KL(softmax(h_b / tau) || softmax(z_b / tau))   (the paper's D_KL(σ(h) || σ(z)))

  On the raw h and z (not normalised). Gradients reach both h and z (the code stops none);
  stop_gradient_z=True makes the projector output a constant teacher.

  Args:
    h: float [B, D] encoder output; z: float [B, D] projector output.
    tau: softmax temperature, > 0 (0.5).
    direction: 'code' (default) or 'paper'.
    stop_gradient_z: treat z as a constant.
  Returns:
    scalar >= 0.
  """
  if jnp.ndim(h) != 2 or jnp.shape(h) != jnp.shape(z):
    raise ValueError(f'distillation_loss: h {jnp.shape(h)} and z {jnp.shape(z)} must both be '
                     '[B, D] (the KL compares them coordinate by coordinate)')
  check_positive('tau', tau)
  if direction not in PD_DIRECTIONS:
    raise ValueError(f'distillation_loss: direction = {direction!r} is invalid: must be one of '
                     f'{PD_DIRECTIONS}')
  if stop_gradient_z:
    z = jax.lax.stop_gradient(z)
  lh, lz = _log_softmax(h, tau), _log_softmax(z, tau)
  teacher, student = (lz, lh) if direction == 'code' else (lh, lz)
  return jnp.mean(jnp.sum(jnp.exp(teacher) * (teacher - student), axis=1))


def subset_size(dim: int, num_vectors: int, size: int = 0) -> int:
  """|S_k|: `size` when given (> 0), else floor(D / K); ValueError when K blocks of it do not fit
  in D dimensions."""
  m = size if size > 0 else dim // max(num_vectors, 1)
  if num_vectors < 1 or m < 1 or num_vectors * m > dim:
    raise ValueError(f'{num_vectors} clients with {m} dimensions each do not fit in D = {dim} '
                     'embedding dimensions: each client needs its own disjoint block (K x m <= D)')
  return m


def scaling_vectors(rng: np.random.Generator, num_vectors: int, dim: int, alpha: float,
                    size: int = 0, separation: str = 'soft') -> np.ndarray:
  """The dimension-scaling vectors d_k (the code's `generate_weighted_subspaces`).

  A random permutation of the D dimensions is cut into blocks S_k = perm[k m : (k + 1) m],
  k < K, m = subset_size(D, K, size). The S_k are pairwise disjoint; D - K m dimensions belong to
  nobody.
    soft (SSD): d_k is alpha on S_k and 1 elsewhere.
    hard (HSD, the paper's soft-against-hard comparison; not in the official code): d_k is 1 on
      S_k and 0 elsewhere, so that `dsr_target` is z U_k U_kᵀ with U_k = Q[:, S_k], the
      projection onto the client's subspace: in the code's form, the alpha -> infinity limit of
      the soft target. alpha is not used. The same rng draws give the same blocks as soft.

  Args:
    rng: numpy Generator (the run's; drawn once, before training).
    num_vectors: K; dim: D; alpha: > 0 (10); size: m, or 0 for floor(D / K);
    separation: 'soft' or 'hard'.
  Returns:
    float64 [K, D].
  """
  check_positive('alpha', alpha)
  if separation not in SEPARATIONS:
    raise ValueError(f'separation = {separation!r} is invalid: must be one of {SEPARATIONS}')
  m = subset_size(dim, num_vectors, size)
  perm = rng.permutation(dim)
  inside, outside = (alpha, 1.0) if separation == 'soft' else (1.0, 0.0)
  d = np.full((num_vectors, dim), outside)
  for k in range(num_vectors):
    d[k, perm[k * m:(k + 1) * m]] = inside
  return d


def orthogonal_basis(rng: np.random.Generator, dim: int, kind: str = 'random_orthogonal'
                     ) -> np.ndarray:
  """Q [D, D] float64: Q of the QR factorisation of a standard Gaussian matrix (the code's
  `torch.linalg.qr(randn(D, D))`), or the identity (the paper's implicit basis)."""
  if kind not in BASES:
    raise ValueError(f'basis = {kind!r} is invalid: must be one of {BASES}')
  if kind == 'identity':
    return np.eye(dim)
  return np.linalg.qr(rng.standard_normal((dim, dim)))[0]
