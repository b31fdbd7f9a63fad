"""The round step serialised (`jax.export`) into the cache folder: a second run loads it untraced.

A cache hit of JAX's persistent compilation cache still traces the round in Python and lowers it
(the Flax modules, autodiff, vmap): on a GPU that trace was most of a second run's compile
(docs/notes/performance.md#perf-50, #perf-52). So the first call of an `ExportedStep` exports the
round step (`jax.export`: trace and lower once) into

  CACHE_DIR/exports/<key>.jaxexport

and every later process of the same program deserialises that file and compiles the StableHLO it
holds (from the persistent cache, CACHE_DIR/xla, after the first time): nothing is traced but a
one-call wrapper. The run's rounds always run the exported program, written or loaded, so a run
that wrote the file and one that read it compute bit-identical rounds
(docs/notes/performance.md#perf-60).

The key (`identity`) is everything that shapes the program: the config's values less the host-only
ones (`run_identity.export_keys`), the resolved strategy and chunk, the pytree structure, shapes,
dtypes and shardings of the round's inputs, jax and jaxlib versions, the jax settings that change
a trace (x64, matmul precision, PRNG), the backend, its device kind and count, and a digest of the
package's source files and of the files that define the configured algorithm and objective (a
researcher's own module included; a module that one imports is not followed). The file stores
the identity in full, checked on load, and a digest of the serialised program, checked before it
is deserialised: a changed program is never served a stale export, and a damaged file is exported
again with a one-line warning. A cache folder that cannot be read is ignored with a warning. Code
patched at run time (a test's monkeypatch of the round) is not in the key: set
FEDJAX_SSL_EXPORT=0 there.

Exported: the single-process round of `client_state='device'` with 'map' or 'vmap' (the default).
'host' client state (host-side gather and scatter), 'shard' and several processes trace as before
(`status` says why). FEDJAX_SSL_EXPORT=0 turns the export off. The exported call keeps the round's
donation of the state (`jax.jit(exported.call, donate_argnums=0)`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import os
import pathlib
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import jax

from fedjax_ssl import files

ENV_VAR = 'FEDJAX_SSL_EXPORT'
SUBDIR = 'exports'
SUFFIX = '.jaxexport'
MAGIC = b'fedjax_ssl export 1\n'  # a file of another format is damaged, not misread
# jax.export refuses custom calls whose format it does not promise to keep, among them the Triton
# kernels of conv_impl='pallas' (ops/pallas_conv.py). An export here is loaded only by the same jax
# and jaxlib on the same backend and device kind (both in its key), so that promise is not needed.
DISABLED_CHECKS = (jax.export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton'),)
_PACKAGE = pathlib.Path(__file__).resolve().parents[1]  # fedjax_ssl/


class DamagedExport(ValueError):
  """An export file that is not what its name promises (one line: the file and why)."""


class NotExportable(Exception):
  """The round cannot be exported (one line: why); it is traced as usual."""


def enabled() -> bool:
  """False when FEDJAX_SSL_EXPORT is 0 / false / off / no."""
  return os.environ.get(ENV_VAR, '1').strip().lower() not in ('0', 'false', 'off', 'no')


def _callables(obj: Any) -> Iterable[Callable]:
  """The functions `obj` is or holds as dataclass / NamedTuple fields, partials unwrapped."""
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
  elif isinstance(obj, tuple) and hasattr(obj, '_fields'):
    values = list(obj)
  else:
    values = [obj]
  for v in values:
    while isinstance(v, functools.partial):
      v = v.func
    if callable(v) and not isinstance(v, type):
      yield v


def source_files(*objs: Any) -> List[pathlib.Path]:
  """Every .py file of the fedjax_ssl package, plus the files defining the functions of `objs`
  (the algorithm, its registry entries: a researcher's own module lives outside the package)."""
  out = set(_PACKAGE.rglob('*.py'))
  for obj in objs:
    for fn in _callables(obj):
      try:
        path = inspect.getsourcefile(fn)
      except TypeError:  # a builtin: no source to change
        continue
      if path:
        out.add(pathlib.Path(path).resolve())
  return sorted(out)


def source_digest(paths: Sequence[pathlib.Path]) -> str:
  """sha256 over the paths and contents of `paths` (any edit of one gives another digest)."""
  h = hashlib.sha256()
  for p in paths:
    h.update(str(p).encode())
    try:
      h.update(p.read_bytes())
    except OSError:  # vanished since listed: its absence is part of the digest
      h.update(b'<unreadable>')
  return h.hexdigest()


# jax settings that change what a trace produces (dtypes, matmul precision, random bits) without
# changing the config or the source.
_TRACE_SETTINGS = ('jax_enable_x64', 'jax_default_matmul_precision', 'jax_default_prng_impl',
                   'jax_threefry_partitionable')


def _leaf_signature(a: Any) -> list:
  """[shape, dtype, sharding] of one input leaf."""
  sharding = getattr(a, 'sharding', None)
  return [list(a.shape), str(a.dtype), str(sharding) if sharding is not None else None]


def identity(program: Dict[str, Any], args: Sequence[Any], sources: str) -> Dict[str, Any]:
  """The full key of a round program (module docstring): `program` (config values and resolved
  strategy), the inputs' tree and per-leaf [shape, dtype, sharding], versions, trace settings,
  backend, sources."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  leaves, tree = jax.tree_util.tree_flatten(tuple(args))
  device = jax.devices()[0]
  return {'program': program, 'tree': str(tree), 'leaves': [_leaf_signature(a) for a in leaves],
          'jax': jax.__version__, 'jaxlib': jaxlib.__version__, 'backend': jax.default_backend(),
          'device_kind': device.device_kind, 'device_count': jax.device_count(),
          'process_count': jax.process_count(), 'sources': sources,
          'settings': {k: str(getattr(jax.config, k, None)) for k in _TRACE_SETTINGS}}


def key_of(ident: Dict[str, Any]) -> str:
  """The file name stem of an identity: sha256 of its canonical JSON."""
  return hashlib.sha256(_canonical(ident)).hexdigest()[:32]


def _canonical(ident: Dict[str, Any]) -> bytes:
  return json.dumps(ident, sort_keys=True, default=str).encode()


def encode(ident: Dict[str, Any], payload: bytes) -> bytes:
  """The file: MAGIC, the identity's JSON line, the payload's sha256 line, the payload."""
  return (MAGIC + _canonical(ident) + b'\n' + hashlib.sha256(payload).hexdigest().encode() + b'\n'
          + payload)


def decode(blob: bytes, ident: Dict[str, Any], path: os.PathLike | str) -> bytes:
  """The serialised Exported of a file written by `encode` for `ident`; DamagedExport (one line
  naming the file) when the header, the identity or the payload's digest does not match."""
  if not blob.startswith(MAGIC):
    raise DamagedExport(f'export {path} is damaged: it does not start with {MAGIC!r}')
  parts = blob[len(MAGIC):].split(b'\n', 2)
  if len(parts) != 3:
    raise DamagedExport(f'export {path} is damaged: its header is cut short')
  stored, digest, payload = parts
  if stored != _canonical(ident):
    raise DamagedExport(f'export {path} is damaged: its stored identity is not its name\'s')
  if hashlib.sha256(payload).hexdigest().encode() != digest:
    raise DamagedExport(f'export {path} is damaged: the program\'s sha256 does not match '
                        f'({len(payload)} bytes)')
  return payload


def _flat_step(step: Callable, state_tree, data_tree) -> Callable:
  """step(state, data, key) as fn(state_leaves, data_leaves, key) -> (new state leaves, metrics):
  only built-in containers cross the export (the FedState / FedData dataclasses, optax NamedTuples
  and Flax modules' trees would each need a registered serialisation)."""
  def fn(state_leaves, data_leaves, key):
    state = jax.tree_util.tree_unflatten(state_tree, state_leaves)
    data = jax.tree_util.tree_unflatten(data_tree, data_leaves)
    new_state, metrics = step(state, data, key)
    if jax.tree_util.tree_structure(new_state) != state_tree:
      raise NotExportable('the round returns a state of another structure than its input')
    return jax.tree_util.tree_leaves(new_state), metrics
  return fn


class ExportedStep:
  """A round step `step(state, data, key) -> (state, metrics)` that runs as an exported program.

  The first call loads CACHE_DIR/exports/<key>.jaxexport, or exports `step` there (module
  docstring); `status` is then 'loaded', 'written' or 'off: <why>' (the round traced as usual).
  The state is donated, as by `step`.
  """

  def __init__(self, step: Callable, cache_dir: Optional[os.PathLike | str],
               program: Dict[str, Any], sources: Sequence[pathlib.Path], *, donate: bool = True):
    self._step = step
    self._dir = pathlib.Path(cache_dir) / SUBDIR if cache_dir is not None else None
    self._program = program
    self._sources = sources
    self._donate = donate
    self._call: Optional[Callable] = None
    self._trees = None
    self.status = 'off: not called yet'
    self.path: Optional[pathlib.Path] = None
    self.seconds = 0.0  # reading or writing the file, digests included

  def __call__(self, state, data, key):
    if self._call is None:
      self._call = self._prepare(state, data, key)
    if self._trees is None:
      return self._call(state, data, key)
    state_tree, _ = self._trees
    leaves, metrics = self._call(jax.tree_util.tree_leaves(state),
                                 jax.tree_util.tree_leaves(data), key)
    return jax.tree_util.tree_unflatten(state_tree, leaves), metrics

  def _off(self, why: str) -> Callable:
    self.status = f'off: {why}'
    logging.info('round step not exported (%s): traced as usual', why)
    return self._step

  def _prepare(self, state, data, key) -> Callable:
    """The callable of every call: the loaded or written export, or `step` (status 'off')."""
    if self._dir is None:
      return self._off('no cache folder')
    if not enabled():
      return self._off(f'{ENV_VAR}=0')
    t0 = time.perf_counter()
    state_leaves, state_tree = jax.tree_util.tree_flatten(state)
    data_leaves, data_tree = jax.tree_util.tree_flatten(data)
    args = (state_leaves, data_leaves, key)
    ident = identity(self._program, args, source_digest(self._sources))
    self.path = self._dir / (key_of(ident) + SUFFIX)
    exported = self._read(ident)
    if exported is None:
      self.seconds += time.perf_counter() - t0
      try:
        exported = self._export(state_tree, data_tree, args, ident)
      except NotExportable as e:
        return self._off(str(e))
      except Exception as e:  # pylint: disable=broad-except  (e.g. a host callback in the round)
        first = str(e).splitlines()[0][:200] if str(e) else ''
        logging.warning('round step cannot be exported (%s: %s): traced as usual',
                        type(e).__name__, first)
        return self._off(f'{type(e).__name__}: {first}')
      self.status = 'written'
    else:
      self.seconds += time.perf_counter() - t0
      self.status = 'loaded'
    self._trees = (state_tree, data_tree)
    return jax.jit(exported.call, donate_argnums=(0,) if self._donate else ())

  def _read(self, ident: Dict[str, Any]):
    """The Exported stored for `ident`, or None: absent, unreadable or damaged (with a warning)."""
    try:
      blob = self.path.read_bytes()
    except FileNotFoundError:
      return None
    except OSError as e:
      logging.warning('export cache %s cannot be read (%s): ignored, tracing the round',
                      self.path, e.strerror or e)
      return None
    try:
      payload = decode(blob, ident, self.path)
      return jax.export.deserialize(bytearray(payload))
    except DamagedExport as e:
      logging.warning('%s: exporting it again', e)
    except Exception as e:  # pylint: disable=broad-except  (a payload jax cannot read)
      logging.warning('export %s is damaged (%s: %s): exporting it again', self.path,
                      type(e).__name__, str(e).splitlines()[0][:200] if str(e) else '')
    return None

  def _export(self, state_tree, data_tree, args, ident: Dict[str, Any]):
    """Exports the flat round (trace and lower), writes it (a write failure: a warning), and
    returns it deserialised, so this run runs the very program a later run will load."""
    fn = jax.jit(_flat_step(self._step, state_tree, data_tree),
                 donate_argnums=(0,) if self._donate else ())
    abstract = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, 'sharding', None)),
        args)
    payload = bytes(jax.export.export(fn, disabled_checks=DISABLED_CHECKS)(*abstract).serialize())
    t0 = time.perf_counter()
    try:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      files.write_bytes(self.path, encode(ident, payload))
    except OSError as e:
      logging.warning('export %s cannot be written (%s): the next run traces again', self.path,
                      e.strerror or e)
    self.seconds += time.perf_counter() - t0
    return jax.export.deserialize(bytearray(payload))
