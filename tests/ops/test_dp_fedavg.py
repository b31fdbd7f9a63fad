"""ops/dp_fedavg.py and its engine hook (core/round.py `dp_aggregate`): clipping and the noisy mean
against float64 numpy loops, the noise std against the formula, epsilon against dp-accounting called
directly, calibration, the config refusals, and a DP round: its update bounded by the clip,
bit-exact resume, epsilon in the host metrics."""
import math
import re

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment
from fedjax_ssl.runs.checkpoint import Checkpointer
from fedjax_ssl.core import rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.ops import dp_fedavg
from tests.algorithms.test_registry import _small_config
from tests.core.test_server_opt import _Run, _assert_equal

# float32 sums of O(10) terms of magnitude <= a few units: rounding <= ~1e-6 of that scale.
F32_ATOL = 1e-5


def _tree(rs, lead=()):
  return {'a': rs.normal(size=lead + (3, 4)).astype(np.float32),
          'b': {'c': rs.normal(size=lead + (5,)).astype(np.float32) * 3.0}}


def _np_clip(tree, s, per_layer):
  leaves = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)]
  if per_layer:
    bound = s / math.sqrt(len(leaves))
    return [x * min(1.0, bound / np.linalg.norm(x)) for x in leaves]
  norm = math.sqrt(sum(np.sum(x * x) for x in leaves))
  return [x * min(1.0, s / norm) for x in leaves]


@pytest.mark.parametrize('per_layer', [False, True])
@pytest.mark.parametrize('s', [0.5, 1e3])   # clipped / left as it is
def test_clip_matches_numpy(per_layer, s):
  tree = _tree(np.random.RandomState(0))
  got = jax.tree_util.tree_leaves(dp_fedavg.clip_update(tree, s, per_layer))
  want = _np_clip(tree, s, per_layer)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-6, atol=1e-7)
  norm = math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in got))
  assert norm <= s * (1 + 1e-6)


def test_noise_std_is_noise_multiplier_times_clip_norm():
  """n = 400k draws: the sample std's relative error has sd ~ 1/sqrt(2n) and the mean's sd is
  std/sqrt(n); 6 of each bounds a false failure below 1e-8."""
  n, std = 400_000, 1.3 * 0.7
  noise = np.asarray(dp_fedavg.gaussian_noise(jax.random.PRNGKey(5), jnp.zeros((n,)), std),
                     np.float64)
  assert abs(noise.std() / std - 1) <= 6 / math.sqrt(2 * n)
  assert abs(noise.mean()) <= 6 * std / math.sqrt(n)


@pytest.mark.parametrize('per_layer', [False, True])
def test_noisy_mean_matches_a_per_client_numpy_loop(per_layer):
  """g + (sum over present k of clip(u_k - g) + noise) / m, with the same noise, absent rows
  (zeroed, or non-finite) adding nothing but counting in m."""
  rs = np.random.RandomState(1)
  m, s, z = 5, 1.5, 0.8
  g = _tree(rs)
  payloads = _tree(rs, (m,))
  payloads['a'][3] = np.nan                      # a failed upload
  present = np.array([True, True, False, False, True])
  key = jax.random.PRNGKey(9)
  dp = dp_fedavg.DpAggregation(s, z, per_layer)
  got = jax.tree_util.tree_leaves(
      dp_fedavg.noisy_mean(g, payloads, jnp.asarray(present), key, dp, m))
  noise = jax.tree_util.tree_leaves(dp_fedavg.gaussian_noise(key, g, z * s))
  total = [np.zeros(np.shape(x)) for x in jax.tree_util.tree_leaves(g)]
  for k in range(m):
    if present[k]:
      delta = jax.tree_util.tree_map(lambda u, r: np.asarray(u[k], np.float64) - r, payloads, g)
      total = [t + c for t, c in zip(total, _np_clip(delta, s, per_layer))]
  for out, ref, t, e in zip(got, jax.tree_util.tree_leaves(g), total, noise):
    want = np.asarray(ref, np.float64) + (t + np.asarray(e, np.float64)) / m
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=0, atol=F32_ATOL)


