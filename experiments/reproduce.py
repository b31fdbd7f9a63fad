r"""Reproduce a results table: every cell x seed through the training binary's code path.

  python -m experiments.reproduce --table configs/fedssl/fmnist.py --out DIR
  python -m experiments.reproduce --table configs/fedssl/fmnist.py --out DIR --seeds 0,1,2 \
      --scale evidence --only 'fedbyol.*'
  python -m experiments.reproduce --table configs/fedssl/fmnist.py --out DIR --list

What a rerun finishes, what DIR holds and `--recompute_references`:
docs/notes/harness.md#reproduce-binary.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shlex
import sys
import traceback

from absl import app, flags

# First thing, before anything runs on JAX: glibc's malloc keeps freed memory from here on, so that
# repeated XLA:CPU executions reuse their temporaries instead of page-faulting fresh ones every call
# (fedjax_ssl/core/host_memory.py; FEDJAX_SSL_MALLOC=system keeps glibc's defaults). mallopt governs
# later allocations only; importing jax (which fedjax_ssl.core does) creates none of XLA's buffers.
# Only as a program: importing this module (tests) changes nothing.
from fedjax_ssl.core import host_memory

if __name__ == '__main__':
  host_memory.keep_freed_memory()

import jax  # noqa: E402
import tqdm  # noqa: E402

from fedjax_ssl import config_validation as cv  # noqa: E402
from fedjax_ssl import configuration, experiment, files, tables  # noqa: E402
from fedjax_ssl.core import autotune, compilation  # noqa: E402
from fedjax_ssl.runs import logging_utils, shared_references, training  # noqa: E402
from fedjax_ssl.runs.run_dir import RunDir  # noqa: E402

_TABLE = flags.DEFINE_string('table', None, 'Table file (configs/<paper>/<table>.py).')
_OUT = flags.DEFINE_string('out', None, 'Output directory (runs/ and table.{csv,md,png}).')
_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'Comma-separated integer seeds.')
_SCALE = flags.DEFINE_enum('scale', 'quick', list(tables.SCALES),
                           'quick: a smoke-sized grid on a 2-core CPU; evidence: the CPU budget at which the '
                           'methods learn (tables that define it); paper: the paper.')
_ONLY = flags.DEFINE_multi_string('only', [], 'Cell names or fnmatch patterns to run (repeatable).')
_LIST = flags.DEFINE_bool('list', False, 'Print the cells and their run directories, then exit.')
_RECOMPUTE_REFERENCES = flags.DEFINE_bool(
    'recompute_references', False,
    'Train nothing: evaluate the per-seed references (random-init encoder, raw pixels) of the '
    'cells that OUT/table.csv carries without them, pair them with those cells\' seeds, and '
    'rewrite the table.')
_RENDER_ONLY = flags.DEFINE_bool(
    'render_only', False,
    'Train nothing: rebuild OUT/table.{csv,md,png} from the runs on disk and the cells OUT/table.csv '
    'carries (after a change of the harness: the collapse rule, the verdicts).')
flags.mark_flags_as_required(['table', 'out'])
_OVERRIDE = re.compile(r'^--?(no)?config\.([^=]+)(?:=(.*))?$', re.DOTALL)


def parse_seeds(values) -> list:
  try:
    seeds = [int(v) for v in values]
  except ValueError:
    raise cv.ConfigError(f'--seeds = {",".join(values)!r} is invalid: must be comma-separated '
                         'integers') from None
  if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
    raise cv.ConfigError(f'--seeds = {seeds} is invalid: must be distinct non-negative integers')
  return seeds


def _parse_value(key: str, text, default):
  """`text` as the type of the key's default (bool, int, float or str)."""
  if isinstance(default, bool):
    if text.lower() in ('true', '1'):
      return True
    if text.lower() in ('false', '0'):
      return False
    raise cv.ConfigError(f'--config.{key}={text} is invalid: must be true or false')
  for kind in (int, float):
    if isinstance(default, kind):
      try:
        return kind(text)
      except ValueError:
        raise cv.ConfigError(f'--config.{key}={text} is invalid: must be a {kind.__name__}') from None
  return text


def split_overrides(argv):
  """(argv without the `--config.KEY=VALUE` flags, {key: value}) for overrides that apply to every
  cell. Values take the type of the key's default; `--config.KEY` / `--noconfig.KEY` set a bool.
  An unknown key is a cv.ConfigError naming it and the closest known keys."""
  reference = experiment.default_config()
  rest, overrides = [argv[0]], {}
  for i, arg in enumerate(argv[1:], 1):
    if arg == '--':
      rest += argv[i:]
      break
    match = _OVERRIDE.match(arg)
    if not match:
      rest.append(arg)
      continue
    error = cv.unknown_override([argv[0], arg], reference)
    if error is not None:
      raise error
    negate, key, text = match.groups()
    default = reference
    for part in key.split('.'):
      default = default[part]
    if text is None or negate:
      if not isinstance(default, bool) or text is not None:
        raise cv.ConfigError(f'{arg} is invalid: give a value, --config.{key}=VALUE')
      overrides[key] = not negate
    else:
      overrides[key] = _parse_value(key, text, default)
  return rest, overrides


