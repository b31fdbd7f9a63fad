"""The evaluation protocol (fedjax_ssl.eval.protocol / .logistic) against references.

* The L-BFGS probe against scikit-learn's LogisticRegression (lbfgs, multinomial, same C) on the
  same standardised features: a Gaussian mixture and raw Fashion-MNIST pixels (the shipped subset).
* The held-out choice of C, the stratified counts, the kNN against a float64 brute force, the
  metric names of `evaluate_features`, and every bad-input error (one line, before any compute).

Weight tolerance. f(W, b) = L(W, b) + lambda/2 ||W||^2 with L convex and lambda = 1 / (C n). For
any two points z1, z2, convexity of L and lambda-strong convexity of the penalty give
lambda ||W1 - W2||^2 <= <grad f(z1) - grad f(z2), z1 - z2>. When the intercept parts of the
gradients vanish (both solvers drive them to ~0 with the rest), Cauchy-Schwarz gives
||W1 - W2||_F <= (||grad f(z1)|| + ||grad f(z2)||) / lambda. Both gradients are evaluated here in
float64 at the returned solutions; the JAX one must itself be below the solver's tolerance (x1.5
for float32 rounding), and float32 storage of W adds 2^-24 ||W|| per entry, covered by 1e-6 ||W||.
The intercept has no strong convexity from the penalty; its tolerance is a local second-order
estimate (`_intercept_bound`).
"""
import re

import jax
import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits

from fedjax_ssl.eval import knn as knn_lib
from fedjax_ssl.eval import logistic, protocol

SUBSET = protocol.__file__.replace('fedjax_ssl/eval/protocol.py',
                                   'tests/data/fashion_mnist_subset.npz')


def _mixture(seed, n, m, d, k, spread):
  """Balanced classes k, Gaussian means * spread, correlated features: train [n], test [m]."""
  rng = np.random.default_rng(seed)
  means = rng.standard_normal((k, d)) * spread
  mix = rng.standard_normal((d, d)) / np.sqrt(d) + np.eye(d)

  def draw(size):
    y = rng.permutation(np.arange(size) % k).astype(np.int32)
    return ((means[y] + rng.standard_normal((size, d))) @ mix).astype(np.float32), y

  return draw(n) + draw(m)


def _grad64(w, b, x, y, c):
  """Gradient (over W [K, d] and b [K]) of the mean-form objective, in float64."""
  x, w, b = (np.asarray(a, np.float64) for a in (x, w, b))
  logits = x @ w.T + b
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  p[np.arange(len(y)), y] -= 1
  p /= len(y)
  return p.T @ x + w / (c * len(y)), p.sum(0)


def _sklearn(x, y, c, tol=1e-8):
  with threadpool_limits(1):  # two OpenMP threads on 2 shared cores ran ~10x slower
    return LogisticRegression(C=c, tol=tol, max_iter=20000).fit(np.asarray(x, np.float64), y)


def _compare_with_sklearn(x, y, xt, yt, c, tol):
  res = protocol.logistic_probe(x, y, xt, yt, int(y.max()) + 1, cs=(c,), tol=tol)
  xs, xts = protocol.standardize(x, xt)
  sk = _sklearn(xs, y, c)
  lam = 1.0 / (c * len(y))
  g_jax = np.sqrt(sum(np.sum(g ** 2) for g in _grad64(res['weights'], res['bias'], xs, y, c)))
  g_sk = np.sqrt(sum(np.sum(g ** 2) for g in _grad64(sk.coef_, sk.intercept_, xs, y, c)))
  w_err = np.linalg.norm(res['weights'] - sk.coef_)
  bound = (g_jax + g_sk) / lam + 1e-6 * np.linalg.norm(sk.coef_)
  acc_sk = sk.score(xts.astype(np.float64), yt)
  return res, dict(acc_jax=res['test_acc'], acc_sk=acc_sk, g_jax=g_jax, g_sk=g_sk, w_err=w_err,
                   bound=bound, w_norm=np.linalg.norm(sk.coef_),
                   b_err=np.linalg.norm(res['bias'] - sk.intercept_),
                   b_bound=_intercept_bound(sk, res['weights'] - sk.coef_, xs, g_jax + g_sk))


