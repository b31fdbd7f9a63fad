"""On-device image augmentation in pure JAX (SimCLR/BYOL pipeline with torchvision semantics).

Every function works on one image, float32 [H, W, C] in [0, 1] (C = 3 RGB or C = 1 grayscale), draws its randomness
from an explicit key, and is jit- and vmap-friendly: crop boxes, flip decisions and jitter factors are traced values,
while the `AugmentConfig` is a frozen, hashable dataclass passed as a static argument.

Pipeline of `augment` (the order used by every reference code, up to ops that commute exactly):
  to_float -> RandomResizedCrop (bilinear) -> RandomHorizontalFlip -> RandomApply(ColorJitter, p)
  -> RandomGrayscale -> clip to [0, 1].
The codes put flip before (EasyFL), between (FedSC) or after (FedU2) the colour ops; flipping is a pixel permutation and
the colour ops act per pixel or through image-wide means, so the three orders give identical outputs.

Deviations from torchvision (which runs these ops on PIL uint8 images in all three reference codes) are listed in
docs/notes/data.md#augmentation; in short: no uint8 re-quantisation between ops, luma weights 0.299/0.587/0.114 (PIL's)
everywhere, and no antialiasing when the output is smaller than the crop (a no-op for every preset, whose crops are
never larger than the output).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

# ITU-R 601-2 luma, the weights PIL's convert('L') uses (torchvision's tensor path uses 0.2989 for red).
LUMA_WEIGHTS = (0.299, 0.587, 0.114)
# torchvision's RandomResizedCrop tries this many (area, ratio) draws before the centre-crop fallback.
CROP_NUM_TRIES = 10
# Canonical ColorJitter op order; `JitterParams.order` indexes the enabled subset of this tuple.
JITTER_OPS = ('brightness', 'contrast', 'saturation', 'hue')


def _check_pair(name, value, lo_bound, hi_bound):
  """Returns `value` as a float pair (lo, hi) with lo_bound < lo <= hi <= hi_bound, else raises ValueError."""
  try:
    pair = tuple(float(v) for v in value)
  except TypeError as e:
    raise ValueError(f'{name} must be a pair (lo, hi), got {value!r}') from e
  if len(pair) != 2 or not (lo_bound < pair[0] <= pair[1] <= hi_bound):
    raise ValueError(f'{name} must be a pair (lo, hi) with {lo_bound} < lo <= hi <= {hi_bound}, got {value!r}')
  return pair


@dataclasses.dataclass(frozen=True)
class AugmentConfig:
  """Static description of one augmentation pipeline (hashable, so it can be a `static_argnames` entry).

  The defaults are the identity: `augment(key, x, AugmentConfig())` returns exactly `to_float(x)`.

  Attributes:
    out_size: side of the square output; None keeps the input's (H, W).
    crop: apply RandomResizedCrop (else the whole image is resized to the output size, if it differs).
    crop_scale: (lo, hi) range of the crop's area as a fraction of the image area, 0 < lo <= hi <= 1.
    crop_ratio: (lo, hi) range of the crop's width/height ratio, sampled log-uniformly.
    flip_prob: probability of a horizontal flip.
    jitter_prob: probability of applying ColorJitter (torchvision's RandomApply p).
    brightness, contrast, saturation: jitter strengths s >= 0; factors are drawn from U[max(0, 1 - s), 1 + s].
    hue: hue jitter strength in [0, 0.5]; the shift is drawn from U[-hue, hue] (fraction of the hue circle).
    jitter_random_order: apply the enabled jitter ops in a fresh random order per image, as torchvision's
      ColorJitter does; False applies them in the order brightness, contrast, saturation, hue.
    grayscale_prob: probability of replacing an RGB image by its luma (kept as 3 equal channels).
  """
  out_size: Optional[int] = None
  crop: bool = False
  crop_scale: Tuple[float, float] = (0.08, 1.0)
  crop_ratio: Tuple[float, float] = (3 / 4, 4 / 3)
  flip_prob: float = 0.0
  jitter_prob: float = 0.0
  brightness: float = 0.0
  contrast: float = 0.0
  saturation: float = 0.0
  hue: float = 0.0
  jitter_random_order: bool = True
  grayscale_prob: float = 0.0

  def __post_init__(self):
    if self.out_size is not None and (isinstance(self.out_size, bool) or not isinstance(self.out_size, int)
                                      or self.out_size < 1):
      raise ValueError(f'out_size must be None or a positive int, got {self.out_size!r}')
    # Tuples (not lists) keep the config hashable; the pair checks also normalise ints to floats.
    object.__setattr__(self, 'crop_scale', _check_pair('crop_scale', self.crop_scale, 0.0, 1.0))
    object.__setattr__(self, 'crop_ratio', _check_pair('crop_ratio', self.crop_ratio, 0.0, math.inf))
    for name in ('flip_prob', 'jitter_prob', 'grayscale_prob'):
      value = getattr(self, name)
      if not 0.0 <= value <= 1.0:
        raise ValueError(f'{name} must lie in [0, 1], got {value!r}')
    for name in ('brightness', 'contrast', 'saturation'):
      value = getattr(self, name)
      if not 0.0 <= value < math.inf:
        raise ValueError(f'{name} must be a finite number >= 0, got {value!r}')
    if not 0.0 <= self.hue <= 0.5:
      raise ValueError(f'hue must lie in [0, 0.5], got {self.hue!r}')

  def output_hw(self, height: int, width: int) -> Tuple[int, int]:
    """Output (height, width) for an input of size (height, width)."""
    return (height, width) if self.out_size is None else (self.out_size, self.out_size)

  def jitter_ops(self, num_channels: int) -> Tuple[str, ...]:
    """Names of the jitter ops that can change a `num_channels` image, in `JITTER_OPS` order.

    Zero strengths are dropped (torchvision sets them to None and skips them), and saturation and hue are dropped for
    grayscale images (torchvision returns such images unchanged). Dropping them also keeps identity settings exact:
    an RGB->HSV->RGB round trip with a zero shift is not bit-exact in float32.
    """
    if self.jitter_prob == 0.0:
      return ()
    ops = tuple(name for name in JITTER_OPS if getattr(self, name) > 0.0)
    return ops if num_channels == 3 else tuple(op for op in ops if op in ('brightness', 'contrast'))


_SIMCLR_CROP = dict(crop=True, crop_ratio=(3 / 4, 4 / 3), flip_prob=0.5, jitter_prob=0.8, jitter_random_order=True,
                    grayscale_prob=0.2)

# Named after the paper / code base each pipeline comes from; out_size 32 is the CIFAR setting of every paper (use
# `preset(name, out_size)` for other image sizes, e.g. 64 for Tiny-ImageNet or 28 for (Fashion-)MNIST).
PRESETS = {
    # Hetero-SSFL gives none, so EasyFL's BYOL/SimSiam SimCLRTransform. Default crop scale, strong jitter.
    'byol_easyfl': AugmentConfig(out_size=32, crop_scale=(0.08, 1.0), brightness=0.8, contrast=0.8, saturation=0.8,
                                 hue=0.2, **_SIMCLR_CROP),
    # FedSC official code (all datasets); FedSC additionally normalises with the dataset mean/std (see `normalize`).
    'fedsc': AugmentConfig(out_size=32, crop_scale=(0.2, 1.0), brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1,
                           **_SIMCLR_CROP),
    # FedU2 code: one shared pipeline for SimCLR, BYOL and SimSiam. It is NOT the usual SimCLR-CIFAR one: crop scale
    # (0.2, 1) with the strong (0.8, 0.8, 0.8, 0.2) jitter. No normalisation.
    'fedu2': AugmentConfig(out_size=32, crop_scale=(0.2, 1.0), brightness=0.8, contrast=0.8, saturation=0.8, hue=0.2,
                           **_SIMCLR_CROP),
    # FedU2 code, semi-supervised fine-tuning transform: RandomResizedCrop(32, scale (0.64, 1), ratio (1, 1)) + HFlip.
    'fedu2_finetune': AugmentConfig(out_size=32, crop=True, crop_scale=(0.64, 1.0), crop_ratio=(1.0, 1.0),
                                    flip_prob=0.5),
    # SimCLR's CIFAR pipeline (colour strength s = 0.5: jitter 0.8·s, 0.8·s, 0.8·s, 0.2·s).
    'simclr': AugmentConfig(out_size=32, crop_scale=(0.08, 1.0), brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1,
                            **_SIMCLR_CROP),
    # Identity (RepShare uses no augmentation; evaluation feature extraction uses none either).
    'none': AugmentConfig(),
    # Random horizontal flip only: the cheapest pair of views that differ. With 'none' the two views of
    # an SSL step are the same array and XLA computes the model once for both (common-subexpression
    # elimination), so `experiments.benchmark` times model compute with this preset instead.
    'flip': AugmentConfig(flip_prob=0.5),
}


def preset(name: str, out_size: Optional[int]) -> AugmentConfig:
  """Returns `PRESETS[name]` with `out_size` replaced (None keeps the input size)."""
  if name not in PRESETS:
    raise ValueError(f'unknown augmentation preset {name!r}; allowed: {sorted(PRESETS)}')
  return dataclasses.replace(PRESETS[name], out_size=out_size)


# ----------------------------------------------------------------------------------------------------------------------
# Conversion and normalisation.


# x / 255 correctly rounded in float32 (torchvision's ToTensor). A table lookup rather than a division because XLA
# rewrites division by a constant into multiplication by its reciprocal, which is off by one ulp for half the values.
_UINT8_TO_FLOAT = np.arange(256, dtype=np.float32) / np.float32(255)


def to_float(x):
  """uint8 array (any shape) -> float32 in [0, 1], exactly float32(x / 255) as torchvision's ToTensor."""
  if x.dtype != np.uint8:
    raise ValueError(f'to_float expects uint8 images, got dtype {x.dtype}')
  return jnp.asarray(_UINT8_TO_FLOAT)[jnp.asarray(x).astype(jnp.int32)]


def normalize_images(images_uint8: jax.Array, mean: jax.Array, std: jax.Array,
                     dtype=jnp.float32) -> jax.Array:
  """(x / 255 - mean) / std per channel; uint8 [..., C] -> dtype (float32) [..., C]: the input
  of evaluation's forwards and of representation sharing's uploads (no augmentation)."""
  x = images_uint8.astype(dtype) / 255.0
  return (x - mean) / std


def normalize(x, mean: Sequence[float], std: Sequence[float]):
  """Per-channel (x - mean) / std for float x [..., C]; mean and std have length C, std > 0."""
  num_channels = x.shape[-1]
  if len(mean) != num_channels or len(std) != num_channels:
    raise ValueError(f'mean and std must have one entry per channel ({num_channels}), got {mean!r} and {std!r}')
  if min(std) <= 0:
    raise ValueError(f'std entries must be > 0, got {std!r}')
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


# ----------------------------------------------------------------------------------------------------------------------
# RandomResizedCrop.


def _fallback_box(height: int, width: int, ratio: Tuple[float, float]) -> Tuple[int, int, int, int]:
  """torchvision's centre-crop fallback (static: depends only on the image size and the ratio range)."""
  in_ratio = width / height
  if in_ratio < ratio[0]:
    w = width
    h = int(round(w / ratio[0]))
  elif in_ratio > ratio[1]:
    h = height
    w = int(round(h * ratio[1]))
  else:
    w, h = width, height
  return (height - h) // 2, (width - w) // 2, h, w


def crop_box_from_draws(area_fracs, log_ratios, u_top, u_left, height: int, width: int,
                        ratio: Tuple[float, float]):
  """torchvision's RandomResizedCrop.get_params, vectorised over the tries, given the random draws.

  Try t proposes w = round(sqrt(A·a_t·r_t)), h = round(sqrt(A·a_t/r_t)) with A = height·width, a_t = area_fracs[t],
  r_t = exp(log_ratios[t]); the first try with 0 < w <= width and 0 < h <= height wins and is placed at
  top = floor(u_top·(height - h + 1)), left = floor(u_left·(width - w + 1)) (torchvision's randint); if no try is valid
  the static centre-crop fallback is used. Rounding is half-to-even, like Python's round.

  Args:
    area_fracs: float32 [T], area fractions drawn from U[scale].
    log_ratios: float32 [T], log aspect ratios drawn from U[log ratio].
    u_top, u_left: float32 scalars in [0, 1) placing the crop.
    height, width: static image size.
    ratio: static (lo, hi) aspect-ratio range (only used by the fallback).
  Returns:
    int32 [4]: (top, left, h, w).
  """
  area = float(height * width)
  target_area = area * area_fracs
  aspect = jnp.exp(log_ratios)
  w = jnp.round(jnp.sqrt(target_area * aspect)).astype(jnp.int32)
  h = jnp.round(jnp.sqrt(target_area / aspect)).astype(jnp.int32)
  valid = (w > 0) & (w <= width) & (h > 0) & (h <= height)
  first = jnp.argmax(valid)  # index of the first valid try (0 if none; then the fallback is used)
  h, w = h[first], w[first]
  # min() guards against u·n rounding up to n in float32 when u is just below 1.
  top = jnp.minimum(jnp.floor(u_top * (height - h + 1).astype(jnp.float32)).astype(jnp.int32), height - h)
  left = jnp.minimum(jnp.floor(u_left * (width - w + 1).astype(jnp.float32)).astype(jnp.int32), width - w)
  sampled = jnp.stack([top, left, h, w])
  return jnp.where(jnp.any(valid), sampled, jnp.asarray(_fallback_box(height, width, ratio), jnp.int32))


def _crop_box_from_uniforms(u, height: int, width: int, scale: Tuple[float, float], ratio: Tuple[float, float]):
  """Crop box from u float32 [2·T + 2] of U[0, 1) draws: T area draws, T log-ratio draws, then top and left."""
  t = (u.shape[0] - 2) // 2
  area_fracs = scale[0] + (scale[1] - scale[0]) * u[:t]
  log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
  log_ratios = log_lo + (log_hi - log_lo) * u[t:2 * t]
  return crop_box_from_draws(area_fracs, log_ratios, u[2 * t], u[2 * t + 1], height, width, ratio)


def sample_crop_box(key, height: int, width: int, scale: Tuple[float, float], ratio: Tuple[float, float],
                    num_tries: int = CROP_NUM_TRIES):
  """Samples a RandomResizedCrop box (top, left, h, w) as int32 [4] for a static (height, width) image."""
  return _crop_box_from_uniforms(jax.random.uniform(key, (2 * num_tries + 2,)), height, width, scale, ratio)


def _resize_taps(start, length, total: int, out_len: int):
  """Source taps along one axis for bilinear resizing of [start, start + length) to out_len samples.

  Same arithmetic as torch's interpolate(mode='bilinear', align_corners=False, antialias=False) on the cropped
  array: src = (d + 0.5)·length/out_len - 0.5, clamped to [0, length - 1]; taps floor(src) and floor(src) + 1
  (clamped to the crop), weight of the second tap = src - floor(src).
  """
  length_f = jnp.asarray(length, jnp.float32)
  src = (jnp.arange(out_len, dtype=jnp.float32) + 0.5) * (length_f / out_len) - 0.5
  src = jnp.clip(src, 0.0, length_f - 1.0)
  i0 = jnp.floor(src)
  frac = src - i0
  i0 = i0.astype(jnp.int32)
  i1 = jnp.minimum(i0 + 1, length - 1)
  start = jnp.asarray(start, jnp.int32)
  # Final clip only matters for malformed boxes; valid boxes already stay inside [0, total).
  return jnp.clip(start + i0, 0, total - 1), jnp.clip(start + i1, 0, total - 1), frac


def crop_resize(x, box, out_hw: Tuple[int, int], flip=False):
  """Crops x [H, W, C] to box = (top, left, h, w) (ints, may be traced) and resizes bilinearly to out_hw; then flips
  the result horizontally if `flip` (bool, may be traced).

  Implemented as a separable sampling grid (gathers at dynamic indices), so the box can differ per sample under vmap.
  The flip reverses the column taps instead of the output: the same arithmetic per output pixel, so bit-identical to
  `hflip(crop_resize(...))`, but XLA:CPU runs a select between a gather and its reverse inside a scan far slower
  than the gather alone (docs/notes/data.md#augmentation-cost).
  A full-image box with out_hw == (H, W) returns x exactly (all second-tap weights are 0).
  """
  height, width, _ = x.shape
  top, left, h, w = box[0], box[1], box[2], box[3]
  y0, y1, fy = _resize_taps(top, h, height, out_hw[0])
  x0, x1, fx = (jnp.where(flip, t[::-1], t) for t in _resize_taps(left, w, width, out_hw[1]))
  fy = fy[:, None, None]
  rows = (1.0 - fy) * jnp.take(x, y0, axis=0) + fy * jnp.take(x, y1, axis=0)  # [out_h, W, C]
  fx = fx[None, :, None]
  return (1.0 - fx) * jnp.take(rows, x0, axis=1) + fx * jnp.take(rows, x1, axis=1)


def hflip(x):
  """Horizontal flip of x [H, W, C]."""
  return x[:, ::-1, :]


# ----------------------------------------------------------------------------------------------------------------------
# Colour ops (torchvision's tensor semantics; each op clamps to [0, 1] like torchvision's _blend).


def luma(x):
  """Luma of x [H, W, C] as [H, W, 1]; identity for C = 1."""
  if x.shape[-1] == 1:
    return x
  return x[..., 0:1] * LUMA_WEIGHTS[0] + x[..., 1:2] * LUMA_WEIGHTS[1] + x[..., 2:3] * LUMA_WEIGHTS[2]


def rgb_to_grayscale(x):
  """Grayscale of x [H, W, C] keeping C channels (torchvision's Grayscale(num_output_channels=C))."""
  return jnp.broadcast_to(luma(x), x.shape)


def _blend(img1, img2, ratio):
  return jnp.clip(ratio * img1 + (1.0 - ratio) * img2, 0.0, 1.0)


def adjust_brightness(x, factor):
  """x·factor clamped to [0, 1] (blend with black)."""
  return _blend(x, jnp.zeros_like(x), factor)


def adjust_contrast(x, factor):
  """Blend of x with the image-wide mean of its luma (mean of the single channel for C = 1)."""
  return _blend(x, jnp.mean(luma(x)), factor)


def adjust_saturation(x, factor):
  """Blend of x with its grayscale; identity for C = 1."""
  if x.shape[-1] == 1:
    return x
  return _blend(x, luma(x), factor)


def _frac(a):
  """a mod 1 for float a in [-1, 2): a - floor(a) is exact there (the same value as jnp.mod(a, 1.0), which lowers to
  a much slower fmod on CPU)."""
  return a - jnp.floor(a)


def rgb_to_hsv(rgb):
  """float [..., 3] RGB in [0, 1] -> HSV in [0, 1] (torchvision's _rgb2hsv; hue is a fraction of the circle)."""
  r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
  # Elementwise max/min, not jnp.max(rgb, axis=-1): the hue sector is picked by exact tests such as maxc == r, and
  # with a reduce-max XLA:CPU (jax 0.10.2) got those tests wrong once the producer of rgb was fused in, sending
  # pixels to the wrong sector (hue errors up to 0.75; test_hue_after_fused_producer_under_jit).
  maxc = jnp.maximum(jnp.maximum(r, g), b)
  minc = jnp.minimum(jnp.minimum(r, g), b)
  eqc = maxc == minc
  cr = maxc - minc
  ones = jnp.ones_like(maxc)
  s = cr / jnp.where(eqc, ones, maxc)
  cr_divisor = jnp.where(eqc, ones, cr)
  rc = (maxc - r) / cr_divisor
  gc = (maxc - g) / cr_divisor
  bc = (maxc - b) / cr_divisor
  hr = jnp.where(maxc == r, bc - gc, 0.0)
  hg = jnp.where((maxc == g) & (maxc != r), 2.0 + rc - bc, 0.0)
  hb = jnp.where((maxc != g) & (maxc != r), 4.0 + gc - rc, 0.0)
  return jnp.stack([_frac(((hr + hg + hb) / 6.0) + 1.0), s, maxc], axis=-1)


def hsv_to_rgb(hsv):
  """float [..., 3] HSV in [0, 1] -> RGB in [0, 1] (torchvision's _hsv2rgb)."""
  h, s, v = hsv[..., 0], hsv[..., 1], hsv[..., 2]
  i = jnp.floor(h * 6.0)
  f = h * 6.0 - i
  i = i.astype(jnp.int32)
  i = jnp.where(i >= 6, i - 6, i)  # h in [0, 1] gives i in [0, 6]; cheaper than % 6
  p = jnp.clip(v * (1.0 - s), 0.0, 1.0)
  q = jnp.clip(v * (1.0 - s * f), 0.0, 1.0)
  t = jnp.clip(v * (1.0 - s * (1.0 - f)), 0.0, 1.0)
  def sector(*values):  # values[i]: the channel's value in hue sector i (a select chain, not a gather)
    out = values[5]
    for k in range(4, -1, -1):
      out = jnp.where(i == k, values[k], out)
    return out
  return jnp.stack([sector(v, q, p, p, t, v), sector(t, v, v, q, p, p), sector(p, p, t, v, v, q)], axis=-1)


def adjust_hue(x, hue_factor):
  """Rotates the hue of x [H, W, 3] by hue_factor (in [-0.5, 0.5], fraction of the circle); identity for C = 1."""
  if x.shape[-1] == 1:
    return x
  hsv = rgb_to_hsv(x)
  hsv = hsv.at[..., 0].set(_frac(hsv[..., 0] + hue_factor))
  return hsv_to_rgb(hsv)


class JitterParams(NamedTuple):
  """Per-image ColorJitter draw.

  brightness, contrast, saturation: float32 factors; hue: float32 shift; order: int32 [n], a permutation of
  range(n) indexing `cfg.jitter_ops(C)` (n enabled ops): position k applies op jitter_ops[order[k]].
  Factors of disabled ops are present but unused.
  """
  brightness: jax.Array
  contrast: jax.Array
  saturation: jax.Array
  hue: jax.Array
  order: jax.Array


# Uniform draws used per image by ColorJitter: 4 factors, then 4 sort keys for the order.
_JITTER_NUM_DRAWS = 8


def _jitter_params_from_uniforms(u, cfg: AugmentConfig, num_channels: int) -> JitterParams:
  """JitterParams from u float32 [8] of U[0, 1) draws (see `sample_jitter_params`)."""

  def factor(v, strength):
    lo = max(0.0, 1.0 - strength)
    return lo + (1.0 + strength - lo) * v

  n = len(cfg.jitter_ops(num_channels))
  # argsort of iid uniforms is a uniformly random permutation (torchvision: torch.randperm(4)).
  order = jnp.argsort(u[4:4 + n]) if cfg.jitter_random_order else jnp.arange(n)
  return JitterParams(brightness=factor(u[0], cfg.brightness), contrast=factor(u[1], cfg.contrast),
                      saturation=factor(u[2], cfg.saturation), hue=cfg.hue * (2.0 * u[3] - 1.0),
                      order=order.astype(jnp.int32))


def sample_jitter_params(key, cfg: AugmentConfig, num_channels: int) -> JitterParams:
  """Draws torchvision's ColorJitter.get_params: factors from U[max(0, 1 - s), 1 + s], hue from U[-hue, hue] and a
  uniformly random order of the enabled ops (`cfg.jitter_ops(num_channels)`)."""
  return _jitter_params_from_uniforms(jax.random.uniform(key, (_JITTER_NUM_DRAWS,)), cfg, num_channels)


def color_jitter(x, params: JitterParams, ops: Tuple[str, ...]):
  """Applies the jitter ops `ops` (static names) to x [H, W, C] in the order params.order with params' factors.

  Brightness, contrast and saturation are all `_blend(x, target, factor)` with target black, the mean luma or the luma,
  so one unrolled loop over positions selects the target by op id. The hue rotation costs several blends, and
  its position differs per image, so rather than evaluating it at every position, the blends before it are applied
  (masked by position), then the rotation once, then the blends after it: the same sequence of operations per image.
  """
  op_ids = jnp.asarray([JITTER_OPS.index(name) for name in ops], jnp.int32)
  factors = jnp.stack([params.brightness, params.contrast, params.saturation, params.hue])
  ops_in_order = op_ids[params.order]  # int32 [n]: the op applied at each position
  hue_id = JITTER_OPS.index('hue')
  hue_pos = jnp.argmax(ops_in_order == hue_id) if 'hue' in ops else len(ops)

  def blends(x, apply_at):
    for k in range(len(ops)):
      op = ops_in_order[k]
      gray = luma(x)
      target = jnp.where(op == 0, 0.0, jnp.where(op == 1, jnp.mean(gray), gray))
      x = jnp.where(apply_at(k) & (op != hue_id), _blend(x, target, factors[op]), x)
    return x

  x = blends(x, lambda k: k < hue_pos)
  if 'hue' in ops:
    x = blends(adjust_hue(x, params.hue), lambda k: k > hue_pos)
  return x


# ----------------------------------------------------------------------------------------------------------------------
# The pipeline.


def _check_image(image, ndim: int):
  if image.ndim != ndim or image.shape[-1] not in (1, 3):
    raise ValueError(f'expected uint8 images of rank {ndim} with C in (1, 3) last, got shape {image.shape}')
  if image.dtype != np.uint8:
    raise ValueError(f'expected uint8 images, got dtype {image.dtype}')


# Layout of the per-image uniform draws: crop (2·T + 2), flip, jitter-apply, jitter (8), grayscale. Fixed for every
# config, so e.g. the crop drawn for a key does not depend on the jitter settings. One draw per image (rather than a
# key split per stage) keeps the traced PRNG code, and so compile time, small.
_CROP_DRAWS = slice(0, 2 * CROP_NUM_TRIES + 2)
_FLIP_DRAW = _CROP_DRAWS.stop
_JITTER_APPLY_DRAW = _FLIP_DRAW + 1
_JITTER_DRAWS = slice(_JITTER_APPLY_DRAW + 1, _JITTER_APPLY_DRAW + 1 + _JITTER_NUM_DRAWS)
_GRAY_DRAW = _JITTER_DRAWS.stop
_NUM_DRAWS = _GRAY_DRAW + 1


def augment(key, image, cfg: AugmentConfig):
  """Augments one image: uint8 [H, W, C] -> float32 [out_h, out_w, C] in [0, 1] (see the module docstring).

  Stages disabled in `cfg` are skipped statically and leave the image bit-exact; a stage with probability p is applied
  when its uniform draw is < p (as jax.random.bernoulli).
  """
  _check_image(image, 3)
  height, width, num_channels = image.shape
  out_hw = cfg.output_hw(height, width)
  u = jax.random.uniform(key, (_NUM_DRAWS,))
  x = to_float(image)
  flip = u[_FLIP_DRAW] < cfg.flip_prob if cfg.flip_prob > 0.0 else False
  if cfg.crop:
    box = _crop_box_from_uniforms(u[_CROP_DRAWS], height, width, cfg.crop_scale, cfg.crop_ratio)
    x = crop_resize(x, box, out_hw, flip)
  elif out_hw != (height, width):
    x = crop_resize(x, jnp.asarray([0, 0, height, width], jnp.int32), out_hw, flip)
  elif cfg.flip_prob > 0.0:
    x = jnp.where(flip, hflip(x), x)
  ops = cfg.jitter_ops(num_channels)
  if ops:
    jittered = color_jitter(x, _jitter_params_from_uniforms(u[_JITTER_DRAWS], cfg, num_channels), ops)
    x = jnp.where(u[_JITTER_APPLY_DRAW] < cfg.jitter_prob, jittered, x)
  if cfg.grayscale_prob > 0.0 and num_channels == 3:
    x = jnp.where(u[_GRAY_DRAW] < cfg.grayscale_prob, rgb_to_grayscale(x), x)
  return jnp.clip(x, 0.0, 1.0)


@functools.partial(jax.jit, static_argnames=('cfg',))
def augment_batch(key, images, cfg: AugmentConfig):
  """Augments uint8 [B, H, W, C] with an independent sub-key per image -> float32 [B, out_h, out_w, C]."""
  _check_image(images, 4)
  keys = jax.random.split(key, images.shape[0])
  return jax.vmap(lambda k, im: augment(k, im, cfg))(keys, images)


def two_views(key, images, cfg: AugmentConfig):
  """Two independently augmented views (v1, v2) of uint8 [B, H, W, C], each float32 [B, out_h, out_w, C].

  v_i = augment_batch(k_i, images, cfg) with (k_1, k_2) = jax.random.split(key). Not jitted itself: called eagerly
  it reuses augment_batch's compiled executable (vmapping over the two keys compiled slower on CPU).
  """
  k1, k2 = jax.random.split(key)
  return augment_batch(k1, images, cfg), augment_batch(k2, images, cfg)