def _write_error(rundir: RunDir, exc: BaseException) -> None:
  rundir.path.mkdir(parents=True, exist_ok=True)
  text = ''.join(traceback.format_exception_only(type(exc), exc)).strip()
  files.write_json(rundir.error_file, {'error': text, 'traceback': traceback.format_exc()},
                   sort_keys=False)


# Under OUT, when the binaries' cache folder is off ($FEDJAX_SSL_CACHE_DIR=''): the reference rows
# shared by the runs that read the same pixels (else CACHE_DIR/references,
# shared_references.REFERENCES).
REFERENCES = 'references'


def _reference_cache(out: pathlib.Path) -> str:
  """The folder where the table's runs share their reference evaluations."""
  cache_dir = compilation.resolve_cache_dir(None)
  return str(cache_dir / shared_references.REFERENCES if cache_dir is not None else out / REFERENCES)


def run_table(table_path: str, out: str, seeds, scale: str = 'quick', only=(),
              command: str = '', overrides=None, smoke: bool = False) -> list:
  """Runs what is missing of the table and writes its outputs; returns the summary rows.
  `overrides` (config key -> value) apply to every cell (`tables.with_overrides`). `smoke` runs
  only the first valid run of the plan, its config shrunk by `configuration.smoke`."""
  # Imported here, after flag parsing: the training binary's module defines its own required flags.
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  # Library INFO chatter of the planning phase (the jax backend's start, validation) goes to a file;
  # each run routes its own logs to its workdir's train.log.
  with logging_utils.RunLog() as log:
    log.open(str(out / 'reproduce.log'))
    table = tables.with_overrides(tables.load_table(table_path, scale), overrides or {})
    runs = tables.plan_runs(table, seeds, only)
    if smoke:
      runs = [dataclasses.replace(r, config=configuration.smoke(r.config))
              for r in runs if r.config is not None][:1]
    # The outputs summarise every run of the table under OUT, and keep the earlier table.csv's
    # entries of cells with no run here (read once: each write below replaces the file).
    summarised = tables.table_runs(table, runs, out)
    previous = tables.read_csv(out / 'table.csv')
    shown_seeds = sorted({r.seed for r in summarised} |
                         {s for e in previous for s in e['seeds']})

  def write():
    summary = tables.carry_over(table, tables.summarize(table, summarised, out), previous)
    tables.write_outputs(table, summary, out, shown_seeds, command)
    return summary
  # The seeds of a cell compile the same programs, and 'auto' measures each program once: the
  # binaries' cache folder ($FEDJAX_SSL_CACHE_DIR, else ~/.cache/fedjax_ssl; core/compilation.py).
  try:
    cache_dir = (compilation.enable_cache() if not jax.config.jax_compilation_cache_dir else
                 compilation.resolve_cache_dir(None))
    autotune.check_environment()
  except ValueError as e:
    raise cv.ConfigError(str(e)) from None
  todo = [r for r in runs if tables.run_status(r, out)[0] in ('missing', 'failed')
          and r.config is not None]
  grid = tqdm.tqdm(total=len(runs), initial=len(runs) - len(todo), desc=table.name, position=0,
                   dynamic_ncols=True)
  for run in todo:
    grid.set_postfix_str(run.name)
    rundir = RunDir(run.workdir(out))
    rundir.error_file.unlink(missing_ok=True)
    try:
      training.train_and_evaluate(run.config, str(rundir.path), verbose=False, bar_position=1,
                                  reference_cache=_reference_cache(out), cache_dir=cache_dir)
    except Exception as e:  # pylint: disable=broad-except
      # Recorded in the table and retried on the next invocation; the other runs go on.
      _write_error(rundir, e)
      tqdm.tqdm.write(f'run {run.name} failed: {type(e).__name__}: {e}')
    grid.update(1)
    write()
  grid.close()
  summary = write()
  tables.plot_curves(table, tables.curves(table, summarised, out), out / 'curves.png')
  return summary


