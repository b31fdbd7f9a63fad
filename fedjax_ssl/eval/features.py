"""Feature extraction for evaluation: frozen models, un-augmented images, fixed-shape jitted batches.

The model is given as `apply_fn(variables, x) -> features`, where x is float32 [B, H, W, C] already
normalised and the function runs the model in eval mode, e.g. `functools.partial(encoder.apply, train=False)`
or `lambda v, x: ssl_model.apply(v, x, train=False, with_predictor=False)['h']`. `apply_fn` is a static
argument of the jitted forward: pass the same object across calls to reuse the compiled program.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl.data.augment import normalize_images  # noqa: F401 (eval's name for it too)
from fedjax_ssl.models import layers

ApplyFn = Callable[[Any, jax.Array], jax.Array]


# Both forwards are traced inside `layers.inference_convs()`: these programs are never
# differentiated, so conv_impl='auto' takes XLA's convolution, the faster one without gradients.
@functools.partial(jax.jit, static_argnums=0)
def _forward(apply_fn: ApplyFn, variables: Any, images_uint8: jax.Array, mean: jax.Array,
             std: jax.Array) -> jax.Array:
  with layers.inference_convs():
    return apply_fn(variables, normalize_images(images_uint8, mean, std)).astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _forward_stacked(apply_fn: ApplyFn, stacked_variables: Any, images_uint8: jax.Array, mean: jax.Array,
                     std: jax.Array, client_strategy: str) -> jax.Array:
  x = normalize_images(images_uint8, mean, std)
  one = lambda v: apply_fn(v, x).astype(jnp.float32)
  with layers.inference_convs():
    if client_strategy == 'vmap':
      return jax.vmap(one)(stacked_variables)
    return jax.lax.map(one, stacked_variables)


def _check_images(images_uint8: Any, mean: Sequence[float], std: Sequence[float], batch_size: int) -> None:
  shape = np.shape(images_uint8)
  if len(shape) != 4:
    raise ValueError(f'images must be [N, H, W, C], got shape {shape}')
  if np.dtype(images_uint8.dtype) != np.uint8:
    raise ValueError(f'images must be uint8, got {images_uint8.dtype}')
  if len(mean) != shape[-1] or len(std) != shape[-1]:
    raise ValueError(f'mean/std need one entry per channel ({shape[-1]}), got {len(mean)} and {len(std)}')
  if batch_size < 1:
    raise ValueError(f'batch_size must be >= 1, got {batch_size}')


def _batched(fn: Callable[[jax.Array], jax.Array], images_uint8: Any, batch_size: int, axis: int) -> jax.Array:
  """Runs fn over fixed-size batches (last one zero-padded) and concatenates along `axis`, dropping padding."""
  xp = jnp if isinstance(images_uint8, jax.Array) else np  # device arrays stay on the device.
  n = images_uint8.shape[0]
  outs = []
  for start in range(0, n, batch_size):
    batch = images_uint8[start:start + batch_size]
    pad = batch_size - batch.shape[0]
    if pad:  # one static shape for every batch -> a single compilation.
      batch = xp.pad(batch, [(0, pad)] + [(0, 0)] * (batch.ndim - 1))
    outs.append(fn(batch))
  return jax.lax.slice_in_dim(jnp.concatenate(outs, axis=axis), 0, n, axis=axis)


def extract_features(apply_fn: ApplyFn, variables: Any, images_uint8: Any, mean: Sequence[float],
                     std: Sequence[float], batch_size: int = 512) -> jax.Array:
  """Features of un-augmented images under one model.

  Args:
    apply_fn: (variables, x float32 [B, H, W, C]) -> float [B, d], eval mode (see module docstring).
    variables: the model's variables, e.g. {'params': ..., 'batch_stats': ...}.
    images_uint8: uint8 [N, H, W, C] (numpy or jax); batches are moved to the device one at a time.
    mean, std: per-channel statistics of the [0, 1]-scaled training images (len C).
    batch_size: images per forward pass.
  Returns:
    float32 [N, d].
  """
  _check_images(images_uint8, mean, std, batch_size)
  mean, std = jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32)
  fn = lambda batch: _forward(apply_fn, variables, batch, mean, std)
  return _batched(fn, images_uint8, batch_size, axis=0)


def extract_features_stacked(apply_fn: ApplyFn, stacked_variables: Any, images_uint8: Any,
                             mean: Sequence[float], std: Sequence[float], batch_size: int = 512,
                             client_strategy: str = 'auto') -> jax.Array:
  """Features of the same images under C per-client models whose variables are stacked on a leading axis.

  Args:
    apply_fn: as in `extract_features`.
    stacked_variables: pytree whose every leaf has a leading client axis of size C.
    images_uint8: uint8 [N, H, W, C].
    mean, std: per-channel statistics (len C).
    batch_size: images per forward pass (each pass runs all C models on them).
    client_strategy: 'vmap' (one fused program over clients), 'map' (`lax.map`, one client at a time,
      C times less activation memory) or 'auto': 'map' on the CPU backend, where vmapped per-client
      kernels make grouped convolutions or batched GEMMs (slower than 'map' for 10 LeNet-5
      classifiers, docs/notes/performance.md#perf-eval-convs), else 'vmap'.
  Returns:
    float32 [C, N, d].
  """
  _check_images(images_uint8, mean, std, batch_size)
  if client_strategy not in ('auto', 'vmap', 'map'):
    raise ValueError(f"client_strategy must be 'auto', 'vmap' or 'map', got {client_strategy!r}")
  if client_strategy == 'auto':
    client_strategy = 'map' if jax.default_backend() == 'cpu' else 'vmap'
  mean, std = jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32)
  fn = lambda batch: _forward_stacked(apply_fn, stacked_variables, batch, mean, std, client_strategy)
  return _batched(fn, images_uint8, batch_size, axis=1)
