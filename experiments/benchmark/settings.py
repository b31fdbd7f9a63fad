"""The benchmark's settings: one frozen value, checked when built, that every timing function takes.

`make(**given)` is the one way in: the fields not given take the chosen setting's defaults (the
cross-device, scale and conv_layers settings have their own, below the plain defaults), and a bad
value raises `ConfigError` naming the flag, its value and what is allowed, before any compute.
`__main__` builds it from the command line's flags (only those given count as given); tests build
it directly, e.g. `make(models=['small_cnn'], clients=[3], batch_size=8)`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple

from experiments import conv_layers
from experiments.benchmark import layers, round_speed, scale
from fedjax_ssl import config_validation as cv
from fedjax_ssl import models
from fedjax_ssl.data import augment

SETTINGS = ('byol', 'cross_device', 'scale', 'conv_layers')

# Each setting's defaults, for every field not given (an explicitly given value wins).
SETTING_DEFAULTS: Dict[str, Dict[str, Any]] = {
    'byol': {}, 'cross_device': round_speed.CROSS_DEVICE_DEFAULTS, 'scale': scale.SCALE_DEFAULTS,
    'conv_layers': layers.CONV_LAYERS_DEFAULTS}

# The comma-separated list flags: tuples of their strings, as absl's DEFINE_list gives them.
LIST_FIELDS = ('models', 'clients', 'variants', 'augmentations', 'torch_variants',
               'profile_variants', 'precisions', 'peak_tflops', 'processes')


@dataclasses.dataclass(frozen=True)
class Settings:
  """Every knob of a benchmark run; each field is the flag of the same name (`__main__`'s help)."""
  setting: str = 'byol'
  participants: int = 0
  out: str = 'results.json'
  alpha: float = 0.1
  models: Tuple[str, ...] = ('small_cnn', 'resnet18')
  clients: Tuple[str, ...] = ('10', '100')
  local_steps: int = 5
  batch_size: int = 64
  repeats: int = 3
  variants: Tuple[str, ...] = ('stepwise', 'sequential', 'vmap', 'map', 'map10', 'shard')
  augmentations: Tuple[str, ...] = ('byol_easyfl', 'flip')
  torch: bool = True
  torch_variants: Tuple[str, ...] = tuple(round_speed.TORCH_VARIANTS)
  profile_dir: str = ''
  profile_variants: Tuple[str, ...] = ()
  conv_impl: str = 'auto'
  cache_dir: str = ''
  interleave: bool = True
  precisions: Tuple[str, ...] = ('float32',)
  peak_tflops: Tuple[str, ...] = ()
  max_variant_seconds: float = 600.0
  processes: Tuple[str, ...] = ()

  def __post_init__(self):
    for name in LIST_FIELDS:  # lists (or ints, in tests) -> tuples of strings
      object.__setattr__(self, name, tuple(str(v) for v in getattr(self, name)))
    check(self)

  @property
  def client_counts(self) -> Tuple[int, ...]:
    """--clients as integers."""
    return tuple(int(c) for c in self.clients)


FIELDS = tuple(f.name for f in dataclasses.fields(Settings))
DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}


def make(**given: Any) -> Settings:
  """The settings of a run: `given` over the defaults of `given['setting']` over the plain ones."""
  unknown = sorted(set(given) - set(FIELDS))
  if unknown:
    raise cv.ConfigError(f'benchmark settings {unknown} are unknown: allowed are {list(FIELDS)}')
  setting = given.get('setting', DEFAULTS['setting'])
  if setting not in SETTINGS:
    raise cv.ConfigError(f'--setting = {setting!r} is invalid: must be one of {list(SETTINGS)}')
  defaults = {k: v() if callable(v) else v for k, v in SETTING_DEFAULTS[setting].items()}
  return Settings(**{**defaults, **given})


