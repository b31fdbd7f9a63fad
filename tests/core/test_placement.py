"""Placement 'divided' (core/placement.py): each process holds its block of clients; a round on the
participants' rows gathered from their owners equals the round on the whole data. Two processes
against one: tests/core/test_scale.py."""
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.algorithms import hetero_ssfl
from fedjax_ssl.core import placement, rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import Prepare
from tests.algorithms import test_hetero_ssfl as th
from tests.algorithms import test_repshare as trs
from tests.core import test_round_equivalence as eq
from tests.core import test_scale


@pytest.mark.parametrize('clients,processes', [(6, 1), (6, 4), (7, 3), (5, 5)])
def test_owned_ranges_cut_the_clients_as_array_split(clients, processes):
  blocks = [placement.owned_range(clients, p, processes) for p in range(processes)]
  want = [(int(b[0]), int(b[-1]) + 1) for b in np.array_split(np.arange(clients), processes)]
  assert blocks == want
  ids = np.arange(clients)
  np.testing.assert_array_equal(placement.owners(ids, clients, processes),
                                [next(p for p, (lo, hi) in enumerate(blocks) if lo <= c < hi)
                                 for c in ids])


def test_more_processes_than_clients_is_refused():
  with pytest.raises(ValueError, match=r'process count 7 is invalid for placement "divided": must '
                                       r'be in \[1, num_clients=6\]'):
    placement.owned_range(6, 0, 7)


def test_the_participants_data_holds_their_padded_views():
  fed = eq._data()
  ids = np.array([4, 0, 3])
  local = placement.divide(fed, 0, 1)
  part = placement.participant_data(local, ids)
  assert part.x.shape == (3 * fed.n_max,) + fed.x.shape[1:]
  assert (part.n_max, part.n_min) == (fed.n_max, int(np.min(fed.n)))
  np.testing.assert_array_equal(part.n, fed.n)
  for c in ids:
    for got, want in zip(part.client(c), fed.client(c)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # A process holding clients 2..3 of 6 (process 1 of 3) returns those clients' rows.
  held = placement.divide(fed, 1, 3)
  assert (held.lo, held.hi) == (2, 4)
  assert held.x.shape[0] == int(fed.n[2] + fed.n[3])
  for c in (2, 3):
    x, y = held.client_rows(c)
    want_x, want_y, _ = fed.client(c)
    np.testing.assert_array_equal(x, np.asarray(want_x))
    np.testing.assert_array_equal(y, np.asarray(want_y))
  with pytest.raises(ValueError, match=r'client 4 is not held by this process: it holds \[2, 4\)'):
    held.client_rows(4)


def _rounds(name, placement_, client_state, rounds=2):
  algo = {'hetero_ssfl': hetero_mu0, 'hetero_ssfl_aligned': lambda: th._algo('default')[0],
          'repshare': lambda: trs._algo('ours')[0], 'fd': lambda: trs._algo('fd')[0]}.get(
              name, lambda: eq._algo(name)[0])()
  fed = th._hetero_data()  # the equivalence tests' clients, with a public set
  cfg = dataclasses.replace(eq._round_cfg('vmap', 4, client_state=client_state),
                            placement=placement_)
  step = rd.make_round_step(algo, cfg, eq.NUM_CLIENTS, donate=False)
  divided = placement_ == 'divided'
  state = rd.init_state(algo, jax.random.PRNGKey(3), eq.NUM_CLIENTS, client_state=client_state,
                        process=(0, 1) if divided else None)
  data = placement.divide(fed, 0, 1) if divided else fed
  out = []
  for r in range(rounds):
    state, metrics = step(state, data, rng.round_key(jax.random.PRNGKey(7), r))
    # Copied: a host stack is written in place by the next round.
    out.append(jax.tree_util.tree_map(lambda a: np.array(a, copy=True),
                                      jax.device_get((state.clients, state.server, metrics))))
  return out


# FedEMA: per-client state (online, target, divergence) held in host memory, or on the device (one
# gather and one donated scatter a round around the host path's device program, so it equals
# 'host' replicated bit for bit; the device-resident replicated round fuses the gather and scatter
# into its program and differs from both by float rounding, ~6e-7 relative); FedSimCLR: stateless
# clients. 4 of 6 clients a round, so clients sit out and return.
@pytest.mark.parametrize('name,client_state,replicated_state', [
    ('fedema', 'host', 'host'), ('fedema', 'device', 'host'), ('fedsimclr', 'device', 'host')])
def test_a_divided_round_equals_the_replicated_round_bit_for_bit(name, client_state,
                                                                 replicated_state):
  # The same program reads the same bytes at other offsets: no arithmetic differs.
  want = _rounds(name, 'replicated', replicated_state)
  got = _rounds(name, 'divided', client_state)
  for r, (g, w) in enumerate(zip(got, want)):
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(w)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f'{name} round {r}')


