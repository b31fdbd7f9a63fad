r"""Compile one federated round without data or training: the device memory and FLOPs of a config.

  python -m experiments.plan --config configs/fedu2/paper_cross_device.py
  python -m experiments.plan --table configs/fedu2/table2.py          # a table's FLOPs and hours
  python -m experiments.plan --config configs/fedu2/paper_cross_silo.py --measure_rounds 1

What it prints, how close a CPU plan is to the GPU's, `--table`, `--measure_rounds`, `--json` and
the exit statuses: docs/notes/performance.md#plan-binary.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from ml_collections import config_flags

from fedjax_ssl import algorithms, configuration, experiment, run_identity, tables
from fedjax_ssl import config_validation as cv
from fedjax_ssl.core import compilation, local, rng, strategies
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import Algorithm, restore_client
from fedjax_ssl.core.state import FedState
from fedjax_ssl.data import partition, sources
from fedjax_ssl.data.info import DatasetInfo
from fedjax_ssl.data.types import DataInfo, Dataset, FedData


def _define_flags():
  """The binary's flags, defined only when it runs: the tests import this module beside
  experiments.train and experiments.reproduce, whose --config / --table would clash."""
  global _CONFIG, _DEVICE_MEMORY_GB, _MEMORY_FRACTION, _TARGET, _TABLE, _SCALE, _SEEDS, _TFLOPS, _JSON
  global _MEASURE_ROUNDS, _HOSTS, _DEVICES_PER_HOST
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'ml_collections config file.',
                                            lock_config=True)
  _DEVICE_MEMORY_GB = flags.DEFINE_float('device_memory_gb', 80.0,
                                         'Memory of one device in GiB (2^30 bytes).')
  _MEMORY_FRACTION = flags.DEFINE_float(
      'memory_fraction', 0.75, 'Share of the device memory a run may use: 0.75 is what JAX '
      'preallocates on a GPU by default (XLA_PYTHON_CLIENT_MEM_FRACTION; pass the value you set).')
  _TARGET = flags.DEFINE_enum('target', 'gpu', ('gpu', 'cpu'),
                              "The platform the config's 'auto' settings are resolved for "
                              "(strategy, conv_impl); the compile runs on this machine's backend.")
  _TABLE = flags.DEFINE_string('table', None, 'A table file (configs/<paper>/<table>.py): estimate '
                               'its FLOPs and hours instead of planning one config.')
  _SCALE = flags.DEFINE_string('scale', 'paper', 'The table scale (--table).')
  _SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'The table seeds (--table).')
  _TFLOPS = flags.DEFINE_float('tflops', 18.0, 'Sustained TFLOP/s of the hours estimate (--table).')
  _JSON = flags.DEFINE_bool('json', False, 'Print one JSON object instead of the text report.')
  _MEASURE_ROUNDS = flags.DEFINE_integer(
      'measure_rounds', 0, 'After planning, train this many timed rounds (after one warm-up '
      'round) on synthetic images of the planned shape and sizes; 0: plan only.')
  _HOSTS = flags.DEFINE_integer(
      'hosts', 1, 'Machines, one process each (jax.distributed): the report gives the memory per '
      'host and per device and the strategy to use (`topology`).')
  _DEVICES_PER_HOST = flags.DEFINE_integer(
      'devices_per_host', 1, 'Accelerators per host; hosts x devices_per_host devices in all.')


EXIT_DOES_NOT_FIT = 2
GIB = 2**30
# Normalisation statistics of the abstract data: the plan computes nothing, any value compiles the
# same program.
_STATS = 0.5


class Setup(NamedTuple):
  """A config's round, abstractly: `config` with its 'auto' settings resolved, the dataset's info,
  the clients' sizes int64 [C], the abstract FedData and FedState, the built algorithm."""
  config: ml_collections.ConfigDict
  info: DatasetInfo
  sizes: np.ndarray
  data: FedData
  algo: Algorithm
  state: FedState


def resolve_for(config: ml_collections.ConfigDict, target: str) -> ml_collections.ConfigDict:
  """`config` with strategy and conv_impl 'auto' resolved as on `target` ('gpu' | 'cpu')."""
  config = ml_collections.ConfigDict(config.to_dict())
  if config.strategy == 'auto':
    config.strategy = strategies.default_strategy(target)
  if config.conv_impl == 'auto':
    config.conv_impl = 'im2col' if target == 'cpu' else 'xla'
  return config


def balanced_labels(num: int, num_classes: int) -> np.ndarray:
  """int32 [num]: labels with every class equally often (to one), as in CIFAR's splits."""
  return (np.arange(num) % num_classes).astype(np.int32)


