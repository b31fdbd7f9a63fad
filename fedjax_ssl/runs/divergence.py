"""Divergence: a round whose loss, metrics or new server parameters are not finite, or in which too
many clients failed, stops the run with one line (`Divergence.message`) and exit status
`run_guard.EXIT_DIVERGED`. A part of what a run survives (fedjax_ssl/runs/run_guard.py)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl.core import strategies


def _is_float(x) -> bool:
  """Whether an array leaf holds floating (or complex) numbers: what can become NaN / Inf."""
  return jnp.issubdtype(x.dtype, jnp.inexact)


def make_finite_check(tree: Any) -> Tuple[List[str], Callable[[Any], jax.Array]]:
  """(names, check): `check(tree)` returns on the device one bool per floating leaf of `tree`,
  True where every entry is finite; `names` are those leaves' paths.

  A program of its own, run on the round's output right after it, rather than an extra output of
  the jitted round: the round's program stays byte-identical (an extra consumer of the new
  parameters could change XLA's fusion of the round, and with it the bits of a floating-point
  result), and it needs no change to the round. It reads the parameters once and returns a few
  bytes; the round's metrics are read on the host anyway.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  names = [jax.tree_util.keystr(path) for path, leaf in flat if _is_float(leaf)]

  def check(tree):
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if _is_float(x)]
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]) if leaves else jnp.ones((0,), bool)
  return names, strategies.jit_replicated(check)


@dataclasses.dataclass(frozen=True)
class Divergence:
  """Where a run stopped being finite: the round, the quantity ('loss', another round metric, or
  'server parameter <path>'), its value (None for a parameter), and the quantity's last finite
  value and round (None when there was none)."""
  round: int
  rounds: int
  quantity: str
  value: Optional[float]
  last_finite_round: Optional[int]
  last_finite_value: Optional[float]
  detail: Optional[str] = None

  def message(self, hint: str) -> str:
    """One line: round, quantity, value, last finite value, the hint."""
    if self.detail is not None:
      return f'error: diverged at round {self.round}/{self.rounds}: {self.detail}; {hint}'
    if self.value is None:
      what = f'{self.quantity} is not finite'
      last = (f' (finite through round {self.last_finite_round})'
              if self.last_finite_round is not None else '')
    else:
      what = f'{self.quantity} = {self.value}'
      last = (f' (last finite: {self.last_finite_value:.6g} at round {self.last_finite_round})'
              if self.last_finite_round is not None else ' (never finite)')
    return f'error: diverged at round {self.round}/{self.rounds}: {what}{last}; {hint}'

  def to_json(self) -> dict:
    """results.json's 'diverged' entry (the value as text: JSON has no NaN)."""
    return {'round': self.round, 'quantity': self.quantity,
            'value': None if self.value is None else repr(self.value),
            'last_finite_round': self.last_finite_round,
            'last_finite_value': self.last_finite_value,
            **({'detail': self.detail} if self.detail is not None else {})}


def too_many_failed(round_idx: int, rounds: int, failed: Sequence[int], participants: int,
                    max_fraction: float) -> Optional[Divergence]:
  """The divergence of a round in which more than `max_fraction` of its `participants` failed
  (their uploads were not finite, core/faults.py), or None."""
  if len(failed) <= max_fraction * participants:
    return None
  return Divergence(round_idx, rounds, 'failed clients', float(len(failed)), None, None,
                    detail=f'{len(failed)} of {participants} participants sent a non-finite update '
                    f'(clients {list(failed)}), more than max_failed_fraction = {max_fraction:g}')


def divergence_hint(lr: float, grad_clip_norm: float) -> str:
  """What to try after a divergence, from the config's learning rate and clipping."""
  clip = ('clip gradients (config.grad_clip_norm, now 0 = off)' if not grad_clip_norm else
          f'lower config.grad_clip_norm (now {grad_clip_norm:g})')
  return (f'lower config.lr (now {lr:g}) or {clip}; in reduced precision (bfloat16/float16) try '
          'float32')


class DivergenceWatch:
  """Checks each round's metrics and parameter flags; remembers the last finite value of each
  metric (seeded from metrics.jsonl on resume) for the message."""

  def __init__(self, rounds: int, param_names: Sequence[str], history: Sequence[dict] = ()):
    self.rounds = rounds
    self.param_names = list(param_names)
    self._last: Dict[str, Tuple[int, float]] = {}
    self._params_finite_through: Optional[int] = None
    for record in history:
      self._remember(record['round'], record)

  def _remember(self, round_idx: int, metrics: Mapping[str, float]) -> None:
    for key, value in metrics.items():
      if key != 'round' and isinstance(value, (int, float)) and math.isfinite(value):
        self._last[key] = (round_idx, float(value))
    self._params_finite_through = round_idx

  def check(self, round_idx: int, metrics: Mapping[str, float], params_finite: np.ndarray
            ) -> Optional[Divergence]:
    """The divergence of round `round_idx` (the loss first, then the other metrics, then the
    parameters), or None when everything is finite."""
    bad = sorted((k for k, v in metrics.items() if not math.isfinite(v)),
                 key=lambda k: (k != 'loss', k))
    if bad:
      last = self._last.get(bad[0])
      return Divergence(round_idx, self.rounds, bad[0], float(metrics[bad[0]]),
                        last[0] if last else None, last[1] if last else None)
    params_finite = np.asarray(params_finite)
    if not params_finite.all():
      name = self.param_names[int(np.argmin(params_finite))]
      return Divergence(round_idx, self.rounds, f'server parameter {name}', None,
                        self._params_finite_through, None)
    self._remember(round_idx, metrics)
    return None
