"""Small encoders: the project's benchmark CNN and Hetero-SSFL's small-capacity clients (Table 8).

  small_cnn:  conv3x3(16) -> ReLU -> maxpool2 -> conv3x3(32) -> ReLU -> maxpool2 -> flatten
              -> Dense(256) -> ReLU -> Dense(128)                                  features 128 (linear)
  cross_device_cnn: the CNN of the cross-device simulation benchmark (CIFAR-10 shaped input):
              conv3x3(32) -> ReLU -> maxpool2 -> conv3x3(64) -> ReLU -> maxpool2 -> flatten
              -> Dense(128) -> ReLU                                                features 128;
              with the classifier's Dense(10) 545,098 parameters
  hetero_cnn: FedHeNN CNNCifar100_1: conv5x5(64, VALID) -> ReLU -> maxpool2 -> conv5x5(128, VALID)
              -> ReLU -> maxpool2 -> flatten -> fc 256 -> ReLU -> fc 128 -> ReLU    features 128
  mlp:        flatten -> 512 -> ReLU -> 256 -> ReLU -> 128 -> ReLU                  features 128

hetero_cnn and mlp end in a ReLU because FedHeNN's feature vectors (CNNCifar100_1 `feat_vec`,
MLP `get_feat_vec`) are taken after it; FedHeNN's dropout (0.6) before the classifier is left out
because these are SSL encoders followed by projector heads. Flatten is HWC order (PyTorch: CHW),
a fixed permutation of the Dense input that does not matter for training from scratch.
Each computes in its `dtype` (layers.Conv) and returns its features at least float32.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import flax.linen as nn
import jax

from fedjax_ssl.models import layers


class SmallCNN(nn.Module):
  """Benchmark CNN: [B, H, W, C] -> [B, 128] (28x28 -> 7x7x32 before the Dense layers)."""
  conv_features: Sequence[int] = (16, 32)
  dense_features: Sequence[int] = (256, 128)
  conv_impl: str = 'auto'
  relu_features: bool = False  # a ReLU after the last Dense too (cross_device_cnn)
  dtype: Optional[Any] = None

  @property
  def feature_dim(self) -> int:
    return self.dense_features[-1]

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    del train
    layers.check_nhwc(x)
    for i, f in enumerate(self.conv_features):
      x = layers.Conv(f, 3, 1, padding=1, conv_impl=self.conv_impl, dtype=self.dtype,
                      name=f'conv{i + 1}')(x)
      x = layers.max_pool(nn.relu(x))
    x = x.reshape(x.shape[0], -1)
    for i, f in enumerate(self.dense_features):
      x = layers.Dense(f, dtype=self.dtype, name=f'fc{i + 1}')(x)
      if i < len(self.dense_features) - 1 or self.relu_features:
        x = nn.relu(x)
    return layers.as_float(x)


class HeteroCNN(nn.Module):
  """FedHeNN CNNCifar100_1 encoder: [B, 32, 32, 3] -> [B, 128] (32 -> 28 -> 14 -> 10 -> 5)."""
  conv_impl: str = 'auto'
  feature_dim: int = 128
  dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    del train
    layers.check_nhwc(x)
    conv = lambda f, name: layers.Conv(f, 5, 1, padding='VALID', conv_impl=self.conv_impl,
                                       dtype=self.dtype, name=name)
    x = layers.max_pool(nn.relu(conv(64, 'conv1')(x)))
    x = layers.max_pool(nn.relu(conv(128, 'conv2')(x)))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(layers.Dense(256, dtype=self.dtype, name='fc1')(x))
    return layers.as_float(nn.relu(layers.Dense(self.feature_dim, dtype=self.dtype, name='fc2')(x)))


class MLP(nn.Module):
  """MLP encoder: [B, H, W, C] -> flatten -> hidden layers with ReLU -> [B, features[-1]]."""
  features: Sequence[int] = (512, 256, 128)
  conv_impl: str = 'auto'  # accepted for a uniform encoder interface; the MLP has no convolution
  dtype: Optional[Any] = None
  CONVOLUTIONS = False  # so conv_impl 'packed' / 'measured' (a convolution layout) is refused

  @property
  def feature_dim(self) -> int:
    return self.features[-1]

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    del train
    layers.check_nhwc(x)
    layers.resolve_conv_impl(self.conv_impl)  # reject an invalid value like the conv encoders do
    if self.conv_impl in layers.PACKED_IMPLS:
      raise ValueError(f'conv_impl={self.conv_impl!r} lays out convolutions and the MLP has none; '
                       "allowed for it: 'auto', 'xla', 'im2col'")
    x = x.reshape(x.shape[0], -1)
    for i, f in enumerate(self.features):
      x = nn.relu(layers.Dense(f, dtype=self.dtype, name=f'fc{i + 1}')(x))
    return layers.as_float(x)
