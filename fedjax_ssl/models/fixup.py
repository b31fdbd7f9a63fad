"""Fixup-ResNet20 (Zhang et al. 2019), widen factor 8: FedSC's "modified ResNet20" (Jing et al., ICML 2024).

No BatchNorm. Scalar parameters (shape ()) replace it:
  stem:   relu(conv3x3(x) + bias1)                                     3 -> 16*widen channels
  block:  out = conv1(x + bias1a); out = relu(out + bias1b); out = conv2(out + bias2a)
          out = out * scale + bias2b; y = relu(out + identity)
          identity = x, or when downsampling AvgPool(kernel 1, stride 2)(x + bias1a) (= every
          second pixel) concatenated with zeros to double the channels.
  3 stages x 3 blocks (16/32/64 * widen = 128/256/512 channels), global average pool,
  features = pooled + bias2 (the input of the original fc, which FedSC replaces by Identity).
Initialisation: block conv1 ~ N(0, sqrt(2 / (cout * 9)) / sqrt(L)) with L = 9 blocks, block conv2 = 0,
scale = 1, all biases 0; the stem conv keeps PyTorch's default. At init every block is therefore
relu(identity). Parameter count (widen 8): 17,108,352 conv weights + 47 scalars.
Computes in `dtype` (layers.Conv; the scalars are cast to it) and returns float32 features.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl.models import layers


def _scalar(module: nn.Module, name: str, value: float) -> jax.Array:
  """A float32 scalar parameter, in the module's compute dtype (a float32 one would promote the
  activations it is added to)."""
  value = module.param(name, nn.initializers.constant(value), (), jnp.float32)
  return layers.cast(module.dtype, value)[0]


class FixupBlock(nn.Module):
  """Fixup basic block: [B,H,W,Cin] -> [B,ceil(H/s),ceil(W/s),planes]; downsampling needs planes = 2*Cin.

  Attributes:
    planes: output channels.
    strides: 1 or 2 (2 = downsampling block).
    num_layers: L, the total number of residual blocks of the network (Fixup's depth rescaling).
  """
  planes: int
  strides: int = 1
  num_layers: int = 9
  conv_impl: str = 'auto'
  dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cin = x.shape[-1]
    if self.strides != 1 and self.planes != 2 * cin:
      raise ValueError(f'downsampling Fixup block needs planes = 2 * in_channels; got {self.planes}, {cin}')
    if self.strides == 1 and self.planes != cin:
      raise ValueError(f'identity Fixup block needs planes = in_channels; got {self.planes}, {cin}')
    # PyTorch: std = sqrt(2 / (weight.shape[0] * prod(weight.shape[2:]))) * L^-0.5, weight [cout, cin, 3, 3].
    conv1_std = float(np.sqrt(2.0 / (self.planes * 9)) / np.sqrt(self.num_layers))
    bias1a = _scalar(self, 'bias1a', 0.0)
    out = layers.Conv(self.planes, 3, self.strides, padding=1, use_bias=False,
                      kernel_init=nn.initializers.normal(conv1_std), conv_impl=self.conv_impl,
                      dtype=self.dtype, name='conv1')(x + bias1a)
    out = nn.relu(out + _scalar(self, 'bias1b', 0.0))
    out = layers.Conv(self.planes, 3, 1, padding=1, use_bias=False,
                      kernel_init=nn.initializers.zeros, conv_impl=self.conv_impl,
                      dtype=self.dtype, name='conv2')(out + _scalar(self, 'bias2a', 0.0))
    out = out * _scalar(self, 'scale', 1.0) + _scalar(self, 'bias2b', 0.0)
    identity = x
    if self.strides != 1:
      identity = (x + bias1a)[:, ::self.strides, ::self.strides, :]  # AvgPool2d(kernel 1, stride s)
      identity = jnp.concatenate([identity, jnp.zeros_like(identity)], axis=-1)
    return nn.relu(out + identity)


class FixupResNet20(nn.Module):
  """Fixup-ResNet20 encoder: x float32 [B, H, W, C] -> features [B, 64 * widen] (512 for widen 8)."""
  widen: int = 8
  stage_sizes: Sequence[int] = (3, 3, 3)
  conv_impl: str = 'auto'
  dtype: Optional[Any] = None

  @property
  def feature_dim(self) -> int:
    return 16 * self.widen * 2 ** (len(self.stage_sizes) - 1)

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    del train  # no BN / dropout
    layers.check_nhwc(x)
    num_layers = sum(self.stage_sizes)
    width = 16 * self.widen
    x = layers.Conv(width, 3, 1, padding=1, use_bias=False, conv_impl=self.conv_impl,
                    dtype=self.dtype, name='conv1')(x)
    x = nn.relu(x + _scalar(self, 'bias1', 0.0))
    for i, num_blocks in enumerate(self.stage_sizes):
      planes = width * 2 ** i
      for j in range(num_blocks):
        strides = 2 if (i > 0 and j == 0) else 1
        x = FixupBlock(planes, strides, num_layers, conv_impl=self.conv_impl, dtype=self.dtype,
                       name=f'layer{i + 1}_{j}')(x)
    return layers.as_float(layers.global_avg_pool(x) + _scalar(self, 'bias2', 0.0))