def _intercept_bound(sk, dw, x, g):
  """Local (second-order) bound on the intercept error: the penalty gives b no curvature.

  To first order grad_b f(z1) - grad_b f(z2) = H_bb db + H_bW dW, so
  ||db|| <= (||grad f(z1)|| + ||grad f(z2)|| + ||H_bW dW||) / mu_b, with mu_b the smallest
  eigenvalue of H_bb = mean_i (diag p_i - p_i p_i^T) off its null direction 1 (the loss ignores a
  common shift of b; both solvers keep sum_k b_k = 0). Doubled for the second-order remainder.
  """
  x = np.asarray(x, np.float64)
  p = sk.predict_proba(x)
  h_bb = np.diag(p.mean(0)) - p.T @ p / len(p)
  mu_b = np.linalg.eigvalsh(h_bb)[1]
  a = x @ dw.T                                               # [n, K]
  h_bw_dw = (p * a - p * np.sum(p * a, axis=1, keepdims=True)).mean(0)
  return 2 * (g + np.linalg.norm(h_bw_dw)) / mu_b


def test_probe_matches_sklearn_on_a_gaussian_mixture():
  x, y, xt, yt = _mixture(0, 1200, 600, 20, 4, spread=0.5)
  tol = 1e-6
  res, r = _compare_with_sklearn(x, y, xt, yt, c=0.1, tol=tol)
  assert res['converged'] and r['g_jax'] < 1.5 * tol, r
  assert abs(r['acc_jax'] - r['acc_sk']) <= 0.003, r
  assert 0.5 < r['acc_sk'] < 0.95, r          # neither trivial nor hopeless
  assert r['w_err'] <= r['bound'], r
  assert r['bound'] < 1e-2 * r['w_norm'], r    # the tolerance is tight enough to mean something
  assert r['b_err'] <= r['b_bound'] < 5e-2 * (1 + np.linalg.norm(res['bias'])), r


def test_probe_matches_sklearn_on_fashion_mnist_pixels():
  data = np.load(SUBSET)
  n = 1000
  x = data['train_x'][:n].reshape(n, -1).astype(np.float32)
  xt = data['test_x'].reshape(len(data['test_y']), -1).astype(np.float32)
  tol = 1e-4   # the default
  res, r = _compare_with_sklearn(x, data['train_y'][:n], xt, data['test_y'], c=0.01, tol=tol)
  assert res['converged'] and r['g_jax'] < 1.5 * tol, r
  assert abs(r['acc_jax'] - r['acc_sk']) <= 0.003, r
  assert r['acc_sk'] > 0.7, r
  assert r['w_err'] <= r['bound'], r
  assert r['bound'] < 1e-2 * r['w_norm'], r
  assert r['b_err'] <= r['b_bound'] < 5e-2 * (1 + np.linalg.norm(res['bias'])), r


def test_fit_is_vmappable_over_c():
  x, y, _, _ = _mixture(0, 1200, 600, 20, 4, spread=0.5)   # the first test's shapes: one compile
  x, = protocol.standardize(x)
  cs = np.array([0.01, 0.1], np.float32)
  fits = jax.vmap(lambda c: logistic.fit_logistic(x, y, c, num_classes=4, tol=1e-6))(cs)
  for i, c in enumerate(cs):
    one = logistic.fit_logistic(x, y, c, num_classes=4, tol=1e-6)
    assert float(one.grad_norm) < 1e-6 and float(fits.grad_norm[i]) < 1e-6
    # Both within ||grad|| / lambda of the optimum (module docstring), lambda = 1 / (c n).
    assert np.linalg.norm(fits.weights[i] - one.weights) <= 2e-6 * c * len(y) + 1e-6


