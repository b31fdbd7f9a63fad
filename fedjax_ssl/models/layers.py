"""Layers shared by every encoder: a 2-D convolution with a selectable implementation, a Dense
layer, PyTorch-default initialisers, pooling and the project's BatchNorm settings.

Why a custom convolution: on XLA:CPU convolutions are slow, and a convolution whose kernel is
batched by `jax.vmap` over per-client weights lowers to a grouped convolution, which is slower
still. The 'im2col' implementation extracts the kh*kw shifted (strided) views of the padded input
with plain slices and contracts them with the kernel in ONE matmul, which XLA:CPU runs as a
(batched) GEMM. Both implementations read the same 'kernel' [kh, kw, cin, cout] (HWIO, like
flax `nn.Conv`) and 'bias' [cout] parameters, so parameters are interchangeable between them.
im2col wins through the gradients; a program that is never differentiated (feature extraction)
is faster with XLA's own convolution, which `inference_convs()` selects for 'auto'.

'packed', 'measured' and 'pallas' are XLA's convolution per client, marked so that where the engine
vmaps a local step over clients the whole step runs in the client-packed layout [N, H, W, K*C]
(core/packing.py; 'measured': each convolution's implementation timed once, core/conv_choice.py;
'pallas': every convolution it applies to by the Pallas kernel of ops/pallas_conv.py, GPU backends
only; docs/notes/performance.md#perf-53, #perf-68).

Precision: every layer takes `dtype`, the compute dtype of its matmul / convolution and output
(None: the dtype of its input and parameters, i.e. float32, or float64 in the x64 tests).
Parameters are float32 whatever `dtype` is; `compute_dtype(config.precision)` gives the dtype, and
the encoders and heads return their outputs at least float32 (`as_float`), so losses, evaluation
and the ops see float32 (docs/notes/engine.md#eng-58).

Initialisation follows PyTorch's defaults, because every reference code reproduced here
(repshare, FedSC, EasyFL, FedU2) is PyTorch with default-initialised Conv2d/Linear layers:
weights ~ U(+-1/sqrt(fan_in)) (kaiming_uniform with a=sqrt(5)) and biases ~ U(+-1/sqrt(fan_in)).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl.ops.numerics import as_float  # noqa: F401  (the modules' output cast, layers.as_float)

CONV_IMPLS = ('auto', 'xla', 'im2col', 'packed', 'measured', 'pallas')
# Implementations that take effect where the local step is vmapped over clients (core/packing.py):
# per client they are XLA's convolution.
PACKED_IMPLS = ('packed', 'measured', 'pallas')
# The backends where conv_impl='pallas' compiles its kernel (Triton); elsewhere Pallas only
# interprets, orders of magnitude slower (ops/pallas_conv.py).
PALLAS_BACKENDS = ('gpu',)

# config.precision -> compute dtype of convolutions, matmuls and activations. 'float32' is None, not
# jnp.float32: no cast at all, so a float32 run computes bit for bit what it did before the key
# existed and the float64 reference tests stay float64.
PRECISIONS: Dict[str, Optional[Any]] = {'float32': None, 'bfloat16': jnp.bfloat16}

Initializer = Callable[..., jax.Array]
PaddingLike = Union[str, int, Sequence[Union[int, Tuple[int, int]]]]

# kaiming_uniform(a=sqrt(5)) as used by torch.nn.Conv2d / nn.Linear: gain^2 = 2 / (1 + 5) = 1/3,
# bound = gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in), which is variance_scaling(1/3, fan_in, uniform).
# For an HWIO kernel flax computes fan_in = kh * kw * cin, as PyTorch does.
torch_kernel_init = nn.initializers.variance_scaling(1.0 / 3.0, 'fan_in', 'uniform')

# PyTorch defaults for BatchNorm{1,2}d: momentum 0.1 (flax keeps 1 - 0.1 of the old statistic),
# eps 1e-5. Flax stores the biased batch variance in the running 'var' (PyTorch the unbiased one;
# the factor n/(n-1) is negligible for the batch sizes used here). The batch variance is the two-pass
# E[(x - E[x])^2] (`use_fast_variance=False`): flax's default E[x^2] - E[x]^2 cancels in float32 when
# |mean| >> std and put the updates of a BYOL step 2e-4 to 2e-3 off a float64 reference, where
# PyTorch's float32 step is 3e-6 to 7e-5 off (docs/notes/evaluation.md#eval-8).
BatchNorm = functools.partial(nn.BatchNorm, momentum=0.9, epsilon=1e-5, use_fast_variance=False)


def torch_bias_init(fan_in: int) -> Initializer:
  """PyTorch's default bias initialiser U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for a layer with `fan_in` inputs."""
  bound = 1.0 / float(np.sqrt(fan_in))

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def compute_dtype(precision: str) -> Optional[Any]:
  """The layers' `dtype` for config.precision `precision` (None for 'float32', see PRECISIONS)."""
  if precision not in PRECISIONS:
    raise ValueError(f'precision={precision!r}; allowed: {tuple(PRECISIONS)}')
  return PRECISIONS[precision]