@pytest.mark.parametrize('m,c,rounds', [(3, 10, 20), (10, 10, 7), (50, 500, 1), (50, 500, 30)])
def test_epsilon_equals_dp_accounting_called_directly(m, c, rounds):
  z, delta = 1.1, 1e-5
  gaussian = dp_accounting.GaussianDpEvent(z / 2)   # replace-one: sensitivity 2 S
  event = gaussian if m == c else dp_accounting.SampledWithoutReplacementDpEvent(c, m, gaussian)
  acc = dp_accounting.rdp.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  acc.compose(event, rounds)
  assert dp_fedavg.epsilon(z, m, c, rounds, delta, 'rdp') == acc.get_epsilon(delta)
  if m == c:
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(gaussian, rounds)
    assert dp_fedavg.epsilon(z, m, c, rounds, delta, 'pld') == pld.get_epsilon(delta)
    # PLD is the tighter accountant of the same mechanism.
    assert dp_fedavg.epsilon(z, m, c, rounds, delta, 'pld') <= acc.get_epsilon(delta)
  assert dp_fedavg.epsilon(z, m, c, 0, delta) == 0.0
  assert dp_fedavg.epsilon(0.0, m, c, rounds, delta) == math.inf


def test_calibration_meets_the_target_and_no_more():
  target, delta = 4.0, 1e-5
  z = dp_fedavg.calibrate_noise_multiplier(target, delta, 3, 10, 20, 'rdp')
  assert dp_fedavg.epsilon(z, 3, 10, 20, delta) <= target
  assert dp_fedavg.epsilon(z * (1 - 1e-3), 3, 10, 20, delta) > target


def test_pld_refuses_sampling_without_replacement():
  with pytest.raises(ValueError, match=re.escape("dp.accountant = 'pld' is invalid with "
                                                 'clients_per_round = 3 < num_clients = 10')):
    dp_fedavg.epsilon(1.0, 3, 10, 5, 1e-5, 'pld')


def _dp_config(name='fedavg', **dp):
  config = _small_config(name)
  config.dp.update(dict(enabled=True, **dp))
  return config


@pytest.mark.parametrize('name,dp,message', [
    ('fedavg', dict(clip_norm=0.0), 'config.dp.clip_norm = 0.0 is invalid: must be a finite '
                                    'number > 0'),
    ('fedavg', dict(noise_multiplier=-1.0), 'config.dp.noise_multiplier = -1.0 is invalid'),
    ('fedavg', dict(delta=1.0), 'config.dp.delta = 1.0 is invalid'),
    ('fedavg', dict(accountant='pld'), "config.dp.accountant = 'pld' is invalid with "
                                       'clients_per_round = 2 < num_clients = 4'),
    ('fedavg', dict(noise_multiplier=0.5, target_epsilon=1.0),
     'config.dp.target_epsilon = 1.0 cannot be met: dp.noise_multiplier = 0.5 over 2 rounds'),
    ('fedu2', dict(noise_multiplier=1.0), "config.dp.enabled = True is invalid for algorithm "
                                          "'fedu2': its server update (EUA)"),
    ('fedca', dict(noise_multiplier=1.0), "config.dp.enabled = True is invalid for algorithm "
                                          "'fedca': its aggregate is not registered"),
])
def test_bad_dp_configs_are_refused_in_one_line(name, dp, message):
  config = _dp_config(name, **dp)
  with pytest.raises(cv.ConfigError, match=re.escape(message)):
    experiment.validate_config(config)