def test_the_probe_program_has_no_host_callback():
  """The preconditioner's eigendecomposition runs on the host before the program: a callback inside
  it deadlocked on one CPU (the only XLA thread waited for the callback's own input buffer; 4 of 6
  probes hung under `taskset -c 0`)."""
  x, y, _, _ = _mixture(0, 1200, 600, 20, 4, spread=0.5)
  x, = protocol.standardize(x)
  mask = np.ones(len(y), np.float32)
  cs = np.array([0.01, 0.1], np.float32)
  eig = logistic.feature_eigh(x)
  text = logistic._select_and_refit.lower(x, y, cs, mask, mask, eig, num_classes=4, tol=1e-4,
                                          max_iter=10, memory_size=10).as_text()
  assert 'custom_call' not in text and 'callback' not in text
  s, u = eig  # and it is the eigendecomposition of the covariance, in float64 on the host
  np.testing.assert_allclose(np.asarray(u) * np.asarray(s) @ np.asarray(u).T,
                             np.asarray(x).T @ np.asarray(x) / len(x), atol=1e-4)
  with pytest.raises(ValueError, match='concrete features'):
    jax.jit(logistic.feature_eigh)(x)


def test_the_grid_edge_warning_says_why():
  grid = np.asarray(protocol.DEFAULT_CS)
  flat = protocol._edge_warning(grid, [0.1] * 10, 0, 10)
  assert flat.startswith('logistic_probe: the chosen C = 0.0001 is at the edge of the grid '
                         '[0.0001, 100]: every C ties at held-out accuracy 0.100 on 10 images')
  assert 'strongest penalty scores best (or ties) on 40' in protocol._edge_warning(
      grid, [0.5] + [0.4] * 9, 0, 40)
  assert 'still rises at the weakest penalty' in protocol._edge_warning(
      grid, np.linspace(0.5, 0.8, 10).tolist(), 9, 40)


def test_a_fit_capped_at_max_iter_is_named_and_left_as_it_is(monkeypatch):
  """EVAL-23: the probe does not stop at 100 % training accuracy (that would change its numbers);
  a fit that runs into max_iter is named in one warning, with the cause when the features are
  separable, and the result is the capped fit itself."""
  x, y, xt, yt = _mixture(2, 60, 30, 8, 3, spread=10.0)     # far-apart means: separable
  said = []
  monkeypatch.setattr(protocol.logging, 'warning', said.append)
  res = protocol.logistic_probe(x, y, xt, yt, 3, cs=[100.0], max_iter=5)
  assert res['train_acc'] == 1.0 and not res['converged'] and res['num_iter'] == 5
  assert len(said) == 1, said
  assert said[0].startswith('logistic_probe: the fit at the chosen C = 100 stopped at max_iter = 5 '
                            'with ||grad|| = '), said[0]
  assert ', not under tol = 0.0001; training accuracy 100 %' in said[0]
  assert 'linearly separable' in said[0]
  xs, = protocol.standardize(x)
  fit = logistic.fit_logistic(xs, y, 100.0, num_classes=3, max_iter=5)
  np.testing.assert_array_equal(res['weights'], np.asarray(fit.weights))
  said.clear()
  res = protocol.logistic_probe(x, y, xt, yt, 3, cs=[1e-3], max_iter=1000)   # converges: silent
  assert res['converged'] and said == []
  said.clear()
  overlapping = _mixture(2, 60, 30, 8, 3, spread=0.1)
  res = protocol.logistic_probe(*overlapping, 3, cs=[100.0], max_iter=5)
  assert res['train_acc'] < 1.0 and len(said) == 1 and 'separable' not in said[0], said


GRID_DATA = dict(seed=1, n=600, m=300, d=30, k=3, spread=0.25)


