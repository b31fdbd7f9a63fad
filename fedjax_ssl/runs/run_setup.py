"""A run's first stage (`training.setup`): the config checked against the workdir's, the data, the
algorithm, the strategy and the compiled round, as one `Run` that the later stages share, and the
run's round-0 state (`InitialState`)."""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_ssl import algorithms, configuration, evaluation, experiment
from fedjax_ssl import config_validation as cv
from fedjax_ssl.algorithms import Plan
from fedjax_ssl.core import autotune, comm, placement, strategies
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import Algorithm
from fedjax_ssl.core.state import FedState
from fedjax_ssl.data import partition
from fedjax_ssl.data.info import DatasetInfo
from fedjax_ssl.data.types import Dataset, FedData, Rows
from fedjax_ssl.runs import checkpoint, logging_utils, numerics, resuming
from fedjax_ssl.runs.run_dir import RunDir


class InitialState:
  """The run's round-0 state, built anew on each call (it holds every client's state, so a run
  keeps one copy); with several processes, global arrays (every process built the same data and
  state). On the device it is one compiled program (`rd.compiled_init`, cached across runs); an
  `init` that cannot be traced runs eagerly, with a warning."""

  def __init__(self, config: ml_collections.ConfigDict, algo: Algorithm, init_key: jax.Array):
    self._config, self._algo, self._key = config, algo, init_key
    self._init_fn = None  # the compiled `algo.init` on first use; False: eager

  def __call__(self) -> FedState:
    config, algo = self._config, self._algo
    if self._init_fn is None and config.client_state == 'device':
      self._init_fn = rd.compiled_init(algo, config.num_clients)
    held = None
    if config.placement == 'divided':
      held = (jax.process_index(), jax.process_count())
    try:
      state = rd.init_state(algo, self._key, config.num_clients,
                            client_state=config.client_state, init_fn=self._init_fn or None,
                            process=held)
    except jax.errors.JAXTypeError as e:  # a Python-side init (concrete values): run it eagerly
      if not self._init_fn:
        raise
      logging.warning('%s.init cannot be one program (%s): initialised eagerly', algo.name,
                      str(e).splitlines()[0][:200])
      self._init_fn = False
      state = rd.init_state(algo, self._key, config.num_clients, client_state=config.client_state,
                            process=held)
    # A held block differs per process: it stays this process's own (numpy, or its device).
    return state.replace(server=strategies.replicate(state.server),
                         round=strategies.replicate(state.round),
                         clients=(state.clients if config.client_state == 'host' or held else
                                  strategies.replicate(state.clients)))


@dataclasses.dataclass(frozen=True)
class Run:
  """A run once set up (`setup`), built once: what its later stages share.

  Attributes:
    config: the run's config; rundir: its run directory (`RunDir`: the run's files, written by
      process 0 only); console: this process's console (`logging_utils.Console`).
    dataset; fed_data: what the round step takes: the federated data replicated over the
    processes, or under placement 'divided' this process's `placement.LocalClients`; algo: the
    Algorithm;
    plan: the algorithm's run plan, or None; round_cfg: the RoundConfig; init_key, run_key: the
    keys of the initial state and of the rounds; choice: the resolved strategy; round_step: the
    compiled round; per_participant: message sizes per cohort (`rd.message_bytes`); changes: the
    config's changes against the workdir's config.json ({} when none or new); host: the numerics
    host the run started on (`numerics.numerics_host`), recorded in strategy.json; initial_state:
    builds the round-0 state (`InitialState`); client_splits: with config.per_client_eval, each
    client's held-out test rows (`evaluation.client_test_splits`), else None; train_features:
    under placement 'divided' with a shared encoder the training split's features from the rows
    this process holds (`TrainFeatures`), else None (every process embeds dataset.train_x;
    None also where some rows are in no client or the images are unlabelled); client_blocks: under
    placement 'divided' with personalised models, the block of each cohort's clients this process
    holds and scores (`evaluation.evaluate`), else None.
  """
  config: ml_collections.ConfigDict
  rundir: RunDir
  console: logging_utils.Console
  dataset: Dataset
  fed_data: FedData
  algo: Algorithm
  plan: Optional[Plan]
  round_cfg: rd.RoundConfig
  init_key: jax.Array
  run_key: jax.Array
  choice: autotune.Choice
  round_step: Callable
  per_participant: tuple[comm.MessageBytes, ...]
  changes: dict[str, tuple[Any, Any]]
  host: dict
  initial_state: InitialState
  client_splits: Optional[list]
  train_features: Optional['TrainFeatures'] = None
  client_blocks: Optional[tuple[placement.StateBlock, ...]] = None

  @property
  def divided_evaluation(self) -> bool:
    """Whether an evaluation gathers from every process (so each process must run it)."""
    return self.train_features is not None or self.client_blocks is not None

  @property
  def evaluation_inputs(self) -> dict:
    """`evaluation.evaluate`'s keyword arguments of a divided evaluation."""
    return dict(train_features=self.train_features, client_blocks=self.client_blocks)


