"""Validation of ml_collections configs before any compute.

Every failure raises ``ConfigError`` (a ValueError) whose message names the
offending key and value and says what is allowed, e.g.
``config.alpha = -1.0 is invalid: must be > 0``.
"""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Iterable, Mapping

import ml_collections


class ConfigError(ValueError):
  """A config value or key is not allowed."""


def _qualified(key: str) -> str:
  return key if key == 'config' or key.startswith('config.') else f'config.{key}'


def _shown(value: Any) -> str:
  """repr() with numpy/jax scalars shown as python values (``-1.0``, not ``np.float64(-1.0)``)."""
  if hasattr(value, 'item') and getattr(value, 'ndim', None) == 0:
    value = value.item()
  return repr(value)


def _invalid(key: str, value: Any, requirement: str) -> ConfigError:
  return ConfigError(f'{_qualified(key)} = {_shown(value)} is invalid: {requirement}')


def _is_mapping(x: Any) -> bool:
  return isinstance(x, (Mapping, ml_collections.ConfigDict))


def check_known_keys(config: Any, reference: Any, prefix: str = 'config') -> None:
  """Checks that every key of ``config`` (recursively) exists in ``reference``.

  ``reference`` is the default config the experiment was built from; a nested
  dict/ConfigDict in both is checked recursively. Where the reference value is
  not a dict (e.g. a ``None`` placeholder) the config's sub-tree is not
  checked further.

  Raises:
    ConfigError: naming the unknown key, the closest known keys and all keys
      allowed at that level.
  """
  known = list(reference.keys())
  for key in config.keys():
    path = f'{prefix}.{key}'
    if key not in known:
      close = difflib.get_close_matches(str(key), [str(k) for k in known], n=3, cutoff=0.6)
      hint = f" (did you mean {' or '.join(repr(f'{prefix}.{c}') for c in close)}?)" if close else ''
      raise ConfigError(
          f'unknown config key {path!r}{hint}; known keys at {prefix}: {sorted(map(str, known))}')
    value, ref_value = config[key], reference[key]
    if _is_mapping(value) and _is_mapping(ref_value):
      check_known_keys(value, ref_value, prefix=path)


def check_choice(key: str, value: Any, allowed: Iterable[Any]) -> Any:
  """``value`` must be one of ``allowed``; returns ``value``."""
  allowed = list(allowed)
  if value in allowed:
    return value
  hint = ''
  if isinstance(value, str):
    close = difflib.get_close_matches(value, [a for a in allowed if isinstance(a, str)], n=1)
    hint = f'; did you mean {close[0]!r}?' if close else ''
  raise _invalid(key, value, f'must be one of {allowed}{hint}')


def _is_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _range_text(lo, hi, inclusive: tuple[bool, bool]) -> str:
  if lo is None and hi is None:
    return ''
  if hi is None:
    return f" {'>=' if inclusive[0] else '>'} {lo}"
  if lo is None:
    return f" {'<=' if inclusive[1] else '<'} {hi}"
  return f" in {'[' if inclusive[0] else '('}{lo}, {hi}{']' if inclusive[1] else ')'}"


def _in_range(value, lo, hi, inclusive: tuple[bool, bool]) -> bool:
  if lo is not None and (value < lo if inclusive[0] else value <= lo):
    return False
  if hi is not None and (value > hi if inclusive[1] else value >= hi):
    return False
  return True


def check_int_range(key: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
  """``value`` must be an integer (not bool) with ``lo <= value <= hi``; None = unbounded."""
  requirement = 'must be an integer' + _range_text(lo, hi, (True, True))
  if not _is_int(value) or not _in_range(value, lo, hi, (True, True)):
    raise _invalid(key, value, requirement)
  return int(value)


def check_float_range(key: str, value: Any, lo: float | None = None, hi: float | None = None,
                      inclusive: bool | tuple[bool, bool] = True) -> float:
  """``value`` must be a finite real number (int allowed, not bool) within the bounds.

  Args:
    inclusive: whether (lo, hi) themselves are allowed; one bool for both.
  """
  inclusive = (inclusive, inclusive) if isinstance(inclusive, bool) else tuple(inclusive)
  requirement = 'must be a finite number' + _range_text(lo, hi, inclusive)
  if not _is_real(value) or not math.isfinite(value) or not _in_range(value, lo, hi, inclusive):
    raise _invalid(key, value, requirement)
  return float(value)


def check_positive(key: str, value: Any, allow_zero: bool = False) -> Any:
  """``value`` must be a real number > 0 (>= 0 with ``allow_zero``); returns it."""
  requirement = f"must be {'>=' if allow_zero else '>'} 0"
  if not _is_real(value) or math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
    raise _invalid(key, value, requirement)
  return value