def test_grid_selection_picks_the_held_out_best_c():
  x, y, xt, yt = _mixture(**GRID_DATA)
  x, y = x[:300], y[:300]      # the shape of evaluate_features' 50% subsets below (one compile)
  res = protocol.logistic_probe(x, y, xt, yt, 3, rng=np.random.default_rng(7), tol=1e-6)
  cs, val = np.asarray(res['cs']), np.asarray(res['val_acc'])
  np.testing.assert_allclose(cs, protocol.DEFAULT_CS)
  assert res['c'] == cs[np.argmax(val)]                 # the first maximum: smallest C on ties
  best = int(np.argmax(val))
  assert 0 < best < len(cs) - 1 and val.max() - val.min() > 0.1, val   # an interior optimum
  # The same held-out split, fitted by sklearn at every C, scores the same on the held-out part.
  fit_idx, val_idx = protocol.stratified_holdout(y, 3, np.random.default_rng(7))
  xs, = protocol.standardize(x)
  sk_val = np.array([_sklearn(xs[fit_idx], y[fit_idx], c).score(xs[val_idx], y[val_idx])
                     for c in cs])
  assert np.abs(sk_val - val).max() <= 1 / len(val_idx) + 1e-9, (sk_val, val)
  assert sk_val[best] == sk_val.max()
  # The refit uses every labelled image with the chosen C.
  sk = _sklearn(xs, y, res['c'])
  assert abs(sk.score(protocol.standardize(x, xt)[1], yt) - res['test_acc']) <= 0.003


def test_stratified_counts_are_exact():
  y = np.repeat([0, 1, 2], [47, 33, 20])
  np.random.default_rng(0).shuffle(y)
  # quotas 4.7, 3.3, 2.0 -> floors 4, 3, 2 (9); round(10) = 10: the extra one to class 0 (.7).
  np.testing.assert_array_equal(protocol.subset_counts(y, 3, 0.1), [5, 3, 2])
  # quotas 11.75, 8.25, 5 -> 11, 8, 5 (24); 25: the extra one to class 0.
  np.testing.assert_array_equal(protocol.subset_counts(y, 3, 0.25), [12, 8, 5])
  np.testing.assert_array_equal(protocol.apportion(np.array([5, 5, 5, 5]), 0.5), [3, 3, 2, 2])
  for draw in range(3):
    idx = protocol.stratified_subset(y, 3, 0.25, protocol.fraction_rng(0, draw, 0.25))
    assert np.all(np.diff(idx) > 0) and idx.max() < len(y)
    np.testing.assert_array_equal(np.bincount(y[idx], minlength=3), [12, 8, 5])
  a, b = (protocol.stratified_subset(y, 3, 0.25, protocol.fraction_rng(0, d, 0.25)) for d in (0, 1))
  assert not np.array_equal(a, b)
  np.testing.assert_array_equal(
      a, protocol.stratified_subset(y, 3, 0.25, protocol.fraction_rng(0, 0, 0.25)))
  np.testing.assert_array_equal(protocol.stratified_subset(y, 3, 1.0, None), np.arange(100))
  # Held-out split of a 25-image subset [12, 8, 5]: quotas 1.2, 0.8, 0.5, total round(2.5) = 3.
  sub = np.repeat([0, 1, 2], [12, 8, 5])
  np.testing.assert_array_equal(protocol.holdout_counts(sub, 3), [1, 1, 1])
  fit, val = protocol.stratified_holdout(sub, 3, np.random.default_rng(0))
  np.testing.assert_array_equal(np.bincount(sub[val], minlength=3), [1, 1, 1])
  np.testing.assert_array_equal(np.sort(np.concatenate([fit, val])), np.arange(25))
  # A class with one image keeps it in the fitted part.
  np.testing.assert_array_equal(protocol.holdout_counts(np.repeat([0, 1], [19, 1]), 2, 0.1),
                                [2, 0])