def recompute_references(table_path: str, out: str, scale: str = 'quick', command: str = '',
                         overrides=None, references: bool = True) -> list:
  """Rewrites the table from the runs on disk and table.csv, training nothing; with `references`
  it first pairs the seeds of the cells table.csv carries without per-seed references (a csv written
  before those columns existed) with their references, and rewrites the table; returns the
  summary rows. Each (cell, seed) gets the random-init and raw-pixel evaluations its run recorded
  at round 0 (`shared_references.reference_evaluations`: the cell's config at that seed, nothing trained);
  `tables.fill_references` takes them only where they reproduce the stored means, and the
  cells it leaves unpaired are printed with their gaps."""
  out = pathlib.Path(out)
  if not (out / 'table.csv').exists():
    raise cv.ConfigError(f'--recompute_references: {out / "table.csv"} does not exist (nothing '
                         'is carried): run the table first')
  with logging_utils.RunLog() as log:
    log.open(str(out / 'reproduce.log'))
    table = tables.with_overrides(tables.load_table(table_path, scale), overrides or {})
    previous = tables.read_csv(out / 'table.csv')
    summarised = tables.table_runs(table, [], out)
    backfilled = 0
    if references:  # finished runs recorded before their raw-pixel reference existed
      for run in summarised:
        if tables.run_status(run, out)[0] == 'done' and run.config is not None:
          backfilled += shared_references.add_raw_pixel_reference(
              run.config, RunDir(run.workdir(out)), _reference_cache(out)) is not None
    summary = tables.carry_over(table, tables.summarize(table, summarised, out), previous)
    todo = tables.without_references(summary) if references else {}
    runs = {}
    seeds = sorted({s for ss in todo.values() for s in ss})
    for run in tables.plan_runs(table, seeds, sorted(todo)):
      for row, column in run.cells:
        runs[(tables.cell_id(row, column), run.seed)] = run
    pairs = [(cell, s) for cell, ss in todo.items() for s in ss]
    references, memo = {}, {}
    for cell, seed in tqdm.tqdm(pairs, desc=f'{table.name} references', dynamic_ncols=True):
      run = runs[(cell, seed)]
      if run.config is None:
        raise cv.ConfigError(f'cell {cell!r} at seed {seed}: {run.config_error}')
      references[(cell, seed)] = shared_references.reference_evaluations(run.config, _reference_cache(out),
                                                             memo)
    problems = tables.fill_references(summary, references)
    shown_seeds = sorted({s for e in summary for s in e['seeds']})
    # table.md keeps the command that produced its values, when it names one, and the note after
    # it (how the runs were split between processes or sessions).
    found = re.search(r'^Command: `([^`]*)`(.*)$', (out / 'table.md').read_text(), re.M) if (
        out / 'table.md').exists() else None
    tables.write_outputs(table, summary, out, shown_seeds, found.group(1) if found else command,
                         found.group(2).strip() if found else '')
  print(f'{len(todo)} cells, {len(pairs)} (cell, seed) references, {len(memo)} distinct '
        f'random-init evaluations; raw-pixel reference added to {backfilled} finished runs')
  for line in problems:
    print(f'unpaired: {line}')
  return summary


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  seeds = parse_seeds(_SEEDS.value)
  overrides = _OVERRIDES
  if _LIST.value:
    with logging_utils.RunLog():  # library INFO lines are dropped: this only prints the plan
      table = tables.with_overrides(tables.load_table(_TABLE.value, _SCALE.value), overrides)
      runs = tables.plan_runs(table, seeds, _ONLY.value)
    for run in runs:
      cells = ', '.join(tables.cell_id(*c) for c in run.cells)
      print(f'{run.name:40s} cells: {cells}' + (f'  INVALID: {run.config_error}'
                                                if run.config_error else ''))
    return
  # The command as typed, overrides included: the table's record of how to reproduce it.
  command = 'python -m experiments.reproduce ' + ' '.join(shlex.quote(a) for a in _TYPED_ARGS)
  if _RECOMPUTE_REFERENCES.value or _RENDER_ONLY.value:
    recompute_references(_TABLE.value, _OUT.value, _SCALE.value, command, overrides,
                         references=_RECOMPUTE_REFERENCES.value)
    return
  smoke = configuration.smoke_requested(os.environ)
  summary = run_table(_TABLE.value, _OUT.value, seeds, _SCALE.value, _ONLY.value, command,
                      overrides, smoke=smoke)
  if smoke:  # one shrunk run: the table's other cells and metrics are absent, not failed
    table = tables.with_overrides(tables.load_table(_TABLE.value, _SCALE.value), overrides)
    runs = [r for r in tables.plan_runs(table, seeds, _ONLY.value) if r.config is not None][:1]
    rundir = RunDir(runs[0].workdir(pathlib.Path(_OUT.value))) if runs else None
    failed = rundir is None or rundir.error_file.exists()
    print(f'smoke run ({configuration.SMOKE_ENV}=1): ' + (
        'no valid cell' if rundir is None else
        f'{rundir.path}, ' + (f'failed: see {rundir.error_file}' if failed else 'completed')))
    if failed:
      sys.exit(1)
    return
  failed = sorted({e['cell'] for e in summary if e['errors']})
  print(f'table: {pathlib.Path(_OUT.value) / "table.md"}' +
        (f'   failed cells: {failed}' if failed else ''))


# `--config.KEY=VALUE` flags are taken out before absl parses the rest: the training binary, imported
# by run_table, defines its own --config flag.
_OVERRIDES: dict = {}
_TYPED_ARGS: list = []

if __name__ == '__main__':
  _TYPED_ARGS = sys.argv[1:]
  try:
    sys.argv, _OVERRIDES = split_overrides(sys.argv)
  except cv.ConfigError as e:
    cv.exit_with_error(e)
  cv.run(main)
