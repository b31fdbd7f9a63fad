"""Client-packed `vmap` (conv_impl='packed', issue 65): the stacked clients' activations as
[N, H, W, K*C], the client axis folded beside the channels (HFTA's layout, MLSys 2021).

Under `jax.vmap` over K clients a convolution whose kernel differs per client becomes a grouped
convolution, and JAX's batching rule moves the client axis beside the channels before it and back
after it, at every layer (lax `_conv_general_dilated_batch_rule`: a reshape and a transpose each
way, docs/notes/performance.md#perf-50). `vmap(fn, in_axes)(*args)` here computes what
`jax.vmap` does, but evaluates fn's (unbatched) jaxpr itself, giving each value one of three forms:

  shared   the same for every client (not batched);
  stacked  [K, *s], the client axis first (jax.vmap's form);
  packed   s[:-1] + (K * s[-1],): client k's last axis at [k * s[-1], (k + 1) * s[-1]).

A convolution whose feature axis is last (NHWC) produces a packed value; elementwise operations,
broadcasts, reductions, reshapes and transposes that keep the last axis pass packed values on
packed (BatchNorm's per-client statistics are reductions over N, H, W of the packed array); every
other primitive receives stacked values and is batched by jax.vmap. The gradient convolutions of
the local step's jaxpr (it contains the backward pass: the local step takes its gradient before it
is batched, core/local.py) are packed too: the input gradient is a grouped convolution like the
forward one, the kernel gradient a convolution with batch_group_count = K. So from the first
convolution to the pooled features, forward and backward, the client axis moves only where a
value leaves the convolutional part (the flatten before a Dense layer, the pooled features).

The numbers are those of jax.vmap up to float summation order. Enabled only for programs traced
with a `layers.Conv(conv_impl='packed')` (its convolution is a jit named PACKED_CONV) or 'measured'
(MEASURED_CONV: each convolution's implementation chosen by timing, core/conv_choice.py): every
other program is vmapped by jax.vmap unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import tree_util as _tree_util
from jax.extend import core as jax_core

from fedjax_ssl.ops import pallas_conv

PACKED_CONV = 'fedjax_ssl_packed_conv'
MEASURED_CONV = 'fedjax_ssl_measured_conv'  # conv_impl='measured': choices by core/conv_choice.py
PALLAS_CONV = 'fedjax_ssl_pallas_conv'  # conv_impl='pallas': the Pallas kernel wherever it applies
SHARED, STACKED, PACKED = 'shared', 'stacked', 'packed'
# How a packed convolution is computed (`conv`); 'pallas' (ops/pallas_conv.py) only for the
# equations `pallas_applies` accepts, and a measured candidate only where it compiles natively.
IMPLS = ('grouped', 'loop', 'vmap', 'pallas')

# Elementwise primitives: equal operand shapes, output of that shape, so a packed operand layout
# is an elementwise layout too.
_ELEMENTWISE = frozenset((
    'abs', 'add', 'add_any', 'and', 'ceil', 'convert_element_type', 'copy', 'copy_p', 'cos', 'div', 'eq',
    'erf', 'exp', 'exp2', 'expm1', 'floor', 'ge', 'gt', 'integer_pow', 'is_finite', 'le', 'log',
    'log1p', 'logistic', 'lt', 'max', 'min', 'mul', 'ne', 'neg', 'not', 'or', 'pow',
    'reduce_precision', 'rem', 'round', 'rsqrt', 'select_n', 'sign', 'sin', 'sqrt', 'square',
    'sub', 'tanh', 'xor'))
_REDUCTIONS = frozenset(('reduce_sum', 'reduce_max', 'reduce_min', 'reduce_prod'))
_CALLS = frozenset(('jit', 'pjit', 'closed_call', 'core_call', 'remat', 'checkpoint',
                    'custom_jvp_call', 'custom_vjp_call', 'custom_vjp_call_jaxpr'))


class Value:
  """An array in one of the forms of the module docstring; `shape` is one client's shape."""
  __slots__ = ('array', 'form', 'shape', 'other')

  def __init__(self, array: Any, form: str, shape: Sequence[int]):
    self.array, self.form, self.shape = array, form, tuple(shape)
    self.other: Dict[str, jax.Array] = {}  # the array in other forms, converted once


