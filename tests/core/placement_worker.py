"""One process of tests/core/test_placement.py's multi-process run: `python -m
tests.core.placement_worker OUT PLACEMENT NUM_PROCESSES PROCESS_ID [COORDINATOR]`.

Runs two rounds of FedEMA (host-resident client state) on the equivalence tests' six clients, four
a round, under strategy 'shard' over every process's devices, and writes what this process holds
(client rows lo .. hi - 1, the server, the metrics, every client's rows gathered back) to OUT as
.npz; with two processes at most, the same of two rounds of cohorts (`_cohort_rounds`)."""
import dataclasses
import sys

import jax
import numpy as np

from fedjax_ssl import configuration, evaluation
from fedjax_ssl.core import placement, rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.data import sources
from tests.algorithms import test_hetero_ssfl as th
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
  fed = th._hetero_data()  # the equivalence tests' clients, with a public set for Hetero-SSFL
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
      rows[f'{r}{jax.tree_util.keystr(path)}'] = np.array(leaf, copy=True)  # host: written in place
  if jax.device_count() <= 2:  # cohorts of 3 clients: a block for each of 2 processes at most
    rows.update(_cohort_rounds(data, placement_, process_id, num_processes))
    rows.update(_fedsc_rounds(data, placement_, process_id, num_processes))
  # Every client's rows back on every process (the divided evaluation's gather of features): the
  # held rows' per-row sums stand for their features.
  held = np.asarray(jax.device_get(data.x), np.float32).reshape(len(data.x), -1).sum(axis=1)
  rows['gathered'] = (placement.gather_rows(held, data) if placement_ == 'divided' else held)
  rows.update(_personal_scores(placement_, process_id, num_processes))
  # Per-client results' entries (evaluation._gather_entries: JSON bytes, one all-gather), uneven
  # in length across processes: every client's, in id order.
  entries = [{'client': c, 'score': c / 3, 'ids': list(range(c))} for c in range(lo, hi)]
  if placement_ == 'divided':
    entries = evaluation._gather_entries(entries, num_processes)
  rows['entries'] = np.array([[e['client'], e['score'], len(e['ids'])] for e in entries])
  np.savez(out, lo=lo, hi=hi, **rows)
  if num_processes > 1:
    jax.distributed.shutdown()


def _personal_scores(placement_, process_id, num_processes):
  """One model per client, a single cohort (independent, initial models, host state): under
  'divided' each process scores the block it holds and the scores are gathered
  (`evaluation.evaluate(client_blocks=)`); the same metrics as one process scoring all six."""
  algo, _ = eq._algo('independent')
  divided = placement_ == 'divided'
  state = rd.init_state(algo, jax.random.PRNGKey(3), eq.NUM_CLIENTS, client_state='host',
                        process=(process_id, num_processes) if divided else None)
  blocks = (rd.state_blocks(algo, eq.NUM_CLIENTS, process_id, num_processes) if divided else
            None)
  scores = evaluation.evaluate(_eval_config(), algo, state, _eval_dataset(), probe=False,
                               client_blocks=blocks)
  return {f'personal/{k}': np.asarray(v) for k, v in scores.items()}


def _eval_config():
  config = configuration.default_config()
  config.knn_k = 3
  return config


def _eval_dataset():
  return sources.make_synthetic(num_train=40, num_test=12, image_shape=(8, 8, 1))


def _fedsc_rounds(data, placement_, process_id, num_processes):
  """Two rounds of FedSC with DP-CalR (`fedsc_dp`): at its first share round (round 0) every
  client's matrix from its own rows, computed by the process holding them and gathered
  (`round.absorb_summaries`), the participants' at round 1; host-resident state either way.
  'shard' over the P devices either way, so the server's mean adds the same terms in the same
  order (under 'vmap' one process's program and two processes' replicated one round the model
  differently, ~1e-7)."""
  algo = eq._algo('fedsc_dp')[0]
  divided = placement_ == 'divided'
  cfg = dataclasses.replace(eq._round_cfg('shard', 4, client_state='host'), placement=placement_)
  step = rd.make_round_step(algo, cfg, eq.NUM_CLIENTS, donate=False)
  state = rd.init_state(algo, jax.random.PRNGKey(3), eq.NUM_CLIENTS, client_state='host',
                        process=(process_id, num_processes) if divided else None)
  rows = {}
  for r in range(2):
    state, metrics = step(state, data, rng.round_key(jax.random.PRNGKey(7), r))
    tree = jax.device_get({'server': state.server, 'metrics': metrics})
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      rows[f'fedsc{r}{jax.tree_util.keystr(path)}'] = np.array(leaf, copy=True)
  return rows


def _cohort_rounds(data, placement_, process_id, num_processes):
  """Two rounds of Hetero-SSFL with alignment (two cohorts of interleaved clients, 3 each):
  device-resident personal models each process holds its block of, per cohort, under 'divided'
  (`round.state_blocks`: 2 + 1 rows at P = 2; round 0's representations computed from the block
  and gathered, `round.absorb_summaries`); under 'replicated' host-resident (the divided round's
  device program, so bit for bit). 'vmap': no cross-device sum."""
  algo = th._algo('default')[0]
  divided = placement_ == 'divided'
  cfg = dataclasses.replace(eq._round_cfg('vmap', 4, client_state='device' if divided else 'host'),
                            placement=placement_)
  step = rd.make_round_step(algo, cfg, eq.NUM_CLIENTS, donate=False)
  state = rd.init_state(algo, jax.random.PRNGKey(3), eq.NUM_CLIENTS, client_state=cfg.client_state,
                        process=(process_id, num_processes) if divided else None)
  rows = {}
  for b, block in enumerate(rd.state_blocks(algo, eq.NUM_CLIENTS, process_id,
                                            num_processes if divided else 1)):
    rows[f'cohort{b}_lo'], rows[f'cohort{b}_hi'] = block.lo, block.hi
  for r in range(2):
    state, metrics = step(state, data, rng.round_key(jax.random.PRNGKey(7), r))
    tree = jax.device_get({'clients': state.clients, 'server': state.server, 'metrics': metrics})
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      rows[f'cohorts{r}{jax.tree_util.keystr(path)}'] = np.array(leaf, copy=True)  # host: in place
  # Each process scores the personal models it holds (kNN on a small labelled set), one gather
  # bringing every client's scores (`evaluation.evaluate(client_blocks=)`).
  blocks = (rd.state_blocks(algo, eq.NUM_CLIENTS, process_id, num_processes) if divided else
            None)
  scores = evaluation.evaluate(_eval_config(), algo, state, _eval_dataset(), probe=False,
                               client_blocks=blocks)
  rows.update({f'eval/{k}': np.asarray(v) for k, v in scores.items()})
  return rows


if __name__ == '__main__':
  args = sys.argv[1:]
  main(args[0], args[1], int(args[2]), int(args[3]), *args[4:])
