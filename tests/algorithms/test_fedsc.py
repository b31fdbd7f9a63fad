"""FedSC's algorithm pieces: DP-CalR against a loop, the schedules, the exact share plan, the ledger
that logs epsilon, FedAvg+SC as the never-sharing case, and the config errors raised before any
compute. (The round step against a per-client loop is in test_round_equivalence.py; the paper's
identities in test_fedsc_theory.py; the accountant in test_privacy.py.)"""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment, models
from fedjax_ssl.algorithms import fedsc, ssl_client
from fedjax_ssl.core import optim, rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.state import FedState
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import FedData
from fedjax_ssl.ops import privacy
from tests import reference

AUG = augment.AugmentConfig(out_size=8, crop_scale=(0.5, 1.0), flip_prob=0.5, jitter_prob=0.0,
                            grayscale_prob=0.0)
SIZES = (11, 4, 7, 9)


def _spec(sc_mu=2.0):
  enc = models.get_encoder('small_cnn', conv_features=(4,), dense_features=(12, 6))
  model = models.SSLModel(enc, models.MLPHead(8, 5, use_bn=False), None)
  return ssl_client.ClientSpec(objective='sc', model=model, tx=optim.make_optimizer('sgd', momentum=0.9),
                               aug=AUG, mean=(0.5,), std=(0.3,), input_shape=(8, 8, 1),
                               hparams={'mu': sc_mu})


def _data(sizes=SIZES):
  rs = np.random.RandomState(1)
  x = np.zeros((len(sizes), max(sizes), 8, 8, 1), np.uint8)
  for c, n in enumerate(sizes):
    x[c, :n] = rs.randint(0, 256, (n, 8, 8, 1))
  y = np.zeros(x.shape[:2], np.int32)
  return FedData.from_padded(x, y, sizes)


def test_calr_matrix_equals_the_loop_and_not_the_chunking():
  """Alg. 2 (before noise) against reference.numpy_calr; the chunk size is memory only."""
  with jax.enable_x64(True):
    spec = _spec()
    variables = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64),
                                       spec.model.init(jax.random.PRNGKey(0),
                                                       jnp.zeros((2, 8, 8, 1)), train=False))
    data, key = _data(), jax.random.PRNGKey(5)
    fn = jax.jit(lambda x, n, chunk: fedsc.calr_matrix(spec, variables, x, n, key, views=2,
                                                       chunk=chunk, sqrt_mu=np.sqrt(2.0)),
                 static_argnums=2)
    apply_fn = jax.jit(lambda v, img: spec.model.apply(v, img, train=False,
                                                        with_predictor=False)['z'])
    augment_fn = jax.jit(lambda k, im: augment.augment(k, im, spec.aug))
    want = reference.numpy_calr(spec, apply_fn, augment_fn, variables, data.padded()[0][0],
                                SIZES[0], key, views=2, chunk=5, mu=2.0)
    for chunk in (4, 16):  # 3 chunks with padding / one chunk: the same matrix
      got = np.asarray(fn(data.client(0)[0], data.n[0], chunk))
      np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    # PSD with ||R||_F <= mu (T9's bound, clip active).
    assert np.linalg.eigvalsh(got).min() > -1e-12 and np.linalg.norm(got) <= 2.0


def test_schedules_match_table_6_and_the_code():
  t = np.arange(1, 201)
  assert int(np.sum(fedsc.is_share_round(t, 0, 1))) == 200
  assert int(np.sum(fedsc.is_share_round(t, 100, 1))) == 100   # SVHN t > 100
  assert int(np.sum(fedsc.is_share_round(t, 150, 1))) == 50    # CIFAR-10 eps = 3: t > 150
  assert int(np.sum(fedsc.is_share_round(t, 100, 2))) == 50    # t > 100, t % 2 == 0
  assert not fedsc.is_share_round(100, 100, 1) and fedsc.is_share_round(101, 100, 1)
  # alpha_t of round t (1-indexed) is the code's 1 - 0.8 t' / T at t' = t - 1.
  alphas = np.asarray(fedsc.alpha_at(jnp.asarray(t), 200, 1.0, 0.2))
  np.testing.assert_allclose(alphas, 1 - 0.8 * (t - 1) / 200, rtol=1e-6)
  assert alphas[-1] == pytest.approx(0.204)


def _plan_config(**fedsc_overrides):
  config = experiment.default_config()
  config.update(dict(algorithm='fedsc', ssl_method='sc', num_clients=4, clients_per_round=2,
                     rounds=7, seed=3))
  config.fedsc.update(fedsc_overrides)
  return config