def _sub_jaxpr(eqn) -> Optional[Any]:
  """The ClosedJaxpr a call-like equation evaluates on its operands (None: not a call)."""
  if eqn.primitive.name not in _CALLS:
    return None
  for name in ('jaxpr', 'call_jaxpr', 'fun_jaxpr'):
    sub = eqn.params.get(name)
    if sub is not None:
      return sub if hasattr(sub, 'jaxpr') else jax_core.ClosedJaxpr(sub, ())
  return None


def has_call(jaxpr: Any, name: str) -> bool:
  """True when `jaxpr` (closed or open) contains a call whose name contains `name`, at any depth
  (after autodiff the gradient's calls are named e.g. 'transpose(jvp(NAME))')."""
  jaxpr = getattr(jaxpr, 'jaxpr', jaxpr)
  for eqn in jaxpr.eqns:
    if name in str(eqn.params.get('name', '')):
      return True
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        if isinstance(sub, (jax_core.ClosedJaxpr, jax_core.Jaxpr)) and has_call(sub, name):
          return True
  return False


def stacked(v: Value, k: int) -> jax.Array:
  """v's array in the stacked form [K, *shape] (a shared value is broadcast)."""
  if v.form == STACKED:
    return v.array
  if STACKED not in v.other:
    if v.form == SHARED:
      v.other[STACKED] = jnp.broadcast_to(v.array, (k,) + v.shape)
    else:
      a = v.array.reshape(v.array.shape[:-1] + (k, v.shape[-1]))
      v.other[STACKED] = jnp.moveaxis(a, -2, 0)
  return v.other[STACKED]


def packed(v: Value, k: int) -> jax.Array:
  """v's array in the packed form shape[:-1] + (K * shape[-1],); needs a shape of rank >= 1."""
  if v.form == PACKED:
    return v.array
  if PACKED not in v.other:
    if v.form == SHARED:
      a = jnp.broadcast_to(v.array[..., None, :], v.shape[:-1] + (k, v.shape[-1]))
    else:
      a = jnp.moveaxis(v.array, 0, -2)
    v.other[PACKED] = a.reshape(v.shape[:-1] + (k * v.shape[-1],))
  return v.other[PACKED]


