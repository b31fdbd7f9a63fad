"""Tests for fedjax_ssl.data.augment against numpy float64 / colorsys / hand-derived references."""
import colorsys
import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from fedjax_ssl.data import augment as aug

LUMA = np.array([0.299, 0.587, 0.114])
# Tolerances below are in units of float32's machine epsilon, derived from the arithmetic under test, so that a
# verdict does not depend on how XLA:CPU vectorises it for the host's instruction set (SSE4.2 / AVX2 / AVX-512 round
# differently) while a wrong formula (errors of 1e-3 or more) still fails.
EPS32 = float(np.finfo(np.float32).eps)
# The colour ops are dtype-generic: under jax.enable_x64 with float64 images they run in float64, where they must
# match the float64 references to rounding (ops chain ~10 roundings of values <= 6: ~1e-15).
F64_ATOL = 1e-12
# float32 colour ops: the hue path (rgb -> hsv -> rgb) accumulates a few roundings in h, then hsv_to_rgb scales h by 6
# (sector position f = 6h - i) and forms v·(1 - s·f): tens of eps at worst (observed <= 6 eps on SSE4.2 and AVX2).
# The other ops are one or two blends (observed < 1 eps).
F32_COLOR_ATOL = 128 * EPS32


def _images(seed, n, h, w, c, lo=0, hi=256):
  return np.random.default_rng(seed).integers(lo, hi, size=(n, h, w, c), dtype=np.uint8)


_crop_resize = jax.jit(aug.crop_resize, static_argnums=2)


def _float_ref(x_uint8):
  return x_uint8.astype(np.float32) / np.float32(255)


def _binomial_ok(count, n, p, sigmas=4.0):
  return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


# ---------------------------------------------------------------------------------------------------------------------
# numpy float64 references


def _luma_ref(x):
  x = np.asarray(x, np.float64)
  return x if x.shape[-1] == 1 else (x @ LUMA)[..., None]


def _brightness_ref(x, f):
  return np.clip(f * np.asarray(x, np.float64), 0, 1)


def _contrast_ref(x, f):
  x = np.asarray(x, np.float64)
  return np.clip(f * x + (1 - f) * _luma_ref(x).mean(), 0, 1)


def _saturation_ref(x, f):
  x = np.asarray(x, np.float64)
  return np.clip(f * x + (1 - f) * _luma_ref(x), 0, 1)


def _hue_ref(x, f):
  x = np.asarray(x, np.float64)
  out = np.empty_like(x)
  for idx in np.ndindex(x.shape[:-1]):
    h, s, v = colorsys.rgb_to_hsv(*x[idx])
    out[idx] = colorsys.hsv_to_rgb((h + f) % 1.0, s, v)
  return out


_REF_OPS = {'brightness': _brightness_ref, 'contrast': _contrast_ref, 'saturation': _saturation_ref, 'hue': _hue_ref}


def _bilinear_ref(img, top, left, h, w, out_h, out_w):
  """torch interpolate(bilinear, align_corners=False) of img[top:top+h, left:left+w], one output pixel at a time."""
  crop = np.asarray(img, np.float64)[top:top + h, left:left + w]
  out = np.zeros((out_h, out_w, img.shape[-1]))
  for i in range(out_h):
    for j in range(out_w):
      sy = max((i + 0.5) * h / out_h - 0.5, 0.0)
      sx = max((j + 0.5) * w / out_w - 0.5, 0.0)
      y0, x0 = min(int(sy), h - 1), min(int(sx), w - 1)
      y1, x1 = min(y0 + 1, h - 1), min(x0 + 1, w - 1)
      ly, lx = min(sy - y0, 1.0), min(sx - x0, 1.0)
      if sy > h - 1:
        ly = 0.0
      if sx > w - 1:
        lx = 0.0
      out[i, j] = ((1 - ly) * ((1 - lx) * crop[y0, x0] + lx * crop[y0, x1])
                   + ly * ((1 - lx) * crop[y1, x0] + lx * crop[y1, x1]))
  return out