@dataclasses.dataclass(frozen=True)
class TrainFeatures:
  """Under placement 'divided': the training split's features [N, d] on every process, each
  process embedding only the rows it holds (its clients' rows, and the public set, which every
  process holds) and one gather (`placement.gather_rows`) bringing the others'. The rows a
  process embeds are the same bytes as the whole split's, so the features and every metric equal
  a single process's (the extraction of a row does not depend on its batch on the CPUs checked:
  docs/notes/engine.md#eng-92).

  Attributes:
    local: this process's `placement.LocalClients`.
    dataset: the run's Dataset without its training images (its mean / std normalise the rows).
    rows: int64 [Σ n]: the training-split row of each federation row (client by client).
    public_idx: int64 [L]: the training-split rows of the public set.
  """
  local: placement.LocalClients
  dataset: Dataset
  rows: np.ndarray
  public_idx: np.ndarray

  @classmethod
  def build(cls, local: placement.LocalClients, dataset: Dataset, info: dict
            ) -> Optional['TrainFeatures']:
    """None when the clients do not train on the training split (unlabelled images) or some of
    its rows are in no client and not public: then every process keeps and embeds the split."""
    if dataset.unlabeled_x is not None:
      return None
    rows = np.concatenate([np.asarray(i, np.int64) for i in info['indices']])
    public_idx = np.asarray(info['public_idx'], np.int64)
    covered = np.zeros(len(dataset.train_y), np.int64)
    np.add.at(covered, np.concatenate([rows, public_idx]), 1)
    if not np.all(covered == 1):
      return None
    return cls(local=local, dataset=_no_train_rows(dataset), rows=rows, public_idx=public_idx)

  def __call__(self, algo: Algorithm, variables: Any) -> np.ndarray:
    """[N, d] float: row i the features of dataset.train_x[i], equal on every process."""
    embed = lambda x: np.asarray(evaluation.encoder_features(algo, variables, False, x,
                                                             self.dataset))
    fed = placement.gather_rows(embed(self.local.x), self.local)
    out = np.empty((len(self.dataset.train_y),) + fed.shape[1:], fed.dtype)
    out[self.rows] = fed
    if len(self.public_idx):
      out[self.public_idx] = embed(self.local.public_x)
    return out


def _no_train_rows(dataset: Dataset) -> Dataset:
  """`dataset` with a training split of no images (a new empty array: a slice would keep the
  whole split alive); labels, test split and statistics kept."""
  return dataclasses.replace(dataset, train_x=np.empty((0,) + dataset.train_x.shape[1:],
                                                       dataset.train_x.dtype))


def drop_train_rows(run: Run) -> Run:
  """Under a divided evaluation (`run.train_features`), the run without the training images this
  process does not hold, once the references (the raw-pixel row reads every image) are done: the
  process's resident client data is then its block. Fine-tuning reads its labelled subsets from
  the split, so with config.finetune the split stays."""
  if run.train_features is None or run.config.finetune != 'none':
    return run
  return dataclasses.replace(run, dataset=_no_train_rows(run.dataset))


