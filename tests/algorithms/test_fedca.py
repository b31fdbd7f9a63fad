"""FedCA as an algorithm: its stacked round step under vmap and map equals a slow per-client Python
loop with a numpy float64 server (FedAvg of the model, the dictionary rows of the participants
updated by the numpy EMA, each upload's entries recomputed row by row), in both loss forms and with
the alignment module; one step's loss equals the numpy formula on a hand-made dictionary (own rows,
padding rows and clients without an upload excluded); the dictionary checkpoints and resumes
exactly; bad values are refused before any compute."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment
from fedjax_ssl.algorithms import fedca, hetero_ssfl, ssl_client
from fedjax_ssl.runs.checkpoint import Checkpointer
from fedjax_ssl.core import rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import restore_client
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import FedData
from tests import reference
from tests.algorithms.test_registry import _small_config
from tests.core.test_round_equivalence import (AUG, BATCH, EPOCHS, NUM_CLIENTS, SIZES,
                                               _assert_tree_close, _float64, _overlay, _persisted,
                                               _round_cfg, _spec)
from tests.core.test_server_opt import _Run
from tests.ops.test_fedca import np_code_dictionary_loss, np_dictionary_nt_xent

PUBLIC = 10
CONFIGS = {
    # The FedSC authors' loss over every other client's entries (pool 6 x 28 < dict_size).
    'code': fedca.FedCAConfig(temperature=0.2, dict_size=1000),
    # The paper's extra negatives, 12 drawn per step from the pool, and the alignment module on a
    # public set (un-normalised form, 4 public images per step).
    'negatives_align': fedca.FedCAConfig(temperature=0.2, dict_loss='negatives', dict_size=12,
                                         dict_momentum=0.3, align_weight=0.5, align_batch=4,
                                         align_normalize=False, upload_batch=8),
}


def _data():
  rs = np.random.RandomState(0)
  n_max = max(SIZES)
  x = np.zeros((NUM_CLIENTS, n_max, 8, 8, 1), np.uint8)
  y = np.full((NUM_CLIENTS, n_max), -1, np.int32)
  for c, n in enumerate(SIZES):
    x[c, :n] = rs.randint(0, 256, (n, 8, 8, 1))
    y[c, :n] = rs.randint(0, 3, n)
  public = rs.randint(0, 256, (PUBLIC, 8, 8, 1)).astype(np.uint8)
  return FedData.from_padded(x, y, SIZES, public_x=public)


@functools.lru_cache(maxsize=None)
def _algo(name, stateless=True):
  algo = fedca.make(_spec('simclr'), client_sizes=SIZES, fc=CONFIGS[name], stateless=stateless)
  return algo, jax.jit(algo.local_step)


@functools.lru_cache(maxsize=None)
def _entry_fn():
  """One row's dictionary view, jitted once: z of augment(key, image) in inference mode."""
  spec = _spec('simclr')

  def z(variables, image, key):
    v = augment.normalize(augment.augment(key, image, AUG), spec.mean, spec.std)[None]
    return spec.model.apply(variables, v, train=False)['z'][0]
  return jax.jit(z)


def np_entries(client, x, n, upload_key):
  """The upload's dictionary entries written out: per real row r, views v = 0, 1 from
  fold_in(fold_in(fold_in(upload key, ENTRY_STREAM), v), r), their mean."""
  base = jax.random.fold_in(upload_key, fedca.ENTRY_STREAM)
  variables = {'params': client['params'], 'batch_stats': client['batch_stats']}
  rows = []
  for r in range(n):
    zs = [np.asarray(_entry_fn()(variables, x[r], jax.random.fold_in(jax.random.fold_in(base, v), r)),
                     np.float64) for v in range(2)]
    rows.append((zs[0] + zs[1]) / 2)
  return np.array(rows)


def np_dictionary_rows(old, entries, seen, momentum, n):
  """Client_CA's EMA then normalisation, row by row; rows past the client's n are zero."""
  out = np.zeros_like(old, dtype=np.float64)
  for r in range(n):
    row = momentum * old[r] + (1 - momentum) * entries[r] if seen else entries[r]
    out[r] = row / np.linalg.norm(row)
  return out