def check(s: Settings) -> None:
  """Raises cv.ConfigError naming the flag, its value and what is allowed (before any compute)."""
  variants = list({'scale': scale.SCALE_VARIANTS, 'conv_layers': conv_layers.CANDIDATES}.get(
      s.setting, round_speed.VARIANT_STRATEGY))
  for name, values, allowed in (('models', s.models, list(round_speed.MODELS)),
                                ('variants', [v.split('/')[0] for v in s.variants], variants),
                                ('torch_variants', s.torch_variants,
                                 list(round_speed.TORCH_VARIANTS)),
                                ('profile_variants', s.profile_variants,
                                 variants + [f'{v}/{q}' for v in variants
                                             for q in models.PRECISIONS])):
    for value in values:
      if value not in allowed:
        raise cv.ConfigError(f'--{name} = {",".join(values)!r} is invalid: {value!r} is not one of '
                             f'{allowed}')
  for value in s.variants:
    if '/' in value and value.split('/', 1)[1] not in models.PRECISIONS:
      raise cv.ConfigError(f'--variants = {",".join(s.variants)!r} is invalid: {value!r} names '
                           f'a precision not in {list(models.PRECISIONS)}')
  for value in s.clients:
    if not value.isdigit() or int(value) < 1:
      raise cv.ConfigError(f'--clients = {",".join(s.clients)!r} is invalid: must be '
                           'comma-separated integers >= 1')
  if s.participants < 0:
    raise cv.ConfigError(f'--participants = {s.participants} is invalid: must be >= 0 '
                         '(0 = every client)')
  for name, value in (('local_steps', s.local_steps), ('repeats', s.repeats)):
    if value < 1:
      raise cv.ConfigError(f'--{name} = {value} is invalid: must be an integer >= 1')
  for value in s.processes:
    if not value.isdigit() or int(value) < 1:
      raise cv.ConfigError(f'--processes = {",".join(s.processes)!r} is invalid: must be '
                           'comma-separated integers >= 1')
  if s.processes and s.setting != 'scale':
    raise cv.ConfigError(f'--processes = {",".join(s.processes)!r} is invalid with --setting = '
                         f"{s.setting!r}: only the scale setting measures placements")
  if s.batch_size < 2:
    raise cv.ConfigError(f'--batch_size = {s.batch_size} is invalid: must be an integer >= 2')
  _check_precisions(s)
  for value in s.augmentations:
    if value not in augment.PRESETS:
      raise cv.ConfigError(f'--augmentations = {",".join(s.augmentations)!r} is invalid: '
                           f'{value!r} is not one of {sorted(augment.PRESETS)}')


def _check_precisions(s: Settings) -> None:
  """--precisions: distinct config.precision values (float32 only under --setting=scale, which has
  no precision variants and no mfu); --peak_tflops: numbers > 0, one for every precision or one per
  --precisions entry."""
  precisions, peaks = list(s.precisions), list(s.peak_tflops)
  text, peak_text = ','.join(precisions), ','.join(peaks)
  for value in precisions:
    if value not in models.PRECISIONS:
      raise cv.ConfigError(f'--precisions = {text!r} is invalid: {value!r} is not one of '
                           f'{list(models.PRECISIONS)}')
  if not precisions or len(set(precisions)) != len(precisions):
    raise cv.ConfigError(f'--precisions = {text!r} is invalid: must name distinct precisions, at '
                         'least one')
  if s.setting == 'scale' and (precisions != ['float32'] or peaks):
    raise cv.ConfigError(f'--precisions = {text!r}, --peak_tflops = {peak_text!r} are invalid with '
                         "--setting=scale: it times float32 only and reports no mfu")
  if not all(_positive_number(p) for p in peaks):
    raise cv.ConfigError(f'--peak_tflops = {peak_text!r} is invalid: must be numbers > 0 (TFLOP/s)')
  if len(peaks) > 1 and len(peaks) != len(precisions):
    raise cv.ConfigError(f'--peak_tflops = {peak_text!r} is invalid: give one value, or one per '
                         f'--precisions entry ({len(precisions)})')


def _positive_number(text: str) -> bool:
  try:
    return float(text) > 0
  except ValueError:
    return False
