"""Every algorithm's stacked round step, under vmap (map and shard for one algorithm of each server
shape), equals the slow per-client Python loop of tests/reference.py on tiny inputs — partial participation and unequal client sizes
(one client smaller than a batch) included — and both benchmark baselines (a jitted call per client,
a jitted call per local step) give the same numbers.

The comparisons run in float64 (x64 enabled, float64 client and server state), so that they decide
on the algorithm and not on rounding. In float32 the verdict depended on the CPU's instruction set:
the momentum of a bias that feeds a BatchNorm has an exactly-zero gradient, so what a float32
comparison sees there is GEMM rounding noise, which XLA vectorises differently for SSE4.2, AVX2 and
AVX-512. In float64 the engine and the loop agree to ~1e-10 relative on every leaf, while a wrong
batch, key, mask, weight or client moves leaves by >= 1e-3 relative
(`test_comparison_detects_a_wrong_batch_key_mask_weight_or_client`).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import models
from fedjax_ssl.algorithms import (fedavg, feddecorr, fedema, fedsc, fedu, fedu2, fedx, independent,
                                   ldawa, ssl_client)
from experiments import baselines
from fedjax_ssl.core import optim, rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import FedData
from fedjax_ssl.ops import uot
from tests import reference
from tests.ops.test_ldawa import np_ldawa

NUM_CLIENTS = 6
SIZES = (18, 5, 28, 12, 22, 16)   # batch 8: 2, 1 (wrapped), 3, 1, 2, 2 steps per epoch
BATCH, EPOCHS = 8, 2
AUG = augment.AugmentConfig(out_size=8, crop_scale=(0.5, 1.0), flip_prob=0.5, jitter_prob=0.0,
                            grayscale_prob=0.0)


def _data(num_clients=NUM_CLIENTS, sizes=SIZES):
  rs = np.random.RandomState(0)
  n_max = max(sizes)
  x = np.zeros((num_clients, n_max, 8, 8, 1), np.uint8)
  y = np.full((num_clients, n_max), -1, np.int32)
  for c, n in enumerate(sizes):
    x[c, :n] = rs.randint(0, 256, (n, 8, 8, 1))
    y[c, :n] = rs.randint(0, 3, n)
  return FedData.from_padded(x, y, sizes)


def _fur(kind):
  """FedU2's per-view FUR term: the paper's UOT (20 solver iterations) or the code's SWD."""
  if kind == 'uot':
    return lambda z, key: 0.1 * uot.fur_uot_loss(z, key, num_iters=20)[0]
  return lambda z, key: 0.01 * uot.tangent_swd_loss(z, key, normalize=True)


def _spec(method, reset_optimizer=True, tx='sgd', fur=None, sc_mu=None):
  enc = models.get_encoder('small_cnn', conv_features=(4,), dense_features=(12, 6))
  if method == 'supervised':
    model = models.Classifier(enc, 3)
  else:
    pred = models.MLPHead(8, 5) if method in ('byol', 'simsiam') else None
    model = models.SSLModel(enc, models.MLPHead(8, 5), pred)
  tx = optim.make_optimizer(tx, momentum=0.9, weight_decay=1e-3)
  return ssl_client.ClientSpec(objective=method, model=model, tx=tx, aug=AUG, mean=(0.5,), std=(0.3,),
                               input_shape=(8, 8, 1),
                               hparams={'temperature': 0.5, 'ema_tau': 0.9, 'mu': sc_mu},
                               reset_optimizer=reset_optimizer,
                               feature_regularizer=_fur(fur) if fur else None)


