"""Containers shared by data sources, partitioners and the federated engine."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import flax.struct
import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A labelled image dataset held in host memory.

  Attributes:
    name: catalog name, e.g. 'fashion_mnist'.
    train_x: uint8 [N_train, H, W, C] (NHWC; grayscale has C=1).
    train_y: int32 [N_train].
    test_x: uint8 [N_test, H, W, C].
    test_y: int32 [N_test].
    num_classes: number of label values (labels lie in [0, num_classes)).
    mean, std: per-channel statistics of train_x scaled to [0, 1], len C; used by `augment.normalize`.
  """
  name: str
  train_x: np.ndarray
  train_y: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray
  num_classes: int
  mean: Tuple[float, ...]
  std: Tuple[float, ...]

  @property
  def image_shape(self) -> Tuple[int, int, int]:
    return tuple(self.train_x.shape[1:])


@flax.struct.dataclass
class FedData:
  """Device-resident federated data, stacked over clients (the design's on-device layout).

  Attributes:
    x: uint8 [C, n_max, H, W, ch]; rows >= n[c] are padding (zeros) and are never trained on.
    y: int32 [C, n_max]; -1 at padding. Used only by supervised methods and evaluation.
    n: int32 [C], true number of examples of each client.
    public_x: uint8 [L, H, W, ch] public/RAD set carved out before partitioning, or None.
  """
  x: jax.Array
  y: jax.Array
  n: jax.Array
  public_x: Optional[jax.Array] = None

  @property
  def num_clients(self) -> int:
    return self.x.shape[0]

  @property
  def n_max(self) -> int:
    return self.x.shape[1]