def _packed_out(array: jax.Array, k: int) -> Value:
  return Value(array, PACKED, array.shape[:-1] + (array.shape[-1] // k,))


def _fallback(eqn, vals: List[Value], k: int) -> List[Value]:
  """jax.vmap of the equation on stacked operands (shared ones unbatched)."""
  arrays = [stacked(v, k) if v.form != SHARED else v.array for v in vals]
  axes = [None if v.form == SHARED else 0 for v in vals]
  bind = lambda *a: eqn.primitive.bind(*a, **eqn.params)
  outs = jax.vmap(bind, in_axes=axes, out_axes=0, axis_size=k)(*arrays)
  outs = outs if eqn.primitive.multiple_results else [outs]
  return [Value(o, STACKED, o.shape[1:]) for o in outs]


def _elementwise(eqn, vals, k):
  # lax broadcasts scalars and size-1 axes of equal-rank operands; the last axes must agree.
  arrays = [v for v in vals if v.shape]
  ranks, lasts = {len(v.shape) for v in arrays}, {v.shape[-1] for v in arrays}
  if len(ranks) != 1 or len(lasts) != 1 or all(v.form != PACKED for v in vals):
    return None
  (r,), (c,) = ranks, lasts

  def operand(v):
    if v.shape:
      return packed(v, k)
    if v.form == SHARED:
      return v.array
    return jnp.repeat(v.array, c).reshape((1,) * (r - 1) + (k * c,))  # a per-client scalar

  out = eqn.primitive.bind(*[operand(v) for v in vals], **eqn.params)
  return [_packed_out(out, k)]


def _broadcast_in_dim(eqn, vals, k):
  (v,) = vals[:1]
  shape, dims = tuple(eqn.params['shape']), tuple(eqn.params['broadcast_dimensions'])
  r = len(shape)
  if len(vals) != 1 or r == 0 or not (v.form == PACKED or r >= 3):
    return None
  maps_last = bool(dims) and dims[-1] == r - 1
  if v.form == PACKED:
    if not maps_last or v.shape[-1] != shape[-1]:
      return None
    return [_packed_out(jax.lax.broadcast_in_dim(v.array, shape[:-1] + (k * shape[-1],), dims), k)]
  a = stacked(v, k)
  if maps_last and v.shape[-1] == shape[-1]:  # the client axis beside the operand's last axis
    a, new_dims = jnp.moveaxis(a, 0, -2), dims[:-1] + (r - 1, r)
  elif maps_last:  # a size-1 last axis broadcast to shape[-1]: drop it, K takes its place
    a, new_dims = jnp.moveaxis(a[..., 0], 0, -1), dims[:-1] + (r - 1,)
  else:
    a, new_dims = jnp.moveaxis(a, 0, -1), dims + (r - 1,)
  out = jax.lax.broadcast_in_dim(a, shape[:-1] + (k, shape[-1]), new_dims)
  return [_packed_out(out.reshape(shape[:-1] + (k * shape[-1],)), k)]


def _reduction(eqn, vals, k):
  (v,) = vals
  axes = tuple(eqn.params['axes'])
  if v.form != PACKED or len(v.shape) - 1 in axes:
    return None
  return [_packed_out(eqn.primitive.bind(v.array, **eqn.params), k)]


def _reshape(eqn, vals, k):
  v = vals[0]
  new = tuple(eqn.params['new_sizes'])
  if (v.form != PACKED or len(vals) != 1 or eqn.params.get('dimensions') is not None or not new
      or new[-1] != v.shape[-1]):
    return None
  return [_packed_out(v.array.reshape(new[:-1] + (k * new[-1],)), k)]


def _transpose(eqn, vals, k):
  (v,) = vals
  perm = tuple(eqn.params['permutation'])
  if v.form != PACKED or perm[-1] != len(perm) - 1:
    return None
  return [_packed_out(jnp.transpose(v.array, perm), k)]


# --- convolutions -------------------------------------------------------------------------------

# (impl of the convolutions of a program) set by `vmap(conv_impls=...)` while it interprets.
_CONV_CHOICE: Dict[str, Any] = {}


def conv_key(eqn, vals: List[Value]) -> str:
  """A convolution equation's identity for the measured choice: operand shapes, dtype, strides,
  padding, dilations, dimension numbers and group counts (the client count excluded)."""
  p = eqn.params
  dn = p['dimension_numbers']
  return '|'.join(str(x) for x in (
      vals[0].shape, vals[1].shape, vals[0].array.dtype, tuple(p['window_strides']),
      tuple(tuple(q) for q in p['padding']), tuple(p['lhs_dilation']), tuple(p['rhs_dilation']),
      (dn.lhs_spec, dn.rhs_spec, dn.out_spec), p['feature_group_count'], p['batch_group_count']))


def conv_case(eqn, vals: List[Value]) -> Optional[str]:
  """'feature' (the client axis goes into the feature groups: the forward convolution and its
  input gradient), 'batch' (into the batch groups: the kernel gradient) or None (not packable)."""
  p = eqn.params
  dn = p['dimension_numbers']
  lhs, rhs = vals
  out_last = len(dn.out_spec) - 1
  if dn.out_spec[1] != out_last or lhs.form == SHARED and rhs.form == SHARED:
    return None
  if (p['batch_group_count'] == 1 and dn.lhs_spec[1] == len(lhs.shape) - 1
      and lhs.form != SHARED and rhs.form != PACKED):
    return 'feature'
  if (p['batch_group_count'] == 1 and p['feature_group_count'] == 1
      and dn.lhs_spec[0] == len(lhs.shape) - 1 and dn.rhs_spec[0] == len(rhs.shape) - 1
      and lhs.form != SHARED and rhs.form != SHARED):
    return 'batch'
  return None


def _conv_grouped(eqn, vals, k, case):
  p = dict(eqn.params)
  lhs, rhs = vals
  if case == 'feature':
    o = p['dimension_numbers'].rhs_spec[0]
    w = jnp.moveaxis(stacked(rhs, k), 0, o)  # the client axis just before the output features
    w = w.reshape(w.shape[:o] + (k * w.shape[o + 1],) + w.shape[o + 2:])
    p['feature_group_count'] *= k
    out = eqn.primitive.bind(packed(lhs, k), w, **p)
  else:
    p['batch_group_count'] = k
    out = eqn.primitive.bind(packed(lhs, k), packed(rhs, k), **p)
  return _packed_out(out, k)


def _conv_loop(eqn, vals, k, case):
  """One dense convolution per client on its slice of the packed operands, concatenated."""
  lhs, rhs = vals
  x = packed(lhs, k)
  c = lhs.shape[-1]
  if case == 'feature':
    w = stacked(rhs, k)
    outs = [eqn.primitive.bind(x[..., i * c:(i + 1) * c], w[i], **eqn.params) for i in range(k)]
  else:
    g, co = packed(rhs, k), rhs.shape[-1]
    outs = [eqn.primitive.bind(x[..., i * c:(i + 1) * c], g[..., i * co:(i + 1) * co],
                               **eqn.params) for i in range(k)]
  return _packed_out(jnp.concatenate(outs, axis=-1), k)


_NHWC = (0, 3, 1, 2)  # an NHWC operand's (batch, feature, spatial...) axes in lax's spec order


def pallas_applies(eqn, vals: List[Value], case: str) -> bool:
  """True when ops/pallas_conv.py computes this packable equation: 2-D, NHWC activations, one
  group per client, no kernel dilation in a 'feature' equation (forward: strides; input gradient:
  lhs dilation, not both), stride-1 windows in a 'batch' one (kernel gradient: rhs dilation =
  the forward's strides), a dtype of pallas_conv.DTYPES for both operands and the result."""
  p = eqn.params
  dn = p['dimension_numbers']
  if (len(vals[0].shape) != 4 or jnp.dtype(vals[0].array.dtype).name not in pallas_conv.DTYPES
      or vals[0].array.dtype != vals[1].array.dtype or p['feature_group_count'] != 1
      or p['batch_group_count'] != 1 or tuple(dn.out_spec)[1] != 3
      or p.get('preferred_element_type') not in (None, vals[0].array.dtype)):
    return False  # (the kernel's output has its inputs' dtype)
  if case == 'feature':
    return (tuple(dn.lhs_spec) == _NHWC and tuple(p['rhs_dilation']) == (1, 1)
            and (tuple(p['window_strides']) == (1, 1) or tuple(p['lhs_dilation']) == (1, 1)))
  return (tuple(p['window_strides']) == (1, 1) and tuple(p['lhs_dilation']) == (1, 1)
          and dn.lhs_spec[0] == 3 and dn.rhs_spec[0] == 3)


def _conv_pallas(eqn, vals, k, case):
  """The equation by ops/pallas_conv.py on the packed operands (groups = clients), its operands
  and result moved to and from the kernel's NHWC / HWIO layout (for the equations of NHWC
  programs, identities but for the kernel's)."""
  p = eqn.params
  dn = p['dimension_numbers']
  lhs, rhs = vals
  pads = tuple(tuple(q) for q in p['padding'])
  if case == 'feature':
    x = jnp.transpose(packed(lhs, k), (dn.lhs_spec[0], dn.lhs_spec[2], dn.lhs_spec[3], 3))
    r = dn.rhs_spec  # each client's kernel to HWIO, the client axis before the output features
    w = jnp.transpose(stacked(rhs, k), (r[2] + 1, r[3] + 1, r[1] + 1, 0, r[0] + 1))
    w = w.reshape(w.shape[:3] + (k * w.shape[4],))
    out = pallas_conv.conv_general(x, w, k, tuple(p['window_strides']), pads,
                                   tuple(p['lhs_dilation']))
    where = (dn.out_spec[0], dn.out_spec[2], dn.out_spec[3], dn.out_spec[1])
  else:
    x = jnp.transpose(packed(lhs, k), (dn.lhs_spec[1], dn.lhs_spec[2], dn.lhs_spec[3], 3))
    g = jnp.transpose(packed(rhs, k), (dn.rhs_spec[1], dn.rhs_spec[2], dn.rhs_spec[3], 3))
    sizes = [eqn.outvars[0].aval.shape[a] for a in dn.out_spec[2:]]
    out = pallas_conv.weight_grad(x, g, k, tuple(p['rhs_dilation']), pads, tuple(sizes))
    where = (dn.out_spec[2], dn.out_spec[3], dn.out_spec[0], dn.out_spec[1])
  return _packed_out(jnp.transpose(out, tuple(int(a) for a in np.argsort(where))), k)


def candidates(eqn, vals: List[Value], case: str) -> Tuple[str, ...]:
  """The implementations `conv_impl='measured'` times for a packable equation: IMPLS, less
  'pallas' where it does not apply or does not compile natively (pallas_conv.available(): a GPU;
  elsewhere it would run interpreted, far slower, and must never be chosen)."""
  ok = pallas_conv.available() and pallas_applies(eqn, vals, case)
  return tuple(i for i in IMPLS if i != 'pallas' or ok)


def _conv(eqn, vals, k):
  case = conv_case(eqn, vals)
  if case is None:
    return None
  choose = _CONV_CHOICE.get('choose')
  impl = choose(eqn, vals, k, case) if choose else 'grouped'
  if impl == 'vmap':
    return None
  return [conv_impl_fn(impl)(eqn, vals, k, case)]


def choose_pallas(eqn, vals: List[Value], k: int, case: str) -> str:
  """conv_impl='pallas': the Pallas kernel for every equation it applies to, else 'grouped'."""
  del k
  return 'pallas' if pallas_applies(eqn, vals, case) else 'grouped'


def conv_impl_fn(impl: str) -> Callable:
  """The evaluator of a packable convolution equation under `impl` (one of IMPLS); for timing."""
  if impl not in IMPLS:
    raise ValueError(f'impl={impl!r}; allowed: {IMPLS}')
  if impl == 'vmap':
    return lambda eqn, vals, k, case: _fallback(eqn, vals, k)[0]
  return {'grouped': _conv_grouped, 'loop': _conv_loop, 'pallas': _conv_pallas}[impl]


_RULES = {'broadcast_in_dim': _broadcast_in_dim, 'reshape': _reshape, 'transpose': _transpose,
          'conv_general_dilated': _conv}
_RULES.update({name: _reduction for name in _REDUCTIONS})
_RULES.update({name: _elementwise for name in _ELEMENTWISE})


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Value], k: int) -> List[Value]:
  """Evaluates `jaxpr` on Values of K clients (module docstring), inlining calls."""
  env: Dict[Any, Value] = {}

  def read(var):
    if isinstance(var, jax_core.Literal):
      return Value(var.val, SHARED, jnp.shape(var.val))
    return env[var]

  for var, c in zip(jaxpr.constvars, consts):
    env[var] = Value(c, SHARED, jnp.shape(c))
  for var, a in zip(jaxpr.invars, args):
    env[var] = a
  for eqn in jaxpr.eqns:
    vals = [read(v) for v in eqn.invars]
    if all(v.form == SHARED for v in vals):
      outs = eqn.primitive.bind(*[v.array for v in vals], **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
      outs = [Value(o, SHARED, jnp.shape(o)) for o in outs]
    else:
      sub = _sub_jaxpr(eqn)
      if sub is not None:
        outs = eval_jaxpr(sub.jaxpr, sub.consts, vals, k)
      else:
        rule = _RULES.get(eqn.primitive.name)
        outs = rule(eqn, vals, k) if rule else None
        if outs is None:
          outs = _fallback(eqn, vals, k)
    for var, v in zip(eqn.outvars, outs):
      if not isinstance(var, jax_core.DropVar):
        env[var] = v
  return [read(v) for v in jaxpr.outvars]


def vmap(fn: Callable, in_axes: Any = 0, *, choose: Optional[Callable] = None) -> Callable:
  """`jax.vmap(fn, in_axes)` (in_axes: a prefix tree of 0 / None, out_axes 0), evaluated in the
  client-packed layout when fn's jaxpr has a packed convolution (PACKED_CONV or MEASURED_CONV),
  else jax.vmap.

  choose: (eqn, vals, k, case) -> one of IMPLS, per packable convolution; None: the measured
    choice (core/conv_choice.py) with a MEASURED_CONV in the program, else 'grouped' everywhere.
  """
  def run(*args):
    axes = _tree_util.broadcast_prefix(in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args),
                                       args, is_leaf=lambda x: x is None)
    flat, tree = jax.tree_util.tree_flatten(args)
    if len(axes) != len(flat):
      raise ValueError(f'in_axes={in_axes!r} does not match the arguments')
    if any(a not in (0, None) for a in axes):
      raise ValueError(f'in_axes={in_axes!r}; allowed entries: 0 or None')
    sizes = {jnp.shape(x)[0] for x, a in zip(flat, axes) if a == 0}
    if len(sizes) != 1:
      raise ValueError(f'the batched arguments have leading sizes {sorted(sizes)}; need one size')
    (k,) = sizes
    one = [jax.ShapeDtypeStruct(jnp.shape(x)[1:] if a == 0 else jnp.shape(x), jnp.result_type(x))
           for x, a in zip(flat, axes)]
    closed, out_shape = jax.make_jaxpr(
        lambda *f: fn(*jax.tree_util.tree_unflatten(tree, f)), return_shape=True)(*one)
    out_tree = jax.tree_util.tree_structure(out_shape)
    measured = has_call(closed, MEASURED_CONV)
    pallas = not measured and has_call(closed, PALLAS_CONV)
    if not measured and not pallas and not has_call(closed, PACKED_CONV):
      # jax.vmap of the jaxpr just traced, not of fn: fn is traced in Python once either way.
      outs = jax.vmap(jax_core.jaxpr_as_fun(closed), in_axes=list(axes), axis_size=k)(*flat)
      return jax.tree_util.tree_unflatten(out_tree, outs)
    if measured and choose is None:
      from fedjax_ssl.core import conv_choice  # pylint: disable=g-import-not-at-top (it imports this)
      chooser = conv_choice.choose
    elif pallas and choose is None:
      chooser = choose_pallas
    else:
      chooser = choose
    vals = [Value(x, STACKED if a == 0 else SHARED, o.shape) for x, a, o in zip(flat, axes, one)]
    previous = _CONV_CHOICE.get('choose')
    _CONV_CHOICE['choose'] = chooser
    try:
      outs = eval_jaxpr(closed.jaxpr, closed.consts, vals, k)
    finally:
      _CONV_CHOICE['choose'] = previous
    return jax.tree_util.tree_unflatten(out_tree, [stacked(v, k) for v in outs])
  return run