def client_sizes(config: ml_collections.ConfigDict, info: DatasetInfo) -> np.ndarray:
  """int64 [C]: each client's examples under the configured partition of balanced labels (the
  same draws as `partition.build_fed_data`; only the class counts enter them). A dataset whose
  clients train on unlabelled images (stl10_unlabelled) splits those (IID)."""
  num_classes = 1 if info.num_unlabeled else info.num_classes
  labels = balanced_labels(info.num_unlabeled or config.train_size or info.num_train, num_classes)
  _, remaining = partition.carve_public(labels, config.public_size, config.seed)
  kw = {'alpha': config.alpha} if config.partition == 'dirichlet' else (
      {'classes_per_client': config.classes_per_client} if config.partition == 'classes' else {})
  parts = partition.partition(labels[remaining], config.num_clients, config.partition,
                              seed=config.seed, num_classes=num_classes, **kw)
  return np.array([len(p) for p in parts], np.int64)


def abstract_fed_data(sizes: np.ndarray, info: DatasetInfo, public_size: int) -> FedData:
  """`FedData` of `jax.ShapeDtypeStruct` leaves for clients of `sizes` (n_max and n_min static, as
  loaded)."""
  rows = max(int(sizes.sum()), 1)
  image = tuple(info.image_shape)
  return FedData(
      x=jax.ShapeDtypeStruct((rows,) + image, jnp.uint8),
      y=jax.ShapeDtypeStruct((rows,), jnp.int32),
      n=jax.ShapeDtypeStruct(sizes.shape, jnp.int32),
      offsets=jax.ShapeDtypeStruct(sizes.shape, jnp.int32),
      n_max=max(int(sizes.max()), 1), n_min=int(sizes.min()),
      public_x=jax.ShapeDtypeStruct((public_size,) + image, jnp.uint8) if public_size else None)


def _key() -> jax.ShapeDtypeStruct:
  return jax.eval_shape(lambda: jax.random.PRNGKey(0))


def abstract_state(algo: Algorithm, num_clients: int) -> FedState:
  """The initial `FedState` as `jax.ShapeDtypeStruct` leaves (nothing allocated)."""
  clients, server = jax.eval_shape(lambda k: algo.init(k, num_clients), _key())
  return FedState(clients=clients, server=server, round=jax.ShapeDtypeStruct((), jnp.int32))


def _data_info(info: DatasetInfo, sizes: np.ndarray) -> DataInfo:
  """What an algorithm's build reads of the data, without the data."""
  ch = info.image_shape[-1]
  return DataInfo(info.name, tuple(info.image_shape), info.num_classes, (_STATS,) * ch,
                  (_STATS,) * ch, sizes)


def setup(config: ml_collections.ConfigDict, target: str = 'gpu') -> Setup:
  """The abstract round of `config` as it would run on `target`; ConfigError for a refused config
  or a dataset whose sizes cannot be known before loading."""
  config = resolve_for(config, target)
  experiment.validate_config(config)
  info = configuration.dataset_info(config)
  if info is None:
    raise cv.ConfigError(f'config.dataset = {config.dataset!r}: its sizes cannot be known without '
                         'loading it (its files are missing or unreadable), so no plan')
  sizes = client_sizes(config, info)
  data = abstract_fed_data(sizes, info, config.public_size)
  algo = algorithms.registry.build(config, _data_info(info, sizes))
  return Setup(config, info, sizes, data, algo, abstract_state(algo, config.num_clients))


def _rows(tree, count: int):
  """The abstract `tree` with its leading (client) axis set to `count`."""
  return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((count,) + a.shape[1:], a.dtype),
                                tree)


def _tree_bytes(tree) -> int:
  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
             for a in jax.tree_util.tree_leaves(tree))


def compile_round(s: Setup) -> Tuple[Any, int, str]:
  """(XLA's compiled round program, bytes of the arrays passed to it, what it holds on the device).

  'device': the whole round, state donated. 'host': the participants' part, on the m stored states
  the host copies in (`round_step.device_program`)."""
  config, algo = s.config, s.algo
  m, num_clients = config.clients_per_round, config.num_clients
  step = rd.make_round_step(algo, experiment.round_config(config), num_clients)
  if config.client_state == 'device':
    args = (s.state, s.data, _key())
    what = f'the whole round; the {num_clients} clients\' stored states on the device, donated'
    return step.lower(*args).compile(), _tree_bytes(args), what
  sel = tuple(_rows(stack, min(m, len(c.members))) for stack, c in
              zip(rd.cohort_stacks(algo, s.state.clients), rd.cohorts(algo, num_clients)))
  args = (s.state.replace(clients=None), sel, s.data, _key())
  what = (f'the participants\' part of the round: {m} stored states copied in from host memory '
          f'(the {num_clients} clients\' stored states stay on the host)')
  return step.device_program.lower(*args).compile(), _tree_bytes(args), what


