"""Per-client scoring primitives (eval/per_client.py): the spread over clients against numpy, the
kNN score of one client against a float64 loop, the metric names and the table section."""
import math

import numpy as np
import pytest

from fedjax_ssl.eval import per_client


@pytest.mark.parametrize('num_clients', [1, 2, 9, 10, 11, 19, 20, 25, 100])
def test_spread_matches_numpy(num_clients):
  values = np.random.default_rng(num_clients).uniform(0, 1, num_clients)
  tail = math.ceil(num_clients / 10)   # the 10 % tail, at least one client
  ordered = np.sort(values)
  got = per_client.spread(values.tolist())
  want = {'mean': values.mean(), 'std': values.std(ddof=0), 'worst10': ordered[:tail].mean(),
          'best10': ordered[-tail:].mean()}
  for key, value in want.items():  # float64 sums of <= 100 values in [0, 1]
    assert got[key] == pytest.approx(value, rel=0, abs=1e-12), key
  assert per_client.tail_count(num_clients) == tail


def test_spread_refuses_no_clients():
  with pytest.raises(ValueError, match='non-empty'):
    per_client.spread([])


def _knn_loop(bank_f, bank_y, query_f, num_classes, k, temperature):
  """Slow float64 reference of the weighted cosine kNN: one query at a time."""
  bank = bank_f / np.linalg.norm(bank_f, axis=1, keepdims=True)
  preds = []
  for q in query_f:
    sim = bank @ (q / np.linalg.norm(q))
    top = np.argsort(-sim, kind='stable')[:k]
    votes = np.zeros(num_classes)
    for i in top:
      votes[bank_y[i]] += np.exp(sim[i] / temperature)
    preds.append(int(np.argmax(votes)))
  return np.array(preds)


def test_knn_scores_match_a_float64_loop_and_cap_k_at_the_bank():
  rng = np.random.default_rng(0)
  num_classes, d = 4, 6
  centres = rng.normal(size=(num_classes, d)) * 2
  bank_y = rng.integers(0, num_classes, 30)
  query_y = rng.integers(0, num_classes, 80)
  bank_f = (centres[bank_y] + rng.normal(size=(30, d))).astype(np.float32)
  query_f = (centres[query_y] + rng.normal(size=(80, d))).astype(np.float32)
  splits = {'split': np.arange(0, 80, 3), 'test': np.arange(80)}
  got = per_client.knn_scores(bank_f, bank_y, query_f, query_y, splits, num_classes, k=200,
                              temperature=0.1)
  preds = _knn_loop(bank_f.astype(np.float64), bank_y, query_f.astype(np.float64), num_classes,
                    30, 0.1)
  for name, idx in splits.items():
    # float32 similarities may reorder a near tie of votes: at most one query of the split.
    assert abs(got[name] - np.mean(preds[idx] == query_y[idx])) <= 1 / idx.size + 1e-12


def test_correct_rates_refuse_an_empty_split():
  with pytest.raises(ValueError, match="rows of 'split' are empty"):
    per_client.correct_rates(np.ones(5, bool), {'split': np.zeros(0, int)})


def test_metric_names_parse_back_and_summary_skips_missing_models():
  names = per_client.metric_names()
  assert len(names) == 2 * 2 * 2 * 4
  for key in names:
    assert per_client.metric_key(*per_client.parse_key(key)) == key
  assert per_client.parse_key('knn_acc_1pct_k20') is None
  assert per_client.parse_key('knn_acc_own_split') is None
  entries = [{'own': {'split': {'knn_acc': a}, 'test': {'knn_acc': b}}}
             for a, b in ((0.5, 0.4), (0.7, 0.6), (0.9, 0.2))]
  got = per_client.summary(entries)
  assert set(got) == {per_client.metric_key('knn_acc', 'own', d, s)
                      for d in per_client.DATA for s in per_client.STATS}
  assert got['knn_acc_own_split_worst10'] == 0.5 and got['knn_acc_own_test_best10'] == 0.6


def test_markdown_section_has_one_grid_per_reported_model():
  metrics = per_client.table_metrics(('knn_acc',), models=('own', 'global'), data=('split',))
  entry = lambda v: {'mean': v, 'n': 1}
  by_key = {('IL', 'N=10', k): entry(i) for i, k in enumerate(metrics[:4])}   # own only
  lines = per_client.markdown_lines(metrics, ['IL', 'FL'], ['N=10'], by_key,
                                    lambda e: f"{e['mean']:.1f}")
  text = '\n'.join(lines)
  assert '## Per-client results' in text
  assert "each client's own model on each client's held-out split" in text
  assert 'the global model' not in text   # no run reported it: no empty grid
  assert '| IL | 0.0 | 1.0 | 2.0 | 3.0 |' in text
  assert per_client.markdown_lines(('knn_acc',), ['IL'], ['N=10'], by_key, str) == []
