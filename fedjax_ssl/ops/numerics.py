"""Small numeric helpers shared by the ops, the models and the SSL losses.

  as_float        promote an array to at least float32 (float64 stays float64 under x64)
  check_positive  reject a concrete Python number <= 0 (a traced value passes unchecked)
  l2_normalize    row-wise x / max(||x||, 1e-12), torch's F.normalize (also
                  fedjax_ssl.ssl.losses.l2_normalize)
"""
from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp


def as_float(x: jax.Array) -> jax.Array:
  """Promotes to at least float32 (keeps float64 when x64 is enabled)."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def check_positive(name: str, value: Any) -> None:
  """Raises for a concrete Python number <= 0; traced values cannot be checked and pass through."""
  if isinstance(value, numbers.Real) and not value > 0:
    raise ValueError(f'{name} must be > 0, got {value!r}')


# F.normalize's default: the norm is clamped from below at eps, so an all-zero row maps to zero (no NaN).
_NORM_EPS = 1e-12


def _safe_sq_norm(x: jax.Array) -> jax.Array:
  """Row-wise squared L2 norm clamped at eps², [B, 1]; the clamp keeps gradients finite at x = 0."""
  return jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), _NORM_EPS ** 2)


def l2_normalize(x: jax.Array) -> jax.Array:
  """Row-wise L2 normalisation x / max(||x||, 1e-12) (torch `F.normalize(x, dim=-1)`).

  Args:
    x: float [..., d].
  Returns:
    float [..., d] with unit-norm rows (zero rows stay zero).
  """
  x = as_float(x)
  return x * jax.lax.rsqrt(_safe_sq_norm(x))
