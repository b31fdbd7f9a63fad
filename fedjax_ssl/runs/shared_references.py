"""The reference rows a run records at round 0 (`References`) and that runs share: the random-init
encoder's evaluation and the raw-pixel row (`raw_pixel_reference`), kept under CACHE_DIR/references
so that runs of equal inputs evaluate them once; `reference_evaluations` evaluates them for a config
without training and `add_raw_pixel_reference` adds a missing raw-pixel row to a finished run
(both for experiments.reproduce).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import numpy as np

from fedjax_ssl import experiment, files
from fedjax_ssl.core import round as rd
from fedjax_ssl.runs import logging_utils
from fedjax_ssl.runs.run_dir import RunDir

REFERENCES = 'references'  # under the cache folder: reference evaluations shared across runs


@dataclasses.dataclass(frozen=True)
class References:
  """A run's reference rows, recorded at round 0 beside its own evaluations: the random-init
  encoder's (`random_init`, the metrics of `experiment.evaluate`) and the raw pixels' (`raw_pixels`,
  None when the run records none: no logistic probe or fine-tuning, or the synthetic set)."""
  random_init: dict
  raw_pixels: dict | None = None

  def value(self, row: str, key: str) -> float:
    """The row's ('random_init' or 'raw_pixels') value of `key`, NaN when it has none."""
    return (getattr(self, row) or {}).get(key, float('nan'))

  def lines(self, keys) -> dict:
    """{metric: {label: value}}: the random-init encoder and (where measured) raw pixels, the
    dashed lines of metrics.png's accuracy panels."""
    lines = {}
    for key in keys:
      refs = {'random-init encoder': self.random_init.get(key),
              'raw pixels': (self.raw_pixels or {}).get(key)}
      refs = {label: value for label, value in refs.items() if isinstance(value, (int, float))}
      if refs:
        lines[key] = refs
    return lines


def shared_reference(shared_dir, name: str, key_fn, compute, *, writes: bool = True,
                     console: logging_utils.Console | None = None):
  """(metrics, a note for the log line): SHARED_DIR/<name>-<key_fn()>.json when an earlier run
  with the same key wrote it, else compute(), then written there when this process `writes` (no
  SHARED_DIR: computed). An unreadable file is evaluated again, with a warning on `console`."""
  shared = pathlib.Path(shared_dir) / f'{name}-{key_fn()}.json' if shared_dir else None
  if shared is not None and shared.exists():
    try:
      return json.loads(shared.read_text()), f'(from {shared})'
    except ValueError as e:
      (console or logging_utils.Console()).report(
          f'warning: {shared} cannot be read ({e}): evaluating again')
  t0 = time.time()
  metrics = compute()
  if writes and shared is not None:
    shared.parent.mkdir(parents=True, exist_ok=True)
    with files.writing(shared):
      files.write_json(shared, metrics)
  return metrics, f'({time.time() - t0:.1f}s)'


def raw_pixel_reference(config, dataset, rundir: RunDir | None, *, reuse: bool,
                        shared_dir=None, console: logging_utils.Console | None = None):
  """The raw-pixel reference row and where it came from: WORKDIR/raw_pixels.json when `reuse`
  (the config that wrote config.json is unchanged), else SHARED_DIR/raw_pixels-<key>.json when an
  earlier run with the same `experiment.raw_pixel_key` wrote it, else computed. Computed or shared,
  it is written to the run directory (which stands alone; rundir None: no run directory) and,
  when computed, to shared_dir (by the process whose run directory writes).

  It is the slowest of a run's reference evaluations (docs/notes/performance.md#perf-48), and every
  row of a table at one seed reads the same pixels: the binaries share it across runs through
  CACHE_DIR/references (`compilation.enable_cache`).
  Returns (metrics dict, a note for the log line)."""
  raw_path = rundir.raw_pixels_file if rundir is not None else None
  if reuse and raw_path is not None and raw_path.exists():
    return rundir.read_json(raw_path), f'(from {raw_path.name})'
  metrics, took = shared_reference(shared_dir, 'raw_pixels',
                                   lambda: experiment.raw_pixel_key(config, dataset),
                                   lambda: experiment.raw_pixel_metrics(config, dataset),
                                   writes=rundir is None or rundir.writes, console=console)
  if raw_path is not None:
    rundir.write_json(raw_path, metrics)
  return metrics, took


def reference_evaluations(config, reference_cache: str | None = None,
                          memo: dict | None = None) -> tuple:
  """(random_init, raw_pixels): the references a run of `config` records at round 0
  (random_init.json and raw_pixels.json; raw_pixels None unless config.probe = 'logistic'),
  evaluated the same way without training and without a workdir. For a table cell carried from an
  older table.csv, which kept each seed's result but not its references
  (`experiments.reproduce --recompute_references`).

  `memo` ({`experiment.evaluation_key`: metrics}) shares one random-init evaluation between the
  configs that evaluate equal variables on equal data; `reference_cache` is the raw-pixel cache
  directory of `raw_pixel_reference`."""
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  fed_data, _ = experiment.build_fed_data(config, dataset)
  algo = experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed_data.n))
  init_key, _ = experiment.run_keys(config)
  state = rd.init_state(algo, init_key, config.num_clients, client_state=config.client_state)
  memo = {} if memo is None else memo
  key = experiment.evaluation_key(config, algo, state, dataset)
  if key not in memo:
    memo[key] = experiment.evaluate(config, algo, state, dataset)
  raw_pixels = None
  if experiment.has_raw_pixel_reference(config):  # as a run: `references`
    raw_pixels, _ = raw_pixel_reference(config, dataset, None, reuse=False,
                                        shared_dir=reference_cache)
  return memo[key], raw_pixels


def add_raw_pixel_reference(config, rundir: RunDir, reference_cache: str | None = None
                            ) -> dict | None:
  """Records the raw-pixel reference in a finished run that lacks it, training nothing: a run of
  `config` (its config.json) finished before its reference metrics existed (fine-tuning's raw-pixel
  row came later than the runs of the fine-tuning tables). The row depends on the data and the
  protocol's settings only, not on the run, so evaluating it now gives what the run would have
  recorded at round 0 (`raw_pixel_reference`, through the cross-run cache). Writes raw_pixels.json
  and adds the metrics it lacked to results.json's 'raw_pixels' (every value it had is kept);
  returns the metrics added, or None when the run had them all or records no raw-pixel reference."""
  results = rundir.read_results()
  if results is None:
    raise ValueError(f'{rundir.path} holds no results.json: only a finished run gets references '
                     'added (run it, or resume it, instead)')
  had = results.get('raw_pixels')
  if not experiment.has_raw_pixel_reference(config) or (
      had is not None and set(experiment.finetune_keys(config)) <= set(had)):
    return None  # nothing to add: checked before loading any data
  dataset = experiment.load_data(config)
  metrics, _ = raw_pixel_reference(config, dataset, None, reuse=False, shared_dir=reference_cache)
  had = had or {}
  added = {k: v for k, v in metrics.items() if k not in had}
  rundir.write_json(rundir.raw_pixels_file, {**metrics, **had})
  rundir.write_results({**results, 'raw_pixels': {**had, **added}})
  return added or None
