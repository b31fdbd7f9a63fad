"""The scale setting (`scale`): skewed federations of Fashion-MNIST over C clients, IID beside
Dirichlet, FedEMA-BYOL with real per-client state; the data's device bytes and, per variant, the
time per round and per real local step and the device memory.

What each variant is and what a row reports: docs/notes/harness.md#benchmark.
"""
from __future__ import annotations

import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Dict, List

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmark.round_speed import tree_mb
from fedjax_ssl import experiment
from fedjax_ssl.core import rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.data import partition

if TYPE_CHECKING:  # settings imports this module for its tables
  from experiments.benchmark.settings import Settings

# The scale setting: Fashion-MNIST partitioned over C clients, IID or Dirichlet alpha = 0.1, m = 10
# participants, FedEMA-BYOL (real per-client state) on the small CNN, batch 32, one local epoch.
SCALE_VARIANTS = {  # name: (vmap_shrink, client_state)
    'vmap_before': (0.0, 'device'),   # every participant runs the longest one's step count
    'vmap': (2.0, 'device'),
    'vmap_host': (2.0, 'host'),
}
SCALE_DEFAULTS = dict(clients=['10', '100', '1000'], variants=list(SCALE_VARIANTS), repeats=5)


def _scale_config(num_clients: int, shrink: float, client_state: str):
  c = experiment.default_config()
  c.algorithm, c.ssl_method, c.encoder, c.heads = 'fedema', 'byol', 'small_cnn', 'custom'
  c.dataset, c.num_clients, c.clients_per_round = 'fashion_mnist', num_clients, 10
  c.batch_size, c.local_epochs, c.strategy = 32, 1, 'vmap'
  c.vmap_shrink, c.client_state = shrink, client_state
  return c


def _device_program_mb(step, state, fed, key, m: int) -> float:
  """XLA's buffer estimate (arguments + outputs + temporaries - aliased) of the round's device
  program: the whole jitted round ('device'), or the participants' part ('host')."""
  program = getattr(step, 'device_program', None)
  if program is None:
    compiled = step.lower(state, fed, key).compile()
  else:
    sel = (jax.tree_util.tree_map(lambda a: jnp.asarray(a[:m]), state.clients),)
    compiled = program.lower(state.replace(clients=None), sel, fed, key).compile()
  ma = compiled.memory_analysis()
  return (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes -
          ma.alias_size_in_bytes) / 2**20


def _device_tree_mb(tree) -> float:
  """MB of the device arrays of `tree` (numpy leaves, the host placement's clients, excluded)."""
  return sum(a.nbytes for a in jax.tree_util.tree_leaves(tree) if isinstance(a, jax.Array)) / 2**20