def _torchvision_box_ref(area_fracs, log_ratios, u_top, u_left, height, width, ratio):
  """torchvision RandomResizedCrop.get_params with the given draws (float64). Returns (box, ambiguous, fell_back)."""
  area = height * width
  ambiguous = False
  for a, lr in zip(np.float64(area_fracs), np.float64(log_ratios)):
    target_area = area * a
    aspect = math.exp(lr)
    ws, hs = math.sqrt(target_area * aspect), math.sqrt(target_area / aspect)
    # float32 vs float64 can only disagree when a value sits on a rounding tie.
    ambiguous |= min(abs(ws % 1 - 0.5), abs(hs % 1 - 0.5)) < 1e-4
    w, h = int(round(ws)), int(round(hs))
    if 0 < w <= width and 0 < h <= height:
      i = int(math.floor(float(u_top) * (height - h + 1)))
      j = int(math.floor(float(u_left) * (width - w + 1)))
      return (i, j, h, w), ambiguous, False
  in_ratio = width / height
  if in_ratio < min(ratio):
    w = width
    h = int(round(w / min(ratio)))
  elif in_ratio > max(ratio):
    h = height
    w = int(round(h * max(ratio)))
  else:
    w, h = width, height
  return ((height - h) // 2, (width - w) // 2, h, w), ambiguous, True


# ---------------------------------------------------------------------------------------------------------------------
# config, presets, conversion


def test_presets_match_specs():
  p = aug.PRESETS
  expected = {  # (scale, (b, c, s, h), jitter_prob, flip, gray) from the reference codes
      'byol_easyfl': ((0.08, 1.0), (0.8, 0.8, 0.8, 0.2), 0.8, 0.5, 0.2),
      'fedsc': ((0.2, 1.0), (0.4, 0.4, 0.4, 0.1), 0.8, 0.5, 0.2),
      'fedu2': ((0.2, 1.0), (0.8, 0.8, 0.8, 0.2), 0.8, 0.5, 0.2),
      'simclr': ((0.08, 1.0), (0.4, 0.4, 0.4, 0.1), 0.8, 0.5, 0.2),
  }
  for name, (scale, jit, pj, pf, pg) in expected.items():
    cfg = p[name]
    assert cfg.crop and cfg.out_size == 32 and cfg.crop_scale == scale
    assert cfg.crop_ratio == pytest.approx((0.75, 4 / 3))
    assert (cfg.brightness, cfg.contrast, cfg.saturation, cfg.hue) == jit
    assert (cfg.jitter_prob, cfg.flip_prob, cfg.grayscale_prob) == (pj, pf, pg)
    assert cfg.jitter_random_order
  ft = p['fedu2_finetune']
  assert ft.crop and ft.crop_scale == (0.64, 1.0) and ft.crop_ratio == (1.0, 1.0) and ft.flip_prob == 0.5
  assert ft.jitter_ops(3) == () and ft.grayscale_prob == 0.0
  assert p['none'] == aug.AugmentConfig()
  assert aug.preset('fedsc', 28) == dataclasses.replace(p['fedsc'], out_size=28)
  assert aug.preset('none', None).out_size is None
  with pytest.raises(ValueError, match='byol_easyfl'):
    aug.preset('imagenet', 32)
  hash(p['fedsc'])  # static under jit


@pytest.mark.parametrize('kw', [dict(crop_scale=(0.5, 0.2)), dict(crop_scale=(0.0, 1.0)), dict(crop_scale=(0.1, 1.5)),
                                dict(crop_ratio=(2.0, 1.0)), dict(flip_prob=1.5), dict(jitter_prob=-0.1),
                                dict(brightness=-1.0), dict(hue=0.6), dict(out_size=0), dict(out_size=2.5),
                                dict(crop_scale=(0.1,))])
def test_config_rejects_bad_values(kw):
  with pytest.raises(ValueError):
    aug.AugmentConfig(**kw)


def test_config_lists_become_tuples():
  cfg = aug.AugmentConfig(crop_scale=[0.2, 1], crop_ratio=[1, 2])
  assert cfg.crop_scale == (0.2, 1.0) and cfg.crop_ratio == (1.0, 2.0)
  hash(cfg)


def test_to_float_and_normalize():
  x = _images(0, 2, 4, 4, 3)
  np.testing.assert_array_equal(np.asarray(aug.to_float(x)), _float_ref(x))
  with pytest.raises(ValueError, match='uint8'):
    aug.to_float(x.astype(np.float32))
  xf = _float_ref(x)
  mean, std = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
  ref = (xf.astype(np.float64) - np.array(mean)) / np.array(std)
  np.testing.assert_allclose(np.asarray(aug.normalize(jnp.asarray(xf), mean, std)), ref, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match='one entry per channel'):
    aug.normalize(jnp.asarray(xf), (0.5,), (0.2,))
  with pytest.raises(ValueError, match='> 0'):
    aug.normalize(jnp.asarray(xf), mean, (0.2, 0.0, 0.1))


def test_bad_images_rejected():
  cfg = aug.PRESETS['none']
  with pytest.raises(ValueError, match='uint8'):
    aug.augment(jax.random.key(0), np.zeros((4, 4, 3), np.float32), cfg)
  with pytest.raises(ValueError, match='C in'):
    aug.augment(jax.random.key(0), np.zeros((4, 4, 2), np.uint8), cfg)
  with pytest.raises(ValueError, match='rank 4'):
    aug.augment_batch(jax.random.key(0), np.zeros((4, 4, 3), np.uint8), cfg)


# ---------------------------------------------------------------------------------------------------------------------
# identity, determinism, jit/vmap


@pytest.mark.parametrize('cfg', [
    aug.AugmentConfig(),
    aug.AugmentConfig(jitter_prob=0.0, brightness=0.8, hue=0.2),  # strengths without probability
    aug.AugmentConfig(jitter_prob=1.0, brightness=0.0, hue=0.0),  # probability without strengths
])
@pytest.mark.parametrize('c', [1, 3])
def test_identity_settings_are_exact(cfg, c):
  x = _images(1, 5, 8, 8, c)
  out = aug.augment_batch(jax.random.key(3), x, cfg)
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out), _float_ref(x))