# Every client's summary on its own rows before a round (`Prepare.summarize`, each client's draws
# from its id): representation sharing's prototypes and FD's mean logits of the untrained models at
# round 0, FedSC's DP-CalR matrices under the server's model at the first share round (round 0 of
# fedsc_dp, round 1 of fedsc_late_ragged; the next share rounds upload the participants'). Under
# 'divided' from the held block and the held rows (`placement.held_data`), host-resident models
# one at a time, as the host-resident replicated round does: bit for bit, the bytes counted too.
@pytest.mark.parametrize('name,client_state,field', [
    ('repshare', 'host', 'means'), ('repshare', 'device', 'means'), ('fd', 'device', 'means'),
    ('fedsc_dp', 'device', 'cov'), ('fedsc_late_ragged', 'host', 'cov')])
def test_summaries_before_a_round_divided_equal_the_replicated_round_bit_for_bit(
    name, client_state, field):
  want = _rounds(name, 'replicated', 'host')
  got = _rounds(name, 'divided', client_state)
  assert float(np.abs(want[-1][1][field]).max()) > 0  # the summaries are there
  for r, (g, w) in enumerate(zip(got, want)):
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(w)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f'{name} round {r}')


@pytest.mark.parametrize('name', ['repshare', 'fd', 'fedsc_dp'])
def test_two_processes_blocks_summarize_their_clients_as_the_whole_federation(name):
  """Each of two processes' blocks (its models from `init_state(process=)`, its rows through
  `placement.held_data`, their client ids) gives the whole federation's summaries of its clients,
  bit for bit: the rows the gather joins (the gather itself: the placement worker)."""
  algo = (eq._algo(name)[0] if name.startswith('fedsc') else
          trs._algo({'repshare': 'ours'}.get(name, name))[0])
  fed = th._hetero_data()
  key = rng.round_key(jax.random.PRNGKey(7), 0)
  whole = rd.init_state(algo, jax.random.PRNGKey(3), eq.NUM_CLIENTS)
  summarize = jax.jit(algo.prepare.summarize)
  (want,) = summarize(whole.server, (whole.clients,), fed, (jnp.arange(eq.NUM_CLIENTS),), key)
  for p in range(2):
    local = placement.divide(fed, p, 2)
    block = rd.init_state(algo, jax.random.PRNGKey(3), eq.NUM_CLIENTS, process=(p, 2))
    (got,) = summarize(block.server, (block.clients,), placement.held_data(local),
                       (jnp.arange(local.lo, local.hi),), key)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[local.lo:local.hi],
                                    err_msg=f'{name} process {p} {jax.tree_util.keystr(path)}')