def _knn_reference(bank, bank_y, queries, num_classes, k, t):
  """float64 brute force; also flags queries whose answer float32 rounding could change."""
  unit = lambda a: a / np.linalg.norm(a, axis=1, keepdims=True)
  sim = unit(bank.astype(np.float64)) @ unit(queries.astype(np.float64)).T   # [N, M]
  order = np.argsort(-sim, axis=0)
  preds, ambiguous = [], []
  for j in range(queries.shape[0]):
    top = order[:k, j]
    votes = np.bincount(bank_y[top], weights=np.exp(sim[top, j] / t), minlength=num_classes)
    ranked = np.sort(votes)
    gap = sim[order[k - 1, j], j] - sim[order[k, j], j] if k < len(bank) else 1.0
    preds.append(int(np.argmax(votes)))
    ambiguous.append(gap < 1e-5 or ranked[-1] - ranked[-2] < 1e-4 * ranked[-1])
  return np.array(preds), np.array(ambiguous)


def test_knn_matches_a_float64_brute_force():
  rng = np.random.default_rng(3)
  centers = rng.standard_normal((5, 16))
  bank_y, test_y = rng.integers(0, 5, 500), rng.integers(0, 5, 200)
  bank = (centers[bank_y] + 1.5 * rng.standard_normal((500, 16))).astype(np.float32)
  queries = (centers[test_y] + 1.5 * rng.standard_normal((200, 16))).astype(np.float32)
  for k in (1, 20, 200):
    ref, ambiguous = _knn_reference(bank, bank_y, queries, 5, k, 0.1)
    assert ambiguous.sum() <= 2, k
    got = knn_lib.knn_predict(bank, bank_y, queries, 5, k=k, temperature=0.1)
    np.testing.assert_array_equal(got[~ambiguous], ref[~ambiguous])
    res = protocol.knn_accuracy(bank, bank_y, queries, test_y, 5, k=k)
    assert res['k'] == k
    assert abs(res['acc'] - np.mean(ref == test_y)) <= ambiguous.sum() / 200
  # k above the bank size is capped at it, and the k used is reported.
  res = protocol.knn_accuracy(bank[:50], bank_y[:50], queries, test_y, 5, k=200)
  ref, ambiguous = _knn_reference(bank[:50], bank_y[:50], queries, 5, 50, 0.1)
  assert res['k'] == 50 and not ambiguous.any()
  assert res['acc'] == np.mean(ref == test_y)


def test_evaluate_features_names_and_values():
  x, y, xt, yt = _mixture(**GRID_DATA)
  out, records = protocol.evaluate_features(x, y, xt, yt, 3, fractions=(0.5,), draws=2, seed=5,
                                            knn_k=(500, 5), tol=1e-6, return_draws=True)
  assert set(out) == {'probe_acc_50pct', 'probe_acc_50pct_std', 'probe_C_50pct',
                      'knn_acc_50pct', 'knn_acc_50pct_std', 'knn_k_50pct',
                      'knn_acc_50pct_k5', 'knn_acc_50pct_k5_std', 'knn_k_50pct_k5',
                      'labelled_50pct'}
  assert out['labelled_50pct'] == 300 and out['knn_k_50pct'] == 300 and out['knn_k_50pct_k5'] == 5
  probe, knn5 = [], []
  for draw in range(2):
    rng = protocol.fraction_rng(5, draw, 0.5)
    idx = protocol.stratified_subset(y, 3, 0.5, rng)
    np.testing.assert_array_equal(np.bincount(y[idx], minlength=3), [100, 100, 100])
    probe.append(protocol.logistic_probe(x[idx], y[idx], xt, yt, 3, rng=rng, tol=1e-6)['test_acc'])
    knn5.append(protocol.knn_accuracy(x[idx], y[idx], xt, yt, 3, k=5)['acc'])
    assert records[draw]['probe']['test_acc'] == probe[-1]
  assert out['probe_acc_50pct'] == pytest.approx(np.mean(probe), abs=1e-12)
  assert out['probe_acc_50pct_std'] == pytest.approx(np.std(probe), abs=1e-12)
  assert out['knn_acc_50pct_k5'] == pytest.approx(np.mean(knn5), abs=1e-12)
  assert [protocol.fraction_tag(f) for f in (1.0, 0.1, 0.01, 0.005, 0.25)] == [
      '', '_10pct', '_1pct', '_0p5pct', '_25pct']