# One full pipeline shared by the tests below so that jit's cache compiles it once per channel count.
FULL_CFG = aug.preset('byol_easyfl', 12)


def test_same_key_same_output_different_keys_differ():
  x = _images(2, 4, 16, 16, 3)
  a = np.asarray(aug.augment_batch(jax.random.key(7), x, FULL_CFG))
  b = np.asarray(aug.augment_batch(jax.random.key(7), x, FULL_CFG))
  c = np.asarray(aug.augment_batch(jax.random.key(8), x, FULL_CFG))
  np.testing.assert_array_equal(a, b)
  assert all(not np.array_equal(a[i], c[i]) for i in range(4))
  # Each image in a batch gets its own key: identical inputs give different views.
  same = np.repeat(x[:1], 4, axis=0)
  v = np.asarray(aug.augment_batch(jax.random.key(7), same, FULL_CFG))
  assert all(not np.array_equal(v[0], v[i]) for i in range(1, 4))


def test_two_views_are_batches_with_split_keys():
  x = _images(2, 4, 16, 16, 3)
  v1, v2 = aug.two_views(jax.random.key(7), x, FULL_CFG)
  k1, k2 = jax.random.split(jax.random.key(7))
  np.testing.assert_array_equal(np.asarray(v1), np.asarray(aug.augment_batch(k1, x, FULL_CFG)))
  np.testing.assert_array_equal(np.asarray(v2), np.asarray(aug.augment_batch(k2, x, FULL_CFG)))
  assert v1.shape == (4, 12, 12, 3) and not np.array_equal(np.asarray(v1), np.asarray(v2))


@pytest.mark.parametrize('c', [1, 3])
def test_jit_vmap_and_channels(c):
  x = _images(3, 4, 16, 16, c)
  keys = jax.random.split(jax.random.key(11), 4)
  # augment_batch (jit of vmap) == per-image jitted augment with the sub-keys jax.random.split(key, B).
  jitted = jax.jit(aug.augment, static_argnames='cfg')
  single = np.stack([np.asarray(jitted(keys[i], x[i], FULL_CFG)) for i in range(4)])
  batched = np.asarray(aug.augment_batch(jax.random.key(11), x, FULL_CFG))
  np.testing.assert_allclose(batched, single, atol=1e-5)
  assert batched.shape == (4, 12, 12, c) and batched.dtype == np.float32
  assert batched.min() >= 0 and batched.max() <= 1
  assert FULL_CFG.jitter_ops(c) == (('brightness', 'contrast', 'saturation', 'hue') if c == 3
                                    else ('brightness', 'contrast'))