ALGOS = {
    'fedbyol': lambda **kw: fedavg.make(_spec('byol'), **kw),
    'fedbyol_reset_target': lambda **kw: fedavg.make(_spec('byol'), byol_target_sync='reset', **kw),
    'fedsimsiam': lambda **kw: fedavg.make(_spec('simsiam'), **kw),
    'fedsimclr': lambda **kw: fedavg.make(_spec('simclr'), **kw),
    'fedavg_supervised': lambda **kw: fedavg.make(_spec('supervised'), **kw),
    # Persistent Adam without a reset (representation sharing's FL): its moments persist.
    'fedavg_supervised_adam': lambda **kw: fedavg.make(
        _spec('supervised', reset_optimizer=False, tx='adam'), **kw),
    # A tiny threshold / scaler so both branches of the divergence rules are exercised.
    'fedu': lambda: fedu.make(_spec('byol'), dapu_threshold=0.05),
    'fedema': lambda: fedema.make(_spec('byol'), autoscaler_tau=0.5),
    # Momentum kept across rounds (reset_optimizer=False).
    'independent': lambda: independent.make(_spec('simclr', reset_optimizer=False)),
    # Persistent Adam (representation sharing's client optimiser). Comparable only in float64: its
    # first steps are g / (|g| + eps), so a gradient that is zero in exact arithmetic gives a step
    # of ~lr * noise / eps — O(lr) for float32 noise (~1e-8), ~1e-9 * lr for float64 noise.
    'independent_adam': lambda: independent.make(_spec('simclr', reset_optimizer=False, tx='adam')),
    # FedU2: FUR + EUA as the code does it (whole model, BYOL target included, fixed server step);
    # the paper's direction with the code's SWD, ADMM weights and a deviation-scaled step; and the
    # no-EUA ablation (data-weighted mean of the same payloads).
    'fedu2_byol': lambda: fedu2.make(_spec('byol', fur='uot'), clients_per_round=4,
                                     server_lr=0.05),
    'fedu2_simclr': lambda: fedu2.make(_spec('simclr', fur='swd'), clients_per_round=4,
                                       eua_direction='paper', eua_solver='admm',
                                       eua_step='deviation', server_lr=1.0),
    'fedu2_simsiam_no_eua': lambda: fedu2.make(_spec('simsiam', fur='uot'), clients_per_round=4,
                                               eua=False),
    # FedSC: sharing from round 1 (round 0 of the engine: everyone uploads, then participants),
    # DP noise, data-weighted matrices with alpha_j = q_j, clipped loss and DP-CalR, 3 views, chunks
    # of 8 (so clients span 1-4 chunks with padding); and a late schedule (no share in the first
    # round, the local SC loss) with uniform weights, no noise and the ragged last batch.
    'fedsc_dp': lambda: fedsc.make(_spec('sc', sc_mu=2.0), num_rounds=10, sigma=0.05,
                                   calr_views=3, calr_batch=8, mu=2.0, matrix_weights='data',
                                   alpha_schedule='q'),
    'fedsc_late_ragged': lambda: fedsc.make(_spec('sc'), num_rounds=10, share_start=1,
                                            calr_views=2, calr_batch=16, model_weights='data'),
    # Issue 27's baselines: a loss term on the backbone features (FedDecorr), the server's
    # cosine-scaled mean (L-DAWA, uniform weights as released) and per-client anchors that persist
    # across rounds with a frozen global model in the step (FedX).
    'feddecorr_simsiam': lambda **kw: feddecorr.make(_spec('simsiam'), beta=0.1, **kw),
    'ldawa_byol': lambda **kw: ldawa.make(_spec('byol'), **kw),
    'fedx_simclr': lambda **kw: fedx.make(
        fedx.with_predictor(_spec('simclr'), models.MLPHead(8, 5)), batch_size=BATCH, **kw),
}

# Algorithms trained with drop_last=False (the ragged last batch).
RAGGED = ('fedsc_late_ragged',)