def test_dp_round_is_bounded_by_the_clip_resumes_exactly_and_logs_epsilon(tmp_path):
  """Without noise the global model moves by at most S per round (the mean of m clipped updates);
  with noise 3 rounds straight equal 2, a checkpoint, a restore and 1 more, bit for bit; epsilon in
  the host metrics is dp-accounting's after state.round rounds."""
  s = 1e-3
  config = _dp_config(clip_norm=s, noise_multiplier=0.0)
  experiment.validate_config(config)
  run = _Run(config)
  start = run.init()
  one = run.rounds(start, 1)
  moved = math.sqrt(sum(float(np.sum(np.square(np.asarray(a, np.float64) - np.asarray(b))))
                        for a, b in zip(jax.tree_util.tree_leaves(one.server),
                                        jax.tree_util.tree_leaves(start.server))))
  assert 0 < moved <= s * (1 + 1e-4)

  config = _dp_config(clip_norm=1.0, noise_multiplier=0.9)
  config.rounds = 3
  experiment.validate_config(config)
  run = _Run(config)
  two = run.rounds(run.init(), 2)
  with Checkpointer(str(tmp_path), save_every=1) as ckpt:
    ckpt.maybe_save(2, two)
    _, restored, _ = ckpt.restore(run.init())
  three = run.rounds(two, 1)
  _assert_equal(run.rounds(restored, 1), three)
  assert run.algo.host_metrics(three) == {'epsilon': dp_fedavg.epsilon(0.9, 2, 4, 3, 1e-5)}
  assert run.algo.host_metrics(restored)['epsilon'] == dp_fedavg.epsilon(0.9, 2, 4, 2, 1e-5) > 0


def test_training_logs_epsilon_every_round_and_the_dp_block(tmp_path):
  """The binary's loop: epsilon after each round in metrics.jsonl, results.json's 'dp' block with
  the last round's epsilon (equal to the planned one) and the settings."""
  import json  # pylint: disable=g-import-not-at-top
  from fedjax_ssl.runs import training  # pylint: disable=g-import-not-at-top
  config = _dp_config(clip_norm=2.0, target_epsilon=50.0, delta=1e-3)
  config.update(dict(rounds=2, checkpoint_every=2, knn_k=5))
  results = training.train_and_evaluate(config, str(tmp_path / 'w'), verbose=False)
  records = [json.loads(l) for l in (tmp_path / 'w' / 'metrics.jsonl').read_text().splitlines()]
  z = results['dp']['noise_multiplier']
  assert [r['epsilon'] for r in records[1:]] == [dp_fedavg.epsilon(z, 2, 4, r, 1e-3)
                                                 for r in (1, 2)]
  assert results['dp']['epsilon'] == records[-1]['epsilon'] == results['dp']['planned_epsilon']
  assert results['dp']['epsilon'] <= 50.0
  assert {k: results['dp'][k] for k in ('clip_norm', 'delta', 'rounds', 'accountant')} == dict(
      clip_norm=2.0, delta=1e-3, rounds=2, accountant='rdp')


def test_run_identity_ignores_the_block_while_dp_is_off():
  """Runs from before config.dp keep their identity (resume, caches); an enabled block counts."""
  import json  # pylint: disable=g-import-not-at-top
  from fedjax_ssl import run_identity  # pylint: disable=g-import-not-at-top
  config = _small_config('fedavg')
  config.dp.clip_norm = 3.0
  assert 'dp' not in json.loads(run_identity.run_key(config))
  config.dp.enabled = True
  assert json.loads(run_identity.run_key(config))['dp']['clip_norm'] == 3.0