# ---------------------------------------------------------------------------------------------------------------------
# flip and grayscale rates


@pytest.mark.parametrize('p', [0.5, 0.2])
def test_flip_rate(p):
  n = 400
  x = _images(4, n, 8, 8, 3)
  out = np.asarray(aug.augment_batch(jax.random.key(5), x, aug.AugmentConfig(flip_prob=p)))
  ref = _float_ref(x)
  flipped = np.array([np.array_equal(out[i], np.flip(ref[i], axis=1)) for i in range(n)])
  kept = np.array([np.array_equal(out[i], ref[i]) for i in range(n)])
  assert np.all(flipped ^ kept)
  assert _binomial_ok(flipped.sum(), n, p), flipped.sum()


@pytest.mark.parametrize('p', [0.2, 0.6])
def test_grayscale_rate_and_values(p):
  n = 400
  x = _images(6, n, 8, 8, 3)
  out = np.asarray(aug.augment_batch(jax.random.key(9), x, aug.AugmentConfig(grayscale_prob=p)))
  ref = _float_ref(x)
  gray_ref = np.broadcast_to(_luma_ref(ref), ref.shape)
  # Luma is 3 products + 2 sums of values <= 1 in float32 (a few eps; observed < 1 eps): 32 eps separates grey images
  # from kept ones, which differ from their grey version by >= 0.5 here.
  gray = np.array([np.allclose(out[i], gray_ref[i], atol=32 * EPS32, rtol=0) for i in range(n)])
  kept = np.array([np.array_equal(out[i], ref[i]) for i in range(n)])
  assert np.all(gray ^ kept)
  assert _binomial_ok(gray.sum(), n, p), gray.sum()
  # Grayscale images are unchanged by RandomGrayscale.
  xg = _images(6, 8, 8, 8, 1)
  np.testing.assert_array_equal(np.asarray(aug.augment_batch(jax.random.key(9), xg, aug.AugmentConfig(grayscale_prob=1.0))),
                                _float_ref(xg))


def test_brightness_jitter_rate_and_factor_range():
  n, p, b = 400, 0.8, 0.4
  x = _images(7, n, 8, 8, 3, lo=60, hi=150)  # values <= 0.59: no clipping for factors <= 1.4
  out = np.asarray(aug.augment_batch(jax.random.key(13), x, aug.AugmentConfig(jitter_prob=p, brightness=b)))
  ref = _float_ref(x).astype(np.float64)
  ratio = out / ref
  factors = ratio.reshape(n, -1).mean(axis=1)
  # Every image is scaled by a single factor.
  np.testing.assert_allclose(ratio, np.broadcast_to(factors[:, None, None, None], ratio.shape), rtol=1e-5)
  changed = np.abs(factors - 1) > 1e-6
  assert _binomial_ok(changed.sum(), n, p), changed.sum()
  f = factors[changed]
  assert f.min() >= 1 - b - 1e-6 and f.max() <= 1 + b + 1e-6
  # U[0.6, 1.4]: mean 1, sd 0.8/sqrt(12).
  assert abs(f.mean() - 1.0) <= 4 * 0.8 / math.sqrt(12 * len(f))


# ---------------------------------------------------------------------------------------------------------------------
# RandomResizedCrop


@pytest.mark.parametrize('hw,scale', [((8, 8), (0.08, 1.0)), ((16, 12), (0.2, 1.0)), ((6, 10), (0.7, 1.0)),
                                      ((10, 6), (0.7, 1.0)), ((8, 8), (1.0, 1.0))])