# The server step each reference loop uses in place of the float64 data-weighted mean.
REFERENCE_AGGREGATES = {
    'fedu2_byol': functools.partial(reference.numpy_eua, direction='code', solver='exact',
                                    server_lr=0.05, step='fixed'),
    'fedu2_simclr': functools.partial(reference.numpy_eua, direction='paper', solver='admm',
                                      server_lr=1.0, step='deviation'),
    'fedu2_simsiam_no_eua': lambda server, payloads, weights: dict(
        reference.numpy_weighted_mean(payloads, weights),
        eua=dict(server['eua'], p=np.asarray(weights, np.asarray(server['eua']['p']).dtype))),
    'fedsc_dp': lambda server, payloads, weights: dict(
        server, model=reference.numpy_weighted_mean(payloads, np.full(len(weights), 1 / len(weights)))),
    'fedsc_late_ragged': lambda server, payloads, weights: dict(
        server, model=reference.numpy_weighted_mean(payloads, weights)),
    'ldawa_byol': lambda server, payloads, weights: np_ldawa(
        payloads, server, np.full(len(weights), 1 / len(weights))),
}

# FedSC's pre-round uploads and per-participant message, written out independently (on a client
# spec equal to the algorithm's).
REFERENCE_HOOKS = {
    'fedsc_dp': lambda: reference.numpy_fedsc_hooks(
        _spec('sc', sc_mu=2.0), num_rounds=10, sigma=0.05, views=3, chunk=8, mu=2.0,
        matrix_weights='data', alpha_schedule='q'),
    'fedsc_late_ragged': lambda: reference.numpy_fedsc_hooks(
        _spec('sc'), num_rounds=10, sigma=0.0, views=2, chunk=16, mu=None,
        share_start=1),
}


# The sweep over algorithms runs vmap without phases (vmap_shrink = 0): the phases live in
# core/local.py's batching rule and treat the step as opaque, and each phase width compiles one more
# copy of the step (~7 s per test on 2 cores). The default phases (2.0) and another width set (1.5)
# run in test_vmap_phase_widths_change_no_number, the host tests and tests/core/test_scale.py.
def _round_cfg(strategy, m, chunk=2, drop_last=True, client_state='device', vmap_shrink=0.0):
  return rd.RoundConfig(clients_per_round=m, local_epochs=EPOCHS, batch_size=BATCH,
                        lr_fn=lambda r: optim.round_lr(0.02, 'cosine', r, 10), strategy=strategy,
                        map_chunk_size=chunk, drop_last=drop_last, client_state=client_state,
                        vmap_shrink=vmap_shrink)


# Stateless algorithms (persist/restore: only what survives a round is stored per client). The
# reference loop runs their stateful twin (`stateless=False`: every client's whole state stored, as
# the engine did before stateless clients), so the equivalence shows they compute the same numbers.
STATELESS = ('fedavg_supervised', 'fedavg_supervised_adam', 'fedbyol', 'fedbyol_reset_target', 'fedsimclr', 'fedsimsiam',
             'feddecorr_simsiam', 'ldawa_byol', 'fedx_simclr')


@functools.lru_cache(maxsize=None)
def _algo(name, whole_state=False):
  """One Algorithm object per name, so its jitted functions compile once per test session.
  whole_state: the stateful twin of a STATELESS algorithm (the algorithm itself otherwise)."""
  algo = ALGOS[name](stateless=False) if whole_state and name in STATELESS else ALGOS[name]()
  return algo, jax.jit(algo.local_step)


def _overlay(full, stored):
  """`full` with every entry that `stored` has replaced by stored's (dicts merged recursively): the
  reference's whole client states carrying the engine's persistent parts."""
  if not isinstance(stored, dict):
    return stored
  return {**full, **{k: _overlay(full[k], v) for k, v in stored.items()}}


def _persisted(algo, clients):
  """What the engine stores of whole stacked client states."""
  return clients if algo.stateless is None else jax.vmap(algo.stateless.persist)(clients)