def memory(compiled, input_bytes: int) -> Dict[str, int]:
  """Bytes of XLA's memory analysis of `compiled`, and their total on the device (module
  docstring: the inputs count whole, read or not)."""
  ma = compiled.memory_analysis()
  out = {'argument_bytes': int(ma.argument_size_in_bytes),
         'input_bytes': int(input_bytes),
         'output_bytes': int(ma.output_size_in_bytes),
         'temp_bytes': int(ma.temp_size_in_bytes),
         'generated_code_bytes': int(ma.generated_code_size_in_bytes),
         'alias_bytes': int(ma.alias_size_in_bytes)}
  out['total_bytes'] = (max(out['input_bytes'], out['argument_bytes']) + out['output_bytes'] -
                        out['alias_bytes'] + out['temp_bytes'] + out['generated_code_bytes'])
  return out


def step_flops(s: Setup, cohort: rd.Cohort, stack) -> float:
  """XLA's FLOPs of one local step of a participant of `cohort` on one batch (forward and backward,
  augmentation, optimiser update), on the state `begin` gives it."""
  algo, ca, cid = s.algo, cohort.client, cohort.members[0]

  def started(stack, server, data, key):
    msg = rd.round_message(algo, server, data)
    if algo.personalize is not None:
      msg = algo.personalize(msg, jnp.int32(cid))
    stored = jax.tree_util.tree_map(lambda a: a[0], stack)
    return ca.begin(restore_client(ca, stored, msg), msg, key), msg

  client, msg = jax.eval_shape(started, stack, s.state.server, s.data, _key())
  b = s.config.batch_size
  batch = {'x': jax.ShapeDtypeStruct((b,) + s.data.x.shape[1:], s.data.x.dtype),
           'y': jax.ShapeDtypeStruct((b,), jnp.int32)}
  if not s.config.drop_last:
    batch['mask'] = jax.ShapeDtypeStruct((b,), jnp.bool_)
  lr = jax.ShapeDtypeStruct((), jnp.float32)
  return compilation.xla_flops(ca.local_step, client, batch, _key(), msg, lr)


def real_steps(sizes: np.ndarray, config: ml_collections.ConfigDict) -> float:
  """Expected real local steps of one round over clients of `sizes` (a random m of C take part)."""
  per_epoch = local.steps_per_epoch(jnp.asarray(sizes), config.batch_size, config.drop_last)
  total = config.local_epochs * float(np.sum(np.asarray(per_epoch)))
  return total * config.clients_per_round / config.num_clients


def cohort_steps(algo: Algorithm, sizes: np.ndarray, config: ml_collections.ConfigDict
                 ) -> List[float]:
  """Expected real local steps of one round, per cohort (one entry for a plain algorithm)."""
  return [real_steps(sizes[np.asarray(c.members)], config)
          for c in rd.cohorts(algo, config.num_clients)]


def cohort_step_flops(s: Setup) -> List[float]:
  """FLOPs of one local step, per cohort."""
  return [step_flops(s, c, stack) for c, stack in
          zip(rd.cohorts(s.algo, s.config.num_clients), rd.cohort_stacks(s.algo, s.state.clients))]


def check_memory_flags(device_memory_gb: float, memory_fraction: float) -> None:
  if not device_memory_gb > 0:
    raise cv.ConfigError(f'--device_memory_gb = {device_memory_gb:g} is invalid: must be > 0 '
                         '(the memory of one device in GiB)')
  if not 0 < memory_fraction <= 1:
    raise cv.ConfigError(f'--memory_fraction = {memory_fraction:g} is invalid: must be in (0, 1]')


