"""Which config keys make a run what it is: the one home of run identity.

  * `run_key(config)`: the canonical JSON of the keys a run depends on. Two configs with equal keys
    are the same run: `reproduce` gives the cells that share one a single run, and `run_guard`
    refuses a resume whose key differs from the stored config's (less `NEUTRAL_KEYS`).
  * `NEUTRAL_KEYS`: keys that cannot change what a run computes (only how often it logs, evaluates
    on the side or saves): a resume may change them freely.
  * `MOVED_KEYS`: keys that moved into a block, old name -> new dotted name. `migrate` moves them in
    a stored config.json as it is read (so committed runs keep their identity and results), and
    `check_no_moved_keys` refuses them, naming the new key, in a config a user sets.
  * `program_keys(config)`: the config values that shape a round's compiled program, the key of the
    strategy 'auto' measured (`core/autotune.py`): evaluation, bookkeeping and values that enter the
    program as numbers of the same shape (seed, lr, rounds) are left out, so that the seeds and
    learning rates of one program share one measurement.
  * `export_keys(config)`: the config values a round's exported program may depend on
    (`core/export_cache.py`): `run_key` less the keys read only on the host (evaluation, logging,
    checkpoints) and the strategy keys (the resolved strategy is keyed instead). Unlike
    `program_keys` it keeps the values baked into the program as constants (lr, rounds, seed).
  * `step_cost_key(config, image_shape)`: the runs whose local steps cost the same FLOPs, whatever
    their data size, client count or rounds (`experiments.plan` compiles one step per key).

Which keys an algorithm *accepts* is validation, not identity (`algorithms.registry.validate`,
`Entry.exclusive`): `run_key` drops every block but the configured algorithm's and objective's.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Sequence

import ml_collections

from fedjax_ssl import algorithms
from fedjax_ssl import config_validation as cv
from fedjax_ssl import ssl

# max_failed_fraction only decides whether a run stops after a round of failed clients, never what a
# round computes: a resume may raise it to go on past such a stop.
# per_client_eval adds an evaluation after the last round and changes no round.
NEUTRAL_KEYS = ('checkpoint_every', 'eval_every', 'max_failed_fraction', 'per_client_eval')

# Keys a config ignores given its other values: left out of `run_key` (centralized training under
# the IID and the Dirichlet column is the same run). The config blocks of the algorithms not
# configured are left out too, and those of the objectives not configured.
UNUSED_WHEN = {
    'alpha': lambda c: c.partition != 'dirichlet',
    'classes_per_client': lambda c: c.partition != 'classes',
    'sc_mu': lambda c: c.ssl_method != 'sc',
    # Issue 64's keys: read only by the image-folder datasets (so older runs keep their key).
    'image_size': lambda c: c.dataset not in ('folder', 'tiny_imagenet'),
    'test_fraction': lambda c: c.dataset != 'folder',
    # DP-FedAvg off: the block is read by nothing, so runs from before it keep their identity.
    'dp': lambda c: not ('dp' in c and c.dp.enabled),
    # FedBuff off: likewise (core/fedbuff.py).
    'fedbuff': lambda c: not ('fedbuff' in c and c.fedbuff.enabled),
    # Issue 67: replicated placement is what every run before the key did.
    'placement': lambda c: c.get('placement', 'replicated') == 'replicated',
}

# Top-level keys that moved into a block: old name -> 'block.key' (issue 25: into the algorithms'
# blocks; issue 48: the objectives' own keys into theirs).
MOVED_KEYS = {'dapu_threshold': 'fedu.dapu_threshold',
              'autoscaler_tau': 'fedema.autoscaler_tau',
              'independent_init': 'independent.independent_init',
              'temperature': 'simclr.temperature',
              'nt_xent_zero_diagonal': 'simclr.zero_diagonal',
              'ema_tau': 'byol.ema_tau'}

_NOT_PROGRAM_KEYS = ('seed', 'rounds', 'lr', 'eval_every', 'checkpoint_every', 'data_dir',
                     'strategy', 'map_chunk_size', 'knn_k', 'knn_temperature', 'knn_k_small',
                     'label_fractions', 'label_draws', 'per_client_eval')
_NOT_PROGRAM_PREFIXES = ('probe', 'finetune')


def run_key(config: ml_collections.ConfigDict) -> str:
  """Canonical JSON of the keys the run depends on (module docstring)."""
  d = config.to_dict()
  for key, unused in UNUSED_WHEN.items():
    if key in d and unused(config):
      del d[key]
  for name in algorithms.names():
    if name != config.algorithm:
      d.pop(name, None)
  for name in ssl.names():
    if name != config.ssl_method:
      d.pop(name, None)
  return json.dumps(d, sort_keys=True, default=str)


def migrate(saved: Dict[str, Any]) -> Dict[str, Any]:
  """A stored config dict (config.json) with its MOVED_KEYS moved into their blocks."""
  saved = dict(saved)
  for old, new in MOVED_KEYS.items():
    if old in saved:
      block, key = new.split('.')
      saved[block] = dict(saved.get(block, {}), **{key: saved.pop(old)})
  return saved


def check_no_moved_keys(config: ml_collections.ConfigDict) -> None:
  """ConfigError naming the new key for a moved key that `config` sets."""
  for old, new in MOVED_KEYS.items():
    if old in config:
      raise cv.ConfigError(f'config.{old} is no longer a key: it moved to config.{new} (set '
                           f'--config.{new}=... or c.{new} = ... instead)')


def program_keys(config: ml_collections.ConfigDict) -> Dict[str, Any]:
  """The config values that shape the round's compiled program (module docstring)."""
  return {k: v for k, v in config.to_dict().items()
          if k not in _NOT_PROGRAM_KEYS and not k.startswith(_NOT_PROGRAM_PREFIXES)}


# Read only on the host, never by the round's program; the strategy keys are replaced by the
# resolved strategy in the export's key.
_HOST_ONLY_KEYS = NEUTRAL_KEYS + ('strategy', 'map_chunk_size', 'knn_k', 'knn_temperature',
                                  'knn_k_small', 'label_fractions', 'label_draws')


def export_keys(config: ml_collections.ConfigDict) -> Dict[str, Any]:
  """The config values an exported round program may depend on (module docstring)."""
  return {k: v for k, v in json.loads(run_key(config)).items()
          if k not in _HOST_ONLY_KEYS and not k.startswith(_NOT_PROGRAM_PREFIXES)}


def _variant(config: ml_collections.ConfigDict) -> str:
  """Which parts of the algorithm's block are on: its strings and bools, and its numbers that are 0
  (Hetero-SSFL at mu = 0 trains without the CKA term on the RAD)."""
  block = config[config.algorithm].to_dict() if config.algorithm in config else {}
  return ','.join(f'{k}={v}' for k, v in sorted(block.items())
                  if isinstance(v, (str, bool)) or (isinstance(v, (int, float)) and v == 0))


def step_cost_key(config: ml_collections.ConfigDict, image_shape: Sequence[int]) -> str:
  """The runs counted at one step cost (module docstring): same encoders, objective, algorithm and
  variant, batch, augmentation, heads, public set and image shape [H, W, C]."""
  encoders = ','.join(e for _, e in algorithms.registry.encoders(config))
  variant = _variant(config)
  return (f'{config.algorithm}{f" ({variant})" if variant else ""} / {config.ssl_method}, '
          f'{encoders}, heads {config.heads}, B {config.batch_size}, {config.augmentation}, '
          f'public {config.public_size}, {"x".join(map(str, image_shape))}')