def fedca_reference_round(name, clients, server, data, key, round_idx, *, m, cfg):
  """One FedCA round written out: participants in a Python loop (reference.train_participant: the
  stateful twin's begin / local_step / upload, the engine's key rules), the personalised message
  (the client's own id) and the server in numpy float64."""
  algo, local_step = _algo(name, stateless=False)
  fc = CONFIGS[name]
  (x, _), n_all = data.padded(), np.asarray(data.n)
  ids = [int(i) for i in np.asarray(rd.sample_participants(key, NUM_CLIENTS, m))]
  msg_all = dict(server)
  if fc.align_weight > 0:
    msg_all['public_x'] = data.public_x
  lr = cfg.lr_fn(round_idx)
  new, payloads, losses = {}, [], []
  for cid in ids:
    msg = dict(msg_all, self=jnp.int32(cid))
    stored = reference._take(clients, cid)  # pylint: disable=protected-access
    client, payload, loss = reference.train_participant(
        algo, local_step, stored, data, key, cid, msg, lr, batch_size=BATCH, local_epochs=EPOCHS)
    n = int(n_all[cid])
    want = np_entries(client, x[cid], n, rng.upload_key(rng.client_key(key, cid)))
    np.testing.assert_allclose(np.asarray(payload['dict'])[:n], want, rtol=1e-9, atol=1e-12)
    new[cid] = client
    payloads.append(payload)
    losses.append(loss)
  weights = n_all[ids] / n_all[ids].sum()
  model = reference.numpy_weighted_mean(
      [{'params': p['params'], 'batch_stats': p['batch_stats']} for p in payloads], weights)
  dictionary = np.array(server['dict'], np.float64)
  seen = np.array(server['seen'], np.float64)
  for cid, p in zip(ids, payloads):
    dictionary[cid] = np_dictionary_rows(dictionary[cid], np.asarray(p['dict'], np.float64),
                                         seen[cid] > 0, fc.dict_momentum, int(n_all[cid]))
    seen[cid] = 1.0
  server = dict(model, dict=dictionary, seen=seen)

  def scatter(stacked, *per_client):
    out = np.array(stacked)
    for cid, leaf in zip(ids, per_client):
      out[cid] = leaf
    return out
  clients = jax.tree_util.tree_map(scatter, clients, *[new[c] for c in ids])
  return clients, server, float(np.mean(losses))


def _check_rounds(name, strategy, m=4, rounds=2):
  with jax.enable_x64(True):
    algo, _ = _algo(name)
    data = _data()
    cfg = _round_cfg(strategy, m)
    step = rd.make_round_step(algo, cfg, NUM_CLIENTS, donate=False)
    state = _float64(rd.init_state(algo, jax.random.PRNGKey(3), NUM_CLIENTS))
    full = _float64(rd.init_state(_algo(name, stateless=False)[0], jax.random.PRNGKey(3),
                                  NUM_CLIENTS)).clients
    _assert_tree_close(state.clients, _persisted(algo, full), f'{name} initial clients')
    for r in range(rounds):
      key = rng.round_key(jax.random.PRNGKey(7), r)
      ref_clients, ref_server, ref_loss = fedca_reference_round(
          name, _overlay(full, state.clients), state.server, data, key, r, m=m, cfg=cfg)
      state, metrics = step(state, data, key)
      _assert_tree_close(state.clients, _persisted(algo, ref_clients),
                         f'{name}/{strategy} round {r} clients')
      full = ref_clients
      _assert_tree_close(state.server, _float64(ref_server), f'{name}/{strategy} round {r} server')
      np.testing.assert_allclose(float(metrics['loss']), ref_loss, rtol=1e-6)
  return state


# vmap only: the strategies change how clients are mapped, not what an algorithm computes, and 'map'
# runs for one algorithm of each server shape in tests/core/test_round_equivalence.py (the suite's
# time budget).
@pytest.mark.parametrize('name,strategy', [('code', 'vmap'), ('negatives_align', 'vmap')])
def test_round_step_equals_per_client_loop(name, strategy):
  """Partial participation (4 of 6): round 2 trains first-time and returning clients on the
  dictionary of round 1's uploads (EMA for returning uploaders, first entries for new ones)."""
  state = _check_rounds(name, strategy)
  seen = np.asarray(state.server['seen'])
  assert seen.sum() >= 4   # round 1's four uploaders at least
  d = np.asarray(state.server['dict'])
  for c, n in enumerate(SIZES):  # unit rows where the client uploaded, zero rows elsewhere
    norms = np.linalg.norm(d[c], axis=1)
    np.testing.assert_allclose(norms[:n], seen[c], atol=1e-12)
    assert np.all(norms[n:] == 0)


# ------------------------------------------------------------------------------------------------
# One step's loss against the numpy formula on a hand-made dictionary.

STEP_SIZES = (4, 2, 3, 4)    # client 1's rows 2-3 and client 2's row 3 are padding


