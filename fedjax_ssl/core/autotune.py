"""`strategy='auto'`: the execution strategy of a round, chosen by timing the candidates once.

Which strategy is fastest depends on the backend, the model, the shapes and the precision, and no
rule got it right: on an H200 `vmap` was slower than `map` in float32 on ResNet-18 and faster in
bfloat16 (docs/notes/performance.md#perf-45). So the first time a program is seen (the
`key`: backend, device kind, jax version and every config value that shapes the round), each
candidate (strategy, chunk size) runs a warm-up round (its compile) and `TIMED_ROUNDS` timed rounds
on a copy of the run's initial state, and the fastest (least median seconds) is kept in
CACHE_DIR/strategy.json beside the compilation cache; later runs of the same key read it and time
nothing. The run's own round step is the winner's, already compiled.

Strategies compute the same function but agree only to float rounding, so a run records its
resolved strategy in its workdir and a resume uses that one, whatever the cache says
(`fedjax_ssl.runs.training`: WORKDIR/strategy.json).

On a CPU there is one candidate, `map` with chunk 1, so nothing is timed: every CPU measurement
so far found `vmap` slower, in its rounds and its compile (docs/notes/performance.md#perf-2,
#perf-47), and timing it made the quickstart much longer. FEDJAX_SSL_AUTOTUNE overrides the candidates: '0' (or off / false / no) resolves 'auto'
to the static per-backend default (`strategies.default_strategy`) without timing anything; a list
such as 'map1,vmap,map4' times those (strategy name with its chunk size; 'vmap' alone).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax

from fedjax_ssl import files
from fedjax_ssl.core import compilation, strategies

ENV_VAR = 'FEDJAX_SSL_AUTOTUNE'
FILE = 'strategy.json'
TIMED_ROUNDS = 2
VERSION = 1  # of the file's entries; an entry of another version is measured again

Candidate = Tuple[str, int]  # (strategy, map_chunk_size)


@dataclasses.dataclass(frozen=True)
class Choice:
  """A resolved strategy and where it came from.

  source: 'config' (not 'auto'), 'measured', 'cache' (CACHE_DIR/strategy.json), 'workdir' (the
    run being resumed), 'static' (auto without timing: one candidate, FEDJAX_SSL_AUTOTUNE=0 or no
    cache folder).
  seconds: {candidate label: median seconds per round} of the measurement ({} if none), and
    errors: {label: why it could not run} (e.g. out of memory).
  """
  strategy: str
  map_chunk_size: int
  source: str
  seconds: Dict[str, float] = dataclasses.field(default_factory=dict)
  errors: Dict[str, str] = dataclasses.field(default_factory=dict)
  compile_seconds: Dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def label(self) -> str:
    return label(self.strategy, self.map_chunk_size)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict, source: Optional[str] = None) -> 'Choice':
    fields = {f.name for f in dataclasses.fields(cls)}
    c = cls(**{k: v for k, v in d.items() if k in fields})
    return dataclasses.replace(c, source=source) if source else c

  def text(self) -> str:
    what = f'strategy {self.strategy!r}' + (f' (chunk {self.map_chunk_size})'
                                             if self.strategy != 'vmap' else '')
    if self.source == 'measured':
      times = ', '.join(f'{k} {v:.3f}s' for k, v in sorted(self.seconds.items(),
                                                          key=lambda kv: kv[1]))
      failed = ''.join(f'; {k} failed: {v}' for k, v in self.errors.items())
      return f'{what}, the fastest by measurement (s/round: {times}{failed})'
    return what + {'config': ' (config)', 'cache': ', measured earlier (strategy cache)',
                   'workdir': ', as the run being resumed', 'static': ' (auto: the default of '
                   'this backend, nothing to measure)'}[self.source]


def label(strategy: str, chunk: int) -> str:
  return strategy if strategy == 'vmap' else f'{strategy}{chunk}'


def enabled() -> bool:
  """False when FEDJAX_SSL_AUTOTUNE is 0 / false / off / no."""
  return os.environ.get(ENV_VAR, '1').strip().lower() not in ('0', 'false', 'off', 'no')


def parse_candidates(text: str) -> List[Candidate]:
  """'map1,vmap,map4' -> [('map', 1), ('vmap', 1), ('map', 4)]; ValueError naming a bad entry."""
  out = []
  for item in (t.strip() for t in text.split(',') if t.strip()):
    if item == 'vmap':
      out.append(('vmap', 1))
    elif item.startswith('map') and item[3:].isdigit() and int(item[3:]) >= 1:
      out.append(('map', int(item[3:])))
    else:
      raise ValueError(f"{ENV_VAR} = {text!r} is invalid: {item!r} is not 'vmap' or 'map<chunk>' "
                       "with a chunk >= 1 (e.g. 'map1,vmap,map4'), nor 0 / 1")
  return out


def _explicit_candidates() -> Optional[List[Candidate]]:
  """The candidates FEDJAX_SSL_AUTOTUNE lists, None when it does not list any."""
  value = os.environ.get(ENV_VAR, '1').strip().lower()
  if value in ('', '1', 'true', 'on', 'yes', '0', 'false', 'off', 'no'):
    return None
  return parse_candidates(value)


def check_environment() -> None:
  """Raises ValueError (one line) when FEDJAX_SSL_AUTOTUNE is not 0 / 1 or a candidate list."""
  _explicit_candidates()


def candidates(backend: str, participants: int) -> List[Candidate]:
  """The (strategy, chunk) pairs worth timing for `participants` clients a round.

  On an accelerator: 'map' with chunk 1 (clients one after another in one program), 'vmap' (one
  fused program) and a chunked 'map' of about half the participants (vmap inside lax.map: fuller
  kernels than chunk 1, less memory and smaller grouped convolutions than vmap). On a CPU: 'map'
  with chunk 1 alone (module docstring). FEDJAX_SSL_AUTOTUNE='map1,vmap,...' replaces them. Chunks
  above the participants are dropped; 'shard' needs several devices and is never picked by 'auto'.
  """
  explicit = _explicit_candidates()
  if explicit is not None:
    out = explicit
  elif backend == 'cpu':
    out = [('map', 1)]
  else:
    out = [('map', 1), ('vmap', 1), ('map', (participants + 1) // 2)]
  unique: List[Candidate] = []
  for strategy, chunk in out:
    if strategy == 'vmap' and participants < 2:
      continue  # one participant: vmap is map
    if strategy == 'map' and (chunk > participants or (chunk == participants and chunk > 1)):
      continue  # a chunk of every participant is vmap
    if (strategy, chunk) not in unique:
      unique.append((strategy, chunk))
  return unique or [('map', 1)]


class StrategyCache:
  """CACHE_DIR/strategy.json: {key: Choice as json}. Unreadable: a warning, treated as empty."""

  def __init__(self, cache_dir: pathlib.Path):
    self.path = pathlib.Path(cache_dir) / FILE

  def _read(self) -> Dict[str, dict]:
    if not self.path.exists():
      return {}
    try:
      data = json.loads(self.path.read_text())
      if not isinstance(data, dict):
        raise ValueError('not a JSON object')
      return data
    except (OSError, ValueError) as e:
      logging.warning('strategy cache %s cannot be read (%s): ignored, measuring again',
                      self.path, e)
      return {}

  def get(self, key: str) -> Optional[Choice]:
    entry = self._read().get(key)
    if not isinstance(entry, dict) or entry.get('version') != VERSION:
      return None
    try:
      return Choice.from_json(entry['choice'], source='cache')
    except (KeyError, TypeError) as e:
      logging.warning('strategy cache %s: entry %s unreadable (%s): measuring again', self.path,
                      key, e)
      return None

  def put(self, key: str, choice: Choice, description: dict) -> None:
    data = self._read()
    data[key] = {'version': VERSION, 'choice': choice.to_json(), 'program': description,
                 'measured_at': time.strftime('%Y-%m-%dT%H:%M:%S')}
    self.path.parent.mkdir(parents=True, exist_ok=True)
    files.write_json(self.path, data, indent=1)


def measure(make_step: Callable[[str, int], Callable], fresh_state: Callable[[], Any],
            fed_data: Any, keys: Sequence[jax.Array], cands: Sequence[Candidate]
            ) -> Tuple[Choice, Dict[str, Callable]]:
  """Times every candidate: a warm-up round (its compile), then a round per entry of keys[1:].

  make_step(strategy, chunk) -> round step; fresh_state() -> a new initial FedState (each call its
  own buffers: the step donates them). Returns (the fastest as a 'measured' Choice, {label: its
  compiled step}) — the caller keeps the winner's step. A candidate that raises (e.g. out of
  memory) is recorded in Choice.errors; if all raise, the first error is raised.
  """
  seconds, errors, compile_s, steps, first_error = {}, {}, {}, {}, None
  for strategy, chunk in cands:
    name = label(strategy, chunk)
    try:
      step = make_step(strategy, chunk)
      state = fresh_state()
      with compilation.compile_timer() as times:
        state, _ = step(state, fed_data, keys[0])
        jax.block_until_ready(state)
      compile_s[name] = times.total
      per_round = []
      for key in keys[1:]:
        t0 = time.perf_counter()
        state, _ = step(state, fed_data, key)
        jax.block_until_ready(state)
        per_round.append(time.perf_counter() - t0)
      seconds[name] = statistics.median(per_round)
      steps[name] = step
      del state
    except Exception as e:  # pylint: disable=broad-except
      first_error = first_error or e
      errors[name] = f'{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ""}'
      logging.warning('strategy candidate %s failed: %s', name, errors[name])
  if not seconds:
    raise first_error
  best = min(seconds, key=seconds.get)
  strategy, chunk = next((s, c) for s, c in cands if label(s, c) == best)
  return Choice(strategy, chunk, 'measured', seconds, errors, compile_s), steps


def program_description(**fields) -> dict:
  """What identifies a program for the strategy cache: the caller's fields (the config values that
  shape the round, the data's shapes) plus the backend, device kind and count and jax version."""
  device = jax.devices()[0]
  return dict(fields, backend=jax.default_backend(), device_kind=device.device_kind,
              device_count=jax.device_count(), jax=jax.__version__)


