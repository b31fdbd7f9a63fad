"""Shared by the model tests: a float64 numpy convolution, hand parameter counts, numpy-filled
variables (no per-shape jax.random compile) and parameter shapes by eval_shape."""
import jax
import jax.numpy as jnp
import numpy as np


def np_conv(x, kernel, bias, strides, pads):
  """Direct float64 cross-correlation: x [B,H,W,Ci], kernel [kh,kw,Ci,Co], pads ((t,b),(l,r))."""
  x = np.pad(np.asarray(x, np.float64), ((0, 0), pads[0], pads[1], (0, 0)))
  k = np.asarray(kernel, np.float64)
  kh, kw, _, co = k.shape
  sh, sw = strides
  ho = (x.shape[1] - kh) // sh + 1
  wo = (x.shape[2] - kw) // sw + 1
  out = np.zeros((x.shape[0], ho, wo, co))
  for oh in range(ho):
    for ow in range(wo):
      for i in range(kh):
        for j in range(kw):
          out[:, oh, ow, :] += x[:, oh * sh + i, ow * sw + j, :] @ k[i, j]
  if bias is not None:
    out += np.asarray(bias, np.float64)
  return out


def conv_count(k, cin, cout, bias=False):
  return k * k * cin * cout + (cout if bias else 0)


def bn_count(c):
  return 2 * c  # gamma + beta (PyTorch parameters(); running stats excluded)


def dense_count(din, dout):
  return din * dout + dout


def hand_cifar_resnet(stage_sizes, bottleneck):
  """Parameter count of a CIFAR ResNet backbone (no fc) summed over its layer list."""
  total = conv_count(3, 3, 64) + bn_count(64)
  cin = 64
  for i, (n, planes) in enumerate(zip(stage_sizes, (64, 128, 256, 512))):
    for j in range(n):
      stride = 2 if (i > 0 and j == 0) else 1
      if bottleneck:
        cout = 4 * planes
        total += conv_count(1, cin, planes) + bn_count(planes)
        total += conv_count(3, planes, planes) + bn_count(planes)
        total += conv_count(1, planes, cout) + bn_count(cout)
      else:
        cout = planes
        total += conv_count(3, cin, planes) + bn_count(planes)
        total += conv_count(3, planes, planes) + bn_count(planes)
      if stride != 1 or cin != cout:
        total += conv_count(1, cin, cout) + bn_count(cout)
      cin = cout
  return total


def random_variables(module, x, seed, **kwargs):
  """Variables with the module's structure filled by numpy draws (no jax.random: its per-shape
  compilation dominates test time on CPU). Kernels ~ N(0, 1/fan_in); BN scale ~ 1 + N(0, 0.1^2)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda k: module.init(k, x, **kwargs), jax.random.key(0))

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    if len(s.shape) >= 2:
      v = rng.normal(size=s.shape) / np.sqrt(np.prod(s.shape[:-1]))
    elif "'var'" in name:
      v = rng.uniform(0.5, 1.5, size=s.shape)
    elif "'scale'" in name:
      v = 1 + 0.1 * rng.normal(size=s.shape)
    else:
      v = 0.1 * rng.normal(size=s.shape)
    return jnp.asarray(v, jnp.float32)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def fast_key(seed):
  """PRNG key whose bit generator compiles quickly on CPU (threefry's per-shape compile is slow)."""
  return jax.random.key(seed, impl='rbg')


def randn(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def shape_params(module, input_shape, **kwargs):
  """Parameter shapes via eval_shape (nothing is computed)."""
  x = jnp.zeros((2,) + tuple(input_shape), jnp.float32)
  return jax.eval_shape(lambda k: module.init(k, x, train=False, **kwargs), jax.random.key(0))