def _step_setup(fc):
  spec = _spec('simclr')
  algo = fedca.make(spec, client_sizes=STEP_SIZES, fc=fc)
  clients, server = algo.init(jax.random.PRNGKey(0), len(STEP_SIZES))
  rs = np.random.RandomState(1)
  raw = rs.normal(size=np.asarray(server['dict']).shape)
  dictionary = raw / np.linalg.norm(raw, axis=-1, keepdims=True)   # padding rows nonzero too
  msg = dict(server, dict=jnp.asarray(dictionary), seen=jnp.asarray([1.0, 1.0, 0.0, 1.0]),
             self=jnp.int32(0), public_x=jnp.asarray(rs.randint(0, 256, (PUBLIC, 8, 8, 1)),
                                                       jnp.uint8))
  client = algo.begin(restore_client(algo, jax.tree_util.tree_map(lambda a: a[0], clients), msg),
                      msg, jax.random.PRNGKey(1))
  batch = {'x': jnp.asarray(rs.randint(0, 256, (BATCH, 8, 8, 1)), jnp.uint8),
           'y': jnp.zeros(BATCH, jnp.int32)}
  # Client 0's own rows, client 1's padding rows, and client 2 (no upload yet) are excluded:
  # the valid negatives are client 1's rows 0-1 and client 3's rows 0-3, in this order.
  valid_rows = np.concatenate([dictionary[1, :2], dictionary[3, :4]])
  return spec, algo, client, batch, msg, valid_rows


@pytest.mark.parametrize('fc', [
    fedca.FedCAConfig(dict_size=1000),
    fedca.FedCAConfig(dict_size=3, temperature=0.3, dict_weight=0.4),   # the first 3 valid rows
    fedca.FedCAConfig(dict_loss='negatives', dict_size=1000, align_weight=0.7, align_batch=6),
], ids=['code_all', 'code_first3', 'negatives_align'])
def test_one_step_loss_is_the_numpy_formula(fc):
  key = jax.random.PRNGKey(5)
  with jax.enable_x64(True):
    spec, algo, client, batch, msg, valid_rows = _step_setup(fc)
    client, msg = _float64(client), _float64(msg)
    entry_mask = jnp.asarray(np.arange(4)[None, :] < np.asarray(STEP_SIZES)[:, None])
    total, (_, terms) = fedca.loss_fn(spec, fc, entry_mask, client['params'], client, batch, key,
                                      msg)
    assert total.dtype == jnp.float64
    v0, v1 = ssl_client._views(spec, key, batch['x'], 2)  # pylint: disable=protected-access
    o0, bs = ssl_client.apply_train(spec.model, client['params'], client['batch_stats'], v0)
    o1, bs = ssl_client.apply_train(spec.model, client['params'], bs, v1)
    if fc.align_weight:
      pick = hetero_ssfl.rad_indices(jax.random.fold_in(key, fedca.ALIGN_STREAM), PUBLIC,
                                     fc.align_batch)
      xa = augment.normalize(augment.to_float(msg['public_x'][pick]), spec.mean, spec.std)
      oa, _ = ssl_client.apply_train(spec.model, client['params'], bs, xa)
      ga = spec.model.apply({'params': msg['params'], 'batch_stats': msg['batch_stats']}, xa,
                            train=False)
  z0, z1 = np.asarray(o0['z']), np.asarray(o1['z'])
  rows = valid_rows[:min(fc.dict_size, len(valid_rows))]
  valid = np.ones(len(rows), bool)
  if fc.dict_loss == 'code':
    want = np_code_dictionary_loss(z0, z1, rows, valid, fc.temperature, fc.dict_weight)
  else:
    want = np_dictionary_nt_xent(z0, z1, rows, valid, fc.temperature)
  assert float(terms['dict']) == pytest.approx(want, rel=1e-10)
  align = 0.0
  if fc.align_weight:
    za, zg = np.asarray(oa['z'], np.float64), np.asarray(ga['z'], np.float64)
    norm = lambda v: v / np.linalg.norm(v, axis=1, keepdims=True)
    align = np.mean(np.sum((norm(za) - norm(zg)) ** 2, axis=1))
    assert float(terms['align']) == pytest.approx(align, rel=1e-10) and align > 1e-6
  assert float(total) == pytest.approx(want + fc.align_weight * align, rel=1e-10)
  # Not vacuous: the dictionary term differs from the loss without any dictionary.
  none = np.zeros(len(rows), bool)
  plain = (np_code_dictionary_loss(z0, z1, rows, none, fc.temperature, fc.dict_weight)
           if fc.dict_loss == 'code' else np_dictionary_nt_xent(z0, z1, rows, none, fc.temperature))
  assert abs(plain - want) > 1e-4


def test_step_gives_no_gradient_to_the_dictionary_or_the_global_model():
  fc = fedca.FedCAConfig(dict_loss='negatives', align_weight=1.0, align_batch=4)
  spec, _, client, batch, msg, _ = _step_setup(fc)
  entry_mask = jnp.asarray(np.arange(4)[None, :] < np.asarray(STEP_SIZES)[:, None])
  grads = jax.grad(lambda m: fedca.loss_fn(spec, fc, entry_mask, client['params'], client, batch,
                                           jax.random.PRNGKey(2), m)[0],
                   allow_int=True)({k: v for k, v in msg.items()})
  for k in ('dict', 'params'):
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree_util.tree_leaves(grads[k])), k