def cast(dtype: Optional[Any], *arrays: jax.Array) -> Tuple[jax.Array, ...]:
  """`arrays` in the compute dtype `dtype`; unchanged when `dtype` is None."""
  return arrays if dtype is None else tuple(jnp.asarray(a, dtype) for a in arrays)


# True while a forward-only program is traced (`inference_convs`).
_INFERENCE = contextvars.ContextVar('fedjax_ssl_inference_convs', default=False)


@contextlib.contextmanager
def inference_convs() -> Iterator[None]:
  """Within it, conv_impl='auto' resolves to 'xla' on every backend: for programs that are never
  differentiated (feature extraction). im2col pays off through the gradients, which XLA:CPU
  computes slowly; XLA:CPU's forward convolution alone is the faster one on every CPU encoder of
  the registry (docs/notes/performance.md#perf-eval-convs). It acts at trace time, so
  enter it inside the jitted function."""
  token = _INFERENCE.set(True)
  try:
    yield
  finally:
    _INFERENCE.reset(token)


def resolve_conv_impl(conv_impl: str) -> str:
  """Maps `conv_impl` to 'xla', 'im2col' or 'packed'; 'auto' picks 'im2col' on the CPU backend,
  else 'xla' (and 'xla' inside `inference_convs`); 'packed', 'measured' and 'pallas' give 'packed'
  (the choice between them is made where the clients are vmapped, core/packing.py); 'pallas' on
  a backend outside PALLAS_BACKENDS raises.

  Resolved at trace time, so the same module definition is fast on CPU and uses cuDNN/TPU
  convolutions elsewhere.
  """
  if conv_impl not in CONV_IMPLS:
    raise ValueError(f'conv_impl={conv_impl!r}; allowed: {CONV_IMPLS}')
  check_pallas_backend(conv_impl)
  if conv_impl == 'auto':
    return 'im2col' if jax.default_backend() == 'cpu' and not _INFERENCE.get() else 'xla'
  return 'packed' if conv_impl in PACKED_IMPLS else conv_impl


def check_pallas_backend(conv_impl: str) -> None:
  """Raises (one line) for conv_impl='pallas' on a backend whose Pallas kernels cannot compile."""
  backend = jax.default_backend()
  if conv_impl == 'pallas' and backend not in PALLAS_BACKENDS:
    raise ValueError(f"conv_impl='pallas' needs a backend in {PALLAS_BACKENDS} (its Triton kernel); "
                     f"this one is {backend!r}: use 'packed', 'measured', 'xla' or 'im2col'")


def _pair(value: Union[int, Sequence[int]], name: str) -> Tuple[int, int]:
  if isinstance(value, (int, np.integer)):
    return (int(value), int(value))
  value = tuple(int(v) for v in value)
  if len(value) != 2:
    raise ValueError(f'{name}={value!r}; expected an int or a pair of ints (2-D convolution)')
  return value