def run(s: Settings) -> List[Dict]:
  """Per C and partition: the data's device bytes (flat layout vs the padded one it replaced), and
  per variant the median over rounds of seconds per round and per real local step (round time /
  the participants' real steps), resident device MB between rounds, the device program's MB."""
  dataset = experiment.load_data(_scale_config(10, 2.0, 'device'))
  info = {'backend': jax.default_backend(), 'devices': [str(d) for d in jax.devices()],
          'setting': 'scale', 'jax': jax.__version__, 'repeats': s.repeats,
          'alpha': s.alpha,
          'cpu_affinity': sorted(os.sched_getaffinity(0))}
  print(json.dumps(info))
  rows = []
  for num_clients in [int(c) for c in s.clients]:
    for scheme, kw in (('iid', {}), ('dirichlet', {'alpha': s.alpha})):
      fed, _ = partition.build_fed_data(dataset, num_clients, scheme, seed=0, **kw)
      n = np.asarray(fed.n)
      row_bytes = int(np.prod(fed.x.shape[1:])) + 4  # image + label
      label = scheme + (f'(alpha={kw["alpha"]})' if kw else '')
      row = {'clients': num_clients, 'participants': 10, 'partition': label,
             'real_rows': int(n.sum()), 'n_max': int(n.max()),
             'data_device_mb': tree_mb((fed.x, fed.y, fed.n, fed.offsets)),
             'padded_data_mb': num_clients * int(n.max()) * row_bytes / 2**20,
             'real_data_mb': int(n.sum()) * row_bytes / 2**20, 'results': {}}
      prepared = {}
      for variant in s.variants:
        shrink, placement = SCALE_VARIANTS[variant]
        config = _scale_config(num_clients, shrink, placement)
        algo = experiment.build_algorithm(config, dataset)
        step = rd.make_round_step(algo, experiment.round_config(config), num_clients)
        state = rd.init_state(algo, jax.random.PRNGKey(0), num_clients, client_state=placement)
        root = jax.random.PRNGKey(1)
        program_mb = _device_program_mb(step, state, fed, rng.round_key(root, 99), 10)
        prepared[variant] = dict(step=step, state=state, root=root, times=[], per_step=[],
                                 program_mb=program_mb)
        state, _ = step(state, fed, rng.round_key(root, 0))  # compile and warm up
        jax.block_until_ready(state.server)
        prepared[variant]['state'] = state
        # Resident on the device between rounds: the data and the state's device arrays.
        prepared[variant]['resident_mb'] = _device_tree_mb((fed, state))
        del state
      for r in range(1, s.repeats + 1):  # interleaved: drift hits every variant alike
        key = rng.round_key(jax.random.PRNGKey(1), r)
        ids = np.asarray(rd.sample_participants(key, num_clients, 10))
        real_steps = int(np.maximum(n[ids] // 32, 1).sum())
        for p in prepared.values():
          t0 = time.perf_counter()
          p['state'], metrics = p['step'](p['state'], fed, key)
          jax.block_until_ready((p['state'].server, metrics))
          p['times'].append(time.perf_counter() - t0)
          p['per_step'].append(p['times'][-1] / real_steps)
      for variant, p in prepared.items():
        row['results'][variant] = {
            'seconds_per_round': statistics.median(p['times']),
            'ms_per_real_step': 1e3 * statistics.median(p['per_step']),
            'resident_device_mb': p['resident_mb'], 'device_program_mb': p['program_mb'],
            'client_state_mb': tree_mb(p['state'].clients)}
        print(f'C={num_clients:5d} {label:20s} {variant:12s} {json.dumps(row["results"][variant])}',
              flush=True)
      prepared.clear()
      gc.collect()
      print(f'C={num_clients:5d} {label:20s} data {row["data_device_mb"]:.1f} MB on device for '
            f'{row["real_data_mb"]:.1f} MB of real rows (padded layout: {row["padded_data_mb"]:.1f}'
            ' MB)', flush=True)
      rows.append(row)
  for c in sorted({r['clients'] for r in rows}):
    iid = next(r for r in rows if r['clients'] == c and r['partition'] == 'iid')
    skew = next(r for r in rows if r['clients'] == c and r['partition'] != 'iid')
    ratio = lambda v: (skew['results'][v]['ms_per_real_step'] /
                       iid['results'][v]['ms_per_real_step'])
    print(f'==> C={c}: per real step, {skew["partition"]} / IID: ' + ', '.join(
        f'{v}: {ratio(v):.2f}x' for v in s.variants), flush=True)
  return [info] + rows


# The placement rows (issue 67, `--processes`): what one process holds with the clients' data and
# host-resident state replicated, against 'divided' over P processes (core/placement.py).
PLACEMENT_ALGORITHMS = (('fedema', 'byol'), ('fedavg', 'simclr'))  # stateful, stateless


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


def _placement_group(args: dict, processes: int) -> List[Dict]:
  """Runs `processes` placement workers on 127.0.0.1 (one CPU device each); their rows."""
  coordinator = f'127.0.0.1:{_free_port()}'
  procs = [subprocess.Popen(
      [sys.executable, '-m', 'experiments.benchmark.placement_worker', json.dumps(dict(
          args, processes=processes, process_id=p, coordinator=coordinator))],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for p in range(processes)]
  outs = [p.communicate()[0] for p in procs]
  rows = []
  for p, out in zip(procs, outs):
    if p.returncode:
      raise RuntimeError(f'placement worker failed (rc {p.returncode}):\n{out[-3000:]}')
    rows.append(json.loads(next(l for l in out.splitlines() if l.startswith('PLACEMENT_ROW '))
                           .split(' ', 1)[1]))
  return rows


def placement_rows(s: Settings) -> List[Dict]:
  """Per algorithm (stateful FedEMA-BYOL, stateless FedSimCLR), client count and process count P:
  each process's held clients, rows and client-state MB, the load's peak, resident and peak memory,
  and seconds per round and per exchange; 'replicated' on one process first, then 'divided' on each P."""
  info = {'backend': jax.default_backend(), 'setting': 'scale', 'jax': jax.__version__,
          'processes': list(s.processes), 'repeats': s.repeats, 'partition': 'iid',
          'cpu_affinity': sorted(os.sched_getaffinity(0))}
  print(json.dumps(info))
  rows = []
  for num_clients in s.client_counts:
    for algorithm, ssl_method in PLACEMENT_ALGORITHMS:
      args = dict(algorithm=algorithm, ssl_method=ssl_method, num_clients=num_clients,
                  participants=8, rounds=s.repeats)
      groups = [('replicated', 1)] + [('divided', int(p)) for p in s.processes]
      for placement_, processes in groups:
        for row in _placement_group(dict(args, placement=placement_), processes):
          print(f'C={num_clients:5d} {row["algorithm"]:14s} {placement_:10s} P={processes} '
                f'process {row["process"]}: holds {row["held_clients"]} clients, data '
                f'{row["held_data_mb"]:.1f} MB (load peak {row["load_peak_mb"]:.1f} MB), client '
                f'state {row["held_client_state_mb"]:.1f} MB, '
                f'RSS {row["rss_mb"]:.0f} MB (peak {row["peak_rss_mb"]:.0f}), '
                f'{row["seconds_per_round"]:.2f} s/round, exchange {row["exchange_seconds"]:.3f} s',
                flush=True)
          rows.append(row)
  return [info] + rows