# ------------------------------------------------------------------------------------------------
# The dictionary is server state: checkpointed, resumed exactly.

def test_dictionary_is_checkpointed_and_resumes_exactly(tmp_path):
  """3 rounds straight equal 2 rounds, a checkpoint, a restore into a fresh template and 1 more
  round, bit for bit (the dictionary and its EMA live in FedState.server)."""
  config = _small_config('fedca')
  experiment.validate_config(config)
  run = _Run(config)
  two = run.rounds(run.init(), 2)
  assert float(jnp.sum(two.server['seen'])) > 0 and float(jnp.max(jnp.abs(two.server['dict']))) > 0
  with Checkpointer(str(tmp_path), save_every=1) as ckpt:
    ckpt.maybe_save(2, two)
    _, restored, _ = ckpt.restore(run.init())
  resumed, straight = run.rounds(restored, 1), run.rounds(two, 1)
  la, lb = jax.tree_util.tree_leaves(resumed), jax.tree_util.tree_leaves(straight)
  assert jax.tree_util.tree_structure(resumed) == jax.tree_util.tree_structure(straight)
  assert all(jnp.array_equal(a, b) for a, b in zip(la, lb))


# ------------------------------------------------------------------------------------------------
# Config checks: refused before any compute, one line naming the value and what is allowed.

@pytest.mark.parametrize('overrides,message', [
    ({'fedca.dict_size': 0}, r'config.fedca.dict_size = 0 is invalid: must be an integer >= 1'),
    ({'fedca.dict_size': -5}, r'config.fedca.dict_size = -5 is invalid: must be an integer >= 1'),
    ({'fedca.temperature': 0.0}, r'config.fedca.temperature = 0.0 is invalid: must be a finite '
                                 r'number > 0'),
    ({'fedca.dict_loss': 'negative'}, r"config.fedca.dict_loss = 'negative' is invalid: must be one "
                                      r"of \['code', 'negatives'\]; did you mean 'negatives'\?"),
    ({'fedca.dict_momentum': 1.0}, r'config.fedca.dict_momentum = 1.0 is invalid: must be a finite '
                                   r'number in \[0.0, 1.0\)'),
    ({'fedca.dict_weight': 1.5}, r'config.fedca.dict_weight = 1.5 is invalid: must be a finite '
                                 r'number in \[0.0, 1.0\]'),
    ({'fedca.dict_loss': 'negatives', 'fedca.dict_weight': 0.5},
     r"config.fedca.dict_weight = 0.5 is invalid with fedca.dict_loss = 'negatives': only 'code' "
     r'reads it'),
    ({'fedca.align_weight': 1.0}, r'config.public_size = 0 is invalid with fedca.align_weight = '
                                  r'1.0: the alignment module needs a public set'),
    ({'fedca.align_weight': 1.0, 'public_size': 32, 'fedca.align_batch': 33},
     r'config.fedca.align_batch = 33 is invalid: must be in \[1, 32\], the public set'),
    ({'fedca.align_weight': -0.1}, r'config.fedca.align_weight = -0.1 is invalid: must be a finite '
                                   r'number >= 0.0'),
    # An alignment set as large as the data (train_size 288) leaves no client any example.
    ({'fedca.align_weight': 1.0, 'public_size': 288, 'fedca.align_batch': 16},
     r'config.public_size = 288 is invalid: must be < 288'),
    ({'ssl_method': 'byol'}, r"config.ssl_method = 'byol' is invalid for algorithm 'fedca': must be "
                             r"one of \('simclr',\)"),
])
def test_bad_values_are_refused(overrides, message):
  with pytest.raises(cv.ConfigError, match=message) as err:
    experiment.validate_config(_small_config('fedca', **overrides))
  assert '\n' not in str(err.value)


def test_valid_configs_pass_and_the_alignment_form_runs_a_round():
  experiment.validate_config(_small_config('fedca'))
  config = _small_config('fedca', **{'fedca.align_weight': 1.0, 'public_size': 32,
                                     'fedca.align_batch': 16, 'fedca.dict_loss': 'negatives',
                                     'fedca.dict_size': 40})
  experiment.validate_config(config)
  run = _Run(config)
  assert run.algo.uses_public
  state, metrics = run.step(run.init(), run.fed_data, rng.round_key(run.run_key, 0))
  assert np.isfinite(float(metrics['loss'])) and float(jnp.sum(state.server['seen'])) == 2