def conv_padding(padding: PaddingLike, in_hw: Tuple[int, int], kernel_hw: Tuple[int, int],
                 strides: Tuple[int, int]) -> Tuple[Tuple[int, int], Tuple[int, int]]:
  """Explicit ((top, bottom), (left, right)) padding for a 2-D convolution.

  padding: 'SAME' / 'VALID' (lax semantics: SAME puts the odd extra pixel at the end), an int
  (symmetric, like PyTorch's `padding=p`), a pair of ints (symmetric per dimension) or a pair of
  (low, high) pairs. Note PyTorch's padding=k//2 with stride 2 differs from 'SAME' on even inputs.
  """
  if isinstance(padding, str):
    if padding.upper() not in ('SAME', 'VALID'):
      raise ValueError(f"padding={padding!r}; allowed: 'SAME', 'VALID', an int, or explicit pairs")
    pads = jax.lax.padtype_to_pads(in_hw, kernel_hw, strides, padding.upper())
    return tuple((int(lo), int(hi)) for lo, hi in pads)
  if isinstance(padding, (int, np.integer)):
    pads = ((int(padding),) * 2,) * 2
  else:
    padding = tuple(padding)
    if len(padding) != 2:
      raise ValueError(f'padding={padding!r}; expected 2 entries (one per spatial dimension)')
    pads = []
    for p in padding:
      if isinstance(p, (int, np.integer)):
        pads.append((int(p), int(p)))
      elif len(tuple(p)) == 2:
        pads.append(tuple(int(v) for v in p))
      else:
        raise ValueError(f'padding entry {p!r}; expected an int or a (low, high) pair')
    pads = tuple(pads)
  if min(min(p) for p in pads) < 0:
    raise ValueError(f'padding={padding!r}; negative padding is not supported')
  return pads


def im2col_conv(x: jax.Array, kernel: jax.Array, strides: Tuple[int, int],
                pads: Tuple[Tuple[int, int], Tuple[int, int]]) -> jax.Array:
  """Convolution (cross-correlation, like lax/PyTorch) as patch extraction + one matmul.

  Args:
    x: [B, H, W, cin] input.
    kernel: [kh, kw, cin, cout] (HWIO).
    strides: (sh, sw).
    pads: ((top, bottom), (left, right)) non-negative explicit padding.
  Returns:
    [B, Ho, Wo, cout] with Ho = (H + top + bottom - kh) // sh + 1 (likewise Wo).

  The patches are strided slices x_pad[:, i : i + sh*(Ho-1) + 1 : sh, j : ..., :] for every kernel
  offset (i, j), concatenated on the channel axis in (i, j, c) order, which is exactly the row
  order of kernel.reshape(kh * kw * cin, cout). A 1x1 kernel is a single slice (no concatenation).
  """
  kh, kw, cin, cout = kernel.shape
  sh, sw = strides
  if any(p != (0, 0) for p in pads):
    x = jnp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
  hp, wp = x.shape[1], x.shape[2]
  ho, wo = (hp - kh) // sh + 1, (wp - kw) // sw + 1
  if ho < 1 or wo < 1:
    raise ValueError(f'padded input {hp}x{wp} is smaller than the kernel {kh}x{kw}')
  patches = [x[:, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw, :]
             for i in range(kh) for j in range(kw)]
  cols = patches[0] if len(patches) == 1 else jnp.concatenate(patches, axis=-1)
  b = cols.shape[0]
  y = patch_matmul(cols.reshape(b * ho * wo, kh * kw * cin), kernel.reshape(kh * kw * cin, cout))
  return y.reshape(b, ho, wo, cout)


