"""The runner: config -> data -> algorithm (from the registry) -> round step -> evaluation.

The binaries (`experiments/train.py`, `experiments/benchmark/`, ...) and research code share it:

  config = experiment.default_config(); config.update(...)
  experiment.validate_config(config)                 # every error before any compute
  dataset = experiment.load_data(config)
  fed_data, partition_info = experiment.build_fed_data(config, dataset)
  algo = experiment.build_algorithm(config, dataset, client_sizes=fed_data.n)
  round_step = core.make_round_step(algo, experiment.round_config(config), config.num_clients)
  init_key, run_key = experiment.run_keys(config)
  state = core.init_state(algo, init_key, config.num_clients)
  for r in range(config.rounds):
    state, metrics = round_step(state, fed_data, core.round_key(run_key, r))
  results = experiment.evaluate(config, algo, state, dataset)

The configuration (`fedjax_ssl.configuration`) and the evaluation of a federated state
(`fedjax_ssl.evaluation`) live in their own modules; the names above are re-exported here so that
one module carries a run from start to end.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Dict, Optional, Tuple

import jax
import ml_collections
import numpy as np

from fedjax_ssl import algorithms, run_identity
from fedjax_ssl import config_validation as cv
from fedjax_ssl.configuration import (default_config, round_config,  # noqa: F401
                                      validate_config)
from fedjax_ssl.core import autotune, export_cache, fedbuff, placement, rng, strategies
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import Algorithm
from fedjax_ssl.data import partition, sources
from fedjax_ssl.data.types import DataInfo, Dataset, FedData
from fedjax_ssl.ssl import registry as ssl_registry
from fedjax_ssl.evaluation import (check_protocol_plan, encoder_features, evaluate,  # noqa: F401
                                   evaluation_key, finetune_keys, has_raw_pixel_reference,
                                   raw_pixel_key, raw_pixel_metrics)


def run_keys(config: ml_collections.ConfigDict) -> Tuple[jax.Array, jax.Array]:
  """(init_key, run_key) of a run: the model init and every round's randomness
  (round r uses rng.round_key(run_key, r))."""
  return rng.run_keys(config.seed)


def load_data(config: ml_collections.ConfigDict, rows_on_demand: bool = False) -> Dataset:
  """The configured dataset, in host memory (the first `train_size` training examples if > 0, as
  the representation-sharing code's `load_data(reduced=f)`; the test split stays whole). With
  `rows_on_demand` the training images stay in their files where the source reads by row
  (`sources.load_dataset`): placement 'divided' reads each process's rows only."""
  kw = {}
  if config.dataset in sources.FOLDER_NAMES:
    kw['image_size'] = config.image_size
  if config.dataset == 'folder':
    kw['test_fraction'] = config.test_fraction
  ds = sources.load_dataset(config.dataset, source=config.data_source,
                            data_dir=config.data_dir or None, seed=config.seed,
                            rows_on_demand=rows_on_demand, **kw)
  if config.train_size:
    if config.train_size > len(ds.train_y):
      raise cv.ConfigError(f'config.train_size = {config.train_size} is invalid: the {ds.name} '
                           f'training split has only {len(ds.train_y)} examples')
    mean, std = ds.mean, ds.std
    if config.subset_stats:  # the representation-sharing code's load_data normalises after reducing
      mean, std = sources.channel_stats(ds.train_x[:config.train_size])
    ds = dataclasses.replace(ds, train_x=ds.train_x[:config.train_size],
                             train_y=ds.train_y[:config.train_size], mean=mean, std=std)
  check_protocol_plan(config, ds)
  return ds


def _partition_kwargs(config: ml_collections.ConfigDict) -> Dict:
  kw = {}
  if config.partition == 'dirichlet':
    kw['alpha'] = config.alpha
  elif config.partition == 'classes':
    kw['classes_per_client'] = config.classes_per_client
  return kw


@contextlib.contextmanager
def _partition_errors(config: ml_collections.ConfigDict, dataset: Dataset):
  """A partition that cannot be drawn: one line (cv.ConfigError), before any compute."""
  try:
    yield
  except ValueError as e:
    alpha = config.partition == 'dirichlet'
    raise cv.ConfigError(f'config.num_clients = {config.num_clients} with config.partition = '
                         f'{config.partition!r}' + (f' (alpha = {config.alpha})' if alpha
                                                    else '') + f' cannot be drawn on '
                         f'{dataset.name}: {e}') from None


def build_fed_data(config: ml_collections.ConfigDict, dataset: Dataset, on_host: bool = False
                   ) -> Tuple[FedData, Dict]:
  """Partitions `dataset` into the on-device client layout (numpy arrays with `on_host`); the dict
  has the class histogram."""
  with _partition_errors(config, dataset):
    return partition.build_fed_data(dataset, config.num_clients, config.partition,
                                    seed=config.seed, public_size=config.public_size,
                                    on_host=on_host, **_partition_kwargs(config))


def draw_rows(config: ml_collections.ConfigDict, dataset: Dataset) -> Dict:
  """`build_fed_data`'s dict alone (`partition.draw_rows`: the rows of each client and of the
  public set, drawn from the labels), for a labelled training split; no image is read."""
  with _partition_errors(config, dataset):
    return partition.draw_rows(dataset, config.num_clients, config.partition, seed=config.seed,
                               public_size=config.public_size, **_partition_kwargs(config))


def build_algorithm(config: ml_collections.ConfigDict, dataset: Dataset,
                    client_sizes: Optional[np.ndarray] = None) -> Algorithm:
  """The configured Algorithm, built by its registry entry. client_sizes (int [C], `fed_data.n`) is
  needed by FedSC with DP (its noise level and privacy ledger depend on |D_j|); given, the
  objective's `check_clients` runs on it first (MoCo's queue against the smallest client)."""
  objective = ssl_registry.get(config.ssl_method)
  if client_sizes is not None and objective.check_clients is not None:
    objective.check_clients(config[objective.name], np.asarray(client_sizes), config.batch_size)
  return algorithms.registry.build(config, DataInfo.of(dataset, client_sizes))


def run_plan(config: ml_collections.ConfigDict, dataset: Dataset,
             client_sizes: np.ndarray) -> Optional[algorithms.Plan]:
  """What the configured run will spend, known before training (FedSC: its privacy budget)."""
  return algorithms.registry.plan(config, DataInfo.of(dataset, client_sizes))


def strategy_program(config: ml_collections.ConfigDict, fed_data: FedData) -> dict:
  """What identifies a run's round program for `strategy='auto'` (autotune.program_description):
  every config key that shapes the round, the data's shapes, the backend and device."""
  # Under placement 'divided' `fed_data` is this process's LocalClients: the whole federation's
  # row count, the same on every process.
  divided = isinstance(fed_data, placement.LocalClients)
  rows = int(np.sum(fed_data.n)) if divided else fed_data.x.shape[0]
  return autotune.program_description(
      config=run_identity.program_keys(config),
      data={'x': [rows] + list(fed_data.x.shape[1:]), 'n_max': int(fed_data.n_max)})


def export_off_reason(config: ml_collections.ConfigDict, strategy: str) -> Optional[str]:
  """Why a round of `config` under the resolved `strategy` is not exported, None when it is."""
  if config.client_state != 'device':
    return f"client_state = {config.client_state!r} (the round gathers on the host)"
  if config.placement == 'divided':
    return "placement 'divided' (the round gathers its participants' rows on the host)"
  if strategies.multi_process():
    return f'{jax.process_count()} processes'
  if strategies.resolve_strategy(strategy) == 'shard':
    return "strategy 'shard'"
  return None


def exported_step(config: ml_collections.ConfigDict, algo: Algorithm, step, strategy: str,
                  chunk: int, cache_dir):
  """`step` as an `export_cache.ExportedStep` under CACHE_DIR/exports (module docstring of
  core/export_cache.py), or `step` itself with the reason logged when this round is not exported."""
  why = export_off_reason(config, strategy)
  if why is not None:
    logging.info('round step not exported (%s): traced as usual', why)
    return step
  program = dict(config=run_identity.export_keys(config), strategy=strategy, map_chunk_size=chunk)
  sources = export_cache.source_files(algo, algorithms.registry.get(config.algorithm),
                                      ssl_registry.get(config.ssl_method))
  return export_cache.ExportedStep(step, cache_dir, program, sources)


def export_status(step) -> str:
  """results.json's `first_round.export`: 'loaded', 'written' or 'off: <why>'."""
  return getattr(step, 'status', 'off: not exported (see train.log)')


def choose_strategy(config: ml_collections.ConfigDict, algo: Algorithm, fed_data: FedData,
                    fresh_state, run_key: jax.Array, *, cache_dir=None, stored=None
                    ) -> Tuple[autotune.Choice, object]:
  """(the resolved strategy, the run's round step) for `config.strategy` (autotune.resolve):
  'auto' is timed once per program on this backend and kept in CACHE_DIR/strategy.json; `stored`
  (the Choice json of the run being resumed) wins, so that a resume stays bit-exact.

  fresh_state() -> a new initial FedState (the timing rounds run on their own copies; they start
  from the keys of rounds 2**31 - 1, 2**31 - 2, ..., which no run reaches)."""
  round_cfg = round_config(config)

  def make_step(strategy, chunk):
    if isinstance(algo, fedbuff.FedBuffAlgorithm):  # FedBuff's server step (not exported)
      return fedbuff.make_step(
          algo, dataclasses.replace(round_cfg, strategy=strategy, map_chunk_size=chunk),
          config.num_clients)
    step = rd.make_round_step(
        algo, dataclasses.replace(round_cfg, strategy=strategy, map_chunk_size=chunk),
        config.num_clients)
    return exported_step(config, algo, step, strategy, chunk, cache_dir)
  keys = [rng.round_key(run_key, 2**31 - 1 - i) for i in range(1 + autotune.TIMED_ROUNDS)]
  choice, step = autotune.resolve(
      config.strategy, config.map_chunk_size,
      participants=(config.fedbuff.buffer_size if algorithms.registry.fedbuff_enabled(config)
                    else config.clients_per_round),
      description=strategy_program(config, fed_data), cache_dir=cache_dir, stored=stored,
      make_step=make_step, fresh_state=fresh_state, fed_data=fed_data, keys=keys)
  return choice, step or make_step(choice.strategy, choice.map_chunk_size)
