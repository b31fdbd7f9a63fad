"""Weighted kNN monitor (InstDisc / SimSiam `knn_predict`; the kNN monitors of the FedSC and FedU2 official code).

Features are L2-normalised; every test feature takes its k most cosine-similar training features, and each
neighbour votes for its label with weight exp(sim / temperature). The prediction is the class with the
largest summed weight. The test set is processed in fixed-size chunks (the last one padded), so memory is
bounded by chunk x N_train similarities and a single program is compiled.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl.ssl.losses import l2_normalize


@functools.partial(jax.jit, static_argnames=('num_classes', 'k'))
def _predict_chunk(bank: jax.Array, bank_y: jax.Array, queries: jax.Array, temperature: jax.Array, *,
                   num_classes: int, k: int) -> jax.Array:
  """bank [N, d] (unit rows), bank_y [N], queries [B, d] -> predicted labels int32 [B]."""
  sim = l2_normalize(queries) @ bank.T                     # [B, N]
  top_sim, top_idx = jax.lax.top_k(sim, k)                 # [B, k]
  weights = jnp.exp(top_sim / temperature)
  votes = jax.nn.one_hot(bank_y[top_idx], num_classes) * weights[..., None]   # [B, k, K]
  return jnp.argmax(jnp.sum(votes, axis=1), axis=-1).astype(jnp.int32)


def knn_predict(train_f: Any, train_y: Any, test_f: Any, num_classes: int, k: int = 200,
                temperature: float = 0.1, batch_size: int = 256) -> np.ndarray:
  """Weighted-kNN class predictions.

  Args:
    train_f: float [N, d], the memory bank (un-augmented training features).
    train_y: int [N] in [0, num_classes).
    test_f: float [M, d] queries.
    num_classes: K.
    k: neighbours per query, 1 <= k <= N.
    temperature: > 0; neighbour weight exp(cos / temperature).
    batch_size: queries per chunk.
  Returns:
    int32 numpy [M] predicted labels (ties between classes go to the smallest label).
  """
  n, d = np.shape(train_f)
  if np.shape(train_y) != (n,) or np.ndim(test_f) != 2 or np.shape(test_f)[1] != d:
    raise ValueError(f'expected train_f [N, d], train_y [N], test_f [M, d]; got {np.shape(train_f)}, '
                     f'{np.shape(train_y)}, {np.shape(test_f)}')
  if not 1 <= k <= n:
    raise ValueError(f'k must lie in [1, N_train={n}], got {k}')
  if not temperature > 0 or batch_size < 1:
    raise ValueError(f'need temperature > 0 and batch_size >= 1, got {temperature}, {batch_size}')
  y = np.asarray(train_y)
  if y.min() < 0 or y.max() >= num_classes:
    raise ValueError(f'train_y must lie in [0, {num_classes}), got range [{y.min()}, {y.max()}]')
  bank = l2_normalize(jnp.asarray(train_f))
  bank_y = jnp.asarray(train_y)
  test_f = jnp.asarray(test_f)
  m = test_f.shape[0]
  if m == 0:
    return np.zeros((0,), np.int32)
  batch_size = min(batch_size, m)  # a small query set is not padded up to a large chunk.
  preds = []
  for start in range(0, m, batch_size):
    chunk = test_f[start:start + batch_size]
    chunk = jnp.pad(chunk, ((0, batch_size - chunk.shape[0]), (0, 0)))
    preds.append(_predict_chunk(bank, bank_y, chunk, jnp.float32(temperature), num_classes=num_classes, k=k))
  return np.asarray(jnp.concatenate(preds)[:m])


def knn_monitor(train_f: Any, train_y: Any, test_f: Any, test_y: Any, num_classes: int, k: int = 200,
                temperature: float = 0.1, batch_size: int = 256) -> float:
  """Top-1 accuracy of the weighted kNN classifier (`knn_predict`) on the test set.

  Args:
    As in `knn_predict`, plus test_y: int [M].
  Returns:
    accuracy in [0, 1].
  """
  if np.shape(test_y) != (np.shape(test_f)[0],) or np.shape(test_y)[0] == 0:
    raise ValueError(f'test_y must be [M] with M >= 1 matching test_f {np.shape(test_f)}, got {np.shape(test_y)}')
  preds = knn_predict(train_f, train_y, test_f, num_classes, k, temperature, batch_size)
  return float(np.mean(preds == np.asarray(test_y)))
