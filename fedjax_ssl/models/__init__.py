"""Flax encoders, heads and the encoder registry.

  enc = get_encoder('resnet18')                   # nn.Module: enc(x [B,H,W,C] float32, train) -> [B, 512]
  feature_dim('resnet18')                         # 512
  model = SSLModel(enc, *make_heads('fedu2'))     # params['encoder'], ['projector'], ['predictor']

Every encoder takes `conv_impl` ('auto' | 'xla' | 'im2col' | 'packed' | 'measured', see
layers.Conv; the last two only where there are convolutions); 'auto' uses im2col on CPU and XLA's
convolution elsewhere. Every encoder and head takes `dtype`, the compute dtype
(`compute_dtype(config.precision)`: None for float32, bfloat16); parameters stay float32 and
outputs are at least float32.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import numpy as np

from fedjax_ssl.models import layers
from fedjax_ssl.models.fixup import FixupResNet20
from fedjax_ssl.models.heads import HEAD_PRESETS, Classifier, MLPHead, SSLModel, make_heads
from fedjax_ssl.models.layers import PRECISIONS, compute_dtype
from fedjax_ssl.models.repshare import LeNet5, RepShareResNet18, ResNet9
from fedjax_ssl.models.resnet import CifarResNet
from fedjax_ssl.models.small import MLP, HeteroCNN, SmallCNN


class EncoderSpec(NamedTuple):
  """A registry entry: module class, its default attributes, the native input shape (H, W, C)."""
  cls: Callable[..., nn.Module]
  defaults: Dict[str, Any]
  input_shape: Tuple[int, int, int]


ENCODERS: Dict[str, EncoderSpec] = {
    # CIFAR-style ResNets (EasyFL / FedU2 / FedSC). FedSC's 'resnet50' (BasicBlock [3,4,6,3]) is resnet34.
    'resnet18': EncoderSpec(CifarResNet, dict(stage_sizes=(2, 2, 2, 2), block='basic'), (32, 32, 3)),
    'resnet34': EncoderSpec(CifarResNet, dict(stage_sizes=(3, 4, 6, 3), block='basic'), (32, 32, 3)),
    'resnet50': EncoderSpec(CifarResNet, dict(stage_sizes=(3, 4, 6, 3), block='bottleneck'), (32, 32, 3)),
    # repshare (Tanh feature layer; classifier = Classifier's head).
    'lenet5': EncoderSpec(LeNet5, {}, (28, 28, 1)),
    'resnet9': EncoderSpec(ResNet9, {}, (28, 28, 1)),
    'resnet18_repshare': EncoderSpec(RepShareResNet18, {}, (32, 32, 3)),
    # FedSC.
    'fixup_resnet20': EncoderSpec(FixupResNet20, dict(widen=8), (32, 32, 3)),
    # Small encoders: the project benchmark CNN and Hetero-SSFL's small clients.
    'small_cnn': EncoderSpec(SmallCNN, {}, (28, 28, 1)),
    # Twice small_cnn's conv channels (3.2x its MACs): the wider encoder of the evidence budget
    # search (docs/notes/evaluation.md#eval-19).
    'small_cnn_wide': EncoderSpec(SmallCNN, dict(conv_features=(32, 64)), (28, 28, 1)),
    'cross_device_cnn': EncoderSpec(
        SmallCNN, dict(conv_features=(32, 64), dense_features=(128,), relu_features=True),
        (32, 32, 3)),
    'hetero_cnn': EncoderSpec(HeteroCNN, {}, (32, 32, 3)),
    'mlp': EncoderSpec(MLP, {}, (32, 32, 3)),
}


def _spec(name: str) -> EncoderSpec:
  if name not in ENCODERS:
    raise ValueError(f'unknown encoder {name!r}; allowed: {sorted(ENCODERS)}')
  return ENCODERS[name]


def get_encoder(name: str, **overrides) -> nn.Module:
  """The encoder module `name` with its registry defaults, updated by `overrides` (module attributes)."""
  spec = _spec(name)
  allowed = sorted(f.name for f in dataclasses.fields(spec.cls) if f.name not in ('parent', 'name'))
  unknown = sorted(set(overrides) - set(allowed))
  if unknown:
    raise ValueError(f'encoder {name!r} has no attribute(s) {unknown}; allowed: {allowed}')
  if overrides.get('conv_impl', 'auto') not in layers.CONV_IMPLS:
    raise ValueError(f"conv_impl={overrides['conv_impl']!r}; allowed: {layers.CONV_IMPLS}")
  if overrides.get('conv_impl') in layers.PACKED_IMPLS and not getattr(spec.cls, 'CONVOLUTIONS', True):
    raise ValueError(f"conv_impl={overrides['conv_impl']!r} lays out convolutions, and encoder "
                     f"{name!r} has none; allowed for it: 'auto', 'xla', 'im2col'")
  return spec.cls(**{**spec.defaults, **overrides})


def feature_dim(name: str, **overrides) -> int:
  """Output dimension d of encoder `name` (with the same overrides as get_encoder)."""
  return get_encoder(name, **overrides).feature_dim


def input_shape(name: str) -> Tuple[int, int, int]:
  """Native (H, W, C) input of encoder `name` (the dataset it was specified for)."""
  return _spec(name).input_shape


def build_ssl_model(name: str, head_preset: str, with_predictor: bool = True,
                    dtype: Optional[Any] = None, **overrides) -> SSLModel:
  """SSLModel(get_encoder(name, dtype=dtype, **overrides), *make_heads(head_preset, with_predictor,
  dtype))."""
  return SSLModel(get_encoder(name, dtype=dtype, **overrides),
                  *make_heads(head_preset, with_predictor, dtype))


def count_params(tree: Any) -> int:
  """Total number of array elements in a pytree (pass variables['params']: PyTorch `parameters()`
  semantics, i.e. BN scale/bias counted and running statistics, kept in 'batch_stats', not)."""
  return int(sum(np.prod(np.shape(leaf), dtype=np.int64) for leaf in jax.tree_util.tree_leaves(tree)))


__all__ = [
    'ENCODERS', 'EncoderSpec', 'HEAD_PRESETS', 'PRECISIONS', 'Classifier', 'MLPHead', 'SSLModel',
    'build_ssl_model', 'compute_dtype', 'count_params', 'feature_dim', 'get_encoder', 'input_shape',
    'layers', 'make_heads',
]