def cache_key(description: dict) -> str:
  return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()
                        ).hexdigest()[:24]


def resolve(requested: str, chunk: int, *, participants: int, description: dict,
            cache_dir: Optional[pathlib.Path], stored: Optional[dict],
            make_step: Callable[[str, int], Callable], fresh_state: Callable[[], Any],
            fed_data: Any, keys: Sequence[jax.Array]) -> Tuple[Choice, Optional[Callable]]:
  """The strategy a run uses, and its compiled round step when one was built on the way.

  Args:
    requested, chunk: config.strategy and config.map_chunk_size.
    participants: clients per round (the candidates' chunk sizes).
    description: `program_description(...)` of the run's round (the cache key's content).
    cache_dir: the cache folder (None: off, so 'auto' is the static default).
    stored: the Choice json a run being resumed recorded (its strategy is kept), else None.
    make_step, fresh_state, fed_data, keys: as `measure` (keys: 1 + TIMED_ROUNDS round keys).
  Returns:
    (Choice, the winner's step or None: the caller builds it with make_step).
  """
  if requested != 'auto':
    return Choice(strategies.resolve_strategy(requested), chunk, 'config'), None
  if stored is not None:
    return Choice.from_json(stored, source='workdir'), None
  cands = candidates(jax.default_backend(), participants) if enabled() else []
  if len(cands) == 1 and _explicit_candidates() is not None:  # the user's one candidate
    return Choice(*cands[0], 'static'), None
  if cache_dir is None or len(cands) < 2:
    return Choice(strategies.default_strategy(), chunk, 'static'), None
  cache = StrategyCache(cache_dir)
  key = cache_key(dict(description, candidates=[label(*c) for c in cands]))
  cached = cache.get(key)
  if cached is not None:
    return cached, None
  choice, steps = measure(make_step, fresh_state, fed_data, keys, cands)
  try:
    cache.put(key, choice, description)
  except OSError as e:
    logging.warning('strategy cache %s cannot be written (%s): the choice is not kept',
                    cache.path, e)
  return choice, steps[choice.label]
