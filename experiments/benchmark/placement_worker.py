"""One process of the scale setting's placement rows (`scale.placement_rows`): `python -m
experiments.benchmark.placement_worker '<json>'` with keys algorithm, ssl_method, placement,
num_clients, participants, rounds, processes, process_id, coordinator.

It loads Fashion-MNIST, partitions it over C clients (IID), keeps what its placement holds (all of
it under 'replicated'; under 'divided' its block of clients, reading only their rows from the IDX
file as a run does: `types.Rows`, `placement.divide_rows`), initialises the client state in host
memory, runs one warm-up round and `rounds` timed ones, and prints one JSON line: the rows and
client states it holds, the peak of the load (numpy's allocations traced by `tracemalloc` from the
load to the held block), the process's resident memory (VmRSS) and peak (VmHWM) from
/proc/self/status, and the seconds per round and per participants' exchange.
"""
from __future__ import annotations

import gc
import json
import statistics
import sys
import time
import tracemalloc

import jax
import numpy as np

from fedjax_ssl import experiment
from fedjax_ssl.core import placement, rng
from fedjax_ssl.core import round as rd


def _status_mb(field: str) -> float:
  with open('/proc/self/status') as f:
    line = next(l for l in f if l.startswith(field + ':'))
  return int(line.split()[1]) / 1024  # kB


def _mb(tree) -> float:
  return sum(np.asarray(a).nbytes for a in jax.tree_util.tree_leaves(tree)) / 2**20


def _config(a: dict):
  c = experiment.default_config()
  c.algorithm, c.ssl_method, c.encoder, c.heads = a['algorithm'], a['ssl_method'], 'small_cnn', 'custom'
  c.dataset, c.num_clients, c.clients_per_round = 'fashion_mnist', a['num_clients'], a['participants']
  c.batch_size, c.local_epochs, c.strategy, c.partition = 32, 1, 'shard', 'iid'
  c.client_state, c.placement = 'host', a['placement']
  return c


def main(a: dict) -> dict:
  if a['processes'] > 1:
    jax.distributed.initialize(coordinator_address=a['coordinator'], num_processes=a['processes'],
                               process_id=a['process_id'])
  config = _config(a)
  c, pid, count = config.num_clients, jax.process_index(), jax.process_count()
  rss_start = _status_mb('VmRSS')
  divided = config.placement == 'divided'
  tracemalloc.start()
  dataset = experiment.load_data(config, rows_on_demand=divided)
  if divided:
    info = experiment.draw_rows(config, dataset)
    data = placement.divide_rows(dataset.train_x, dataset.train_y, info['indices'],
                                 info['public_idx'], pid, count)
  else:
    data, _ = experiment.build_fed_data(config, dataset)
  load_peak = tracemalloc.get_traced_memory()[1] / 2**20
  tracemalloc.stop()
  algo = experiment.build_algorithm(config, dataset)
  lo, hi = placement.owned_range(c, pid, count) if divided else (0, c)
  del dataset  # under 'divided' only this process's block stays
  gc.collect()
  state = rd.init_state(algo, jax.random.PRNGKey(0), c, client_state='host',
                        process=(pid, count) if divided else None)
  step = rd.make_round_step(algo, experiment.round_config(config), c)
  root = jax.random.PRNGKey(1)
  state, _ = step(state, data, rng.round_key(root, 0))  # compile and warm up
  jax.block_until_ready(state.server)
  times, exchanges = [], []
  for r in range(1, a['rounds'] + 1):
    key = rng.round_key(root, r)
    if divided:  # the participants' rows and states alone, as the round gathers them
      ids = np.asarray(rd.sample_participants(key, c, config.clients_per_round))
      block = placement.StateBlock.of(c, pid, count)
      t0 = time.perf_counter()
      placement.participant_data(data, ids)
      placement.participant_states(state.clients, block, ids)
      exchanges.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    state, metrics = step(state, data, key)
    jax.block_until_ready((state.server, metrics))
    times.append(time.perf_counter() - t0)
  held_data = (data.x, data.y) if divided else (data.x, data.y, data.n, data.offsets)
  out = {'algorithm': f"{a['algorithm']}/{a['ssl_method']}", 'placement': config.placement,
         'processes': count, 'process': pid, 'clients': c, 'held_clients': hi - lo,
         'held_data_mb': _mb(held_data), 'held_client_state_mb': _mb(state.clients),
         'load_peak_mb': load_peak, 'rss_mb': _status_mb('VmRSS'),
         'peak_rss_mb': _status_mb('VmHWM'),
         'rss_at_start_mb': rss_start, 'seconds_per_round': statistics.median(times),
         'exchange_seconds': statistics.median(exchanges) if exchanges else 0.0}
  if count > 1:
    jax.distributed.shutdown()
  return out


if __name__ == '__main__':
  print('PLACEMENT_ROW ' + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