def check_topology(hosts, devices_per_host, clients_per_round: int) -> int:
  """The device count hosts x devices_per_host; cv.ConfigError (one line) for a count < 1 or a
  round whose participants do not split evenly over the devices ('shard' gives each device the same
  number, strategies.check_participants)."""
  for name, value, what in (('hosts', hosts, 'machines, one process each'),
                            ('devices_per_host', devices_per_host, 'accelerators per host')):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise cv.ConfigError(f'--{name} = {value!r} is invalid: must be an integer >= 1 ({what})')
  devices = int(hosts) * int(devices_per_host)
  m = int(clients_per_round)
  if devices > 1 and m % devices:
    near = ' or '.join(str(k) for k in (m // devices * devices, (m // devices + 1) * devices) if k)
    raise cv.ConfigError(
        f'clients_per_round = {m} is invalid with --hosts={hosts} x --devices_per_host='
        f'{devices_per_host} = {devices} devices: strategy \'shard\' gives every device the same '
        f'number of participants, so it must be a multiple of {devices} (e.g. {near})')
  return devices


def device_config(config: ml_collections.ConfigDict, devices: int
                  ) -> Tuple[ml_collections.ConfigDict, int]:
  """(the config of what ONE device runs under 'shard', participants per device). `config` has its
  'auto' settings resolved. 'shard' runs each device's m / P participants in chunks of
  map_chunk_size (strategies.run); a config on 'vmap' means one vmap over them (chunk m / P). The
  one-device program is compiled as that many participants under 'vmap' (one chunk) or 'map'."""
  local = config.clients_per_round // devices
  chunk = local if config.strategy == 'vmap' else min(config.map_chunk_size, local)
  dev = ml_collections.ConfigDict(config.to_dict())
  dev.clients_per_round = local
  dev.strategy = 'vmap' if chunk == local else 'map'
  dev.map_chunk_size = chunk
  return dev, chunk


def _round_data_bytes(data: FedData, config: ml_collections.ConfigDict) -> int:
  """Bytes of `placement.participant_data`'s FedData: the m participants' padded rows (x and y),
  every client's n and offsets, and the public set."""
  row = int(np.prod(data.x.shape[1:])) * data.x.dtype.itemsize + 4
  public = _tree_bytes(data.public_x) if data.public_x is not None else 0
  return config.clients_per_round * data.n_max * row + 2 * 4 * config.num_clients + public


def topology(config: ml_collections.ConfigDict, mem: Dict[str, int], data_bytes: int,
             round_data_bytes: int, stored_client_bytes: int, hosts: int, devices_per_host: int,
             target: str, cohort_states: Optional[Sequence[Tuple[int, int]]] = None
             ) -> Dict[str, Any]:
  """Bytes per device and per host of a round on hosts x devices_per_host devices, with the clients
  replicated (the default) and with `placement='divided'` (core/placement.py).

  `mem` is `memory` of the one-device program (`device_config`: m / P participants); `data_bytes`
  the federated data (FedData); `stored_client_bytes` one client's stored state. Today every
  process loads and partitions the whole data and every device receives the round's inputs whole
  (strategies.replicate; a single process's jit copies its replicated inputs to each device): the
  data, the C stored states ('device') or, under 'host', all m participants' states, of which the
  compile counted its own m / P. Only the participants' training (the temporaries) divides. Per
  host: the federated data and, under 'host', the C stored states; on a CPU target the host's
  devices are its memory too. Under 'divided' (`round_data_bytes`: the FedData of the round's m
  participants' padded rows, `placement.participant_data`) every device receives that FedData in
  place of the whole data, and each host holds 1 / H of the data and of the host-resident states
  (an even cut: the hosts' blocks differ by one client at most) plus that FedData; device-resident
  client state divides too (each host's first device holds its ⌈C_c / H⌉ clients' states of each
  cohort c, and every device the round's participants' states, min(m, C_c) of each cohort, as under
  'host'). `cohort_states` [(C_c, bytes of one client of cohort c)] (None: one cohort of C clients
  of `stored_client_bytes`).
  """
  devices = hosts * devices_per_host
  m, c = config.clients_per_round, config.num_clients
  local = m // devices
  on_device_states = (c if config.client_state == 'device' else m) * stored_client_bytes
  host_states = c * stored_client_bytes if config.client_state == 'host' else 0
  # The one-device compile holds the m / P participants' states under 'host'; the other m - m / P
  # arrive (and leave) replicated as well.
  extra = (m - local) * stored_client_bytes if config.client_state == 'host' else 0
  per_device = mem['total_bytes'] + 2 * extra
  per_host = data_bytes + host_states + (devices_per_host * per_device if target == 'cpu' else 0)
  divided_device = per_device - data_bytes + round_data_bytes
  if config.client_state == 'device':
    # The held block (the first device of each host) and the participants' states in place of C,
    # each cohort cut on its own (round.state_blocks).
    divided_device += sum((-(-n // hosts) + min(m, n) - n) * b
                          for n, b in cohort_states or [(c, stored_client_bytes)])
  divided_host = (-(-(data_bytes + host_states) // hosts) + round_data_bytes +
                  (devices_per_host * divided_device if target == 'cpu' else 0))
  return {
      'hosts': hosts, 'devices_per_host': devices_per_host, 'devices': devices,
      'participants_per_device': local,
      'replicated_data_bytes': data_bytes, 'replicated_client_state_bytes': on_device_states,
      'host_client_state_bytes': host_states, 'other_participant_state_bytes': extra,
      'bytes_per_device': per_device, 'bytes_per_host': per_host,
      'round_data_bytes_divided': round_data_bytes,
      'bytes_per_device_divided': divided_device, 'bytes_per_host_divided': divided_host,
      'divided_device_block': bool(config.client_state == 'device' and stored_client_bytes),
  }


def plan(config: ml_collections.ConfigDict, device_memory_gb: float = 80.0,
         memory_fraction: float = 0.75, target: str = 'gpu', measure_rounds: int = 0,
         hosts: int = 1, devices_per_host: int = 1) -> Dict[str, Any]:
  """Compiles one round of `config` abstractly; returns its memory, FLOPs and whether it fits, and
  with `measure_rounds` > 0 what training that many rounds here measured (`measured`).

  With hosts x devices_per_host = P > 1 devices the strategy is 'shard' and the memory is that of
  one device's program (m / P participants; `device_config`), with the inputs every device holds
  counted whole (placement replicated) (`topology`); FLOPs stay those of the whole round.

  Raises cv.ConfigError for a refused config, device memory, fraction, round count or topology.
  """
  check_memory_flags(device_memory_gb, memory_fraction)
  if measure_rounds < 0:
    raise cv.ConfigError(f'--measure_rounds = {measure_rounds} is invalid: must be >= 0')
  devices = check_topology(hosts, devices_per_host, config.clients_per_round)
  if devices > 1 and measure_rounds:
    raise cv.ConfigError(f'--measure_rounds = {measure_rounds} is invalid with {devices} devices: '
                         'it trains on this machine\'s one device; plan without it')
  s = setup(config, target)
  config = s.config
  run_config, chunk = config, None
  if devices > 1:
    dev_config, chunk = device_config(config, devices)
    logging.info('the program of one of %d devices: %d participants', devices,
                 dev_config.clients_per_round)
    s = setup(dev_config, target)
  # Progress on stderr: a compile can take minutes (a run stopped by a time limit says where).
  logging.info('compiling the round abstractly')
  compiled, input_bytes, holds = compile_round(s)
  mem = memory(compiled, input_bytes)
  logging.info('counting the FLOPs of a local step (an XLA:CPU compile)')
  per_step, steps = cohort_step_flops(s), cohort_steps(s.algo, s.sizes, run_config)
  stored = _tree_bytes(s.state.clients) // config.num_clients
  sizes = [len(c.members) for c in s.algo.cohorts] or [config.num_clients]
  cohort_states = [(n, _tree_bytes(st) // n)
                   for n, st in zip(sizes, rd.cohort_stacks(s.algo, s.state.clients))]
  topo = topology(config, mem, _tree_bytes(s.data), _round_data_bytes(s.data, config),
                  stored, int(hosts), int(devices_per_host), target, cohort_states)
  if devices > 1:  # the inputs every device holds whole under placement replicated (`topology`)
    extra = topo['other_participant_state_bytes']
    mem = dict(mem, input_bytes=mem['input_bytes'] + extra,
               output_bytes=mem['output_bytes'] + extra, total_bytes=topo['bytes_per_device'])
  usable = device_memory_gb * memory_fraction * GIB
  p = {
      'algorithm': s.algo.name, 'ssl_method': config.ssl_method, 'dataset': s.info.name,
      'image_shape': list(s.info.image_shape),
      'encoders': [e for _, e in algorithms.registry.encoders(config)],
      'num_clients': config.num_clients, 'clients_per_round': config.clients_per_round,
      'local_epochs': config.local_epochs, 'batch_size': config.batch_size,
      'rounds': config.rounds,
      'strategy': config.strategy if devices == 1 else 'shard',
      'map_chunk_size': config.map_chunk_size if devices == 1 else chunk,
      'client_state': config.client_state, 'conv_impl': config.conv_impl,
      'target': target, 'backend': jax.default_backend(), 'device_program': holds,
      'stored_client_bytes': stored,
      **mem, **topo,
      'bytes_per_device': mem['total_bytes'],
      'flops_per_step': per_step[0] if len(per_step) == 1 else per_step,
      'steps_per_round': float(sum(steps)),
      'flops_per_round': float(sum(f * n for f, n in zip(per_step, steps))),
      'xla_round_flops': compilation.compiled_flops(compiled),
      'device_memory_bytes': int(device_memory_gb * GIB), 'memory_fraction': memory_fraction,
      'usable_bytes': int(usable), 'fits': mem['total_bytes'] <= usable,
  }
  if measure_rounds and p['fits']:  # a round planned not to fit is not started
    m = measure(s, measure_rounds, compiled)
    m['flops_per_second'] = p['flops_per_round'] / m['seconds_per_round']
    p['measured'] = m
  return p


def synthetic_dataset(config: ml_collections.ConfigDict, info: DatasetInfo) -> Dataset:
  """Synthetic images of `info`'s shape, classes and training size (`config.train_size` if set),
  their labels in the order of `balanced_labels`: the labels the plan partitions, so the clients
  get the planned sizes (a public set's random carve depends on the order too)."""
  ds = sources.make_synthetic(config.seed, num_train=config.train_size or info.num_train,
                              num_test=min(info.num_test, 1000),
                              image_shape=tuple(info.image_shape), num_classes=info.num_classes)
  planned = balanced_labels(len(ds.train_y), info.num_classes)
  order = np.empty(len(planned), np.int64)
  for c in range(info.num_classes):  # the class counts agree: both are balanced
    order[planned == c] = np.flatnonzero(ds.train_y == c)
  return dataclasses.replace(ds, train_x=ds.train_x[order], train_y=ds.train_y[order])


def _peak_device_bytes() -> Optional[int]:
  stats = jax.local_devices()[0].memory_stats()
  return int(stats['peak_bytes_in_use']) if stats and 'peak_bytes_in_use' in stats else None


def measure(s: Setup, rounds: int, compiled=None) -> Dict[str, Any]:
  """Trains `rounds` + 1 rounds of the planned config on this machine's device (module docstring);
  returns the first round's seconds, the median of the others and the peak device bytes.

  `compiled`: the plan's compiled whole round (client_state 'device'), run as it is rather than
  compiled a second time (a paper-scale round compiles for a minute or more on a GPU)."""
  if rounds < 1:
    raise cv.ConfigError(f'--measure_rounds = {rounds} is invalid: must be >= 1 (0: plan only)')
  config = s.config
  dataset = synthetic_dataset(config, s.info)
  fed_data, _ = experiment.build_fed_data(config, dataset)
  if not np.array_equal(np.asarray(fed_data.n), s.sizes):  # the plan's partition, or no check
    raise RuntimeError('the synthetic partition differs from the planned client sizes')
  algo = experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed_data.n))
  init_key, run_key = experiment.run_keys(config)
  state = rd.init_state(algo, init_key, config.num_clients, client_state=config.client_state)
  step = (compiled if compiled is not None and config.client_state == 'device' else
          rd.make_round_step(algo, experiment.round_config(config), config.num_clients))
  seconds = []
  for r in range(rounds + 1):
    logging.info('measuring: round %d of %d', r + 1, rounds + 1)
    start = time.perf_counter()
    state, metrics = step(state, fed_data, rng.round_key(run_key, r))
    jax.block_until_ready((state, metrics))
    seconds.append(time.perf_counter() - start)
  return {'rounds_timed': rounds, 'first_round_seconds': seconds[0],
          'seconds_per_round': statistics.median(seconds[1:]),
          'peak_device_bytes': _peak_device_bytes(),
          'device': str(jax.local_devices()[0].device_kind)}


def table_estimate(path: str, scale: str = 'paper', seeds: Sequence[int] = (0, 1, 2),
                   tflops: float = 18.0, target: str = 'gpu') -> Dict[str, Any]:
  """FLOPs and hours of every run of a table (module docstring: one step compiled per group)."""
  if not tflops > 0:
    raise cv.ConfigError(f'--tflops = {tflops:g} is invalid: must be > 0')
  table = tables.load_table(path, scale)
  planned = tables.plan_runs(table, seeds)
  runs = [r for r in planned if r.config is not None]
  groups: Dict[str, Dict[str, Any]] = {}
  total = 0.0
  for run in runs:
    group = groups.setdefault(
        run_identity.step_cost_key(run.config, configuration.dataset_info(run.config).image_shape),
        {'from': run.name, 'runs': 0, 'flops': 0.0})
    if 'flops_per_step' not in group:  # the group's first run: its step compiled
      s = setup(run.config, target)
      group['flops_per_step'] = cohort_step_flops(s)
    config = resolve_for(run.config, target)
    info = configuration.dataset_info(config)
    sizes = client_sizes(config, info)
    if algorithms.get(config.algorithm).encoders is None:  # one architecture: one cohort
      steps = [real_steps(sizes, config)]
    else:  # several: built, for its cohorts
      steps = cohort_steps(algorithms.registry.build(config, _data_info(info, sizes)), sizes,
                           config)
    flops = config.rounds * sum(f * n for f, n in zip(group['flops_per_step'], steps))
    group['runs'] += 1
    group['flops'] += flops
    total += flops
  return {'table': table.name, 'scale': scale, 'seeds': list(seeds), 'runs': len(runs),
          'invalid_runs': [r.name for r in planned if r.config is None], 'groups': groups,
          'flops_total': total, 'tflops': tflops,
          'hours': total / (tflops * 1e12) / 3600}


def _gib(b: float) -> str:
  return f'{b / GIB:.2f} GiB' if b >= 2**30 else f'{b / 2**20:.1f} MiB'


def _flop_text(f: float) -> str:
  for unit, scale in (('EFLOP', 1e18), ('PFLOP', 1e15), ('TFLOP', 1e12), ('GFLOP', 1e9),
                      ('MFLOP', 1e6)):
    if f >= scale:
      return f'{f / scale:.3g} {unit}'
  return f'{f:.3g} FLOP'


def not_fit_message(p: Dict[str, Any]) -> str:
  """The one line of a round that does not fit."""
  return (f'does not fit: {_gib(p["bytes_per_device"])} per device > {_gib(p["usable_bytes"])} '
          f'usable ({p["device_memory_bytes"] / GIB:g} GiB x {p["memory_fraction"]:g}); try '
          "strategy 'map' with a smaller map_chunk_size, config.client_state='host', or fewer "
          'clients_per_round')


def text(p: Dict[str, Any]) -> str:
  """The report of one round, for a person."""
  per_step = p['flops_per_step']
  per_step = (_flop_text(per_step) if not isinstance(per_step, list) else
              ', '.join(_flop_text(f) for f in per_step) + ' (per cohort)')
  chunk = f' (chunk {p["map_chunk_size"]})' if p['strategy'] != 'vmap' else ''
  approx = (', an approximation of the GPU program\'s temporaries'
            if p['backend'] != 'gpu' and p['target'] == 'gpu' else '')
  lines = [
      f'{p["algorithm"]} / {p["ssl_method"]}, {", ".join(p["encoders"])} on {p["dataset"]} '
      f'({"x".join(map(str, p["image_shape"]))}; shapes only, no data read)',
      f'{p["num_clients"]} clients, {p["clients_per_round"]} per round, E = {p["local_epochs"]}, '
      f'B = {p["batch_size"]}; strategy {p["strategy"]!r}{chunk}, client_state '
      f'{p["client_state"]!r}, conv {p["conv_impl"]!r}; stored state '
      f'{_gib(p["stored_client_bytes"])} per client',
      f'device program: {p["device_program"]}',
      f'memory per device (XLA memory_analysis of the {p["backend"]} compile{approx}):',
  ]
  for label, key in (('inputs', 'input_bytes'), ('  read by XLA', 'argument_bytes'),
                     ('outputs', 'output_bytes'), ('temporaries', 'temp_bytes'),
                     ('generated code', 'generated_code_bytes'),
                     ('aliased (donated)', 'alias_bytes'), ('total', 'total_bytes')):
    sign = '-' if key == 'alias_bytes' else ' '
    lines.append(f'  {label:18s} {sign}{_gib(p[key]):>12s}')
  lines += topology_text(p)
  lines += [
      f'FLOPs: {per_step} per local step (one batch, forward + backward, XLA cost analysis); '
      f'{p["steps_per_round"]:,.0f} real local steps per round (expected) -> '
      f'{_flop_text(p["flops_per_round"])} per round, '
      f'{_flop_text(p["flops_per_round"] * p["rounds"])} in {p["rounds"]} rounds',
      f'  (XLA\'s count of the compiled round, every loop body once: '
      f'{_flop_text(p["xla_round_flops"])})',
      (f'fits: {_gib(p["bytes_per_device"])} <= {_gib(p["usable_bytes"])} usable '
       f'({p["device_memory_bytes"] / GIB:g} GiB x {p["memory_fraction"]:g})' if p['fits'] else
       not_fit_message(p)),
  ]
  m = p.get('measured')
  if m:
    peak = ('n/a (no memory statistics on this backend)' if m['peak_device_bytes'] is None else
            f'{_gib(m["peak_device_bytes"])} (planned {_gib(p["bytes_per_device"])})')
    lines += [
        f'measured on {m["device"]} ({p["backend"]}), synthetic images of the planned shape and '
        f'sizes: first round {m["first_round_seconds"]:.1f} s (warm-up), then '
        f'{m["seconds_per_round"]:.2f} s per round (median of {m["rounds_timed"]}) -> '
        f'{_flop_text(m["flops_per_second"])}/s of the step count above',
        f'  peak device memory in use: {peak}',
    ]
  return '\n'.join(lines)


def topology_text(p: Dict[str, Any]) -> List[str]:
  """The lines on hosts and devices: the strategy to use, per device and per host with the clients
  replicated and with placement 'divided'."""
  states = ('the C stored states' if p['client_state'] == 'device' else
            "the round's m participants' states")
  host_states = (f' + {_gib(p["host_client_state_bytes"])} of host-resident client states'
                 if p['host_client_state_bytes'] else '')
  cpu = ' + its devices\' memory (a CPU target)' if p['target'] == 'cpu' else ''
  lines = []
  if p['devices'] > 1:
    lines.append(
        f'{p["hosts"]} host(s) x {p["devices_per_host"]} device(s) = {p["devices"]} devices: '
        f"strategy to use 'shard' ({p['participants_per_device']} participants per device, "
        f'map_chunk_size {p["map_chunk_size"]}); the memory above is one device\'s program')
  lines += [
      f'per device, replicated: {_gib(p["bytes_per_device"])}, of which on every device '
      f'{_gib(p["replicated_data_bytes"])} of data and {_gib(p["replicated_client_state_bytes"])} '
      f'of {states}; only the participants\' training divides',
      f'per host, replicated: {_gib(p["bytes_per_host"])} (every process holds the whole data, '
      f'{_gib(p["replicated_data_bytes"])}{host_states}{cpu})',
  ]
  if p['devices'] > 1:
    lines.append(
        f'with --config.placement=divided: per device {_gib(p["bytes_per_device_divided"])} '
        f'(the round\'s participants\' rows, {_gib(p["round_data_bytes_divided"])}, in place of '
        f'the data' + ('; a host\'s first device holds its block of the client states'
                       if p['divided_device_block'] else '') + f'), per host {_gib(p["bytes_per_host_divided"])} (1 / {p["hosts"]} of the data'
        + (' and of the host-resident states' if p['host_client_state_bytes'] else '') +
        ', plus those rows)')
  return lines


def table_text(e: Dict[str, Any]) -> str:
  """The report of a table estimate, for a person."""
  lines = [f'{e["table"]} ({e["scale"]} scale): {e["runs"]} runs over seeds '
           f'{",".join(map(str, e["seeds"]))}' +
           (f' ({len(e["invalid_runs"])} invalid, not counted)' if e['invalid_runs'] else '')]
  for name, g in e['groups'].items():
    per_step = ', '.join(_flop_text(f) for f in g['flops_per_step'])
    lines.append(f'  {name}: {g["runs"]} runs, {per_step} per step (of {g["from"]}), '
                 f'{_flop_text(g["flops"])}')
  lines.append(f'total {_flop_text(e["flops_total"])}: {e["hours"]:.1f} h at '
               f'{e["tflops"]:g} TFLOP/s (an estimate, not a measurement)')
  return '\n'.join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if (_CONFIG.value is None) == (_TABLE.value is None):
    raise cv.ConfigError('give one of --config (plan a round) and --table (estimate a table)')
  if _TABLE.value is not None:
    try:
      seeds = [int(s) for s in _SEEDS.value]
    except ValueError:
      raise cv.ConfigError(f'--seeds = {",".join(_SEEDS.value)} is invalid: must be integers '
                           '(e.g. 0,1,2)') from None
    e = table_estimate(_TABLE.value, _SCALE.value, seeds, _TFLOPS.value, _TARGET.value)
    print(json.dumps(e, sort_keys=True) if _JSON.value else table_text(e), flush=True)
    return
  p = plan(_CONFIG.value, _DEVICE_MEMORY_GB.value, _MEMORY_FRACTION.value, _TARGET.value,
           _MEASURE_ROUNDS.value, _HOSTS.value, _DEVICES_PER_HOST.value)
  print(json.dumps(p, sort_keys=True) if _JSON.value else text(p), flush=True)
  if not p['fits']:
    print(f'error: {not_fit_message(p)}', file=sys.stderr)
    sys.exit(EXIT_DOES_NOT_FIT)


if __name__ == '__main__':
  _define_flags()
  cv.run(main, reference=experiment.default_config, moved=run_identity.MOVED_KEYS)
