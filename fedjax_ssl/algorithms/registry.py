"""The algorithm registry: a name -> how to configure, check and build an algorithm.

Each algorithm module registers itself on import; a researcher's own file does the same (see
`configs/examples/custom_algorithm.py`), and the binaries then run it like a built-in one:

  registry.register('fedprox_simclr', build, defaults=block, validate=check, methods=('simclr',))

`build(config, info) -> core.Algorithm` gets the whole config and the `DataInfo` of the loaded data.
`defaults() -> ConfigDict` is the algorithm's config block, `config.<name>` (every registered name has
one, possibly empty, in `experiment.default_config()`); an unknown key in it is refused with the valid
keys listed. `validate(config, dataset_info)` raises `ConfigError` for bad values of its own keys and
for cross-key rules of the algorithm; `dataset_info` is the `data.info.DatasetInfo` known before
loading, or None. The runner knows algorithms only through this registry: it never compares
`config.algorithm` with a name.

Which objectives (`config.ssl_method`, `fedjax_ssl.ssl`) an algorithm accepts: `needs` names the
capabilities it requires of one (a 'projector', a 'predictor', a momentum 'target'), so a
researcher's own objective runs under every algorithm it fits; `methods` names the objectives an
algorithm is tied to (FedSC's correlation matrices, FedCA's dictionary of NT-Xent), or None.

`build` also puts the configured server optimizer (`config.server_optimizer`, core/server_opt.py) on
the algorithm's global model; an entry registered with `global_model=False` (personalised methods)
refuses any other than plain aggregation.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl import ssl
from fedjax_ssl.core import fedbuff, server_opt
from fedjax_ssl.ops import dp_fedavg


class Plan(NamedTuple):
  """What a run will spend, known before training (FedSC: its privacy budget).

  Attributes:
    key: where the summary goes in results.json (e.g. 'privacy').
    summary: JSON-able numbers of the plan.
    text: one line for the person starting the run.
    final_metrics: keys of the final metrics (`host_metrics`) copied next to the summary.
  """
  key: str
  summary: Dict[str, Any]
  text: str
  final_metrics: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Entry:
  """One registered algorithm.

  Attributes:
    name: the value of `config.algorithm` and of its config block's key.
    build: (config, DataInfo) -> Algorithm.
    defaults: () -> ConfigDict, the config block `config.<name>` with its defaults.
    validate: (config, DatasetInfo | None) -> None, raising ConfigError; None = nothing to check
      beyond the block's keys and `methods`.
    methods: the `config.ssl_method` values the algorithm accepts, or None: any registered
      objective with the capabilities `needs`.
    needs: capabilities (`ssl.CAPABILITIES`) the algorithm requires of the objective.
    exclusive: keys of the block that only mean something with this algorithm: another algorithm
      refuses them at a non-default value (e.g. Hetero-SSFL's architecture mix).
    encoders: config -> [(config key, encoder name)], the encoders the run builds (default:
      `config.encoder`), checked against the image shape before any compute.
    doc: one line for listings and errors.
    methods_note: why `methods` is what it is, appended to the error for another ssl_method.
    plan: (config, DataInfo) -> Plan | None, what the run will spend (None: nothing to plan).
    global_model: the server keeps a global model (the built Algorithm declares `global_model`),
      so `config.server_optimizer` applies; False refuses a server optimizer.
    aggregates: the server combines the participants' uploads, so a failed or dropped upload can
      be left out of it (core/faults.py); False (independent training, one centralized client)
      refuses the dropout and fault-injection knobs.
    dp: the aggregate is a weighted mean of EVERY upload and the built Algorithm declares
      `update_reference`, so user-level DP-FedAvg (`config.dp`, ops/dp_fedavg.py) applies.
    dp_refusal: why `config.dp` is refused when `dp` is False (one clause for the error).
  """
  name: str
  build: Callable[[ml_collections.ConfigDict, Any], Any]
  defaults: Callable[[], ml_collections.ConfigDict]
  validate: Optional[Callable[[ml_collections.ConfigDict, Any], None]] = None
  methods: Optional[Tuple[str, ...]] = None
  needs: Tuple[str, ...] = ()
  exclusive: Tuple[str, ...] = ()
  encoders: Optional[Callable[[ml_collections.ConfigDict], Sequence[Tuple[str, str]]]] = None
  doc: str = ''
  methods_note: str = ''
  plan: Optional[Callable[[ml_collections.ConfigDict, Any], Optional[Plan]]] = None
  global_model: bool = True
  aggregates: bool = True
  dp: bool = False
  dp_refusal: str = ''


_REGISTRY: Dict[str, Entry] = {}


def _empty_block() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict()


def _origin(fn: Callable) -> Tuple[str, str]:
  code = getattr(fn, '__code__', None)
  # The same file may be executed under a relative path (absl's config flag) and an absolute one
  # (an import): compare resolved paths.
  return (getattr(fn, '__qualname__', repr(fn)), os.path.realpath(code.co_filename) if code else '')


def register(name: str, build: Callable, *, defaults: Optional[Callable] = None,
             validate: Optional[Callable] = None, methods: Optional[Sequence[str]] = None,
             needs: Sequence[str] = (),
             exclusive: Sequence[str] = (), encoders: Optional[Callable] = None,
             doc: str = '', methods_note: str = '', plan: Optional[Callable] = None,
             global_model: bool = True, aggregates: bool = True, dp: bool = False,
             dp_refusal: str = '') -> Entry:
  """Adds algorithm `name` (see `Entry` for the arguments) and returns its entry.

  Registering a name again is allowed only from the same `build` function (a config file that is
  executed twice, e.g. by absl's config flag and by an import); another `build` under a taken name
  raises ValueError.
  """
  if not name.isidentifier():
    raise ValueError(f'algorithm name {name!r} is invalid: must be a Python identifier (it is the '
                     'key of its config block, config.<name>)')
  if methods is not None and (not methods or any(m not in ssl.names() for m in methods)):
    raise ValueError(f'methods = {tuple(methods)!r} of algorithm {name!r} is invalid: must be None '
                     f'or a non-empty subset of the registered objectives {ssl.names()}')
  if any(n not in ssl.CAPABILITIES for n in needs):
    raise ValueError(f'needs = {tuple(needs)!r} of algorithm {name!r} is invalid: each must be one '
                     f'of {ssl.CAPABILITIES}')
  old = _REGISTRY.get(name)
  if old is not None and _origin(old.build) != _origin(build):
    raise ValueError(f'algorithm {name!r} is already registered (build {_origin(old.build)[0]} in '
                     f'{_origin(old.build)[1]}); choose another name')
  entry = Entry(name=name, build=build, defaults=defaults or _empty_block, validate=validate,
                methods=None if methods is None else tuple(methods), needs=tuple(needs),
                exclusive=tuple(exclusive), encoders=encoders, doc=doc,
                methods_note=methods_note, plan=plan, global_model=global_model,
                aggregates=aggregates, dp=dp, dp_refusal=dp_refusal)
  _REGISTRY[name] = entry
  return entry


def names() -> Tuple[str, ...]:
  """The registered algorithm names, in registration order."""
  return tuple(_REGISTRY)


def get(name: str) -> Entry:
  """The entry of `name`; ConfigError naming the registered algorithms if there is none."""
  if name not in _REGISTRY:
    cv.check_choice('algorithm', name, names())
  return _REGISTRY[name]


def validate(config: ml_collections.ConfigDict, dataset_info: Any = None) -> None:
  """The algorithm's own checks: its block's keys, `ssl_method`, its validator, and no other
  algorithm's exclusive keys set."""
  entry = get(config.algorithm)
  cv.check_known_keys(config[entry.name], entry.defaults(), prefix=f'config.{entry.name}')
  check_objective(entry, config.ssl_method)
  for other in _REGISTRY.values():
    if other.name == entry.name or other.name not in config:
      continue
    defaults = other.defaults()
    for key in other.exclusive:
      if config[other.name][key] != defaults[key]:
        raise cv.ConfigError(f'config.{other.name}.{key} = {config[other.name][key]!r} is invalid '
                             f'with algorithm {entry.name!r}: only algorithm {other.name!r} reads '
                             'it' + (f' ({other.doc})' if other.doc else ''))
  if not entry.global_model and server_optimizer(config) is not None:
    raise cv.ConfigError(f'config.server_optimizer = {config.server_optimizer!r} (server_lr = '
                         f'{config.server_lr}) is invalid for algorithm {entry.name!r}: it keeps '
                         "no global model to step; use 'sgd' with server_lr = 1.0")
  if not entry.aggregates:
    for key, off in (('dropout_rate', 0.0), ('inject_client_faults', '')):
      if config.get(key, off) != off:
        raise cv.ConfigError(f'config.{key} = {config[key]!r} is invalid for algorithm '
                             f'{entry.name!r}: it has no aggregate to leave an upload out of '
                             f'({entry.doc}); leave it at {off!r}')
  if dp_enabled(config) and not entry.dp:
    raise cv.ConfigError(f'config.dp.enabled = True is invalid for algorithm {entry.name!r}: '
                         + (entry.dp_refusal or 'its aggregate is not registered as a weighted '
                            'mean of every upload (registry dp=False)'))
  if fedbuff_enabled(config) and not entry.dp:
    raise cv.ConfigError(f'config.fedbuff.enabled = True is invalid for algorithm {entry.name!r}: '
                         + (entry.dp_refusal or 'its aggregate is not registered as a weighted '
                            'mean of every upload (registry dp=False)')
                         + '; FedBuff applies staleness-weighted update differences to such a mean')
  if entry.validate is not None:
    entry.validate(config, dataset_info)


def dp_enabled(config: ml_collections.ConfigDict) -> bool:
  """Whether the run is user-level DP-FedAvg (`config.dp.enabled`; a config without the block:
  no)."""
  return 'dp' in config and bool(config.dp.enabled)


def fedbuff_enabled(config: ml_collections.ConfigDict) -> bool:
  """Whether the run is FedBuff (`config.fedbuff.enabled`; a config without the block: no)."""
  return 'fedbuff' in config and bool(config.fedbuff.enabled)


def fedbuff_config(config: ml_collections.ConfigDict) -> fedbuff.FedBuffConfig:
  """config.fedbuff as core/fedbuff.py's FedBuffConfig (ValueError on a bad value)."""
  f = config.fedbuff
  return fedbuff.FedBuffConfig(
      concurrency=f.concurrency, buffer_size=f.buffer_size, latency=f.latency,
      latency_sigma=f.latency_sigma, speed_sigma=f.speed_sigma, staleness=f.staleness,
      staleness_exponent=f.staleness_exponent, hinge_a=f.hinge_a, hinge_b=f.hinge_b)


def dp_noise_multiplier(config: ml_collections.ConfigDict) -> float:
  """config.dp.noise_multiplier, or when it is 0 with a target_epsilon > 0 the smallest one whose
  epsilon after config.rounds meets the target. ConfigError when both are set and the schedule
  cannot meet the target."""
  d = config.dp
  if d.target_epsilon > 0 and d.noise_multiplier == 0:
    return dp_fedavg.calibrate_noise_multiplier(float(d.target_epsilon), float(d.delta),
                                                int(config.clients_per_round),
                                                int(config.num_clients), int(config.rounds),
                                                d.accountant)
  z = float(d.noise_multiplier)
  if d.target_epsilon > 0:
    eps = dp_fedavg.epsilon(z, int(config.clients_per_round), int(config.num_clients),
                            int(config.rounds), float(d.delta), d.accountant)
    if eps > d.target_epsilon:
      raise cv.ConfigError(
          f'config.dp.target_epsilon = {d.target_epsilon!r} cannot be met: dp.noise_multiplier = '
          f'{z!r} over {config.rounds} rounds of {config.clients_per_round}/{config.num_clients} '
          f'clients gives epsilon = {eps:.4g} ({d.accountant}, delta {d.delta}); raise '
          'dp.noise_multiplier or set it to 0 to calibrate it to the target')
  return z


def dp_plan(config: ml_collections.ConfigDict) -> Plan:
  """The DP-FedAvg plan: results.json's 'dp' block (epsilon after the run copied from the last
  round's metrics)."""
  d, z = config.dp, dp_noise_multiplier(config)
  planned = dp_fedavg.epsilon(z, int(config.clients_per_round), int(config.num_clients),
                              int(config.rounds), float(d.delta), d.accountant)
  summary = {'noise_multiplier': z, 'clip_norm': float(d.clip_norm), 'per_layer': bool(d.per_layer),
             'delta': float(d.delta), 'rounds': int(config.rounds), 'accountant': d.accountant,
             'planned_epsilon': planned, 'adjacency': 'replace_one (user level)',
             'sampling': f'{config.clients_per_round} of {config.num_clients} without replacement'}
  text = (f'DP-FedAvg: clip {d.clip_norm:g}{" per layer" if d.per_layer else ""}, noise multiplier '
          f'{z:.4g}, planned epsilon {planned:.4g} after {config.rounds} rounds (delta {d.delta}, '
          f'{d.accountant}, replace-one user)')
  return Plan('dp', summary, text, final_metrics=('epsilon',))


def fedbuff_plan(config: ml_collections.ConfigDict) -> Plan:
  """The FedBuff plan: results.json's 'fedbuff' block (its settings; the virtual clock of every
  step is in metrics.jsonl)."""
  f = config.fedbuff
  summary = {k: f[k] for k in ('concurrency', 'buffer_size', 'latency', 'latency_sigma',
                               'speed_sigma', 'staleness', 'staleness_exponent', 'hinge_a',
                               'hinge_b')}
  summary.update(server_steps=int(config.rounds), server_lr=float(config.server_lr))
  text = (f'FedBuff: {f.concurrency} clients training at once, a server step every '
          f'{f.buffer_size} arrivals ({config.rounds} steps), {f.staleness} staleness weight, '
          f'{f.latency} latency (sigma {f.latency_sigma:g}, client speed sigma {f.speed_sigma:g})')
  return Plan('fedbuff', summary, text)


def check_objective(entry: Entry, name: str) -> None:
  """ConfigError unless algorithm `entry` accepts the objective `name` (its `methods` and `needs`)."""
  if entry.methods is not None and name not in entry.methods:
    raise cv.ConfigError(f'config.ssl_method = {name!r} is invalid for algorithm {entry.name!r}: '
                         f'must be one of {entry.methods}'
                         + (f' ({entry.methods_note})' if entry.methods_note else ''))
  lacking = ssl.registry.lacking(ssl.get(name), entry.needs)
  if lacking:
    raise cv.ConfigError(f'config.ssl_method = {name!r} is invalid for algorithm {entry.name!r}: '
                         f'it needs an objective with a {" and a ".join(lacking)}, which {name!r} '
                         f'has not (objectives that have: '
                         f'{", ".join(ssl.registry.with_capabilities(entry.needs))})')


def accepted_objectives(entry: Entry) -> Tuple[str, ...]:
  """The registered objectives algorithm `entry` accepts."""
  candidates = ssl.names() if entry.methods is None else entry.methods
  return tuple(n for n in candidates if not ssl.registry.lacking(ssl.get(n), entry.needs))


def encoders(config: ml_collections.ConfigDict) -> Sequence[Tuple[str, str]]:
  """[(config key, encoder name)] of the encoders the configured run builds."""
  entry = get(config.algorithm)
  if entry.encoders is None:
    return [('config.encoder', config.encoder)]
  return entry.encoders(config)


def server_optimizer(config: ml_collections.ConfigDict):
  """The configured server optimizer (optax), or None for plain aggregation."""
  return server_opt.make(config.server_optimizer, config.server_lr,
                         momentum=config.server_momentum, b1=config.server_b1,
                         b2=config.server_b2, eps=config.server_eps)


def build(config: ml_collections.ConfigDict, info: Any) -> Any:
  """The configured Algorithm (`config` already validated), with its server optimizer and, with
  `config.fedbuff`, FedBuff's pool on its server (core/fedbuff.py)."""
  algo = get(config.algorithm).build(config, info)
  if dp_enabled(config):  # epsilon spent so far in every metrics row (ops/dp_fedavg.py)
    ledger = dp_fedavg.DpLedger(dp_noise_multiplier(config), config.clients_per_round,
                                config.num_clients, config.dp.delta, config.dp.accountant)
    own = algo.host_metrics
    algo = dataclasses.replace(algo, host_metrics=lambda state: dict(
        own(state) if own is not None else {}, **ledger.host_metrics(state)))
  tx = server_optimizer(config)
  if tx is None:
    return _with_fedbuff(config, algo)
  if algo.global_model is None:
    raise cv.ConfigError(f'config.server_optimizer = {config.server_optimizer!r} is invalid for '
                         f'algorithm {config.algorithm!r}: its Algorithm declares no global_model '
                         "to step; declare one or use 'sgd' with server_lr = 1.0")
  return _with_fedbuff(config, server_opt.wrap(algo, tx))


def _with_fedbuff(config: ml_collections.ConfigDict, algo: Any) -> Any:
  """`algo` with FedBuff's pending pool on its server (core/fedbuff.py) when it is on."""
  if not fedbuff_enabled(config):
    return algo
  try:
    return fedbuff.wrap(algo, fedbuff_config(config), config.num_clients)
  except ValueError as e:
    raise cv.ConfigError(str(e)) from None


def plan(config: ml_collections.ConfigDict, info: Any) -> Optional[Plan]:
  """The configured algorithm's Plan (None when it has nothing to plan)."""
  entry = get(config.algorithm)
  if dp_enabled(config):
    return dp_plan(config)  # only entries marked `dp` get here, none of which has its own plan
  if fedbuff_enabled(config):
    return fedbuff_plan(config)  # likewise (DP and FedBuff exclude each other)
  return None if entry.plan is None else entry.plan(config, info)