def test_crop_box_matches_torchvision_loop(hw, scale):
  height, width = hw
  ratio = (3 / 4, 4 / 3)
  n, t = 300, aug.CROP_NUM_TRIES
  rng = np.random.default_rng(height * 100 + width)
  area_fracs = rng.uniform(*scale, size=(n, t)).astype(np.float32)
  log_ratios = rng.uniform(math.log(ratio[0]), math.log(ratio[1]), size=(n, t)).astype(np.float32)
  u = rng.uniform(size=(n, 2)).astype(np.float32)
  boxes = np.asarray(jax.jit(jax.vmap(
      lambda a, r, ut, ul: aug.crop_box_from_draws(a, r, ut, ul, height, width, ratio)))(
          area_fracs, log_ratios, u[:, 0], u[:, 1]))
  fallbacks = 0
  for i in range(n):
    ref, ambiguous, fell_back = _torchvision_box_ref(area_fracs[i], log_ratios[i], u[i, 0], u[i, 1], height, width,
                                                     ratio)
    fallbacks += fell_back
    if not ambiguous:
      assert tuple(boxes[i]) == ref, (i, boxes[i], ref)
  if hw == (6, 10) or hw == (10, 6):
    assert 0 < fallbacks < n  # both branches exercised


@pytest.mark.parametrize('hw,expected', [((5, 16), (0, 4, 5, 7)), ((16, 5), (4, 0, 7, 5))])
def test_crop_box_fallback_when_no_try_fits(hw, expected):
  # Any area >= 0.9·80 with ratio in [3/4, 4/3] is too tall/wide for these images: torchvision's centre crop,
  # w = round(5·4/3) = 7 (resp. h = round(5/(3/4)) = 7), centred.
  keys = jax.random.split(jax.random.key(0), 50)
  boxes = np.asarray(jax.jit(jax.vmap(lambda k: aug.sample_crop_box(k, *hw, (0.9, 1.0), (3 / 4, 4 / 3))))(keys))
  assert np.all(boxes == np.array(expected))


def test_sampled_crop_boxes_within_ranges():
  height = width = 16
  scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
  keys = jax.random.split(jax.random.key(1), 3000)
  boxes = np.asarray(jax.jit(jax.vmap(lambda k: aug.sample_crop_box(k, height, width, scale, ratio)))(keys))
  top, left, h, w = boxes.T
  assert np.all((top >= 0) & (left >= 0) & (top + h <= height) & (left + w <= width) & (h > 0) & (w > 0))
  # Area and ratio lie in range up to the rounding of w and h to integers (each by at most 0.5).
  area = height * width
  assert np.all((w + 0.5) * (h + 0.5) >= scale[0] * area) and np.all((w - 0.5) * (h - 0.5) <= scale[1] * area)
  assert np.all((w + 0.5) / (h - 0.5) >= ratio[0]) and np.all((w - 0.5) / (h + 0.5) <= ratio[1])
  # The crop's mean area fraction matches a float64 Monte-Carlo run of torchvision's loop.
  rng = np.random.default_rng(0)
  m = 20000
  ref = np.array([np.prod(_torchvision_box_ref(rng.uniform(*scale, 10), rng.uniform(*np.log(ratio), 10),
                                               rng.uniform(), rng.uniform(), height, width, ratio)[0][2:]) / area
                  for _ in range(m)])
  frac = h * w / area
  se = math.sqrt(frac.var() / len(frac) + ref.var() / m)
  assert abs(frac.mean() - ref.mean()) <= 4 * se, (frac.mean(), ref.mean())
  # The crop position is uniform over the valid offsets: mean offset / max offset ≈ 1/2.
  slack = height - h
  assert abs(np.mean(top[slack > 0] / slack[slack > 0]) - 0.5) < 0.03


# ---------------------------------------------------------------------------------------------------------------------
# bilinear crop-resize


@pytest.mark.parametrize('c', [1, 3])
def test_crop_resize_full_box_is_exact(c):
  x = _float_ref(_images(8, 1, 8, 8, c)[0])
  out = _crop_resize(jnp.asarray(x), jnp.array([0, 0, 8, 8]), (8, 8))
  np.testing.assert_array_equal(np.asarray(out), x)


