"""Geometry of learned representations (Wang & Isola 2020; FedU2's dimensional-collapse plots).

  alignment(z1, z2)      mean ||f(x) - f(x+)||^alpha over positive pairs (lower = better aligned)
  uniformity(z)          log mean_{i<j} exp(-t ||z_i - z_j||^2)          (lower = more uniform)
  covariance_spectrum(h) singular values of the feature covariance, descending (collapse = a fast
                         drop to ~0 after a few values)
All take l2-normalised rows where the metric is defined on the sphere (the caller normalises).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def alignment(z1: jax.Array, z2: jax.Array, alpha: float = 2.0) -> jax.Array:
  """Scalar mean_i ||z1_i - z2_i||^alpha for paired rows z1, z2 [N, d]."""
  return jnp.mean(jnp.sum((z1 - z2) ** 2, axis=1) ** (alpha / 2.0))


def uniformity(z: jax.Array, t: float = 2.0) -> jax.Array:
  """Scalar log of the mean over the N(N-1)/2 distinct pairs of exp(-t ||z_i - z_j||^2), z [N, d].

  Uses logsumexp so that a well-spread set (all terms tiny) does not underflow to log 0.
  """
  n = z.shape[0]
  sq = jnp.maximum(jnp.sum(z * z, 1)[:, None] + jnp.sum(z * z, 1)[None, :] - 2.0 * z @ z.T, 0.0)
  iu = jnp.triu_indices(n, k=1)
  return jax.nn.logsumexp(-t * sq[iu]) - jnp.log(n * (n - 1) / 2.0)


def covariance_spectrum(h: jax.Array) -> jax.Array:
  """[min(N, d)] singular values of the (biased) covariance of the rows of h [N, d], descending."""
  hc = h - jnp.mean(h, axis=0, keepdims=True)
  cov = hc.T @ hc / h.shape[0]
  return jnp.linalg.svd(cov, compute_uv=False)[:min(h.shape)]


def effective_rank(h: jax.Array) -> jax.Array:
  """exp(entropy) of the normalised covariance spectrum (Roy & Vetterli 2007), a scalar in [1, d]."""
  s = covariance_spectrum(h)
  p = s / jnp.maximum(jnp.sum(s), 1e-30)
  return jnp.exp(-jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)))