# float64 rounding (eps 1.1e-16) amplified through a round of these chaotic 8-sample BatchNorm
# networks ends at ~1e-10 relative (measured: at most 6e-11, on momentum leaves of BN-fed biases);
# any algorithmic difference is >= 1e-3 relative. The bound sits in between, 1e4 from each.
RTOL, ATOL = 1e-6, 1e-10


def _float64(tree):
  """Floating leaves cast to float64 (call under `jax.enable_x64(True)`)."""
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _assert_tree_close(actual, expected, what):
  """Leafwise |a - e| <= RTOL * max|e| + ATOL, both trees float64."""
  flat_a = jax.tree_util.tree_leaves_with_path(actual)
  flat_e = jax.tree_util.tree_leaves(expected)
  assert len(flat_a) == len(flat_e), what
  for (path, a), e in zip(flat_a, flat_e):
    assert np.asarray(a).dtype != np.float32 and np.asarray(e).dtype != np.float32, (
        f'{what}: {jax.tree_util.keystr(path)} is float32; the comparison must run in float64')
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    assert a.shape == e.shape, f'{what}: {jax.tree_util.keystr(path)} shape'
    scale = float(np.max(np.abs(e), initial=0.0))
    err = float(np.max(np.abs(a - e), initial=0.0))
    assert err <= RTOL * scale + ATOL, (
        f'{what}: {jax.tree_util.keystr(path)} err {err:.3g} scale {scale:.3g}')


def _make_step(algo, cfg, baseline=None):
  if baseline == 'sequential':
    return baselines.make_sequential_round_step(algo, cfg, NUM_CLIENTS)
  if baseline == 'stepwise':
    return baselines.make_stepwise_round_step(algo, cfg, NUM_CLIENTS)
  return rd.make_round_step(algo, cfg, NUM_CLIENTS, donate=False)


def _reference(name, clients, server, data, key, r, cfg, perturb=None):
  """The reference loop of the stateful twin from whole client states `clients`."""
  algo, local_step = _algo(name, whole_state=True)
  return reference.reference_round(
      algo, local_step, clients, server, data, key, r,
      clients_per_round=cfg.clients_per_round, batch_size=BATCH, local_epochs=EPOCHS,
      lr_fn=cfg.lr_fn, aggregates=not name.startswith('independent'),
      aggregate=REFERENCE_AGGREGATES.get(name), drop_last=cfg.drop_last, perturb=perturb,
      **dict(zip(('prepare', 'personalize'), _hooks(name))))


@functools.lru_cache(maxsize=None)
def _hooks(name):
  return REFERENCE_HOOKS[name]() if name in REFERENCE_HOOKS else (None, None)


def _initial_states(name):
  """(the engine's float64 initial FedState, the stateful twin's whole stacked client states). A
  stateless algorithm's stored clients are the persistent part of its twin's (checked here)."""
  algo, _ = _algo(name)
  state = _float64(rd.init_state(algo, jax.random.PRNGKey(3), NUM_CLIENTS))
  twin = _float64(rd.init_state(_algo(name, whole_state=True)[0], jax.random.PRNGKey(3),
                                NUM_CLIENTS))
  _assert_tree_close(state.clients, _persisted(algo, twin.clients), f'{name} initial clients')
  _assert_tree_close(state.server, twin.server, f'{name} initial server')
  return state, twin.clients


