"""Faults inside a round (core/faults.py): a failed participant leaves every registered aggregate as
if it had not taken part and is rolled back; dropouts lose the upload but keep the training; the
config knobs are checked before compute."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import algorithms, experiment
from fedjax_ssl import config_validation as cv
from fedjax_ssl.core import faults, rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import CohortSlots
from tests.algorithms import test_registry
from tests.algorithms.test_registry import _small_config

AGGREGATING = [n for n in test_registry.BUILT_IN if algorithms.get(n).aggregates]
# Besides the defaults: FedU2's ADMM solver, L-DAWA's data weights, a server optimizer, FedSC's
# uniform model average (its default) and data-weighted one.
VARIANTS = {'fedu2_admm': ('fedu2', {'fedu2.solver': 'admm'}),
            'fedu2_literal': ('fedu2', {'fedu2.solver': 'admm_literal'}),
            'ldawa_sizes': ('ldawa', {'ldawa.size_weights': True}),
            'fedavg_adam': ('fedavg', dict(server_optimizer='adam', server_lr=0.01)),
            'fedsc_data': ('fedsc', {'fedsc.model_weights': 'data'})}
CASES = {**{n: (n, {}) for n in AGGREGATING}, **VARIANTS}


def _built(name, **overrides):
  config = _small_config(name, clients_per_round=3, strategy='vmap', **overrides)
  return (config,) + test_registry._built(config)


def _random_like(shapes, m, seed):
  """Payloads [m, ...] of the traced shapes, with normal float entries (integers zero)."""
  leaves, tree = jax.tree_util.tree_flatten(shapes)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  out = [jax.random.normal(k, (m,) + s.shape, s.dtype) if jnp.issubdtype(s.dtype, jnp.floating)
         else jnp.zeros((m,) + s.shape, s.dtype) for k, s in zip(keys, leaves)]
  return jax.tree_util.tree_unflatten(tree, out)


def _assert_close(got, want, rtol, keep=None):
  """Leaf by leaf; `rtol` is relative to each leaf's largest magnitude. A per-participant leaf of
  `got` ([m] where `want` has [m - 1], e.g. FedU2's EUA weights) is compared at `keep` and must be
  0 elsewhere."""
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if keep is not None and a.ndim == 1 and a.shape[0] == b.shape[0] + 1:
      assert not np.any(np.delete(a, keep)), a
      a = a[keep]
    scale = max(np.max(np.abs(b)), 1e-30) if b.size else 1.0
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale)


@pytest.mark.slow
@pytest.mark.parametrize('case', sorted(CASES))
def test_an_absent_participant_leaves_the_aggregate_as_if_it_had_not_taken_part(case):
  """`aggregate` with a participant at weight 0 and its payload zeroed (what the engine hands it,
  core/faults.py) equals `aggregate` over the others alone, with their weights renormalised.

  Tolerance: both sides add the same nonzero terms, the weight-0 side one exact zero more; XLA may
  split the sums differently, and the iterative aggregates (Orchestra's 500 SGD steps on its
  clustering, FedU2's min-norm solve) carry that rounding through their iterations: 1e-6 of a
  leaf's scale for the one-pass aggregates, 1e-4 for the iterative ones (float32, eps 1.2e-7).
  """
  name, overrides = CASES[case]
  config, fed_data, algo, state, key = _built(name, **overrides)
  m = config.clients_per_round
  ids = rd.sample_participants(key, config.num_clients, m)
  server = rd.prepare_server(algo, state, fed_data, ids, key)
  msg = rd.round_message(algo, server, fed_data)
  lr = experiment.round_config(config).lr_fn(state.round)
  groups = rd.cohorts(algo, config.num_clients)
  stacks = rd.cohort_stacks(algo, state.clients)
  slots = tuple(rd.cohort_slots(ids, c, config.num_clients, m) for c in groups)
  payloads = []
  for i, (cohort, stack) in enumerate(zip(groups, stacks)):
    fn = rd.client_round_fn(algo, experiment.round_config(config), cohort.client)
    one = jax.tree_util.tree_map(lambda a: a[0], stack)
    shapes = jax.eval_shape(fn, one, key, jnp.int32(cohort.members[0]), fed_data, msg, lr)[1]
    payloads.append(_random_like(shapes, slots[i].ids.shape[0], i))
  n = [np.where(np.asarray(s.valid), np.asarray(fed_data.n)[np.asarray(s.ids)], 0).astype(np.float32)
       for s in slots]
  # The absent one: the first filled slot of the first cohort with two or more.
  c0 = next(i for i, s in enumerate(slots) if int(np.sum(np.asarray(s.valid))) >= 2)
  absent = 0
  here = [np.ones_like(x, bool) for x in n]
  here[c0][absent] = False
  total = sum(float(np.sum(x * h)) for x, h in zip(n, here))
  weights = tuple(jnp.asarray(x * h / total) for x, h in zip(n, here))
  zeroed = tuple(faults.zero_rows(jnp.asarray(h), p) for h, p in zip(here, payloads))
  agg = algo.aggregate
  if algo.cohorts:
    gone = tuple(CohortSlots(jnp.where(jnp.asarray(h), s.local, len(c.members)), s.ids,
                             s.valid & jnp.asarray(h)) for h, s, c in zip(here, slots, groups))
    # One program for both sides (a compile per aggregate dominates this test's time).
    got, want = jax.jit(lambda *a: (agg(a[0], a[1], a[3], a[4]), agg(a[0], a[2], a[3], a[5])))(
        server, zeroed, payloads, weights, slots, gone)
  else:
    keep = np.flatnonzero(here[0])
    sub = jax.tree_util.tree_map(lambda a: a[keep], payloads[0])
    w_all = jnp.asarray(n[0] / np.sum(n[0]))
    got, want, with_it = jax.jit(lambda *a: (
        agg(a[0], a[1], a[2], a[3]), agg(a[0], a[4], a[5], a[6]), agg(a[0], a[7], a[8], a[3])))(
            server, zeroed[0], weights[0], ids, sub, weights[0][keep], ids[keep], payloads[0],
            w_all)
  iterative = name in ('orchestra', 'fedu2')
  _assert_close(got, want, 1e-4 if iterative else 1e-6,
                keep=None if algo.cohorts else np.flatnonzero(here[0]))
  # The absent participant mattered: with it present the aggregate differs.
  if not algo.cohorts:
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(jax.tree_util.tree_leaves(with_it), jax.tree_util.tree_leaves(want))
               if np.asarray(a).size and np.shape(a) == np.shape(b))
    assert diff > 1e-3

def _stored(state, cid):
  return [np.asarray(a[cid]) for a in jax.tree_util.tree_leaves(jax.device_get(state.clients))]


@pytest.mark.slow
def test_a_failed_client_is_rolled_back_and_the_server_aggregates_the_others():
  """FedBYOL (clients keep their local targets): an injected failure in round 1 is counted and
  named, its client's stored state is its state before the round, the other participants train as
  without the fault, and the server is the aggregate of their uploads alone (each computed one
  client at a time by the per-participant function, as a slow reference)."""
  config, fed_data, algo, state, key = _built('fedavg', ssl_method='byol')
  cfg = experiment.round_config(config)
  ids = [int(i) for i in rd.sample_participants(key, config.num_clients, 3)]
  bad = ids[1]
  before = jax.device_get(state)
  clean, m_clean = rd.make_round_step(algo, cfg, config.num_clients, donate=False)(state, fed_data,
                                                                                    key)
  faulty = dataclasses.replace(cfg, inject_faults=((0, bad),))
  got, metrics = rd.make_round_step(algo, faulty, config.num_clients, donate=False)(state, fed_data,
                                                                                     key)
  metrics = jax.device_get(metrics)
  assert float(metrics['failed_clients']) == 1
  assert [int(i) for i in metrics['failed_ids'] if i >= 0] == [bad]
  assert 'dropped_clients' not in metrics  # dropouts off
  for a, b in zip(_stored(got, bad), _stored(before, bad)):
    np.testing.assert_array_equal(a, b)
  for cid in ids:
    if cid != bad:
      for a, b in zip(_stored(got, cid), _stored(clean, cid)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * max(np.max(np.abs(b)), 1))
  # The survivors' mean loss; the reference: each participant's own round, then `aggregate`.
  server = rd.prepare_server(algo, state, fed_data, jnp.asarray(ids), key)
  msg = rd.round_message(algo, server, fed_data)
  fn = jax.jit(rd.client_round_fn(algo, cfg))
  outs = {cid: fn(jax.tree_util.tree_map(lambda a, c=cid: a[c], state.clients),
                  rng.client_key(key, cid), jnp.int32(cid), fed_data, msg, cfg.lr_fn(state.round))
          for cid in ids if cid != bad}
  keep = sorted(outs)
  n = np.asarray(fed_data.n)[keep].astype(np.float32)
  payloads = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[outs[c][1] for c in keep])
  want = algo.aggregate(server, payloads, jnp.asarray(n / n.sum()), jnp.asarray(keep))
  _assert_close(got.server, want, 1e-6)
  assert float(metrics['loss']) == pytest.approx(np.mean([float(outs[c][2]) for c in keep]),
                                                 rel=1e-5)
  assert float(m_clean['failed_clients']) == 0


@pytest.mark.slow
def test_dropouts_keep_the_training_lose_the_upload_and_a_round_without_uploads_keeps_the_server():
  """client_state='host': with every participant dropped, the server is the one it started from,
  each participant's stored state is the one it trained to, and the round counts the drops."""
  config, fed_data, algo, _, _ = _built('fedavg', ssl_method='byol')
  init_key, run_key = experiment.run_keys(config)
  rate = 0.9
  # A round whose three participants all draw a dropout (the draw is a pure function of the key).
  r = next(r for r in range(50) if bool(np.all(np.asarray(faults.dropped(
      rng.round_key(run_key, r), rd.sample_participants(rng.round_key(run_key, r), 4, 3), rate)))))
  key = rng.round_key(run_key, r)
  ids = [int(i) for i in rd.sample_participants(key, 4, 3)]
  cfg = dataclasses.replace(experiment.round_config(config), client_state='host')
  clean = rd.make_round_step(algo, cfg, 4)(rd.init_state(algo, init_key, 4, 'host'), fed_data,
                                           key)[0]
  state = rd.init_state(algo, init_key, 4, 'host')
  server0 = jax.device_get(state.server)
  step = rd.make_round_step(algo, dataclasses.replace(cfg, dropout_rate=rate), 4)
  got, metrics = step(state, fed_data, key)
  assert float(metrics['dropped_clients']) == 3 and float(metrics['failed_clients']) == 0
  for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(got.server)),
                  jax.tree_util.tree_leaves(server0)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The same local training in another program (the dropout draw added): XLA may fuse it
  # differently, so float32 rounding may differ by an ulp or so per operation (measured: 2 of 512
  # entries 1 ulp apart under XLA:CPU's loop emitters, 9.9e-8 relative). 16 ulps (2^-20 relative)
  # bound that; a client that did not train would be off by its whole update.
  for cid in ids:
    for a, b in zip(_stored(got, cid), _stored(clean, cid)):
      np.testing.assert_allclose(a, b, rtol=2.0 ** -20, atol=1e-9)


def test_the_dropout_draw_is_per_client_and_has_its_rate():
  key = jax.random.PRNGKey(3)
  ids = jnp.arange(20000, dtype=jnp.int32)
  d = np.asarray(faults.dropped(key, ids, 0.3))
  assert abs(d.mean() - 0.3) < 4 * np.sqrt(0.3 * 0.7 / d.size)
  # A client's draw does not depend on who else takes part.
  np.testing.assert_array_equal(np.asarray(faults.dropped(key, ids[jnp.asarray([5, 900, 17])], 0.3)), d[[5, 900, 17]])
  assert not np.any(np.asarray(faults.dropped(key, ids, 0.0)))


def test_injected_faults_and_finite_rows():
  flag = faults.injected(((2, 7), (0, 1)), jnp.int32(2), jnp.asarray([1, 7, 3], jnp.int32))
  assert np.asarray(flag).tolist() == [False, True, False]
  tree = {'a': jnp.ones((3, 2)), 'n': jnp.zeros((3,), jnp.int32)}
  poisoned = faults.poison_rows(flag, tree)
  assert np.asarray(faults.finite_rows(poisoned, 3)).tolist() == [True, False, True]
  assert np.asarray(faults.zero_rows(~flag, poisoned)['a']).tolist() == [[1, 1], [0, 0], [1, 1]]


def test_finite_rows_counts_inf_and_nan_in_any_leaf_and_compiles_linearly_in_the_leaves():
  tree = [jnp.ones((4, 3)) for _ in range(5)]
  tree[1] = tree[1].at[2, 0].set(jnp.inf)
  tree[4] = tree[4].at[0, 2].set(jnp.nan)
  assert np.asarray(faults.finite_rows(tree, 4)).tolist() == [False, True, False, True]
  assert np.asarray(faults.finite_rows([jnp.zeros((4,), jnp.int32)], 4)).tolist() == [True] * 4

  # Every leaf's select consumes the mask: built as a chain of `and`s, XLA copied the chain into
  # each consumer's fusion, a program quadratic in the leaves (16 -> 64 leaves: 736 -> 9,088
  # instructions, x12.3; ResNet-18 FedU2's round compiled 2.4x longer, testing.md#test-17). Linear
  # is x4 (now 374 -> 1,478); the bound 6 sits between.
  def instructions(num_leaves):
    leaves = [jnp.ones((4, 3, 2)) for _ in range(num_leaves)]
    f = jax.jit(lambda t: faults.zero_rows(faults.finite_rows(t, 4), t))
    text = f.lower(leaves).compile().as_text()
    return sum(1 for line in text.splitlines() if re.search(r' = \S+ [a-z-]+\(', line))
  assert instructions(64) / instructions(16) < 6


@pytest.mark.parametrize('value, message', [
    ('3', "entry '3' is invalid: write ROUND:CLIENT"),
    ('0:1', "entry '0:1' is invalid: the round must be >= 1"),
    ('2:9', 'entry 2:9 is invalid: the round must be in [1, rounds=2] and the client in '
            '[0, num_clients=4)'),
])
def test_a_bad_fault_knob_is_refused_in_one_line(value, message):
  config = _small_config('fedavg', inject_client_faults=value)
  with pytest.raises(cv.ConfigError, match=re.escape(message)):
    experiment.validate_config(config)


@pytest.mark.parametrize('key, value', [('dropout_rate', 1.0), ('dropout_rate', -0.1),
                                        ('max_failed_fraction', 1.0)])
def test_rates_outside_0_1_are_refused(key, value):
  with pytest.raises(cv.ConfigError, match=f'config.{key} = {value} is invalid'):
    experiment.validate_config(_small_config('fedavg', **{key: value}))


@pytest.mark.parametrize('name', ['independent', 'centralized'])
def test_the_knobs_are_refused_without_an_aggregate(name):
  assert not algorithms.get(name).aggregates
  for key, value in (('dropout_rate', 0.1), ('inject_client_faults', '1:0')):
    with pytest.raises(cv.ConfigError, match=f"config.{key} = .* is invalid for algorithm "
                       f"'{name}': it has no aggregate"):
      experiment.validate_config(_small_config(name, **{key: value}))