def test_message_bytes_of_a_processs_block_equal_the_whole_stacks():
  """run_setup sizes the messages from this process's block of the initial state under
  'divided': round 0's summaries (Hetero-SSFL's representations, [C_c, L, d] in the server) are not
  traced there, as a block's rows would not fit the server's."""
  algo = th._algo('default')[0]
  cfg = eq._round_cfg('vmap', 4)
  fed = th._hetero_data()
  whole = rd.init_state(algo, jax.random.PRNGKey(3), eq.NUM_CLIENTS)
  block = rd.init_state(algo, jax.random.PRNGKey(3), eq.NUM_CLIENTS, process=(1, 2))
  assert (rd.message_bytes(algo, cfg, eq.NUM_CLIENTS, block, fed) ==
          rd.message_bytes(algo, cfg, eq.NUM_CLIENTS, whole, fed))


@functools.lru_cache(maxsize=None)
def hetero_mu0():
  """Hetero-SSFL without alignment (mu = 0): two cohorts (architectures) of interleaved clients,
  personal models, no server state."""
  return hetero_ssfl.make(th.SPECS, th.MEMBERS, rad_size=th.RAD, mu=0.0)


# Cohorts: each cohort's stack is cut over the processes on its own (`round.state_blocks`); with
# one process its block is the whole stack, and the round reads and writes the same rows as the
# host-resident replicated round. With alignment, round 0's representations of every client's
# initial model (`Prepare.summarize`) come from the held block (device) or one client at a time
# (host) before the device program (`round.absorb_summaries`), as the host-resident replicated
# round computes them: bit for bit. (The device-resident replicated round computes them inside
# its program: equal under XLA's default flags, ~1e-6 apart at round 0 under the suite's
# optimisation level 0, ENG-96.)
@pytest.mark.parametrize('name,client_state', [
    ('hetero_ssfl', 'host'), ('hetero_ssfl', 'device'),
    ('hetero_ssfl_aligned', 'host'), ('hetero_ssfl_aligned', 'device')])
def test_a_divided_cohort_round_equals_the_replicated_round_bit_for_bit(name, client_state):
  want = _rounds(name, 'replicated', 'host')
  got = _rounds(name, 'divided', client_state)
  for r, (g, w) in enumerate(zip(got, want)):
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(w)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f'round {r}')


def test_state_blocks_cut_each_cohort_on_its_own():
  algo = hetero_mu0()  # cohorts (0, 2, 3) and (1, 4, 5)
  assert [[(b.lo, b.hi, b.num) for b in rd.state_blocks(algo, eq.NUM_CLIENTS, p, 2)]
          for p in range(2)] == [[(0, 2, 3), (0, 2, 3)], [(2, 3, 3), (2, 3, 3)]]
  block = placement.StateBlock.of(3, 1, 2)
  np.testing.assert_array_equal(placement.block_rows(block, np.array([0, 2, 2, 1]),
                                                     np.array([True, True, False, True])),
                                [1, 0, 1, 1])
  with pytest.raises(ValueError, match="cohort 'mlp' of 3 clients is invalid for placement "
                                       "'divided' on 2 processes: its size must be a multiple of "
                                       'the process count'):
    placement.check_processes(6, 2, True, [('cnn', 4), ('mlp', 3)])
  with pytest.raises(ValueError, match="cohort 'cnn' of 3 clients is invalid for placement "
                                       "'divided' on 4 processes: its size must be at least the "
                                       'process count'):
    placement.check_processes(8, 4, False, [('cnn', 3), ('mlp', 5)])
  placement.check_processes(8, 2, True, [('cnn', 4), ('mlp', 4)])


def test_divided_refuses_a_prepare_that_reads_other_clients():
  algo = dataclasses.replace(eq._algo('fedema')[0], prepare=Prepare(
      lambda state, data, ids, key: state.server, reads_data=True))
  cfg = dataclasses.replace(eq._round_cfg('vmap', 4), placement='divided')
  with pytest.raises(ValueError, match="placement = 'divided' is invalid for algorithm 'fedema': "
                                       "its `prepare` reads clients other than the round's "
                                       "participants; use 'replicated'"):
    rd.make_round_step(algo, cfg, eq.NUM_CLIENTS)
  with pytest.raises(ValueError, match=r"placement = 'spread' is invalid: must be one of "
                                       r"\('replicated', 'divided'\)"):
    rd.make_round_step(eq._algo('fedema')[0], dataclasses.replace(cfg, placement='spread'),
                       eq.NUM_CLIENTS)