def test_planned_shares_are_the_counts_the_round_step_makes():
  """The share counts known before training (privacy check, calibration) equal those the jitted
  prepare step (`round.prepare_server`: the first share round's uploads taken in, then the hook)
  accumulates when it runs every round with the run's keys."""
  config = _plan_config(share_start=1, share_every=2)
  algo = fedsc.make(_spec(), num_rounds=config.rounds, share_start=1, share_every=2,
                    calr_views=1, calr_batch=16)
  clients, server = algo.init(jax.random.PRNGKey(0), config.num_clients)
  prepare = jax.jit(lambda *a: rd.prepare_server(algo, *a))
  data, run_key = _data(), experiment.run_keys(config)[1]
  for r in range(config.rounds):
    key = rng.round_key(run_key, r)
    ids = rd.sample_participants(key, config.num_clients, config.clients_per_round)
    server = prepare(FedState(clients, server, jnp.int32(r)), data, ids, key)
  planned = fedsc.planned_shares(config)
  np.testing.assert_array_equal(np.asarray(server['shares']), planned)
  # Share rounds t = 2 (everyone), 4, 6 (2 of 4 each): 1 + 2 * 2 / 4 on average, unequal here.
  assert planned.sum() == 4 + 2 + 2 and planned.min() >= 1


def test_ledger_reports_epsilon_of_each_clients_own_shares():
  sizes = np.array([500, 300, 800, 300])
  ledger = privacy.PrivacyLedger(sizes, 2.0, 0.02, 1e-2, 'replace_one', 'rdp')
  algo = fedsc.make(_spec(), num_rounds=5, sigma=0.02, ledger=ledger)
  shares = jnp.asarray([3, 1, 0, 2], jnp.int32)
  state = rd.FedState(clients=None, server={'shares': shares}, round=jnp.int32(3))
  got = algo.host_metrics(state)
  want = max(privacy.epsilon(0.02, privacy.sensitivity(2.0, n, 'replace_one'), s, 1e-2)
             for n, s in zip(sizes, [3, 1, 0, 2]))
  assert got == {'epsilon': pytest.approx(want, rel=1e-12), 'shares_max': 3.0}
  # The worst client is 3 (2 shares of 300 examples): neither the one that shared most (client 0,
  # 3 shares of 500) nor the other smallest one (client 1, 1 share), so per-client bookkeeping matters.
  assert want == pytest.approx(privacy.epsilon(0.02, privacy.sensitivity(2.0, 300), 2, 1e-2))
  assert want > privacy.epsilon(0.02, privacy.sensitivity(2.0, 500), 3, 1e-2)


