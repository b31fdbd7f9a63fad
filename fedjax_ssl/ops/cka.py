"""Centred kernel alignment (CKA; Kornblith et al., ICML 2019) for Hetero-SSFL (Makhija et al.).

For two kernels K, M on the same L samples, with the centring matrix H = I - 11ᵀ/L,

  HSIC(K, M) = tr(K H M H) = <HKH, HMH>_F,
  CKA(K, M) = HSIC(K, M) / sqrt(HSIC(K, K) HSIC(M, M)).

(The 1/(L-1)² of the HSIC estimator cancels in CKA and is left out.) CKA is a cosine similarity
between centred kernels: it lies in [0, 1] for PSD kernels and CKA(K, K) = 1.

Hetero-SSFL aligns clients with different architectures on a public set of L samples: a client with
representation matrix a [L, d] adds mu (1 - CKA(a aᵀ, K̄)) to its loss, where K̄ = Σ_j w_j A_j A_jᵀ
is the server's weighted aggregate of every client's linear kernel. Linear kernels never need to be
formed: with a_c = H a (column means removed),

  HSIC(a aᵀ, b bᵀ) = ||b_cᵀ a_c||_F²,      HSIC(a aᵀ, K̄) = Σ_j w_j ||A_jcᵀ a_c||_F²,
  HSIC(K̄, K̄) = Σ_{j,k} w_j w_k ||A_jcᵀ A_kc||_F²,

so `cka_distance_to_aggregate` holds d_j x d_k cross-Gram matrices (one pair of cohorts at a time)
instead of L x L kernels; `cka_distance_to_kernel` takes K̄ (or its sub-block on a mini-batch of the
public set) explicitly, at O(b² d) for b samples.

`centered=False` drops H everywhere: the kernels' plain cosine similarity <K, M>_F / (||K|| ||M||),
the paper's formula read literally. Every function takes `eps`, added inside the square root of the
denominator, so that a zero representation gives CKA = 0 with finite gradients instead of 0/0. In
float32 the product HSIC(K, K) HSIC(M, M) under that root overflows once ||a_c||_F ||b_c||_F nears
4e9 (e.g. L = 5000 samples of 2048 features of variance ~400): normalise such representations first.

Clients of one architecture form a group [J_g, L, d_g] (one cohort); widths differ between groups.
All functions are pure, jittable and differentiable; they compute in the inputs' float dtype
(float32, or float64 under x64).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import jax
import jax.numpy as jnp

from fedjax_ssl.ops.numerics import as_float


def _float_pair(name: str, x: jax.Array, y: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """x [L, d1] and y [L, d2] as floats; raises naming `name` for any other shapes."""
  x, y = as_float(x), as_float(y)
  if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
    raise ValueError(f'{name} needs x [L, d1] and y [L, d2]; got {x.shape} and {y.shape}')
  return x, y


def _centre_rows(x: jax.Array, centered: bool) -> jax.Array:
  """H x for x [..., L, d]: the mean over the L samples removed from every feature column."""
  return x - jnp.mean(x, axis=-2, keepdims=True) if centered else x


def _centre_gram(k: jax.Array, centered: bool) -> jax.Array:
  """H K H for k [L, L] (row, column and grand means), O(L²) without forming H."""
  if not centered:
    return k
  return k - jnp.mean(k, 0, keepdims=True) - jnp.mean(k, 1, keepdims=True) + jnp.mean(k)


def _ratio(hsic_km, hsic_kk, hsic_mm, eps):
  """HSIC(K, M) / sqrt(HSIC(K, K) HSIC(M, M) + eps)."""
  return hsic_km / jnp.sqrt(hsic_kk * hsic_mm + eps)


def _groups(others: Sequence[jax.Array], weights: Sequence[jax.Array], dtype=None):
  """Validates the cohort groups ([J_g, L, d_g], one L) and casts them and their weights [J_g] to
  one float dtype (`dtype`, or the groups' promoted dtype)."""
  if len(others) != len(weights) or not others:
    raise ValueError(f'need one weight vector per group and at least one group; got '
                     f'{len(others)} groups and {len(weights)} weight vectors')
  others = [as_float(g) for g in others]
  weights = [jnp.asarray(w) for w in weights]
  dtype = jnp.result_type(*others) if dtype is None else dtype
  length = {g.shape[1] if g.ndim == 3 else None for g in others}
  if None in length or len(length) != 1 or any(
      w.shape != g.shape[:1] for g, w in zip(others, weights)):
    raise ValueError('each group must be [J_g, L, d_g] with one L and weights [J_g]; got '
                     f'{[g.shape for g in others]} and {[w.shape for w in weights]}')
  return [(g.astype(dtype), w.astype(dtype)) for g, w in zip(others, weights)]


def linear_cka(x: jax.Array, y: jax.Array, centered: bool = True, eps: float = 1e-12
               ) -> jax.Array:
  """Linear CKA in feature space: ||y_cᵀ x_c||_F² / sqrt(||x_cᵀ x_c||_F² ||y_cᵀ y_c||_F² + eps).

  Equals CKA(x xᵀ, y yᵀ) at O(L (d1 + d2)²) cost; no L x L matrix is formed, so L may be large,
  and d > L is fine.

  Args:
    x: float [L, d1]; y: float [L, d2] (the same L samples, in the same order).
    centered: remove the column means first (Kornblith's CKA); False is the uncentred formula.
    eps: added under the square root of the denominator.
  Returns:
    float scalar in [0, 1].
  """
  x, y = _float_pair('linear_cka', x, y)
  x, y = _centre_rows(x, centered), _centre_rows(y, centered)
  return _ratio(jnp.sum((y.T @ x) ** 2), jnp.sum((x.T @ x) ** 2), jnp.sum((y.T @ y) ** 2), eps)


def _rbf_gram(x: jax.Array, sigma_frac: float) -> jax.Array:
  """K_ij = exp(-||x_i - x_j||² / (2 sigma²)), sigma² = sigma_frac² median_ij ||x_i - x_j||²."""
  # Distances do not depend on the mean; removing it first shrinks ||x_i||² and with it the
  # cancellation in ||x_i||² + ||x_j||² - 2 x_i·x_j.
  x = _centre_rows(x, True)
  gram = x @ x.T
  norms = jnp.diag(gram)
  sq = norms[:, None] + norms[None, :] - 2.0 * gram
  # np.median's convention over all L² entries, the zero diagonal included: the mean of the two
  # middle ones (the same entry twice for odd L²). The median is an order statistic: its gradient
  # lives on the one or two middle pairs and jumps whenever the ranking of the distances changes.
  # So the bandwidth is a per-evaluation choice of kernel, and the gradient is that of CKA under a
  # fixed RBF kernel. (The value is invariant to scaling x, sigma scaling with it; this gradient
  # is not exactly orthogonal to x.)
  ordered = jnp.sort(jax.lax.stop_gradient(sq).ravel())
  median = 0.5 * (ordered[(sq.size - 1) // 2] + ordered[sq.size // 2])
  # All-zero representations (dead ReLU features) or more than half the pairs coincident give
  # median 0; the floor keeps the kernel finite (all ones, or the identity on distinct points)
  # instead of 0/0, and as the square root of the smallest normal number keeps 1/sigma² finite.
  median = jnp.maximum(median, jnp.finfo(sq.dtype).tiny ** 0.5)
  return jnp.exp(-sq / (2.0 * sigma_frac ** 2 * median))


def rbf_cka(x: jax.Array, y: jax.Array, sigma_frac: float = 0.5, centered: bool = True,
            eps: float = 1e-12) -> jax.Array:
  """CKA of RBF kernels: <HKH, HMH>_F / sqrt(||HKH||_F² ||HMH||_F² + eps).

  The bandwidth follows Kornblith's `gram_rbf(x, threshold)`: sigma² = sigma_frac² times the median
  of ALL L² squared distances, the L zeros of the diagonal included (np.median over the full matrix;
  for even L² the mean of the two middle entries). That is (sigma_frac · median distance)² up to the
  averaging of the two middle entries. The median is a constant for the gradient (see `_rbf_gram`).
  Builds L x L kernels: O(L² (d + log L)).

  Args:
    x: float [L, d1]; y: float [L, d2].
    sigma_frac: bandwidth relative to the median distance (Kornblith's `threshold`), > 0.
    centered: centre the kernels (HKH); False compares them uncentred.
    eps: added under the square root of the denominator.
  Returns:
    float scalar in [0, 1].
  """
  x, y = _float_pair('rbf_cka', x, y)
  k = _centre_gram(_rbf_gram(x, sigma_frac), centered)
  m = _centre_gram(_rbf_gram(y, sigma_frac), centered)
  return _ratio(jnp.sum(k * m), jnp.sum(k * k), jnp.sum(m * m), eps)


def aggregate_kernel(others: Sequence[jax.Array], weights: Sequence[jax.Array]) -> jax.Array:
  """K̄ = Σ_g Σ_j w_gj A_gj A_gjᵀ, the server's aggregate of the clients' linear kernels.

  Args:
    others: groups of clients, each float [J_g, L, d_g] (widths may differ between groups).
    weights: one float [J_g] per group.
  Returns:
    float [L, L], symmetric (PSD for non-negative weights).
  """
  groups = _groups(others, weights)
  # One contraction over (client, feature) per group: no [J_g, L, L] intermediate.
  return sum(jnp.einsum('jlp,jmp->lm', g * w[:, None, None], g) for g, w in groups)


def cka_distance_to_kernel(a: jax.Array, kbar: jax.Array, centered: bool = True,
                           eps: float = 1e-12) -> jax.Array:
  """1 - CKA(a aᵀ, K̄) for an explicit kernel K̄, at O(b² d) without forming a aᵀ.

    HSIC(a aᵀ, K̄) = tr(a_cᵀ K̄_c a_c),  HSIC(a aᵀ, a aᵀ) = ||a_cᵀ a_c||_F²,
    HSIC(K̄, K̄) = ||K̄_c||_F²  (K̄_c = H K̄ H).

  Args:
    a: float [b, d], the client's representations of b public samples.
    kbar: float [b, b], PSD (e.g. `aggregate_kernel`, or its sub-block on those b samples); it is
      centred here.
    centered: centre both kernels; False is the uncentred formula.
    eps: added under the square root of the denominator.
  Returns:
    float scalar in [0, 1].
  """
  a = as_float(a)
  kbar = jnp.asarray(kbar, a.dtype)
  if a.ndim != 2 or kbar.shape != (a.shape[0],) * 2:
    raise ValueError(f'need a [b, d] and kbar [b, b]; got {a.shape} and {kbar.shape}')
  a, kbar = _centre_rows(a, centered), _centre_gram(kbar, centered)
  cross = jnp.sum(a * (kbar @ a))
  return 1.0 - _ratio(cross, jnp.sum((a.T @ a) ** 2), jnp.sum(kbar * kbar), eps)


def cka_distance_to_aggregate(a: jax.Array, others: Sequence[jax.Array],
                              weights: Sequence[jax.Array], centered: bool = True,
                              eps: float = 1e-12) -> jax.Array:
  """1 - CKA(a aᵀ, Σ_j w_j A_j A_jᵀ) from the feature matrices alone (no L x L matrix).

    HSIC(a aᵀ, K̄) = Σ_j w_j ||A_jcᵀ a_c||_F²,   HSIC(K̄, K̄) = Σ_{j,k} w_j w_k ||A_jcᵀ A_kc||_F².

  The double sum runs over pairs of groups in Python (groups are few and static); a pair (g, h)
  holds the J_g J_h cross-Gram matrices [d_g, d_h] at once, and (h, g) is counted through (g, h).

  Args:
    a: float [L, d], the client's representations of the L public samples.
    others: groups of clients, each float [J_g, L, d_g] (widths may differ between groups).
    weights: one float [J_g] per group; a zero weight removes that client.
    centered: centre all kernels; False is the uncentred formula.
    eps: added under the square root of the denominator.
  Returns:
    float scalar in [0, 1] (for non-negative weights).
  """
  a = as_float(a)
  if a.ndim != 2:
    raise ValueError(f'a must be [L, d]; got {a.shape}')
  groups = [(_centre_rows(g, centered), w) for g, w in _groups(others, weights, a.dtype)]
  if groups[0][0].shape[1] != a.shape[0]:
    raise ValueError(f'a has {a.shape[0]} samples, the groups {groups[0][0].shape[1]}')
  a = _centre_rows(a, centered)
  cross = sum(jnp.sum(w * jnp.sum(jnp.einsum('jlp,lq->jpq', g, a) ** 2, axis=(1, 2)))
              for g, w in groups)
  hsic_kk = 0.0
  for i, (g, wg) in enumerate(groups):
    for j, (h, wh) in enumerate(groups[i:], start=i):
      pair = jnp.sum(jnp.einsum('jlp,klq->jkpq', g, h) ** 2, axis=(2, 3))
      hsic_kk += (1.0 if i == j else 2.0) * (wg @ pair @ wh)
  return 1.0 - _ratio(cross, jnp.sum((a.T @ a) ** 2), hsic_kk, eps)