def test_vectorised_dp_round_equals_a_per_client_numpy_loop():
  """The jitted round (participants under 'map') against each participant's round run alone, its
  upload clipped, summed and noised in float64 numpy with the engine's noise key, over m = 2.
  Both train the same client program; the float32 rounding of training and aggregation is ~1e-6 of
  the parameters' scale (tests/core/test_round_equivalence.py's bound)."""
  s, z = 0.05, 0.7
  config = _dp_config(clip_norm=s, noise_multiplier=z, per_layer=True)
  experiment.validate_config(config)
  run = _Run(config)
  cfg = experiment.round_config(config)
  state = run.init()
  key = rng.round_key(run.run_key, 0)
  got, _ = run.step(state, run.fed_data, key)

  algo = run.algo
  ids = [int(i) for i in rd.sample_participants(key, 4, 2)]
  msg = rd.round_message(algo, state.server, run.fed_data)
  fn = jax.jit(rd.client_round_fn(algo, cfg))
  g = jax.tree_util.tree_leaves(algo.update_reference(state.server))
  total = [np.zeros(np.shape(x)) for x in g]
  for cid in ids:
    client = jax.tree_util.tree_map(lambda a, c=cid: a[c], state.clients)
    _, payload, _ = fn(client, rng.client_key(key, cid), jnp.int32(cid), run.fed_data, msg,
                       cfg.lr_fn(state.round))
    delta = [np.asarray(u, np.float64) - np.asarray(r, np.float64)
             for u, r in zip(jax.tree_util.tree_leaves(payload), g)]
    total = [t + c for t, c in zip(total, _np_clip(delta, s, True))]
  noise = jax.tree_util.tree_leaves(dp_fedavg.gaussian_noise(
      jax.random.fold_in(key, dp_fedavg.NOISE_STREAM), algo.update_reference(state.server), z * s))
  for out, ref, t, e in zip(jax.tree_util.tree_leaves(algo.update_reference(got.server)), g, total,
                            noise):
    want = np.asarray(ref, np.float64) + (t + np.asarray(e, np.float64)) / 2
    err = float(np.max(np.abs(np.asarray(out, np.float64) - want)))
    assert err <= 1e-6 * max(1.0, float(np.max(np.abs(want)))), err


def test_a_round_without_present_participants_still_releases_noise_over_m():
  """Every client's upload of round 1 made non-finite: nobody is present, yet the DP release is
  g + noise / m (skipping it would depend on all participants' data), and nothing non-finite
  reaches the model."""
  s, z = 0.5, 1.0
  config = _dp_config(clip_norm=s, noise_multiplier=z)
  config.inject_client_faults = '1:0,1:1,1:2,1:3'
  experiment.validate_config(config)
  run = _Run(config)
  state = run.init()
  key = rng.round_key(run.run_key, 0)
  got, metrics = run.step(state, run.fed_data, key)
  assert float(metrics['failed_clients']) == 2
  ref = run.algo.update_reference(state.server)
  noise = dp_fedavg.gaussian_noise(jax.random.fold_in(key, dp_fedavg.NOISE_STREAM), ref, z * s)
  for out, g, e in zip(*(jax.tree_util.tree_leaves(t) for t in (
      run.algo.update_reference(got.server), ref, noise))):
    want = np.asarray(g, np.float64) + np.asarray(e, np.float64) / 2
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=0, atol=F32_ATOL)


def test_a_resume_may_not_change_what_the_ledger_assumes():
  """Even --allow_config_change: a changed dp key, or the rounds / sampling of a DP run, would
  count earlier rounds under settings they did not run with. Other changes and non-DP runs pass."""
  from fedjax_ssl.runs import resuming, run_guard  # pylint: disable=g-import-not-at-top
  stored = _dp_config(noise_multiplier=1.0)
  for key, value in (('dp.noise_multiplier', 0.5), ('rounds', 3), ('dp.enabled', False)):
    current = _dp_config(noise_multiplier=1.0)
    node, leaf = (current.dp, key[3:]) if key.startswith('dp.') else (current, key)
    node[leaf] = value
    changes = resuming.config_changes(stored, current)
    with pytest.raises(run_guard.RunStateError, match=re.escape('a resume cannot change ')):
      resuming.refuse_dp_changes(changes, current.dp.enabled)
  current = _dp_config(noise_multiplier=1.0)
  current.lr = 0.5
  resuming.refuse_dp_changes(resuming.config_changes(stored, current), True)
  plain, longer = _small_config('fedavg'), _small_config('fedavg', rounds=5)
  resuming.refuse_dp_changes(resuming.config_changes(plain, longer), False)