def _divide(config, algo: Algorithm, dataset: Dataset, fed_data: Optional[FedData], info: dict,
            initial_state: InitialState) -> tuple[placement.LocalClients, bool]:
  """This process's share of the clients under placement 'divided': read from the training split
  (`placement.divide_rows`: this process's rows only), or cut from the whole `fed_data` when the
  clients train on unlabelled images; and whether the algorithm evaluates one model per client
  (each process then scores the clients it holds). ConfigError before compute when the process
  count cannot divide the clients (of every cohort), the algorithm reads other clients before a
  round, or per-client results are asked of cohorts."""
  try:
    rd.validate(experiment.round_config(config), config.num_clients, algo)
  except ValueError as e:
    raise cv.ConfigError(f'config.{e}') from None
  # This process's block of the initial state (1/P of it) tells whether the clients keep a state
  # and whether evaluation scores each client's model; building it needs one client per process
  # (of each cohort) at least.
  _check_processes(config, algo, stateful=False)
  state = initial_state()
  _check_processes(config, algo, stateful=bool(jax.tree_util.tree_leaves(state.clients)))
  per_client = bool(algo.eval_variables(state)[1])
  del state
  if config.per_client_eval and algo.cohorts:
    raise cv.ConfigError(f"config.per_client_eval = True is invalid for algorithm "
                         f"{config.algorithm!r} under placement 'divided': a client's model is "
                         "held by its cohort's block, its rows by its id's block; use "
                         "'replicated'")
  if fed_data is not None:
    return placement.divide(fed_data, jax.process_index(), jax.process_count()), per_client
  return placement.divide_rows(dataset.train_x, dataset.train_y, info['indices'],
                               info['public_idx'], jax.process_index(),
                               jax.process_count()), per_client


def _check_processes(config, algo: Algorithm, stateful: bool) -> None:
  try:
    placement.check_processes(config.num_clients, jax.process_count(), stateful,
                              [(c.name, len(c.members)) for c in algo.cohorts or ()])
  except ValueError as e:
    raise cv.ConfigError(f'{e} (--num_processes)') from None


def checkpoint_form(run: Run, state: FedState, round_idx: int) -> FedState:
  """The state as the checkpoint of `round_idx` stores it: under placement 'divided' with a client
  state (`_held`), each cohort's held rows as one array of all its clients cut over the processes
  (each process writes its block), beside `round_idx` in every client's row (`stale_block`
  compares it on restore); otherwise the state itself."""
  if not _held(run, state.clients):
    return state
  return state.replace(clients=_per_cohort(run, state.clients, lambda stack, block: (
      placement.to_global({_STATES: stack,
                           _BLOCK_ROUND: np.full([block.hi - block.lo], round_idx, np.int32)},
                          block.num))))


def checkpoint_template(run: Run, state: FedState) -> FedState:
  """The template `checkpoint_form(state)` is restored into (cut for this run's processes)."""
  if not _held(run, state.clients):
    return state
  return state.replace(clients=_per_cohort(run, state.clients, lambda stack, block: (
      placement.global_template({_STATES: stack,
                                 _BLOCK_ROUND: np.zeros([block.hi - block.lo], np.int32)},
                                block.num))))


def stale_block(run: Run, round_idx: int, restored: FedState) -> str | None:
  """Why the restored checkpoint of `round_idx` cannot be trusted, or None. Under placement
  'divided' each process writes its own block of the client states; a block that another
  checkpoint wrote (a process's files copied or synced from elsewhere) has the same shapes and
  reads back without error, so each client's row carries the round its block was saved at."""
  if not _held(run, restored.clients):
    return None
  groups = rd.cohorts(run.algo, run.config.num_clients)
  for cohort, form, block in zip(groups, rd.cohort_stacks(run.algo, restored.clients),
                                 _blocks(run)):
    saved = placement.to_held(form[_BLOCK_ROUND])
    wrong = np.flatnonzero(saved != round_idx)
    if wrong.size:
      ids = [cohort.members[block.lo + i] for i in wrong]
      named = (f'{ids[0]}-{ids[-1]}' if ids == list(range(ids[0], ids[-1] + 1)) else
               ', '.join(map(str, ids[:8])) + (', ...' if len(ids) > 8 else ''))
      return (f'checkpoint of round {round_idx} holds a block of another checkpoint: clients '
              f'{named} were saved at round {saved[wrong[0]]}')
  return None


