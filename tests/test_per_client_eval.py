"""config.per_client_eval (docs/notes/evaluation.md#eval-25): each client's held-out split of the
test set (disjoint, deterministic per seed, following its training partition: against a Fraction
reference), one client's scores against a direct computation, results.json's 'per_client' list, and
the one-line refusals before any compute."""
import fractions
import hashlib
import json
import re

import jax
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import evaluation, experiment
from fedjax_ssl.runs import training
from fedjax_ssl.core import placement
from fedjax_ssl.core import round as rd
from fedjax_ssl.data import partition
from fedjax_ssl.eval import per_client


def _config(**overrides):
  c = experiment.default_config()
  c.update(dict(dataset='fashion_mnist_subset', train_size=0, partition='dirichlet', alpha=0.5,
                num_clients=5, clients_per_round=5, encoder='mlp', heads='custom', proj_hidden=16,
                proj_out=8, pred_hidden=16, pred_out=8, augmentation='flip', knn_k=20,
                probe='adam', probe_epochs=1, rounds=1, batch_size=32, per_client_eval=True))
  c.update(overrides)
  return c


def _federation(config):
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  fed, info = experiment.build_fed_data(config, dataset)
  return dataset, fed, info


def _reference_counts(test_y, hist):
  """[C, K] test images per client and class: class k's M_k images shared by the training shares
  hist[:, k] / H_k, floor plus the largest remainders (ties to the lower client), in exact
  rational arithmetic."""
  counts = np.zeros_like(hist)
  for k in range(hist.shape[1]):
    m_k, h_k = int(np.sum(test_y == k)), int(hist[:, k].sum())
    if h_k == 0:
      continue
    shares = [fractions.Fraction(m_k * int(h), h_k) for h in hist[:, k]]
    floors = [s.numerator // s.denominator for s in shares]
    order = sorted(range(len(shares)), key=lambda c: (-(shares[c] - floors[c]), c))
    for c in order[:m_k - sum(floors)]:
      floors[c] += 1
    counts[:, k] = floors
  return counts


def test_held_out_splits_follow_each_clients_partition_and_are_disjoint_and_seeded():
  config = _config()
  dataset, fed, info = _federation(config)
  splits = evaluation.client_test_splits(config, dataset, info['histogram'])
  hist = info['histogram']
  y, offsets = np.asarray(fed.y), np.asarray(fed.offsets)
  np.testing.assert_array_equal(   # the partition's counts are those of each client's rows
      [np.bincount(y[o:o + n], minlength=dataset.num_classes) for o, n in zip(offsets, fed.n)],
      hist)
  together = np.concatenate(splits)
  assert np.unique(together).size == together.size   # pairwise disjoint
  assert together.min() >= 0 and together.max() < len(dataset.test_y)
  got = np.stack([np.bincount(dataset.test_y[s], minlength=dataset.num_classes) for s in splits])
  np.testing.assert_array_equal(got, _reference_counts(dataset.test_y, hist))
  # Each client's share of a class is its training share, to within one image.
  m_k = np.bincount(dataset.test_y, minlength=dataset.num_classes)
  assert np.all(np.abs(got - hist / hist.sum(0) * m_k) < 1)
  # Disjoint from the client's training images (no held-out image is one it trains on).
  x = np.asarray(fed.x)
  digest = lambda img: hashlib.sha1(img.tobytes()).hexdigest()
  for c, s in enumerate(splits):
    o, n = int(np.asarray(fed.offsets)[c]), int(np.asarray(fed.n)[c])
    assert not {digest(i) for i in x[o:o + n]} & {digest(i) for i in dataset.test_x[s]}
  # Deterministic per seed; another seed draws other images with the same counts.
  again = evaluation.client_test_splits(config, dataset, info['histogram'])
  assert all(np.array_equal(a, b) for a, b in zip(splits, again))
  other = partition.held_out_splits(dataset.test_y, hist, seed=config.seed + 1)
  assert any(not np.array_equal(a, b) for a, b in zip(splits, other))
  np.testing.assert_array_equal(
      np.stack([np.bincount(dataset.test_y[s], minlength=dataset.num_classes) for s in other]), got)


def test_classes_partition_gives_each_client_only_its_classes():
  config = _config(partition='classes', classes_per_client=2, alpha=0.5)
  dataset, fed, info = _federation(config)
  hist = info["histogram"]
  for s, h in zip(evaluation.client_test_splits(config, dataset, hist), hist):
    assert set(np.unique(dataset.test_y[s])) == set(np.flatnonzero(h))


def _knn_loop(bank_f, bank_y, query_f, num_classes, k, temperature):
  """Slow float64 weighted cosine kNN, one query at a time."""
  bank = bank_f / np.linalg.norm(bank_f, axis=1, keepdims=True)
  preds = []
  for q in query_f:
    sim = bank @ (q / np.linalg.norm(q))
    votes = np.zeros(num_classes)
    for i in np.argsort(-sim, kind='stable')[:k]:
      votes[bank_y[i]] += np.exp(sim[i] / temperature)
    preds.append(int(np.argmax(votes)))
  return np.array(preds)


@pytest.mark.parametrize('algorithm', ['independent', 'fedavg'])
def test_one_clients_scores_equal_a_direct_computation(algorithm):
  config = _config(algorithm=algorithm, ssl_method='simclr')
  dataset, fed, info = _federation(config)
  splits = evaluation.client_test_splits(config, dataset, info['histogram'])
  algo = experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed.n))
  state = rd.init_state(algo, experiment.run_keys(config)[0], config.num_clients)
  entries, summary = evaluation.per_client_results(config, algo, state, dataset, fed, splits)
  c = 3
  variables, stacked = algo.eval_variables(state)
  if stacked:
    variables = jax.tree_util.tree_map(lambda a: a[c], variables)
  o, n = int(np.asarray(fed.offsets)[c]), int(np.asarray(fed.n)[c])
  bank_x, bank_y = np.asarray(fed.x)[o:o + n], np.asarray(fed.y)[o:o + n]
  feats = lambda x: np.concatenate([np.asarray(algo.encoder_apply(
      variables, ((x[i:i + 1] / 255.0 - dataset.mean) / dataset.std).astype(np.float32)))
      for i in range(len(x))]).astype(np.float64)  # one image at a time
  preds = _knn_loop(feats(bank_x), bank_y, feats(dataset.test_x), dataset.num_classes,
                    min(config.knn_k, n), config.knn_temperature)
  model = 'own' if stacked else 'global'
  assert set(entries[c]) == {'client', 'n_train', 'n_test', model}
  assert (entries[c]['client'], entries[c]['n_train'], entries[c]['n_test']) == (
      c, n, splits[c].size)
  for data, idx in (('split', splits[c]), ('test', np.arange(len(dataset.test_y)))):
    want = np.mean(preds[idx] == dataset.test_y[idx])
    # float32 features may flip a near tie between two classes' votes: at most one image.
    assert abs(entries[c][model][data]['knn_acc'] - want) <= 1 / idx.size + 1e-12, data
  assert summary == per_client.summary(entries)