def _workers(tmp_path, placement_, processes, devices_per_process):
  """Runs tests/core/placement_worker.py as `processes` processes on 127.0.0.1; the .npz of each."""
  port = test_scale._free_port()
  outs = [tmp_path / f'{placement_}{processes}.{p}.npz' for p in range(processes)]
  test_scale.run_processes(
      [[sys.executable, '-m', 'tests.core.placement_worker', str(out), placement_, str(processes),
        str(p), f'127.0.0.1:{port}'] for p, out in enumerate(outs)], devices_per_process)
  return [dict(np.load(o)) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize('processes,blocks', [(2, [(0, 3), (3, 6)]),
                                              (4, [(0, 2), (2, 4), (4, 5), (5, 6)])])
def test_processes_holding_a_block_of_clients_each_equal_one_process(tmp_path, processes, blocks):
  """FedEMA with host state, two rounds of 4 of 6 clients: one process holding everything
  (replicated) against P processes (one device each) holding a block of clients each (divided),
  whose participants cross processes by `placement.exchange`. The mesh has P devices either way,
  so the one cross-device sum adds the same terms in the same order: bit for bit at P = 2. At
  P = 4 one process's four virtual CPU devices do not round their local training as four processes
  of one device do (ENG-94: 157 of 171 leaves differ after two rounds, by at most 1.8e-5, the loss
  by 2e-7 relative), so P = 4 is held to rtol 1e-3 / atol 1e-4, about 5x the measured spread.
  `placement.gather_rows` brings every client's rows back to every process, in the whole
  federation's order (exact at any P: rows are moved, never summed), and per-client results'
  entries likewise (`evaluation._gather_entries`), and one model per client (independent) scored
  by the process holding it, the scores gathered (exact). At P = 2 also Hetero-SSFL's
  two cohorts of 3 (`placement_worker._cohort_rounds`): each process holds its block of each
  cohort's personal models (2 + 1 rows), with alignment (round 0's representations computed per
  block and gathered), and FedSC's first share round (every client's DP-CalR matrix computed by the
  process holding its rows, gathered), bit for bit."""
  (one,) = _workers(tmp_path, 'replicated', 1, processes)
  divided = _workers(tmp_path, 'divided', processes, 1)
  assert [(int(t['lo']), int(t['hi'])) for t in divided] == blocks
  cohort_blocks = [[(int(t[f'cohort{b}_lo']), int(t[f'cohort{b}_hi'])) for b in range(2)]
                   for t in divided if 'cohort0_lo' in t]
  assert cohort_blocks == ([[(0, 2), (0, 2)], [(2, 3), (2, 3)]] if processes == 2 else [])
  for t in divided:
    lo, hi = int(t['lo']), int(t['hi'])
    assert t.keys() == one.keys()
    for k in t:
      if k in ('lo', 'hi') or k.endswith(('_lo', '_hi')):
        continue
      want = one[k]
      if k.startswith('cohorts') and "['clients']" in k:  # this process's block of a cohort
        b = int(k.split("['clients'][")[1][0])
        want = want[int(t[f'cohort{b}_lo']):int(t[f'cohort{b}_hi'])]
      elif "['clients']" in k:
        want = want[lo:hi]
      if processes == 2 or k in ('gathered', 'entries') or k.startswith('personal/'):
        np.testing.assert_array_equal(t[k], want, err_msg=k)
      else:
        np.testing.assert_allclose(t[k], want, rtol=1e-3, atol=1e-4, err_msg=k)
