"""Small numeric helpers shared by the ops and the SSL losses.

  as_float        promote an array to at least float32 (float64 stays float64 under x64)
  check_positive  reject a concrete Python number <= 0 (a traced value passes unchecked)
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
