"""FedDecorr's decorrelation loss (Shi et al., "Towards Understanding and Mitigating Dimensional
Collapse in Heterogeneous Federated Learning", ICLR 2023).

For a batch of representations z [N, d], every dimension is standardised over the batch and the
loss penalises the correlations between dimensions:

  ẑ_{:,j} = (z_{:,j} - mean_j) / sqrt(eps + var_j)     (var_j unbiased, over the N rows)
  K = ẑᵀ ẑ                                              [d, d]
  L(z) = (1 / N) · mean_{j≠l} K_jl²                     (over the d(d-1) off-diagonal entries)

K / (N - 1) is the batch correlation matrix, so L(z) = (N - 1)² / N · mean_{j≠l} corr_jl². This is
the authors' released `FedDecorrLoss` (bytedance/FedDecorr, `loss.py`: eps = 1e-8, torch's unbiased
`var`, the off-diagonal mean divided by N; the FedU2 code carries the same class). The paper writes
||K||_F² of the correlation matrix; its diagonal is constant (up to eps), so the two differ by a
constant and a scale. A batch of one row has no variance and the loss is 0, as in the code.
docs/notes/fedu2.md#fedu2-baselines.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_ssl.ops.numerics import as_float

EPS = 1e-8   # the authors' eps inside the square root


def feddecorr_loss(z: jax.Array, eps: float = EPS) -> jax.Array:
  """FedDecorr's loss of one batch.

  Args:
    z: [N, d] representations (N >= 1 rows, d >= 2 dimensions).
    eps: added to each dimension's variance before the square root.
  Returns:
    scalar in z's float dtype (at least float32): 0 for N = 1.
  """
  z = as_float(z)
  if z.ndim != 2 or z.shape[1] < 2:
    raise ValueError(f'feddecorr_loss needs z [N, d] with d >= 2 (off-diagonal correlations); '
                     f'got shape {z.shape}')
  n, d = z.shape
  if n == 1:
    return jnp.zeros((), z.dtype)
  zc = z - jnp.mean(z, axis=0, keepdims=True)
  var = jnp.sum(zc * zc, axis=0, keepdims=True) / (n - 1)
  zn = zc / jnp.sqrt(eps + var)
  # HIGHEST: accelerators would otherwise round the operands to TF32 / bf16.
  k = jnp.matmul(zn.T, zn, precision=jax.lax.Precision.HIGHEST)
  # The diagonal is masked rather than subtracted from the full sum: each diagonal entry is ~N - 1,
  # and subtracting ~d N² would cancel most digits of a small off-diagonal sum in float32.
  off = jnp.where(jnp.eye(d, dtype=bool), 0.0, k)
  return jnp.sum(off * off) / (d * (d - 1)) / n
