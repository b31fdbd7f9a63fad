"""L-DAWA's layer-wise divergence-aware aggregation (Rehman et al., "L-DAWA: Layer-wise Divergence
Aware Weight Aggregation in Federated Self-Supervised Visual Representation Learning", ICCV 2023).

Every layer (here: every array leaf with ndim >= 1) of every participant k is scaled by its angular
agreement with the same layer of the global model it started the round from, and the scaled layers
are averaged:

  δ_k^l = min(cos(w_k^l, w_g^l), 1),       w_g^l <- Σ_k ω_k δ_k^l w_k^l,

with ω_k = 1/m, the authors' release (yasar-rehman/L-DAWA, `L-DAWA-Agg.py`: a plain sum over clients
divided by their number), or data-size weights. As there, the cosine is only clipped above (it can
exceed 1 by rounding; a negative cosine flips the layer), a layer with zero norm is left unscaled
(the release skips a zero client layer; a zero global layer, which the release would divide by, is
left unscaled too), and 0-dim leaves (the release's scalar buffers) are averaged plainly. BatchNorm
running statistics are layers like any other: the release aggregates the whole state dict.
docs/notes/fedu2.md#fedu2-baselines.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp


def _uniform(client_params: Any) -> jax.Array:
  m = jax.tree_util.tree_leaves(client_params)[0].shape[0]
  return jnp.full((m,), 1.0 / m, jax.dtypes.canonicalize_dtype(jnp.float64))


def _layer_scale(stacked: jax.Array, glob: jax.Array, dtype) -> jax.Array:
  """[m] min(cos(stacked[k], glob), 1), or 1 where either norm is 0; 1 for a 0-dim layer."""
  m = stacked.shape[0]
  if glob.ndim == 0:
    return jnp.ones((m,), dtype)
  x = stacked.reshape(m, -1).astype(dtype)
  g = glob.reshape(-1).astype(dtype)
  hp = jax.lax.Precision.HIGHEST
  nx = jnp.sqrt(jnp.sum(x * x, axis=1))
  ng = jnp.sqrt(jnp.sum(g * g))
  ok = (nx > 0) & (ng > 0)
  # Divided by each norm in turn: their product can overflow float32 where the cosine cannot.
  cos = jnp.matmul(x, g, precision=hp) / jnp.where(ok, nx, 1.0) / jnp.where(ok, ng, 1.0)
  return jnp.where(ok, jnp.minimum(cos, 1.0), 1.0)


def layer_scales(client_params: Any, global_params: Any) -> Any:
  """δ_k^l of every participant and layer.

  Args:
    client_params: pytree with float leaves [m, ...], the participants' models stacked.
    global_params: the same pytree with leaves [...], the global model of the round.
  Returns:
    pytree of [m] scales (at least float32), one per leaf; 1 for 0-dim leaves.
  """
  return jax.tree_util.tree_map(
      lambda s, g: _layer_scale(s, g, jnp.promote_types(s.dtype, jnp.float32)),
      client_params, global_params)


def aggregate(client_params: Any, global_params: Any, weights: Optional[jax.Array] = None) -> Any:
  """The L-DAWA global model Σ_k ω_k δ_k^l w_k^l, leaf by leaf.

  Args:
    client_params: pytree with float leaves [m, ...], the participants' models stacked.
    global_params: the same pytree with leaves [...], the global model the participants started
      from.
    weights: [m] ω_k (summing to 1 for an average), or None for 1/m (the authors' release).
  Returns:
    pytree with leaves [...] in the leaves' dtypes; each leaf accumulated in the wider of its dtype
    and the weights' (a float64 model stays float64).
  """
  weights = _uniform(client_params) if weights is None else jnp.asarray(weights)

  def one(stacked, glob):
    acc = jnp.promote_types(stacked.dtype, weights.dtype)
    coef = weights.astype(acc) * _layer_scale(stacked, glob, acc)
    # A contraction over the client axis (as core.algorithm.weighted_mean, for its speed on CPU).
    out = jnp.tensordot(coef, stacked.astype(acc), axes=(0, 0), precision=jax.lax.Precision.HIGHEST)
    return out.astype(stacked.dtype)
  return jax.tree_util.tree_map(one, client_params, global_params)