def from_checkpoint(run: Run, state: FedState) -> FedState:
  """The inverse of `checkpoint_form` on a restored state, placed as a fresh run's state is. With
  one process the arrays are made uncommitted: orbax commits them to one device, which a 'shard'
  round over several devices refuses to mix with its mesh."""
  if _held(run, state.clients):
    state = state.replace(clients=_per_cohort(
        run, state.clients, lambda form, block: placement.to_held(form[_STATES])))
    if run.config.client_state == 'device':  # back on this process's first device, as init puts it
      state = state.replace(clients=jax.tree_util.tree_map(jnp.asarray, state.clients))
  if strategies.multi_process():
    return state
  return state.replace(server=_uncommitted(state.server), round=_uncommitted(state.round),
                       clients=(state.clients if run.config.client_state == 'host' else
                                _uncommitted(state.clients)))


def _uncommitted(tree):
  def one(a):
    if not isinstance(a, jax.Array):
      return a
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(_uncommitted(jax.random.key_data(a)),
                                      impl=jax.random.key_impl(a))
    return jnp.asarray(np.asarray(a))
  return jax.tree_util.tree_map(one, tree)


# The keys of a divided checkpoint's client tree (one per cohort): the held states, and the round
# each row was saved at.
_STATES, _BLOCK_ROUND = 'states', 'block_round'


def _blocks(run: Run) -> tuple[placement.StateBlock, ...]:
  return rd.state_blocks(run.algo, run.config.num_clients, jax.process_index(),
                         jax.process_count())


def _per_cohort(run: Run, clients, fn: Callable) -> Any:
  """`clients` with fn(stack, block) applied to each cohort's stack and this process's block of
  it."""
  out = tuple(fn(stack, block) for stack, block in
              zip(rd.cohort_stacks(run.algo, clients), _blocks(run)))
  return out if run.algo.cohorts else out[0]


def _held(run: Run, clients) -> bool:
  """Whether `clients` (a state's, or a restored checkpoint's) is this process's block of the
  client states (placement 'divided'), not empty."""
  return run.config.placement == 'divided' and bool(jax.tree_util.tree_leaves(clients))


def setup(config, rundir: RunDir, ckpt: checkpoint.Checkpointer, *,
          console: logging_utils.Console | None = None, allow_config_change: bool = False,
          cache_dir=None) -> tuple[Run, FedState]:
  """Checks the config against the workdir's, loads and partitions the data, builds the algorithm,
  resolves the strategy (measured once per program under `cache_dir` when 'auto'; a resume keeps
  its own) and compiles the round; logs the run's header lines. Nothing is trained. Returns
  (`Run`, its initial state): the state is built once, as it holds every client's state."""
  console = console or logging_utils.Console()
  console.log(f'workdir {rundir.path}; config {json.dumps(config.to_dict(), sort_keys=True)}')
  changes = _changes(config, rundir, ckpt, allow_config_change, console)
  known_before_loading = configuration.dataset_info(config) is not None
  divided = config.placement == 'divided'
  # Under placement 'divided' each process reads only its block of the training rows (fine-tuning
  # reads labelled subsets from the whole split); sources that cannot read by row give arrays.
  dataset = experiment.load_data(config, rows_on_demand=divided and config.finetune == 'none')
  if not known_before_loading:  # validate_config could not check the sizes: check them now
    configuration.check_data_config(config, DatasetInfo.of(dataset))
  if divided and dataset.unlabeled_x is None:
    fed_data, info = None, experiment.draw_rows(config, dataset)  # the images come in `_divide`
    sizes = np.array([len(i) for i in info['indices']], np.int32)
  else:  # the whole federation; under 'divided' (unlabelled images) on the host, then cut
    fed_data, info = experiment.build_fed_data(config, dataset, on_host=divided)
    sizes = np.asarray(fed_data.n)
  console.say(_data_summary(config, dataset) + '\n' +
              partition.format_histogram(info['histogram']))
  # Per-client results (issue 69): the splits, refused before any compute when a client's is small.
  splits = (evaluation.client_test_splits(config, dataset, info['histogram'])
            if config.per_client_eval else None)
  algo = experiment.build_algorithm(config, dataset, client_sizes=sizes)
  plan = experiment.run_plan(config, dataset, sizes)
  if plan is not None:
    console.say(plan.text)
  init_key, run_key = experiment.run_keys(config)
  initial_state = InitialState(config, algo, init_key)
  train_features = client_blocks = None
  if divided:
    fed_data, per_client = _divide(config, algo, dataset, fed_data, info, initial_state)
    whole = placement.federation_shapes(fed_data)  # message sizes: traced, no rows needed
    if per_client:
      client_blocks = rd.state_blocks(algo, config.num_clients, jax.process_index(),
                                      jax.process_count())
    else:
      train_features = TrainFeatures.build(fed_data, dataset, info)
    if train_features is None and isinstance(dataset.train_x, Rows):
      # Rows in no client (TrainFeatures.build), or one model per client, scored on the whole
      # split by the process holding it: every process keeps the split.
      dataset = dataclasses.replace(dataset, train_x=np.asarray(dataset.train_x))
  else:
    fed_data = whole = strategies.replicate(fed_data)
  # The strategy: 'auto' is measured once per program (cached under cache_dir); a resumed run keeps
  # the one it started with, since strategies agree only to float rounding.
  stored = numerics.stored_strategy(rundir, ckpt, config.map_chunk_size, console)
  choice, round_step = experiment.choose_strategy(config, algo, fed_data, initial_state, run_key,
                                                  cache_dir=cache_dir, stored=stored)
  host = numerics.numerics_host()
  moved = numerics.host_change(stored, host)
  if moved:
    console.report(moved)
  if (stored or {}).get('host') is not None:
    host = stored['host']   # the record keeps the host the run started on, whatever it lacks
  console.say(_header(config, algo, choice))
  state = initial_state()
  round_cfg = experiment.round_config(config)
  per_participant = rd.message_bytes(algo, round_cfg, config.num_clients, state, whole)
  del whole  # under 'divided' this process keeps its own clients' rows only
  console.say('communication per participant and round: ' + ', '.join(
      f'{c.name}: up {b.up:,} B, down {b.down:,} B'
      for c, b in zip(rd.cohorts(algo, config.num_clients), per_participant)))
  return Run(config=config, rundir=rundir, console=console, dataset=dataset, fed_data=fed_data,
             algo=algo, plan=plan, round_cfg=round_cfg, init_key=init_key, run_key=run_key,
             choice=choice, round_step=round_step, per_participant=per_participant,
             changes=changes, host=host, initial_state=initial_state, client_splits=splits,
             train_features=train_features, client_blocks=client_blocks), state