def _check_rounds(name, strategy, m, baseline=None, rounds=2, **cfg_kw):
  """Runs `rounds` engine rounds in float64; before each, the reference loop starts from the same
  state.

  Comparing round by round (not whole trajectories) matters: these tiny BatchNorm networks on
  8-sample batches are chaotic, and a rounding-level difference in one round's server average grows
  by orders of magnitude a round later, although each round agrees to rounding.
  """
  with jax.enable_x64(True):
    algo, _ = _algo(name)
    data = _data()
    cfg = _round_cfg(strategy, m, drop_last=name not in RAGGED, **cfg_kw)
    step = _make_step(algo, cfg, baseline)
    state, full = _initial_states(name)
    if cfg.client_state == 'host':
      state = state.replace(clients=jax.tree_util.tree_map(np.array, state.clients))
    for r in range(rounds):
      key = rng.round_key(jax.random.PRNGKey(7), r)
      ref_clients, ref_server, ref_loss = _reference(
          name, _overlay(full, state.clients), state.server, data, key, r, cfg)
      state, metrics = step(state, data, key)
      assert int(state.round) == r + 1
      _assert_tree_close(state.clients, _persisted(algo, ref_clients),
                         f'{name}/{strategy} round {r} clients')
      full = ref_clients
      _assert_tree_close(state.server, ref_server, f'{name}/{strategy} round {r} server')
      # The engine reports the loss in float32 (a metric): one float32 rounding of a float64 mean.
      np.testing.assert_allclose(float(metrics['loss']), ref_loss, rtol=1e-6)
  return state


@pytest.mark.parametrize('name', sorted(ALGOS))
def test_vmap_round_step_matches_reference_loop(name):
  # Partial participation: 4 of 6 clients, so round 2 mixes first-time and returning clients.
  # FedSC's late schedule runs a third round: its first share (everyone) is round 2, participants
  # alone upload in round 3.
  _check_rounds(name, 'vmap', 4, rounds=3 if name == 'fedsc_late_ragged' else 2)


# The strategies only change how clients are mapped, not what an algorithm computes, so 'map'
# runs for one algorithm of each server shape, for the suite's time budget: divergence-dependent
# mixing (FedEMA), no aggregation with personal models (independent) and a pre-round upload hook
# with DP noise (FedSC); the global data-weighted mean runs under map in the remainder-chunk test
# (FedSimCLR) below. 'shard' (a 4-device CPU mesh, ~35 s each, mostly compile time) runs the two
# extremes of what crosses the mesh: personal state only (independent) and EUA over payloads
# gathered across devices (FedU2-BYOL). Every algorithm runs under vmap.
SHARD = ('independent', 'fedu2_byol')
MAP = ('fedema', 'independent', 'fedsc_dp')


@pytest.mark.slow
@pytest.mark.parametrize('name,strategy', [(n, 'map') for n in MAP] + [(n, 'shard') for n in SHARD])
def test_other_strategies_match_reference_loop(name, strategy):
  _check_rounds(name, strategy, 4)


def test_host_client_state_and_default_phases_match_reference_loop():
  """Client state in host memory (the participants' stored states travel to the device and back;
  the rest is the device round's traced function) under the default vmap phases (widths 4, 2, 1).
  FedSC-DP keeps real per-client state and adds a pre-round upload hook and a personalised,
  per-lane message."""
  _check_rounds('fedsc_dp', 'vmap', 4, client_state='host', vmap_shrink=2.0)


def test_vmap_phase_widths_change_no_number():
  """Phases of widths 4, 3, 2, 1: each participant's result is its own loop's."""
  _check_rounds('fedsimclr', 'vmap', 4, vmap_shrink=1.5)


def test_comparison_detects_a_wrong_batch_key_mask_weight_or_client():
  """The float64 bound is tight enough to fail on each kind of bug the engine could have."""
  with jax.enable_x64(True):
    algo, _ = _algo('fedbyol')
    data = _data()
    cfg = _round_cfg('vmap', 4)
    state, full = _initial_states('fedbyol')
    key = rng.round_key(jax.random.PRNGKey(7), 0)
    new, _ = _make_step(algo, cfg)(state, data, key)
    for perturb in (None,) + reference.PERTURBATIONS:
      ref_clients, ref_server, _ = _reference('fedbyol', full, state.server, data, key, 0, cfg,
                                              perturb)
      try:
        _assert_tree_close(new.clients, _persisted(algo, ref_clients), 'clients')
        _assert_tree_close(new.server, ref_server, 'server')
        detected = False
      except AssertionError:
        detected = True
      assert detected == (perturb is not None), perturb