def test_crop_resize_downscale_by_two_is_block_mean():
  x = _float_ref(_images(9, 1, 16, 16, 3)[0]).astype(np.float64)
  top, left = 2, 4
  out = np.asarray(_crop_resize(jnp.asarray(x, jnp.float32), jnp.array([top, left, 8, 8]), (4, 4)))
  # Scale 2: source coordinate (d + 0.5)·2 - 0.5 = 2d + 0.5, i.e. equal weights on pixels 2d and 2d + 1.
  crop = x[top:top + 8, left:left + 8]
  ref = crop.reshape(4, 2, 4, 2, 3).mean(axis=(1, 3))
  np.testing.assert_allclose(out, ref, atol=1e-6)
  np.testing.assert_allclose(out[1, 2], (crop[2, 4] + crop[2, 5] + crop[3, 4] + crop[3, 5]) / 4, atol=1e-6)


@pytest.mark.parametrize('box,out_hw', [((1, 2, 5, 3), (8, 8)), ((0, 3, 7, 5), (4, 6)), ((3, 0, 1, 8), (5, 5))])
def test_crop_resize_matches_reference(box, out_hw):
  x = _float_ref(_images(10, 1, 8, 8, 3)[0])
  out = np.asarray(_crop_resize(jnp.asarray(x), jnp.array(box), out_hw))
  # The tap coordinate src = (d + 0.5)·(length / out_len) - 0.5 is float32 by design (torch's arithmetic), so its
  # weight carries up to ~3 roundings of a value <= length; times a pixel difference <= 1 on each axis, plus the two
  # blends' roundings: about 3·eps·(length + 1) at worst. 4·eps·(length + 1) (observed <= 1.8 eps, >= 18x margin);
  # a wrong tap or coordinate convention is off by > 1e-2.
  atol = 4 * EPS32 * (max(box[2], box[3]) + 1)
  np.testing.assert_allclose(out, _bilinear_ref(x, *box, *out_hw), atol=atol)


# ---------------------------------------------------------------------------------------------------------------------
# colour ops


def _rgb_pixels():
  rng = np.random.default_rng(11)
  special = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0], [0.5, 0.5, 0.5], [0, 0, 0], [1, 1, 1],
                      [0.2, 0.8, 0.8], [0.9, 0.1, 0.9]])
  return np.concatenate([special, rng.uniform(size=(27, 3))]).reshape(6, 6, 3).astype(np.float32)


@pytest.mark.parametrize('op,factor', [('brightness', 1.3), ('brightness', 0.4), ('contrast', 1.6), ('contrast', 0.3),
                                       ('saturation', 1.7), ('saturation', 0.2), ('hue', 0.13), ('hue', -0.37),
                                       ('hue', 0.5)])
def test_single_color_ops_match_reference(op, factor):
  x = _rgb_pixels()
  fn = {'brightness': aug.adjust_brightness, 'contrast': aug.adjust_contrast, 'saturation': aug.adjust_saturation,
        'hue': aug.adjust_hue}[op]
  ref = _REF_OPS[op](x, factor)
  # The formula, exactly: the same op in float64 against the float64 reference.
  with jax.enable_x64(True):
    out64 = jax.jit(fn)(jnp.asarray(x, jnp.float64), factor)
    assert out64.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out64), ref, atol=F64_ATOL, rtol=0)
  # The float32 path (what augmentation runs), to float32 rounding.
  out = np.asarray(jax.jit(fn)(jnp.asarray(x), factor))
  np.testing.assert_allclose(out, ref, atol=F32_COLOR_ATOL, rtol=0)


def test_hsv_round_trip_matches_colorsys():
  x = _rgb_pixels().reshape(-1, 3)
  ref = [colorsys.rgb_to_hsv(*p) for p in x.astype(np.float64)]
  with jax.enable_x64(True):
    hsv64 = jax.jit(aug.rgb_to_hsv)(jnp.asarray(x, jnp.float64))
    assert hsv64.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(hsv64), ref, atol=F64_ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(jax.jit(aug.hsv_to_rgb)(hsv64)), x, atol=F64_ATOL, rtol=0)
  # float32 (observed: rgb_to_hsv <= 1 eps, the round trip <= 4.5 eps).
  hsv = np.asarray(jax.jit(aug.rgb_to_hsv)(jnp.asarray(x)))
  np.testing.assert_allclose(hsv, ref, atol=F32_COLOR_ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(jax.jit(aug.hsv_to_rgb)(jnp.asarray(hsv))), x, atol=F32_COLOR_ATOL, rtol=0)


