"""The objective registry: a name -> what a client's local loss needs and computes.

An objective is one value (`Objective`): the views it consumes, the heads and networks it needs
(a predictor, a momentum target), which modules clients share, its loss as a pure function, and its
config block `config.<name>` with defaults and checks. `config.ssl_method` names one. The client
step (`algorithms/ssl_client.py`) asks the objective instead of branching on names, and each
algorithm declares what it needs (`algorithms.register(needs=...)`). A researcher's own file
registers one with public names only (`configs/examples/custom_objective.py`):

  fedjax_ssl.ssl.register(Objective(name='my_loss', loss=..., defaults=..., validate=...))

The loss is `loss(hparams, online, target, batch, shared) -> scalar`:
  hparams  the objective's hyper-parameters, `Objective.hparams(config)` (default: its block as a
           dict of Python values), fixed for the run.
  online   one model output per view: for an SSL model a dict {'h' [B, dh] backbone features,
           'z' [B, dz] projector output, 'p' [B, dz] predictor output when `predictor`}; for a
           `classifier` objective the logits [B, K].
  target   with `target`: one dict {'z' [B, dz]} per view from the momentum target network
           (encoder + projector; gradients stopped); None otherwise.
  batch    the step's batch: 'x' uint8 images [B, H, W, C], 'y' int labels [B], and 'mask' bool
           [B] when the epoch's ragged last batch is kept (only for `ragged_batches` objectives).
  shared   what an algorithm hands the loss each step (FedSC: (alpha, R_other)), None otherwise.

An objective with per-client state (MoCo's queue) also takes `state`, the client's, as a sixth
argument, and gives `update_state(hparams, state, online, target) -> state`, the state after the
step (its inputs' gradients stopped). The state starts at zeros (`state_init(hparams, z_dim)` gives
its shapes), lives with the client (kept by stateless clients, sitting-out clients and host-side
client state), and `hparams['reset_state']`, when true, zeroes it at the start of every round.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import ml_collections

from fedjax_ssl import config_validation as cv

# What an algorithm may require of an objective (`algorithms.register(needs=...)`).
CAPABILITIES = ('projector', 'predictor', 'target')


def _empty_block() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict()


@dataclasses.dataclass(frozen=True)
class Objective:
  """One registered objective.

  Attributes:
    name: the value of `config.ssl_method` and of its config block's key (a Python identifier).
    loss: (hparams, online, target, batch, shared) -> scalar (module docstring).
    views: augmented views per image the loss consumes (1 or 2).
    predictor: the online model has a predictor head (output 'p').
    target: a momentum target network (encoder + projector) follows the online one by an EMA
      after every step, at `hparams['ema_tau']` (target <- tau * target + (1 - tau) * online).
    classifier: the model is an encoder with a linear classifier (supervised), not an SSL model.
    ragged_batches: the loss reads batch['mask'], so a client may keep its ragged last batch
      (config.drop_last = False).
    defaults: () -> ConfigDict, the block `config.<name>` with its defaults (may be empty).
    validate: (block) -> None, raising ConfigError for a bad value; None = nothing to check.
    hparams: config -> dict of the loss's hyper-parameters; None = the block's values.
    state_init: (hparams, z_dim) -> pytree of zeros, the per-client state; None = stateless.
    update_state: (hparams, state, online, target) -> state after a step (with `state_init`).
    prototypes: the model has a prototype layer (SwAV): `hparams['num_prototypes']` bias-free
      outputs on the L2-normalised projection, online output 'scores' [B, K], parameters
      params['prototypes'] renormalised to unit rows before every step; clients share it when
      `hparams['shared_prototypes']` (`shared_modules`).
    check_clients: (block, client_sizes int [C], batch_size) -> None, raising ConfigError when the
      objective cannot run on clients of these sizes (MoCo's queue against a client's data); run
      once the partition is known, before compute. None = nothing to check.
    doc: one line for listings and errors.
  """
  name: str
  loss: Callable[..., Any]
  views: int = 2
  predictor: bool = False
  target: bool = False
  classifier: bool = False
  ragged_batches: bool = False
  defaults: Callable[[], ml_collections.ConfigDict] = _empty_block
  validate: Optional[Callable[[ml_collections.ConfigDict], None]] = None
  hparams: Optional[Callable[[ml_collections.ConfigDict], Dict[str, Any]]] = None
  state_init: Optional[Callable[..., Any]] = None
  update_state: Optional[Callable[..., Any]] = None
  prototypes: bool = False
  check_clients: Optional[Callable[..., None]] = None
  doc: str = ''

  @property
  def shared(self) -> Tuple[str, ...]:
    """The top-level parameter groups clients share (FedAvg averages them): the online network."""
    if self.classifier:
      return ('encoder', 'head')
    return ('encoder', 'projector') + (('predictor',) if self.predictor else ())

  def shared_modules(self, hparams: Dict[str, Any]) -> Tuple[str, ...]:
    """`shared`, plus the prototype layer when the run shares it (`hparams['shared_prototypes']`)."""
    if self.prototypes and hparams.get('shared_prototypes', True):
      return self.shared + ('prototypes',)
    return self.shared

  def capabilities(self) -> Tuple[str, ...]:
    """The CAPABILITIES this objective has."""
    return tuple(c for c, has in (('projector', not self.classifier),
                                  ('predictor', self.predictor), ('target', self.target)) if has)

  def hyperparameters(self, config: ml_collections.ConfigDict) -> Dict[str, Any]:
    """The loss's hyper-parameters for the run `config`."""
    if self.hparams is not None:
      return self.hparams(config)
    return config[self.name].to_dict()


