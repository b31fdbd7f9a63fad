"""CIFAR-style ResNets (EasyFL / FedU2 / FedSC code layout): 3x3 stride-1 stem, no max-pool,
four stages of 64/128/256/512 channels with strides 1/2/2/2, projection shortcut (1x1 conv + BN)
whenever the stride or the width changes, global average pooling, no fc (fc = Identity).

  resnet18: BasicBlock [2, 2, 2, 2] -> 512-d   (11,168,832 parameters, BN gamma/beta included)
  resnet34: BasicBlock [3, 4, 6, 3] -> 512-d
  resnet50: Bottleneck [3, 4, 6, 3] -> 2048-d (the standard ResNet-50)

FedSC's code calls BasicBlock [3, 4, 6, 3] "resnet50"; that network is `resnet34` here.
Padding is PyTorch's symmetric k//2 (not 'SAME'), so stride-2 windows are centred like PyTorch's.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax

from fedjax_ssl.models import layers

BLOCKS = ('basic', 'bottleneck')


def basic_branches(x: jax.Array, planes: int, strides: int, train: bool, conv_impl: str,
                   project: bool, dtype: Optional[Any] = None) -> Tuple[jax.Array, jax.Array]:
  """A basic residual block's two branches, not yet joined: [B,H,W,Cin] -> 2 x [B,H/s,W/s,planes].

  Residual BN(conv3x3(relu(BN(conv3x3_stride(x))))) (submodules conv1, bn1, conv2, bn2) and the
  shortcut: x, or with `project` BN(conv1x1_stride(x)) (shortcut_conv, shortcut_bn), computed in
  `dtype` (layers.conv_bn). Call inside the block's compact __call__.
  """
  conv, bn = layers.conv_bn(conv_impl, train, dtype)
  out = nn.relu(bn('bn1')(conv(planes, 3, strides, 'conv1')(x)))
  out = bn('bn2')(conv(planes, 3, 1, 'conv2')(out))
  shortcut = bn('shortcut_bn')(conv(planes, 1, strides, 'shortcut_conv')(x)) if project else x
  return out, shortcut


class BasicBlock(nn.Module):
  """relu(BN(conv3x3(relu(BN(conv3x3_stride(x))))) + shortcut(x)); [B,H,W,Cin] -> [B,H/s,W/s,planes]."""
  planes: int
  strides: int = 1
  conv_impl: str = 'auto'
  dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    project = self.strides != 1 or x.shape[-1] != self.planes
    out, shortcut = basic_branches(x, self.planes, self.strides, train, self.conv_impl, project,
                                   self.dtype)
    return nn.relu(out + shortcut)


class Bottleneck(nn.Module):
  """1x1 -> 3x3 (stride) -> 1x1 (x4) bottleneck; [B,H,W,Cin] -> [B,H/s,W/s,4*planes]."""
  planes: int
  strides: int = 1
  conv_impl: str = 'auto'
  dtype: Optional[Any] = None
  expansion = 4

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    conv, bn = layers.conv_bn(self.conv_impl, train, self.dtype)
    out_planes = self.expansion * self.planes
    out = nn.relu(bn('bn1')(conv(self.planes, 1, 1, 'conv1')(x)))
    out = nn.relu(bn('bn2')(conv(self.planes, 3, self.strides, 'conv2')(out)))
    out = bn('bn3')(conv(out_planes, 1, 1, 'conv3')(out))
    shortcut = x
    if self.strides != 1 or x.shape[-1] != out_planes:
      shortcut = bn('shortcut_bn')(conv(out_planes, 1, self.strides, 'shortcut_conv')(x))
    return nn.relu(out + shortcut)


class CifarResNet(nn.Module):
  """CIFAR ResNet encoder: x float32 [B, H, W, C] -> features [B, feature_dim].

  Attributes:
    stage_sizes: blocks per stage, e.g. (2, 2, 2, 2).
    block: 'basic' or 'bottleneck'.
    widths: channels of the four stages (planes; bottleneck output is 4x).
    conv_impl: see layers.Conv.
    dtype: compute dtype of the convolutions, BatchNorm outputs and activations (layers.Conv);
      the features are returned at least float32.
  """
  stage_sizes: Sequence[int]
  block: str = 'basic'
  widths: Sequence[int] = (64, 128, 256, 512)
  conv_impl: str = 'auto'
  dtype: Optional[Any] = None

  @property
  def feature_dim(self) -> int:
    return self.widths[-1] * (Bottleneck.expansion if self.block == 'bottleneck' else 1)

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    if self.block not in BLOCKS:
      raise ValueError(f'block={self.block!r}; allowed: {BLOCKS}')
    if len(self.stage_sizes) != len(self.widths):
      raise ValueError(f'stage_sizes={self.stage_sizes} and widths={self.widths} differ in length')
    layers.check_nhwc(x)
    block_cls = BasicBlock if self.block == 'basic' else Bottleneck
    x = layers.conv_bn_relu(x, self.widths[0], train, self.conv_impl, dtype=self.dtype)
    for i, (num_blocks, planes) in enumerate(zip(self.stage_sizes, self.widths)):
      for j in range(num_blocks):
        strides = 2 if (i > 0 and j == 0) else 1
        x = block_cls(planes, strides, conv_impl=self.conv_impl, dtype=self.dtype,
                      name=f'layer{i + 1}_{j}')(x, train)
    return layers.as_float(layers.global_avg_pool(x))