def test_color_ops_on_grayscale_images():
  x = _float_ref(_images(12, 1, 6, 6, 1)[0])
  np.testing.assert_array_equal(np.asarray(aug.adjust_saturation(jnp.asarray(x), 0.3)), x)
  np.testing.assert_array_equal(np.asarray(aug.adjust_hue(jnp.asarray(x), 0.3)), x)
  np.testing.assert_array_equal(np.asarray(aug.rgb_to_grayscale(jnp.asarray(x))), x)
  ref = np.clip(1.5 * x + (1 - 1.5) * x.astype(np.float64).mean(), 0, 1)  # contrast blends with the image mean
  np.testing.assert_allclose(np.asarray(aug.adjust_contrast(jnp.asarray(x), 1.5)), ref, atol=1e-6)


@pytest.mark.parametrize('order', [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2)])
def test_color_jitter_applies_ops_in_given_order(order):
  x = _rgb_pixels()
  ops = aug.JITTER_OPS
  factors = dict(brightness=1.2, contrast=0.7, saturation=1.8, hue=0.21)
  params = aug.JitterParams(order=jnp.array(order), **{k: jnp.float32(v) for k, v in factors.items()})
  out = np.asarray(jax.jit(aug.color_jitter, static_argnums=2)(jnp.asarray(x), params, ops))
  ref = x.astype(np.float64)
  for k in order:
    ref = _REF_OPS[ops[k]](ref, factors[ops[k]])
  np.testing.assert_allclose(out, ref, atol=1e-5)


def test_jitter_params_distribution():
  cfg = aug.PRESETS['byol_easyfl']
  keys = jax.random.split(jax.random.key(2), 2400)
  params = jax.jit(jax.vmap(lambda k: aug.sample_jitter_params(k, cfg, 3)))(keys)
  order = np.asarray(params.order)
  assert np.all(np.sort(order, axis=1) == np.arange(4))
  perms = {p: i for i, p in enumerate(itertools.permutations(range(4)))}
  counts = np.bincount([perms[tuple(o)] for o in order], minlength=24)
  assert stats.chisquare(counts).pvalue > 1e-4 and counts.min() > 0
  for name, lo, hi in [('brightness', 0.2, 1.8), ('contrast', 0.2, 1.8), ('saturation', 0.2, 1.8), ('hue', -0.2, 0.2)]:
    v = np.asarray(getattr(params, name))
    assert v.min() >= lo and v.max() <= hi and v.min() < lo + 0.05 and v.max() > hi - 0.05
  # Strength > 1: torchvision's lower bound max(0, 1 - s) = 0.
  strong = jax.jit(jax.vmap(lambda k: aug.sample_jitter_params(k, aug.AugmentConfig(jitter_prob=1.0, brightness=1.5), 3)))
  v = np.asarray(strong(keys[:400]).brightness)
  assert v.min() >= 0.0 and v.min() < 0.05 and v.max() <= 2.5
  fixed = aug.sample_jitter_params(keys[0], dataclasses.replace(cfg, jitter_random_order=False), 3)
  np.testing.assert_array_equal(np.asarray(fixed.order), np.arange(4))
  assert aug.sample_jitter_params(keys[0], cfg, 1).order.shape == (2,)  # grayscale: brightness and contrast only


def test_hue_after_fused_producer_under_jit():
  # Regression: with a reduce-max in rgb_to_hsv, XLA:CPU fused the saturation blend into the hue conversion and put
  # pixels in the wrong hue sector (errors up to 0.75) although each op alone was exact.
  x = _rgb_pixels()
  out = np.asarray(jax.jit(lambda im: aug.adjust_hue(aug.adjust_saturation(im, 1.8), 0.21))(jnp.asarray(x)))
  ref = _REF_OPS['hue'](_REF_OPS['saturation'](x.astype(np.float64), 1.8), 0.21)
  np.testing.assert_allclose(out, ref, atol=1e-5)
