"""Per-round metrics logging (JSONL + TensorBoard), a tqdm progress bar, and a run's log file.

``<workdir>/metrics.jsonl`` holds one JSON object per line,
``{"round": r, "<metric>": value, ...}``; TensorBoard event files (written by
tensorboardX, no TensorFlow needed) go to ``<workdir>/tb``. On resume from a
checkpoint taken at round ``r`` call ``truncate_after(r)`` before writing, so
the log of an interrupted-and-resumed run equals an uninterrupted run's.

``RunLog`` keeps the console for people: within it, library logging (absl,
orbax, jax, tfds; INFO and up) goes to a log file in the workdir, only warnings
and errors reach the console (through ``tqdm.write``, so they do not break a
progress bar), and ``say`` prints the lines meant for a person.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import sys
import time
from typing import Any, List, Mapping, Optional

from absl import flags
from absl import logging as absl_logging
import numpy as np
import tqdm

from fedjax_ssl import files
from tensorboardX import SummaryWriter

METRICS_FILE = 'metrics.jsonl'
TB_DIR = 'tb'


def to_python_scalar(key: str, value: Any) -> int | float:
  """Converts a python/numpy/jax scalar (0-d array) to a python int or float.

  Integer and bool values give an int (exact counters such as bytes sent),
  every other real value a float. Raises ValueError naming ``key`` for
  non-scalars and non-numbers.
  """
  if isinstance(value, numbers.Integral):  # python int/bool, numpy integer
    return int(value)
  if isinstance(value, numbers.Real):  # python float, numpy floating
    return float(value)
  if hasattr(value, 'shape') and hasattr(value, 'dtype'):  # numpy / jax arrays
    array = np.asarray(value)
    if array.ndim != 0:
      raise ValueError(
          f'metric {key!r} has shape {array.shape}: only scalars can be logged')
    if array.dtype.kind in 'iub':
      return int(array)
    if array.dtype.kind == 'f':
      return float(array)
    if array.dtype.kind == 'V':  # ml_dtypes floats (bfloat16, ...) or structured
      try:
        return float(array)
      except TypeError:
        pass
  raise ValueError(
      f'metric {key!r} = {value!r} of type {type(value).__name__} is not a real scalar')


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = '') -> dict[str, int | float]:
  """Flattens nested dicts to ``'outer/inner'`` keys of python scalars (a list of integers, such
  as the ids of a round's failed clients, is kept as a list)."""
  flat = {}
  for key, value in metrics.items():
    name = f'{prefix}{key}'
    if isinstance(value, Mapping):
      flat.update(flatten_metrics(value, prefix=f'{name}/'))
    elif isinstance(value, (list, tuple)):
      flat[name] = [int(to_python_scalar(name, v)) for v in value]
    else:
      flat[name] = to_python_scalar(name, value)
  return flat


def read_metrics(path: str) -> list[dict]:
  """Reads a metrics JSONL file into a list of dicts, in file order.

  A final line without its newline that does not parse is a write torn by a
  kill and is skipped; any other unparsable line raises ValueError.
  """
  with open(path, encoding='utf-8') as f:
    text = f.read()
  lines = text.split('\n')
  records = []
  for lineno, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      if lineno == len(lines):  # last piece, no trailing newline: torn write
        break
      raise ValueError(f'{path}:{lineno} is not a JSON object: {e}') from e
  return records


class MetricsWriter:
  """Appends per-round scalar metrics to ``metrics.jsonl`` and TensorBoard."""

  def __init__(self, workdir: str, writes: bool = True):
    """`writes=False`: the writer of a process that does not write (one of a multi-process run's
    other processes): it writes, truncates and reads nothing."""
    self.writes = writes
    if writes:
      os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.jsonl_path = os.path.join(workdir, METRICS_FILE)
    self.tb_dir = os.path.join(workdir, TB_DIR)
    self._tb: SummaryWriter | None = None
    # Set by truncate_after: the next event file tells TensorBoard to hide
    # older events with step >= purge_step (tensorboardX `purge_step`).
    self._purge_step: int | None = None

  def _tb_writer(self) -> SummaryWriter:
    if self._tb is None:
      # tensorboardX names event files by the second and opens them with 'wb':
      # a second writer within the same second would overwrite the first file.
      # The nanosecond suffix keeps names unique and in creation order.
      self._tb = SummaryWriter(self.tb_dir, purge_step=self._purge_step,
                               filename_suffix=f'.{time.time_ns()}')
    return self._tb

  def write(self, round_idx: int, metrics: Mapping[str, Any]) -> dict:
    """Logs ``metrics`` for ``round_idx``; returns the JSON record written.

    Values may be python/numpy/jax scalars; nested dicts become ``'a/b'`` keys.
    Non-finite floats are kept (JSON ``NaN``/``Infinity``, which
    ``read_metrics`` reads back) because a diverged loss must be visible.
    """
    if 'round' in metrics:
      raise ValueError("metrics must not contain the reserved key 'round'")
    round_idx = to_python_scalar('round', round_idx)
    if not isinstance(round_idx, int):
      raise ValueError(f'round_idx = {round_idx!r} is invalid: must be an integer')
    record = {'round': round_idx, **flatten_metrics(metrics)}
    if not self.writes:
      return record
    # One write() of one complete line, flushed: a kill leaves at most a torn
    # last line, which read_metrics/truncate_after drop.
    with open(self.jsonl_path, 'a', encoding='utf-8') as f:
      f.write(json.dumps(record) + '\n')
    tb = self._tb_writer()
    for key, value in record.items():
      if key != 'round' and not isinstance(value, list):  # TensorBoard plots scalars only
        tb.add_scalar(key, value, global_step=round_idx)
    tb.flush()
    return record

  def truncate_after(self, round_idx: int) -> None:
    """Drops every logged record with ``round > round_idx`` (call on resume).

    The JSONL file is rewritten atomically (temporary file + os.replace);
    TensorBoard events of later rounds are hidden through a ``purge_step``
    marker in the next event file. ``round_idx = -1`` clears the log (a fresh
    start in a used workdir).
    """
    if not self.writes:
      return
    if os.path.exists(self.jsonl_path):
      kept = [r for r in read_metrics(self.jsonl_path) if r['round'] <= round_idx]
      files.write_text(self.jsonl_path, ''.join(json.dumps(r) + '\n' for r in kept))
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    self._purge_step = round_idx + 1

  def read(self) -> list[dict]:
    """The records logged so far ([] when none, or when this writer does not write)."""
    if not self.writes or not os.path.exists(self.jsonl_path):
      return []
    return read_metrics(self.jsonl_path)

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class Progress(tqdm.tqdm):
  """tqdm bar with ``set_metrics`` for a live loss display."""

  def set_metrics(self, metrics: Mapping[str, Any], refresh: bool = True) -> None:
    """Shows ``metrics`` (jax/numpy scalars allowed) as the bar's postfix."""
    self.set_postfix({k: v for k, v in flatten_metrics(metrics).items() if not isinstance(v, list)},
                     refresh=refresh)


def progress(total: int, initial: int = 0, desc: str = 'rounds',
             disable: bool | None = None, **tqdm_kwargs) -> Progress:
  """A progress bar over rounds ``initial..total`` (``initial`` > 0 on resume).

  ``disable=None`` (tqdm's convention) hides the bar when stderr is not a TTY
  (batch logs); the returned object then still accepts update/set_metrics.
  """
  return Progress(total=total, initial=initial, desc=desc, disable=disable,
                  dynamic_ncols=True, **tqdm_kwargs)


# ----------------------------------------------------------------------------------------------
# A run's log file and a quiet console
# ----------------------------------------------------------------------------------------------
_log = logging.getLogger('fedjax_ssl')


def say(message: str, echo: bool = True, *, stacklevel: int = 2) -> None:
  """A line meant for a person: logged at INFO (so it is in the run's log file) and, with
  ``echo``, printed to stdout through ``tqdm.write`` (a running bar is redrawn below it)."""
  _log.info(message, stacklevel=stacklevel)
  if echo:
    tqdm.tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()


def report(line: str, echo: bool = True, *, stacklevel: int = 2) -> None:
  """A fault line ('warning: ...', 'error: ...'): the run's log file always; stderr when `echo`,
  through tqdm so that a running bar is redrawn below it."""
  _log.info(line, stacklevel=stacklevel)
  if echo:
    sys.stdout.flush()
    tqdm.tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


class Console:
  """What one process of a run shows a person (the idea of Flax's
  `create_default_writer(just_logging=...)`): every line goes to the run's log file, and to the
  console only in the process that prints (process 0 of a multi-process run; `for_process`); the
  lines meant for a person only when `verbose` too. The loop's stages call it without asking which
  process they run in.

    console.say(line)     a line for a person: stdout when verbose
    console.log(line)     the log file only (details a person reads after the fact)
    console.report(line)  a fault line ('warning: ...', 'error: ...'): stderr
    console.progress(..)  the rounds bar (hidden in the processes that do not print)
  """

  def __init__(self, prints: bool = True, verbose: bool = True):
    self.prints = prints
    self.verbose = verbose and prints

  @classmethod
  def for_process(cls, process: int, verbose: bool = True) -> 'Console':
    """The console of process `process` of a run: process 0 prints."""
    return cls(prints=process == 0, verbose=verbose)

  def say(self, message: str) -> None:
    say(message, echo=self.verbose, stacklevel=3)

  def log(self, message: str) -> None:
    say(message, echo=False, stacklevel=3)

  def report(self, line: str) -> None:
    report(line, echo=self.prints, stacklevel=3)

  def progress(self, total: int, initial: int = 0, desc: str = 'rounds', **tqdm_kwargs
               ) -> Progress:
    """`progress`, hidden (tqdm's disable=True) where this process does not print."""
    return progress(total, initial, desc, disable=None if self.prints else True, **tqdm_kwargs)


class ConsoleHandler(logging.Handler):
  """Writes records to the current ``sys.stderr`` through ``tqdm.write``, so that a warning
  printed while a progress bar runs does not break the bar."""

  def emit(self, record: logging.LogRecord) -> None:
    try:
      tqdm.tqdm.write(self.format(record), file=sys.stderr)
    except Exception:  # pylint: disable=broad-except  (logging's own convention)
      self.handleError(record)


class _Buffer(logging.Handler):
  """Keeps the first ``capacity`` records until the log file is opened."""

  def __init__(self, capacity: int = 10_000):
    super().__init__()
    self.capacity = capacity
    self.records: List[logging.LogRecord] = []

  def emit(self, record: logging.LogRecord) -> None:
    if len(self.records) < self.capacity:
      self.records.append(record)


_STD_STREAMS = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)


