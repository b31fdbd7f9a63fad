"""Projector / predictor heads and the two model wrappers the engine trains.

Submodule names are part of the contract: the engine averages, copies and EMA-tracks parameter
subtrees by them ('encoder', 'projector', 'predictor' for SSLModel; 'encoder', 'head' for
Classifier). The BYOL target is the {'encoder', 'projector'} subtree applied with
with_predictor=False.

Precision: the heads compute in their `dtype` (layers.Dense; BatchNorm statistics float32) and return
at least float32, like the encoders, so every output of SSLModel and Classifier is float32.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import flax.linen as nn
import jax

from fedjax_ssl.models import layers
from fedjax_ssl.ops.numerics import l2_normalize


class MLPHead(nn.Module):
  """(Dense(hidden) -> [BatchNorm] -> ReLU) x (depth - 1) -> Dense(out): [B, din] -> [B, out] (at
  least float32). depth 2 is the BYOL / SimCLR head; 3 the VICReg / Barlow Twins expander."""
  hidden: int
  out: int
  use_bn: bool = True
  dtype: Optional[Any] = None
  depth: int = 2

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    # The first hidden block keeps the names 'fc1' / 'bn' of the two-layer head (checkpoints).
    for i in range(self.depth - 1):
      suffix = '' if i == 0 else f'_{i + 1}'
      x = layers.Dense(self.hidden, dtype=self.dtype, name=f'fc1{suffix}')(x)
      if self.use_bn:
        x = layers.BatchNorm(use_running_average=not train, dtype=self.dtype, name=f'bn{suffix}')(x)
      x = nn.relu(x)
    return layers.as_float(layers.Dense(self.out, dtype=self.dtype, name='fc2')(x))


# Head sizes of the reference codes (projector, predictor), all taking the 512-d backbone output
# (the predictor takes the projector output):
#   easyfl: EasyFL BYOL/SimSiam (Hetero-SSFL, FedU, FedEMA baselines) 512-4096(BN)-2048, 2048-4096(BN)-2048
#   fedu2:  FedU2 code, 512-2048(BN)-512 for both
#   fedsc:  FedSC code, projector 512-1024-512 without BN; BYOL-family predictor 512-1024-512 without BN
#   wide8192: VICReg / Barlow Twins code, 512-8192(BN)-8192(BN)-8192
HEAD_PRESETS: Dict[str, Dict[str, Dict[str, object]]] = {
    'easyfl': {'projector': dict(hidden=4096, out=2048, use_bn=True),
               'predictor': dict(hidden=4096, out=2048, use_bn=True)},
    'fedu2': {'projector': dict(hidden=2048, out=512, use_bn=True),
              'predictor': dict(hidden=2048, out=512, use_bn=True)},
    'fedsc': {'projector': dict(hidden=1024, out=512, use_bn=False),
              'predictor': dict(hidden=1024, out=512, use_bn=False)},
    # VICReg's and Barlow Twins' expander at paper scale (their released code: 8192-8192-8192, BN
    # and ReLU after the two hidden layers); the predictor entry only serves a predictor objective.
    'wide8192': {'projector': dict(hidden=8192, out=8192, use_bn=True, depth=3),
                 'predictor': dict(hidden=8192, out=8192, use_bn=True, depth=3)},
}


def make_heads(preset: str, with_predictor: bool = True, dtype: Optional[Any] = None
               ) -> Tuple[MLPHead, Optional[MLPHead]]:
  """(projector, predictor or None) for a HEAD_PRESETS name, computing in `dtype`."""
  if preset not in HEAD_PRESETS:
    raise ValueError(f'head preset {preset!r}; allowed: {sorted(HEAD_PRESETS)}')
  cfg = HEAD_PRESETS[preset]
  return (MLPHead(**cfg['projector'], dtype=dtype),
          MLPHead(**cfg['predictor'], dtype=dtype) if with_predictor else None)


class SSLModel(nn.Module):
  """encoder -> projector -> predictor.

  __call__(x [B,H,W,C], train, with_predictor=True) -> dict with
    h: [B, d] backbone features, z: [B, dz] projector output (= h without a projector),
    p: [B, dp] predictor output, present only if with_predictor and a predictor exists,
    scores: [B, prototypes] float32 = normalize(z) @ Cᵀ with C the bias-free 'prototypes' layer
      (SwAV), present only if prototypes > 0.
  """
  encoder: nn.Module
  projector: Optional[MLPHead] = None
  predictor: Optional[MLPHead] = None
  prototypes: int = 0

  @nn.compact
  def __call__(self, x: jax.Array, train: bool, with_predictor: bool = True) -> Dict[str, jax.Array]:
    h = self.encoder(x, train)
    z = h if self.projector is None else self.projector(h, train)
    out = {'h': h, 'z': z}
    if with_predictor and self.predictor is not None:
      out['p'] = self.predictor(z, train)
    if self.prototypes:
      out['scores'] = nn.Dense(self.prototypes, use_bias=False, name='prototypes')(
          l2_normalize(layers.as_float(z)))
    return out


class Classifier(nn.Module):
  """encoder -> Dense(num_classes) ('head'): [B,H,W,C] -> logits [B, num_classes], at least
  float32; the head computes in `dtype`."""
  encoder: nn.Module
  num_classes: int
  dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    head = layers.Dense(self.num_classes, dtype=self.dtype, name='head')
    return layers.as_float(head(self.encoder(x, train)))