def _changes(config, rundir: RunDir, ckpt: checkpoint.Checkpointer, allow_config_change: bool,
             console: logging_utils.Console) -> dict:
  """The config's changes against the workdir's config.json, refused (before loading anything)
  when a resume may not make them."""
  stored = resuming.stored_config(rundir)
  changes = resuming.config_changes(stored, config) if stored is not None else {}
  if changes and ckpt.all_rounds():  # DP-FedAvg's ledger: no change, even when allowed
    resuming.refuse_dp_changes(changes, algorithms.registry.dp_enabled(config))
  if changes and ckpt.all_rounds() and not allow_config_change:
    resuming.refuse_changed_config(rundir, changes)
  elif changes and not ckpt.all_rounds():
    console.report(f'warning: the config differs from the workdir\'s config.json '
                   f'({resuming.format_changes(changes)}) and there is no checkpoint to '
                   'resume: starting over from round 0')
  return changes


def _data_summary(config, dataset: Dataset) -> str:
  scheme = config.partition + (f'(alpha={config.alpha})' if config.partition == 'dirichlet' else
                               f'(k={config.classes_per_client})' if config.partition == 'classes'
                               else '')
  public = f', {config.public_size} public' if config.public_size else ''
  unlabelled = ('' if dataset.unlabeled_x is None else
                f' (the clients train on {len(dataset.unlabeled_x)} unlabelled images)')
  return (f'{dataset.name}: {len(dataset.train_y)} train / {len(dataset.test_y)} test '
          f'images{unlabelled}{public}; {config.num_clients} clients, {scheme} partition, '
          f'{config.clients_per_round} per round')


def _header(config, algo: Algorithm, choice: autotune.Choice) -> str:
  devices = jax.device_count()
  encoders = (', '.join(f'{c.name} x{len(c.members)}' for c in algo.cohorts) if algo.cohorts
              else config.encoder)
  return (f'{algo.name} / {config.ssl_method}, {encoders} encoder, {config.rounds} '
          f'round{"s" if config.rounds > 1 else ""}; jax on {jax.default_backend()} ({devices} '
          f'device{"s" if devices > 1 else ""}), {choice.text()}')
