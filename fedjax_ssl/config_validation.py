"""Validation of ml_collections configs before any compute.

Every failure raises ``ConfigError`` (a ValueError) whose message names the
offending key and value and says what is allowed, e.g.
``config.alpha = -1.0 is invalid: must be > 0``.

``run(main, reference=default_config)`` replaces ``absl.app.run`` in the
binaries: a config error (a ``ConfigError`` from ``main``, an unknown
``--config.<key>`` override, a flag that does not parse) is printed as one
``error: <message>`` line on stderr and the process exits with status 1,
without a traceback; every other exception keeps its traceback.
"""

from __future__ import annotations

import difflib
import math
import numbers
import re
import sys
from typing import Any, Callable, Iterable, Mapping, NoReturn, Optional, Sequence

from absl import app, flags
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


def _unknown_key(prefix: str, key: Any, known: Iterable[Any], origin: str = '') -> ConfigError:
  """The unknown-key error: the key, where it came from, the closest known keys, all known keys."""
  known = [str(k) for k in known]
  close = difflib.get_close_matches(str(key), known, n=3, cutoff=0.6)
  hint = f" (did you mean {' or '.join(repr(f'{prefix}.{c}') for c in close)}?)" if close else ''
  return ConfigError(f'unknown config key {f"{prefix}.{key}"!r}{origin}{hint}; '
                     f'known keys at {prefix}: {sorted(known)}')


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
      raise _unknown_key(prefix, key, known)
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


# ----------------------------------------------------------------------------------------------
# Binaries: a config error is one line on stderr and exit status 1, never a traceback
# ----------------------------------------------------------------------------------------------
def error_line(error: BaseException | str) -> str:
  """``error: <message>`` on a single line (line breaks of the message become spaces)."""
  return 'error: ' + ' '.join(line.strip() for line in str(error).splitlines() if line.strip())


def exit_with_error(error: BaseException | str) -> NoReturn:
  """Prints ``error_line(error)`` to stderr and exits with status 1."""
  sys.stdout.flush()
  sys.stderr.write(error_line(error) + '\n')
  sys.stderr.flush()
  sys.exit(1)


def unknown_override(argv: Sequence[str], reference: Any, flag_name: str = 'config',
                     moved: Optional[Mapping[str, str]] = None) -> Optional[ConfigError]:
  """The error for the first ``--<flag_name>.<path>=value`` in ``argv`` whose path is no key of
  ``reference`` (None if every override names a known key).

  ml_collections raises a bare ``AttributeError: "'key'"`` (a TypeError for a sub-key of a leaf)
  inside absl's flag parsing for such an override; this names the key, the flag it came from and
  the closest known keys; a key of ``moved`` (old dotted path -> new one) names its new path.
  """
  pattern = re.compile(rf'^--?(?:no)?{re.escape(flag_name)}\.([^=]+)')
  for arg in argv[1:]:
    if arg == '--':  # everything after it is a positional argument
      break
    match = pattern.match(arg)
    if not match:
      continue
    if moved and match.group(1) in moved:
      new = moved[match.group(1)]
      return ConfigError(f'{flag_name}.{match.group(1)} in {arg} is no longer a key: it moved to '
                         f'{flag_name}.{new} (use --{flag_name}.{new}=...)')
    node, prefix = reference, flag_name
    for part in match.group(1).split('.'):
      if not _is_mapping(node):
        return ConfigError(f'unknown config key {f"{prefix}.{part}"!r} in {arg}: {prefix} = '
                           f'{_shown(node)} is a {type(node).__name__}, not a config dict')
      if part not in node:
        return _unknown_key(prefix, part, node.keys(), origin=f' in {arg}')
      node, prefix = node[part], f'{prefix}.{part}'
  return None


def run(main: Callable[[list], Any], *, reference: Optional[Callable[[], Any]] = None,
        config_flag: str = 'config', moved: Optional[Mapping[str, str]] = None) -> None:
  """``absl.app.run(main)`` with config errors reported as one line and exit status 1.

  Args:
    main: the binary's main(argv).
    reference: returns the config every ``--<config_flag>.<key>`` override must name a key of
      (the binaries pass ``experiment.default_config``).
    config_flag: name of the ml_collections config flag.
    moved: keys that moved (old dotted path -> new one): an override of an old one names the new.

  Reported as ``error: <message>`` on stderr, exit status 1, no traceback: a ``ConfigError`` raised
  by ``main``; an override of an unknown key (ml_collections raises a bare AttributeError while
  absl parses the flags); any absl flag error (a value that does not parse, a missing required
  flag, an unknown flag); a config file that cannot be loaded. Every other exception propagates
  with its traceback.
  """
  def parse_flags(argv):
    try:
      args = flags.FLAGS(argv)
    except flags.Error as e:
      exit_with_error(e)
    except (AttributeError, KeyError, TypeError):
      error = unknown_override(argv, reference(), config_flag, moved) if reference is not None else None
      if error is None:
        raise
      exit_with_error(error)
    # ml_collections defers a config file that cannot be loaded to the first use of the config.
    if config_flag in flags.FLAGS and flags.FLAGS[config_flag].value is not None:
      try:
        flags.FLAGS[config_flag].value.keys()
      except OSError as e:
        exit_with_error(f'--{config_flag}: {e}')
    return args

  def main_reporting_config_errors(argv):
    try:
      return main(argv)
    except ConfigError as e:
      exit_with_error(e)

  app.run(main_reporting_config_errors, flags_parser=parse_flags)