@pytest.fixture
def no_compute(monkeypatch):
  """Any fit or kNN fails the test: the errors must come first."""
  def fail(*args, **kwargs):
    raise AssertionError('computed before the arguments were checked')
  for name in ('fit_logistic', 'fit_logistic_path', 'select_and_refit'):
    monkeypatch.setattr(logistic, name, fail)
  monkeypatch.setattr(knn_lib, 'knn_predict', fail)


_Y = np.repeat(np.arange(4), [40, 30, 20, 10])
_X = np.random.default_rng(0).standard_normal((100, 3)).astype(np.float32)


@pytest.mark.parametrize('kwargs, message', [
    (dict(fractions=(1.0, 0.0)), 'label fraction 0.0 is invalid: must be a number in (0, 1]'),
    (dict(fractions=(1.5,)), 'label fraction 1.5 is invalid: must be a number in (0, 1]'),
    (dict(fractions=(-0.1,)), 'label fraction -0.1 is invalid: must be a number in (0, 1]'),
    (dict(fractions=(0.03,)), 'label fraction 0.03 of 100 labelled images gives 3 images, fewer '
                              'than the 4 classes: need fraction >= 0.04'),
    # quotas 2, 1.5, 1, 0.5 -> 2, 1, 1, 0 (4); round(5) = 5: the extra one to class 1 (.5, the
    # smaller id of the two .5 remainders), so class 3 gets none.
    (dict(fractions=(0.05,)), 'label fraction 0.05 leaves class 3 (10 of 100 labelled images) '
                              'with no example in the stratified subset: need fraction >= 0.1'),
    (dict(cs=()), 'regularisation grid cs = () is empty: need at least one value C > 0'),
    (dict(cs=(1.0, -1.0)), 'regularisation grid cs = (1.0, -1.0) is invalid: every C must be a '
                           'distinct finite number > 0'),
    (dict(knn_k=(200, 0)), 'kNN k = 0 is invalid: must be an integer >= 1'),
    (dict(knn_k=(2.5,)), 'kNN k = 2.5 is invalid: must be an integer >= 1'),
    (dict(draws=0), 'draws = 0 is invalid: must be an integer >= 1'),
])
def test_bad_input_is_one_line_before_compute(no_compute, kwargs, message):
  with pytest.raises(ValueError) as info:
    protocol.evaluate_features(_X, _Y, _X[:10], _Y[:10], 4, **kwargs)
  text = str(info.value)
  assert '\n' not in text
  assert text.startswith(message), text


def test_an_empty_held_out_split_is_refused(no_compute):
  y = np.repeat(np.arange(4), 25)
  with pytest.raises(ValueError) as info:   # 4 images, one per class: nothing to hold out
    protocol.evaluate_features(_X, y, _X[:10], y[:10], 4, fractions=(0.04,))
  assert str(info.value) == (
      'label fraction 0.04: holdout = 0.1 of 4 labelled images holds out none (a class keeps at '
      'least one image to fit): need more labelled images, a larger holdout, or a one-value grid '
      'cs')


def test_bad_input_of_the_single_functions(no_compute):
  with pytest.raises(ValueError, match=re.escape('regularisation grid cs = () is empty')):
    protocol.logistic_probe(_X, _Y, _X, _Y, 4, cs=())
  with pytest.raises(ValueError, match=re.escape('kNN k = 0 is invalid: must be an integer >= 1')):
    protocol.knn_accuracy(_X, _Y, _X, _Y, 4, k=0)
  with pytest.raises(ValueError, match=re.escape('label fraction 2 is invalid')):
    protocol.stratified_subset(_Y, 4, 2, np.random.default_rng(0))
  with pytest.raises(ValueError, match=re.escape('train_y must be integers in [0, 3)')):
    protocol.evaluate_features(_X, _Y, _X, _Y, 3)