def _is_console(handler: logging.Handler) -> bool:
  """Whether ``handler`` writes to the terminal (absl's handler, a stdout/stderr StreamHandler)."""
  if isinstance(handler, (ConsoleHandler, absl_logging.ABSLHandler)):
    return True
  return (isinstance(handler, logging.StreamHandler) and
          not isinstance(handler, logging.FileHandler) and
          getattr(handler, 'stream', None) in _STD_STREAMS + (sys.stdout, sys.stderr))


def _logs_wanted_on_stderr() -> bool:
  """Whether the user asked absl for every log line on stderr (--logtostderr, --alsologtostderr)."""
  try:
    return flags.FLAGS.is_parsed() and bool(flags.FLAGS['logtostderr'].value or
                                            flags.FLAGS['alsologtostderr'].value)
  except (KeyError, AttributeError):
    return False


class RunLog:
  """Routes logging for one run (a context manager; ``open`` names the log file).

  Within it: the root logger's console handlers (absl's handler under ``app.run``, stderr stream
  handlers) are replaced by a ``ConsoleHandler`` at ``console_level`` (WARNING: warnings and errors
  still reach the terminal; with absl's --logtostderr / --alsologtostderr every level does), and
  every record from INFO up (DEBUG too with absl's -v 1) is kept until ``open(path)`` and then
  appended to ``path``, so the records logged before the workdir exists (config validation, the
  jax backend's start) are in the file as well. On exit every handler, level and file is put back
  or closed, so runs made one after another in a process neither stack handlers nor write into an
  earlier run's file; other handlers (pytest's, a caller's file handler) are left untouched.

    with RunLog() as log:
      validate(config)                       # warnings go to the console now
      log.open(workdir / 'train.log')
      ...                                    # orbax/absl/jax INFO -> train.log only
  """

  def __init__(self, console_level: int = logging.WARNING, file_level: int = logging.INFO):
    self.console_level = console_level
    self.file_level = file_level
    self.path: Optional[str] = None
    self._file: Optional[logging.FileHandler] = None
    self._buffer: Optional[_Buffer] = None
    self._console: Optional[ConsoleHandler] = None
    self._removed: List[logging.Handler] = []
    self._saved: List[logging.Handler] = []
    self._root_level = logging.NOTSET
    self._absl_level = logging.NOTSET

  def __enter__(self) -> 'RunLog':
    root = logging.getLogger()
    absl_logger = absl_logging.get_absl_logger()
    self._root_level, self._absl_level = root.level, absl_logger.level
    formatter = absl_logging.PythonFormatter()
    self._saved = list(root.handlers)
    self._removed = [h for h in root.handlers if _is_console(h)]
    for handler in self._removed:
      root.removeHandler(handler)
    self._console = ConsoleHandler(
        logging.NOTSET if _logs_wanted_on_stderr() else self.console_level)
    self._console.setFormatter(formatter)
    self._buffer = _Buffer()
    self._buffer.setLevel(self.file_level)
    root.addHandler(self._console)
    root.addHandler(self._buffer)
    # INFO must reach the handlers; a finer level set by the user (absl -v 1) is kept.
    if root.getEffectiveLevel() > self.file_level:
      root.setLevel(self.file_level)
    if absl_logger.level > self.file_level:
      absl_logger.setLevel(self.file_level)
    return self

  def open(self, path) -> None:
    """Appends this run's records to ``path`` from now on (and the ones kept so far)."""
    if self._file is not None:
      raise RuntimeError(f'RunLog already writes to {self.path}')
    self.path = str(path)
    handler = logging.FileHandler(self.path, mode='a', encoding='utf-8')
    handler.setLevel(self.file_level)
    handler.setFormatter(absl_logging.PythonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    self._file = handler
    if self._buffer is not None:
      root.removeHandler(self._buffer)
      for record in self._buffer.records:
        if record.levelno >= handler.level:
          handler.handle(record)
      self._buffer = None

  def __exit__(self, *exc) -> None:
    root = logging.getLogger()
    mine = [h for h in (self._file, self._buffer, self._console) if h is not None]
    for handler in mine:
      root.removeHandler(handler)
      handler.close()
    self._file = self._buffer = self._console = None
    # The caller's handlers in their order (handlers others added meanwhile stay, after them).
    added = [h for h in root.handlers if h not in self._saved]
    for handler in list(root.handlers):
      root.removeHandler(handler)
    for handler in self._saved + added:
      root.addHandler(handler)
    self._saved, self._removed = [], []
    root.setLevel(self._root_level)
    absl_logging.get_absl_logger().setLevel(self._absl_level)