@pytest.mark.slow
def test_full_participation_and_sequential_baselines():
  _check_rounds('fedu', 'vmap', NUM_CLIENTS)
  _check_rounds('fedbyol', 'vmap', 4, baseline='sequential')
  _check_rounds('fedema', 'vmap', 4, baseline='stepwise')


def test_map_chunks_with_remainder():
  # 5 participants in chunks of 2: two full chunks and a remainder of one (the size-1 case).
  _check_rounds('fedsimclr', 'map', 5, rounds=1)


def test_non_participants_are_untouched_and_training_moves_participants():
  algo, _ = _algo('independent')
  data = _data()
  step = rd.make_round_step(algo, _round_cfg('vmap', 2), NUM_CLIENTS, donate=False)
  state = rd.init_state(algo, jax.random.PRNGKey(3), NUM_CLIENTS)
  key = rng.round_key(jax.random.PRNGKey(7), 0)
  ids = set(np.asarray(rd.sample_participants(key, NUM_CLIENTS, 2)).tolist())
  new, _ = step(state, data, key)
  for c in range(NUM_CLIENTS):
    before = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda a: a[c], state.clients['params']))
    after = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda a: a[c], new.clients['params']))
    same = all(np.array_equal(a, b) for a, b in zip(before, after))
    assert same == (c not in ids), c


def test_participant_sampling_is_uniform_without_replacement():
  counts = np.zeros(10)
  for r in range(400):
    ids = np.asarray(rd.sample_participants(jax.random.PRNGKey(r), 10, 3))
    assert len(set(ids.tolist())) == 3 and np.all(np.diff(ids) > 0)
    counts[ids] += 1
  # Each client is picked with probability 3/10: 120 expected of 400, binomial sd ~9.2.
  assert np.all(np.abs(counts - 120) < 5 * 9.2), counts


def test_bad_round_settings_raise_before_compile():
  algo, _ = _algo('fedbyol')
  with pytest.raises(ValueError, match='clients_per_round = 7'):
    rd.make_round_step(algo, _round_cfg('vmap', 7), NUM_CLIENTS)
  with pytest.raises(ValueError, match='multiple of the device count 4'):
    rd.make_round_step(algo, _round_cfg('shard', 3), NUM_CLIENTS)
  with pytest.raises(ValueError, match="strategy = 'pmap'"):
    rd.make_round_step(algo, _round_cfg('pmap', 2), NUM_CLIENTS)
  with pytest.raises(ValueError, match="client_state = 'disk'"):
    rd.make_round_step(algo, _round_cfg('vmap', 2, client_state='disk'), NUM_CLIENTS)
  with pytest.raises(ValueError, match='vmap_shrink = 1.0'):
    rd.make_round_step(algo, _round_cfg('vmap', 2, vmap_shrink=1.0), NUM_CLIENTS)


def test_stateless_clients_store_only_what_persists():
  """Per-client storage: nothing for FedAvg with the optimizer reset, the Adam moments without it,
  BYOL's local target (and its first-participation flag) with target sync 'keep'."""
  stored = {name: rd.init_state(_algo(name)[0], jax.random.PRNGKey(3), NUM_CLIENTS).clients
            for name in STATELESS}
  for name in ('fedavg_supervised', 'fedsimclr', 'fedsimsiam', 'fedbyol_reset_target'):
    assert stored[name] == {}, name
  assert sorted(stored['fedavg_supervised_adam']) == ['opt_state']
  assert sorted(stored['fedbyol']) == ['extras', 'target']
  assert sorted(stored['fedbyol']['extras']) == ['participated']
  full = rd.init_state(_algo('fedavg_supervised_adam', whole_state=True)[0], jax.random.PRNGKey(3),
                       NUM_CLIENTS).clients
  assert sorted(full) == ['batch_stats', 'extras', 'opt_state', 'params']
