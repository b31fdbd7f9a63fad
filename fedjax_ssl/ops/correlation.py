"""FedSC's correlation matrices (Jing et al., ICML 2024): NormClip, the mini-batch estimators of
Eq. (33), a client's DP-CalR matrix (Alg. 2, before noise) and the server's bookkeeping of the
latest matrix of every client (Alg. 1).

Rows are samples throughout (the paper's Z has samples as columns): z [B, H], R = zᵀz / B [H, H].
All functions are pure and jittable; float64 inputs stay float64.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from fedjax_ssl.ops.numerics import as_float, check_positive

# A zero row has norm 0: clamping the squared norm keeps NormClip's gradient finite there.
_NORM_EPS = 1e-12


def norm_clip(z: jax.Array, sqrt_mu: float) -> jax.Array:
  """NormClip(z, sqrt(mu)) = z * min(1, sqrt_mu / ||z||) per row (paper Alg. 2; FedSC code).

  The gradient flows through the rescaling, as in the code's `z if ||z|| < sqrt_mu else
  sqrt_mu * z / ||z||`. Afterwards ||z_b z_bᵀ||_F = ||z_b||² <= mu.

  Args:
    z: float [..., H].
    sqrt_mu: clipping radius, > 0.
  Returns:
    float [..., H].
  """
  check_positive('sqrt_mu', sqrt_mu)
  z = as_float(z)
  sq = jnp.maximum(jnp.sum(z * z, axis=-1, keepdims=True), _NORM_EPS ** 2)
  return jnp.where(sq < sqrt_mu ** 2, z, sqrt_mu * z * jax.lax.rsqrt(sq))


def multiview_correlations(zs: jax.Array, mask: Optional[jax.Array] = None
                           ) -> Tuple[jax.Array, jax.Array]:
  """Mini-batch estimators of FedSC §5.2 from 2V views of the same batch.

    R̂  = 1/(2BV) Σ_{v=1}^{2V} Z_vᵀ Z_v
    R̂⁺ = 1/(2BV) Σ_{v=1}^{V} (Z_vᵀ Z_{v+V} + Z_{v+V}ᵀ Z_v)     (Tr R̂⁺ is Eq. 33)

  Args:
    zs: float [2V, B, H], view v of sample b in zs[v, b].
    mask: optional bool [B]; rows with False are left out and B counts the True rows (the ragged
      last batch of an epoch, A22).
  Returns:
    (R̂, R̂⁺), float [H, H] each, symmetric.
  """
  zs = as_float(zs)
  if zs.ndim != 3 or zs.shape[0] % 2:
    raise ValueError(f'zs must be [2V, B, H] with an even number of views; got {zs.shape}')
  b = zs.shape[1]
  if mask is not None:
    zs = zs * mask[None, :, None].astype(zs.dtype)
    b = jnp.sum(mask).astype(zs.dtype)
  v = zs.shape[0] // 2
  denom = 2 * b * v
  r_hat = jnp.einsum('vbh,vbk->hk', zs, zs) / denom
  cross = jnp.einsum('vbh,vbk->hk', zs[:v], zs[v:])
  return r_hat, (cross + cross.T) / denom


def correlation_matrices(z0: jax.Array, z1: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """The two-view case (V = 1) of `multiview_correlations`, as FedSC trains.

  Args:
    z0, z1: float [B, H], representations of the two views of the same B images.
  Returns:
    R̂ = (z0ᵀz0 + z1ᵀz1) / (2B) and R̂⁺ = (z0ᵀz1 + z1ᵀz0) / (2B), float [H, H].
  """
  if jnp.ndim(z0) != 2 or jnp.shape(z0) != jnp.shape(z1):
    raise ValueError(f'expected equal 2-D shapes [B, H]; got z0={jnp.shape(z0)}, '
                     f'z1={jnp.shape(z1)}')
  return multiview_correlations(jnp.stack([as_float(z0), as_float(z1)]))


def view_sum_correlation(z: jax.Array, sqrt_mu: Optional[float], mask: jax.Array) -> jax.Array:
  """Σ over views and valid rows of ž žᵀ, ž = NormClip(z, sqrt_mu) (DP-CalR's accumulator).

  Args:
    z: float [V, B, H].
    sqrt_mu: clipping radius, or None for no clip.
    mask: bool [B], the rows that are real examples.
  Returns:
    float [H, H] (un-normalised; divide by V·|D_j| once the client's chunks are summed).
  """
  z = as_float(z)
  if sqrt_mu is not None:
    z = norm_clip(z, sqrt_mu)
  z = z * mask[None, :, None].astype(z.dtype)
  return jnp.einsum('vbh,vbk->hk', z, z)


def weighted_sum(cache: jax.Array, q: jax.Array) -> jax.Array:
  """R̃ = Σ_k q_k R̃_k. cache float [J, H, H]; q float [J]. Returns [H, H]."""
  return jnp.einsum('j,jhk->hk', q.astype(cache.dtype), cache)


def leave_one_out(total: jax.Array, r_j: jax.Array, q_j: jax.Array) -> jax.Array:
  """R̃_{-j} = (R̃ - q_j R̃_j) / (1 - q_j) = Σ_{k≠j} q_k R̃_k / (1 - q_j)  (Alg. 1; q_j < 1)."""
  return (total - q_j * r_j) / (1.0 - q_j)


def replace_matrix(total: jax.Array, old_j: jax.Array, new_j: jax.Array, q_j: jax.Array
                   ) -> jax.Array:
  """Alg. 1's incremental update R̃ ← R̃ - q_j R̃_j^{old} + q_j R̃_j^{new} (one client's upload).

  The engine recomputes `weighted_sum` of its cache every round instead (exact, no drift, cheap);
  this form is the paper's and is tested to agree with it (T13)."""
  return total - q_j * old_j + q_j * new_j
