"""Feature extractors phi of "Scalable Collaborative Learning via Representation Sharing"
(Berdoz et al., arXiv:2211.10943), layer for layer as in the author code.

Each returns d' features in [-1, 1] (feature layer Linear -> Tanh). The classifier tau =
Linear(d' -> C) is `heads.Classifier`'s 'head'. PyTorch parameter counts (BN weight and bias
counted, running statistics not) with the 10-way classifier:

  lenet5            MNIST  28x28x1, d'=84:   30,986   (phi 30,136)
  resnet9           FMNIST 28x28x1, d'=128:  2,470,730
  resnet18_repshare CIFAR  32x32x3, d'=256:  11,302,730

The ResNets use the author's non-standard block, relu(BN2(conv2(relu(BN1(conv1 x))))) + shortcut(x):
the ReLU comes before the residual add and there is none after it. Each computes in its `dtype`
(layers.Conv) and returns its features at least float32.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_ssl.models import layers, resnet


class RepShareBlock(resnet.BasicBlock):
  """Author ResBlock: [B,H,W,Cin] -> [B,H/s,W/s,planes]. BasicBlock's fields and branches, joined as
  relu(residual) + shortcut; 1x1 conv + BN shortcut only when strides != 1."""

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    out, shortcut = resnet.basic_branches(x, self.planes, self.strides, train, self.conv_impl,
                                          project=self.strides != 1, dtype=self.dtype)
    return nn.relu(out) + shortcut


def feature_layer(features: int, dtype: Optional[Any]) -> layers.Dense:
  """The Linear before the Tanh of every phi here (call inside the compact __call__)."""
  return layers.Dense(features, dtype=dtype, name='feature_layer')


class LeNet5(nn.Module):
  """LeNet5 phi: [B, 28, 28, 1] -> [B, 84] (Tanh). Convs and linears have biases, no BN."""
  feature_dim: int = 84
  conv_impl: str = 'auto'
  dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    del train  # no BN / dropout
    layers.check_nhwc(x)
    conv = lambda f, k, name: layers.Conv(f, k, 1, padding=k // 2, conv_impl=self.conv_impl,
                                          dtype=self.dtype, name=name)
    x = layers.max_pool(nn.relu(conv(6, 5, 'conv1')(x)))
    x = layers.max_pool(nn.relu(conv(16, 5, 'conv2')(x)))
    x = layers.global_avg_pool(nn.relu(conv(120, 3, 'conv3')(x)))
    return layers.as_float(jnp.tanh(feature_layer(self.feature_dim, self.dtype)(x)))


class ResNet9(nn.Module):
  """repshare ResNet9 phi: [B, 28, 28, 1] -> [B, 128] (Tanh). Spatial 28 -> 14 -> 7 -> 3 -> 1."""
  feature_dim: int = 128
  conv_impl: str = 'auto'
  dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    layers.check_nhwc(x)

    def conv_bn_relu(x, f, name):
      return layers.conv_bn_relu(x, f, train, self.conv_impl, f'{name}_conv', f'{name}_bn',
                                 self.dtype)

    x = conv_bn_relu(x, 64, 'prep')
    x = layers.max_pool(conv_bn_relu(x, 128, 'layer1'))
    x = RepShareBlock(128, conv_impl=self.conv_impl, dtype=self.dtype, name='res1')(x, train)
    x = layers.max_pool(conv_bn_relu(x, 256, 'layer2'))
    x = layers.max_pool(conv_bn_relu(x, 256, 'layer3'))
    x = RepShareBlock(256, conv_impl=self.conv_impl, dtype=self.dtype, name='res2')(x, train)
    x = layers.global_avg_pool(layers.max_pool(x))
    return layers.as_float(jnp.tanh(feature_layer(self.feature_dim, self.dtype)(x)))


# (planes, stride) of the eight blocks of the repshare ResNet18.
RESNET18_BLOCKS: Tuple[Tuple[int, int], ...] = (
    (64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1))


class RepShareResNet18(nn.Module):
  """repshare ResNet18 phi: [B, 32, 32, 3] -> [B, 256] (Tanh); CIFAR stem, no max-pool."""
  feature_dim: int = 256
  blocks: Sequence[Tuple[int, int]] = RESNET18_BLOCKS
  conv_impl: str = 'auto'
  dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    layers.check_nhwc(x)
    x = layers.conv_bn_relu(x, 64, train, self.conv_impl, dtype=self.dtype)
    for i, (planes, strides) in enumerate(self.blocks):
      x = RepShareBlock(planes, strides, conv_impl=self.conv_impl, dtype=self.dtype,
                        name=f'block{i}')(x, train)
    x = layers.global_avg_pool(x)
    return layers.as_float(jnp.tanh(feature_layer(self.feature_dim, self.dtype)(x)))