def test_fedsc_before_any_share_is_fedavg_sc():
  """A FedSC round without a matrix yet (alpha = 1, R_other = 0) computes FedAvg+SC's local loss,
  so both runs reach the same model (the inter-client term adds exactly 0)."""
  spec, data = _spec(), _data()
  # vmap_shrink = 0: one phase (the phases are tested in test_round_equivalence; each width costs
  # one more compile of the step).
  cfg = rd.RoundConfig(clients_per_round=3, local_epochs=1, batch_size=4, lr_fn=lambda r: 0.05,
                       strategy='vmap', vmap_shrink=0)
  key = rng.round_key(jax.random.PRNGKey(2), 0)
  out = []
  for algo in (fedsc.make(spec, num_rounds=5, share_start=5, calr_views=1),
               fedsc.make(spec, num_rounds=5, share=False)):
    state = rd.init_state(algo, jax.random.PRNGKey(1), len(SIZES))
    state, metrics = rd.make_round_step(algo, cfg, len(SIZES), donate=False)(state, data, key)
    out.append((state.server['model'], float(metrics['loss'])))
  for a, b in zip(jax.tree_util.tree_leaves(out[0][0]), jax.tree_util.tree_leaves(out[1][0])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert out[0][1] == pytest.approx(out[1][1], rel=1e-6)


def test_an_unreachable_epsilon_is_refused_before_training():
  config = _plan_config(dp=True, sigma=0.001, target_epsilon=3.0, delta=1e-2)
  sizes = np.array([400, 400, 300, 500])
  with pytest.raises(cv.ConfigError, match=re.escape('config.fedsc.target_epsilon = 3.0 cannot be '
                                                     'met: with fedsc.sigma = 0.001')):
    fedsc.privacy_plan(config, sizes)
  # sigma = 0 calibrates: the planned epsilon meets the target and is within 0.1% of it.
  config.fedsc.sigma = 0.0
  sigma, ledger, summary = fedsc.privacy_plan(config, sizes)
  assert 0.99 * 3.0 <= summary['planned_epsilon'] <= 3.0
  assert ledger.max_epsilon(fedsc.planned_shares(config)) == summary['planned_epsilon']
  assert summary['sigma'] == sigma > 0.001
  # The code's linear sigma scaling makes the same nominal sigma far weaker under 2/4 clients.
  config.fedsc.update(sigma=sigma, target_epsilon=0.0, sigma_partial='linear')
  assert fedsc.privacy_plan(config, sizes)[2]['planned_epsilon'] > 3.0 * 1.5


@pytest.mark.parametrize('overrides,message', [
    (dict(ssl_method='byol'), "config.ssl_method = 'byol' is invalid for algorithm 'fedsc'"),
    (dict(num_clients=1, clients_per_round=1), 'config.num_clients = 1 is invalid for FedSC'),
    (dict(fedsc=dict(dp=True, share=False)), 'config.fedsc.dp = True is invalid with fedsc.share'),
    (dict(fedsc=dict(dp=True)), 'config.fedsc.dp = True needs fedsc.sigma > 0'),
    (dict(fedsc=dict(sigma=0.1)), 'fedsc.dp = False'),
    (dict(sc_mu=0.0, fedsc=dict(dp=True, sigma=0.1)), 'config.sc_mu = 0.0 is invalid with fedsc.dp'),
    (dict(fedsc=dict(delta=1.0)), 'config.fedsc.delta = 1.0 is invalid'),
    (dict(fedsc=dict(accountant='moments')), "config.fedsc.accountant = 'moments'"),
    (dict(fedsc=dict(share_every=0)), 'config.fedsc.share_every = 0 is invalid'),
    (dict(fedsc=dict(share_start=7)), 'leave no share round in 7 rounds'),
    (dict(fedsc=dict(dp=True, target_epsilon=3.0, sigma_partial='linear')),
     "config.fedsc.sigma_partial = 'linear' is invalid when sigma is calibrated"),
    (dict(algorithm='fedavg', ssl_method='byol', drop_last=False),
     "config.drop_last = False is invalid with ssl_method 'byol'"),
])
def test_bad_fedsc_configs_name_the_key(overrides, message):
  config = _plan_config()
  config.update(dict(dataset='fashion_mnist_subset', train_size=200))
  sub = overrides.pop('fedsc', {})
  config.update(overrides)
  config.fedsc.update(sub)
  with pytest.raises(cv.ConfigError, match=re.escape(message)):
    experiment.validate_config(config)


@pytest.mark.slow
def test_train_logs_epsilon_every_round_and_reports_it(tmp_path):
  """A tiny DP run of the binary: epsilon per round in metrics.jsonl (growing with the shares) and
  the final ledger value in results.json, equal to the planned one (full participation)."""
  from fedjax_ssl.runs import training as train  # pylint: disable=g-import-not-at-top
  config = experiment.default_config()
  config.update(dict(algorithm='fedsc', ssl_method='sc', heads='custom', proj_hidden=16,
                     proj_out=8, head_bn=False, dataset='fashion_mnist_subset', train_size=120,
                     num_clients=2, clients_per_round=2, partition='iid', batch_size=32,
                     drop_last=False, local_epochs=1, rounds=3, probe='adam', probe_epochs=1, knn_k=5,
                     checkpoint_every=3, grad_clip_norm=3.0))
  config.fedsc.update(dp=True, target_epsilon=8.0, calr_views=1, share_start=1)
  results = train.train_and_evaluate(config, str(tmp_path / 'w'), verbose=False)
  records = [json.loads(l) for l in (tmp_path / 'w' / 'metrics.jsonl').read_text().splitlines()]
  eps = [r['epsilon'] for r in records[1:]]
  assert eps[0] == 0.0 and 0 < eps[1] < eps[2] <= 8.0   # no share in round 1, then 2 shares
  assert results['privacy']['epsilon'] == eps[2] == results['final']['epsilon']
  assert results['privacy']['planned_epsilon'] == pytest.approx(eps[2], rel=1e-12)


def test_prepare_uploads_are_counted_in_the_round_metrics():
  """FedSC uploads its [H, H] matrices inside `prepare`: the round's bytes_up counts one per share
  (everyone at the first share round, the participants after) on top of the model uploads."""
  algo = fedsc.make(_spec(), num_rounds=5, calr_views=1, calr_batch=16)
  data, h = _data(), 5
  cfg = rd.RoundConfig(clients_per_round=2, local_epochs=1, batch_size=4,
                       lr_fn=lambda r: jnp.float32(0.01), strategy='vmap', vmap_shrink=0)
  state = rd.init_state(algo, jax.random.PRNGKey(0), 4)
  per = rd.message_bytes(algo, cfg, 4, state, data)[0]
  assert per.down > per.up  # the model plus R̃_{-j} [H, H] and alpha come down
  step = rd.make_round_step(algo, cfg, 4)
  for r, sharers in enumerate((4, 2)):
    state, metrics = step(state, data, jax.random.PRNGKey(r))
    assert float(metrics['bytes_up']) == 2 * per.up + sharers * h * h * 4
    assert float(metrics['bytes_down']) == 2 * per.down
