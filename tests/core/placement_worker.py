"""One process of tests/core/test_placement.py's multi-process run: `python -m
tests.core.placement_worker OUT PLACEMENT NUM_PROCESSES PROCESS_ID [COORDINATOR]`.

Runs two rounds of FedEMA (host-resident client state) on the equivalence tests' six clients, four
a round, under strategy 'shard' over every process's devices, and writes what this process holds
(client rows lo .. hi - 1, the server, the metrics, every client's rows gathered back) to OUT as
.npz."""
import dataclasses
import sys

import jax
import numpy as np

from fedjax_ssl.core import placement, rng
from fedjax_ssl.core import round as rd
from tests.core import test_round_equivalence as eq


def main(out, placement_, num_processes, process_id, coordinator=None):
  if num_processes > 1:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
  algo, _ = eq._algo('fedema')
  cfg = eq._round_cfg('shard', 4, client_state='host')
  cfg = dataclasses.replace(cfg, placement=placement_)
  step = rd.make_round_step(algo, cfg, eq.NUM_CLIENTS, donate=False)
  state = rd.init_state(algo, jax.random.PRNGKey(3), eq.NUM_CLIENTS, client_state='host')
  fed = eq._data()
  lo, hi = 0, eq.NUM_CLIENTS
  if placement_ == 'divided':
    data = placement.divide(fed, process_id, num_processes)
    lo, hi = data.lo, data.hi
    state = state.replace(clients=placement.local_rows(state.clients, lo, hi))
  else:
    data = fed
  rows = {}
  for r in range(2):
    state, metrics = step(state, data, rng.round_key(jax.random.PRNGKey(7), r))
    tree = jax.device_get({'clients': state.clients, 'server': state.server, 'metrics': metrics})
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      rows[f'{r}{jax.tree_util.keystr(path)}'] = np.asarray(leaf)
  # Every client's rows back on every process (the divided evaluation's gather of features): the
  # held rows' per-row sums stand for their features.
  held = np.asarray(jax.device_get(data.x), np.float32).reshape(len(data.x), -1).sum(axis=1)
  rows['gathered'] = (placement.gather_rows(held, data) if placement_ == 'divided' else held)
  np.savez(out, lo=lo, hi=hi, **rows)
  if num_processes > 1:
    jax.distributed.shutdown()


if __name__ == '__main__':
  args = sys.argv[1:]
  main(args[0], args[1], int(args[2]), int(args[3]), *args[4:])
