"""Model divergence used by FedU's predictor rule and FedEMA's moving average."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def conv_divergence(before, after) -> jax.Array:
  """Mean over convolution kernels of the L2 distance between two parameter trees.

  EasyFL `_calculate_divergence`: for every conv weight tensor, ||w_after - w_before||_2 (flattened),
  averaged over the number of tensors. Convolution kernels are the 4-D leaves [kh, kw, cin, cout].

  Args:
    before, after: encoder parameter pytrees of the same structure.
  Returns:
    float scalar in the parameters' precision (float32; float64 for a float64 state).
  """
  pairs = [(a, b) for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after))
           if a.ndim == 4]
  if not pairs:
    raise ValueError('conv_divergence needs an encoder with convolution kernels (4-D parameters); '
                     'this encoder has none')
  dists = [jnp.sqrt(jnp.sum(jnp.square((b - a).astype(jnp.promote_types(a.dtype, jnp.float32)))))
           for a, b in pairs]
  return jnp.mean(jnp.stack(dists))