_REGISTRY: Dict[str, Objective] = {}


def _origin(fn: Callable) -> Tuple[str, str]:
  code = getattr(fn, '__code__', None)
  # The same file may be executed under a relative path (absl's config flag) and an absolute one
  # (an import): compare resolved paths.
  return (getattr(fn, '__qualname__', repr(fn)), os.path.realpath(code.co_filename) if code else '')


def register(objective: Objective) -> Objective:
  """Adds `objective` and returns it.

  Registering a name again is allowed only with the same loss function (a config file that is
  executed twice, e.g. by absl's config flag and by an import); another loss under a taken name
  raises ValueError.
  """
  name = objective.name
  if not name.isidentifier():
    raise ValueError(f'objective name {name!r} is invalid: must be a Python identifier (it is the '
                     'key of its config block, config.<name>)')
  if objective.views not in (1, 2):
    raise ValueError(f'objective {name!r}: views = {objective.views!r} is invalid: must be 1 or 2')
  if objective.target and 'ema_tau' not in objective.defaults():
    raise ValueError(f'objective {name!r} has a momentum target: its config block must have '
                     "'ema_tau' (the EMA rate of the target)")
  if (objective.state_init is None) != (objective.update_state is None):
    raise ValueError(f'objective {name!r}: state_init and update_state go together (per-client '
                     'state needs both)')
  old = _REGISTRY.get(name)
  if old is not None and _origin(old.loss) != _origin(objective.loss):
    raise ValueError(f'objective {name!r} is already registered (loss {_origin(old.loss)[0]} in '
                     f'{_origin(old.loss)[1]}); choose another name')
  _REGISTRY[name] = objective
  return objective


def names() -> Tuple[str, ...]:
  """The registered objective names, in registration order."""
  return tuple(_REGISTRY)


def get(name: str) -> Objective:
  """The objective `name`; ConfigError naming the registered objectives if there is none."""
  if name not in _REGISTRY:
    cv.check_choice('ssl_method', name, names())
  return _REGISTRY[name]


def lacking(objective: Objective, needs: Sequence[str]) -> Tuple[str, ...]:
  """The capabilities of `needs` that `objective` does not have."""
  have = objective.capabilities()
  return tuple(n for n in needs if n not in have)


def with_capabilities(needs: Sequence[str]) -> Tuple[str, ...]:
  """The registered objectives that have every capability of `needs`."""
  return tuple(n for n, o in _REGISTRY.items() if not lacking(o, needs))


def validate(config: ml_collections.ConfigDict) -> None:
  """`config.ssl_method` names a registered objective whose block has known keys and good values."""
  objective = get(config.ssl_method)
  cv.check_known_keys(config[objective.name], objective.defaults(),
                      prefix=f'config.{objective.name}')
  if objective.validate is not None:
    objective.validate(config[objective.name])