def xla_conv(x: jax.Array, kernel: jax.Array, strides: Tuple[int, int],
             pads: Tuple[Tuple[int, int], Tuple[int, int]]) -> jax.Array:
  """lax.conv_general_dilated of x [B, H, W, cin] and kernel [kh, kw, cin, cout] -> [B, Ho, Wo, cout]
  in their promoted dtype (as im2col's matmul: a float32 image meets float64 weights under x64)."""
  dt = jnp.result_type(x, kernel)
  return jax.lax.conv_general_dilated(x.astype(dt), kernel.astype(dt), strides, pads,
                                      dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


def fedjax_ssl_packed_conv(x, kernel, strides, pads):
  return xla_conv(x, kernel, strides, pads)


def fedjax_ssl_measured_conv(x, kernel, strides, pads):
  return xla_conv(x, kernel, strides, pads)


def fedjax_ssl_pallas_conv(x, kernel, strides, pads):
  return xla_conv(x, kernel, strides, pads)


# The jits' names (the functions') mark a program for the client-packed vmap of core/packing.py
# (its PACKED_CONV, MEASURED_CONV and PALLAS_CONV).
_MARKED_CONVS = {impl: jax.jit(fn, static_argnums=(2, 3)) for impl, fn in (
    ('packed', fedjax_ssl_packed_conv), ('measured', fedjax_ssl_measured_conv),
    ('pallas', fedjax_ssl_pallas_conv))}


def packed_conv(x: jax.Array, kernel: jax.Array, strides: Tuple[int, int],
                pads: Tuple[Tuple[int, int], Tuple[int, int]], measured: bool = False,
                conv_impl: Optional[str] = None) -> jax.Array:
  """conv_impl='packed' ('measured' with `measured`, or conv_impl='measured' / 'pallas'): XLA's
  convolution [B, H, W, cin] x [kh, kw, cin, cout] -> [B, Ho, Wo, cout] inside a jit named
  core.packing.PACKED_CONV (MEASURED_CONV, PALLAS_CONV), so that a local step vmapped over
  clients (core/local.py) runs the program's convolutions in the client-packed layout (each by
  its measured implementation, or by the Pallas kernel)."""
  impl = conv_impl or ('measured' if measured else 'packed')
  return _MARKED_CONVS[impl](x, kernel, tuple(strides), tuple(tuple(p) for p in pads))


@jax.custom_vjp
def patch_matmul(cols: jax.Array, kmat: jax.Array) -> jax.Array:
  """cols [M, K] @ kmat [K, N] -> [M, N], with a gradient that XLA:CPU runs as plain GEMMs.

  The kernel gradient of a matmul contracts both operands over their leading (row) axis, M = the
  batch's output pixels. XLA:CPU runs that transposed-operand dot outside its fast (YNNPACK) GEMM
  path: 12-20 GFLOP/s on one core for the convolutions of the cross-device CNN, against 55-80 for
  the same work as an ordinary [K, M] @ [M, N] GEMM (docs/notes/performance.md#cross-device-round). The
  backward pass therefore materialises cols^T (an optimization barrier keeps XLA from folding the
  transpose back into the dot). The numbers are those of jnp.dot's own gradient up to float
  summation order.
  """
  return jnp.dot(cols, kmat)


def _patch_matmul_fwd(cols, kmat):
  return jnp.dot(cols, kmat), (cols, kmat)


def _patch_matmul_bwd(res, g):
  cols, kmat = res
  cols_t = jax.lax.optimization_barrier(jnp.swapaxes(cols, -1, -2))
  return jnp.dot(g, jnp.swapaxes(kmat, -1, -2)), jnp.dot(cols_t, g)


patch_matmul.defvjp(_patch_matmul_fwd, _patch_matmul_bwd)


class Conv(nn.Module):
  """2-D convolution over NHWC input, parameter-compatible with flax `nn.Conv`.

  Differences from nn.Conv: 2-D only (an int kernel_size means a square kernel, not a 1-D one),
  no dilation / feature groups, and PyTorch-default initialisers.

  Attributes:
    features: output channels.
    kernel_size: int (square) or (kh, kw).
    strides: int or (sh, sw).
    padding: 'SAME' | 'VALID' | int | per-dimension ints | ((top, bottom), (left, right)).
    use_bias: add a 'bias' [features] parameter.
    kernel_init: initialiser of 'kernel' [kh, kw, cin, features]; PyTorch default.
    bias_init: initialiser of 'bias'; None = PyTorch default U(+-1/sqrt(kh*kw*cin)).
    conv_impl: 'auto' | 'xla' (lax.conv_general_dilated) | 'im2col' (slices + one matmul) |
      'packed' / 'measured' / 'pallas' (XLA's per client; stacked clients in the packed layout,
      with the measured choice per convolution or the Pallas kernel, core/packing.py).
    dtype: compute dtype of the convolution and of the output (None: the input's and kernel's).
  Input [..., H, W, cin] float; output [..., Ho, Wo, features], float32 parameters.
  """
  features: int
  kernel_size: Union[int, Sequence[int]]
  strides: Union[int, Sequence[int]] = 1
  padding: PaddingLike = 'SAME'
  use_bias: bool = True
  kernel_init: Initializer = torch_kernel_init
  bias_init: Optional[Initializer] = None
  conv_impl: str = 'auto'
  dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    impl = resolve_conv_impl(self.conv_impl)
    kh, kw = _pair(self.kernel_size, 'kernel_size')
    strides = _pair(self.strides, 'strides')
    if x.ndim < 3:
      raise ValueError(f'Conv input must be [..., H, W, C]; got shape {x.shape}')
    lead, (h, w, cin) = x.shape[:-3], x.shape[-3:]
    pads = conv_padding(self.padding, (h, w), (kh, kw), strides)
    kernel = self.param('kernel', self.kernel_init, (kh, kw, cin, self.features), jnp.float32)
    x4, kernel = cast(self.dtype, x.reshape((-1, h, w, cin)), kernel)
    if impl == 'xla':
      y = xla_conv(x4, kernel, strides, pads)
    elif impl == 'packed':
      y = packed_conv(x4, kernel, strides, pads, conv_impl=self.conv_impl)
    else:
      y = im2col_conv(x4, kernel, strides, pads)
    if self.use_bias:
      bias_init = self.bias_init or torch_bias_init(kh * kw * cin)
      y = y + cast(self.dtype, self.param('bias', bias_init, (self.features,), jnp.float32))[0]
    return y.reshape(lead + y.shape[1:])


class Dense(nn.Module):
  """Fully-connected layer, parameter-compatible with flax `nn.Dense` ('kernel' [din, features], 'bias').

  Defaults to PyTorch nn.Linear initialisation (kernel and bias U(+-1/sqrt(din))). `dtype`: compute
  dtype of the matmul and of the output [..., features] (None: the input's and kernel's); the
  parameters are float32.
  """
  features: int
  use_bias: bool = True
  kernel_init: Initializer = torch_kernel_init
  bias_init: Optional[Initializer] = None
  dtype: Optional[Any] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    din = x.shape[-1]
    kernel = self.param('kernel', self.kernel_init, (din, self.features), jnp.float32)
    y = jnp.dot(*cast(self.dtype, x, kernel))
    if self.use_bias:
      bias_init = self.bias_init or torch_bias_init(din)
      y = y + cast(self.dtype, self.param('bias', bias_init, (self.features,), jnp.float32))[0]
    return y


def max_pool(x: jax.Array, window: int = 2) -> jax.Array:
  """Non-overlapping max pooling (PyTorch MaxPool2d(window), floor mode) on [B, H, W, C].

  Implemented as crop + reshape + max: cheaper than reduce_window on CPU, and its gradient avoids
  select_and_scatter. Trailing rows/columns that do not fill a window are dropped, as in PyTorch.
  """
  b, h, w, c = x.shape
  ho, wo = h // window, w // window
  if ho < 1 or wo < 1:
    raise ValueError(f'max_pool window {window} larger than the input {h}x{w}')
  x = x[:, :ho * window, :wo * window, :]
  return x.reshape(b, ho, window, wo, window, c).max(axis=(2, 4))


def global_avg_pool(x: jax.Array) -> jax.Array:
  """[B, H, W, C] -> [B, C] mean over space (PyTorch AdaptiveAvgPool2d(1) + flatten)."""
  return jnp.mean(x, axis=(1, 2))


def check_nhwc(x: jax.Array) -> None:
  """Raises unless x is a batch of images [B, H, W, C] (the encoders' input)."""
  if x.ndim != 4:
    raise ValueError(f'input must be [B, H, W, C]; got shape {x.shape}')


def conv_bn(conv_impl: str, train: bool, dtype: Optional[Any] = None
            ) -> Tuple[Callable[..., Conv], Callable[[str], nn.Module]]:
  """The ResNet encoders' layer constructors, (conv, bn):

    conv(features, kernel_size, strides, name): a bias-free Conv, PyTorch's symmetric k//2 padding;
    bn(name): the project BatchNorm, batch statistics when `train`, running averages otherwise.
  Both compute in `dtype` (BatchNorm: its output; flax takes the statistics and the normalisation in
  at least float32 and keeps the running statistics float32).
  Call them inside a compact module's __call__: the layers become that module's submodules.
  """
  def conv(features: int, kernel_size: int, strides: int, name: str) -> Conv:
    return Conv(features, kernel_size, strides, padding=kernel_size // 2, use_bias=False,
                conv_impl=conv_impl, dtype=dtype, name=name)

  def bn(name: str) -> nn.Module:
    return BatchNorm(use_running_average=not train, dtype=dtype, name=name)

  return conv, bn


def conv_bn_relu(x: jax.Array, features: int, train: bool, conv_impl: str,
                 conv_name: str = 'conv1', bn_name: str = 'bn1', dtype: Optional[Any] = None
                 ) -> jax.Array:
  """relu(BN(conv3x3(x))), stride 1, bias-free: the CIFAR ResNet stem [B,H,W,C] -> [B,H,W,features].

  As `conv_bn`, call inside a compact module's __call__.
  """
  conv, bn = conv_bn(conv_impl, train, dtype)
  return nn.relu(bn(bn_name)(conv(features, 3, 1, conv_name)(x)))