@pytest.mark.parametrize('algorithm', ['independent', 'fedavg'])
def test_divided_blocks_score_their_clients_as_the_whole_federation(algorithm, monkeypatch):
  """Placement 'divided': each process scores the clients it holds (their rows, and with personal
  models their block of states); in process order the entries are the whole federation's. The
  gather (`_gather_entries`, one all-gather) is run across processes by
  tests/core/placement_worker.py; here each of 2 blocks is scored in turn."""
  config = _config(algorithm=algorithm, ssl_method='simclr', num_clients=4, clients_per_round=4)
  dataset, fed, info = _federation(config)
  splits = evaluation.client_test_splits(config, dataset, info['histogram'])
  algo = experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed.n))
  key = experiment.run_keys(config)[0]
  want, _ = evaluation.per_client_results(
      config, algo, rd.init_state(algo, key, 4), dataset, fed, splits)
  monkeypatch.setattr(evaluation, '_gather_entries', lambda entries, count: entries)
  got = []
  for p in range(2):
    local = placement.divide(fed, p, 2)
    state = rd.init_state(algo, key, 4, client_state='host', process=(p, 2))
    got += evaluation.per_client_results(config, algo, state, dataset, local, splits)[0]
  assert got == want


def test_results_json_carries_the_per_client_list(tmp_path):
  # Host-resident state: the program a divided run uses too (below), so the numbers are equal.
  config = _config(algorithm='independent', ssl_method='simclr', dataset='synthetic',
                   train_size=400, num_clients=4, clients_per_round=4, knn_k=10,
                   client_state='host')
  results = training.train_and_evaluate(config, str(tmp_path), verbose=False)
  stored = json.loads((tmp_path / 'results.json').read_text())
  assert stored['per_client'] == results['per_client']
  entries = stored['per_client']
  assert [e['client'] for e in entries] == list(range(4))
  for e in entries:
    assert set(e) == {'client', 'n_train', 'n_test', 'own'}
    assert set(e['own']) == {'split', 'test'} and set(e['own']['split']) == {'knn_acc'}
    assert e['n_test'] >= evaluation.MIN_CLIENT_TEST
  assert sum(e['n_train'] for e in entries) == 400
  summary = per_client.summary(entries)
  assert summary and all(stored['final'][k] == v for k, v in summary.items())
  # Placement 'divided' (one process): the same list, scored from the held block.
  divided = config.copy_and_resolve_references()
  divided.placement = 'divided'
  training.train_and_evaluate(divided, str(tmp_path / 'divided'), verbose=False)
  assert json.loads((tmp_path / 'divided' / 'results.json').read_text())['per_client'] == entries


def test_too_small_clients_are_refused_in_one_line_before_any_compute(tmp_path, monkeypatch):
  # 60 IID clients share the synthetic set's 500 test images: 8 or 9 each.
  config = _config(dataset='synthetic', train_size=0, partition='iid', num_clients=60,
                   clients_per_round=60, knn_k=10)
  monkeypatch.setattr(rd, 'make_round_step', lambda *a, **k: pytest.fail('compiled a round'))
  with pytest.raises(cv.ConfigError) as err:
    training.train_and_evaluate(config, str(tmp_path), verbose=False)
  message = str(err.value)
  assert '\n' not in message
  assert message.startswith('config.per_client_eval = True is invalid here: client ')
  assert re.search(r'client \d+ \(trains on \d+ images\) gets \d held-out test images, fewer '
                   r'than the minimum of 10 \(\d+ of 60 clients are below it\)', message), message
  assert not (tmp_path / 'random_init.json').exists()   # no reference evaluated either


def test_per_client_eval_needs_a_score():
  with pytest.raises(cv.ConfigError, match=r'^config.per_client_eval = True with config.knn_k = 0 '
                     r"is invalid for ssl_method 'simclr'"):
    experiment.validate_config(_config(ssl_method='simclr', knn_k=0, probe_epochs=1))
  experiment.validate_config(_config(ssl_method='supervised', knn_k=0))  # its classifier scores
