"""ops/privacy.py: FedSC's DP accounting against brute force, the paper's Table 6, an independent
numpy re-implementation of dp-accounting's RDP conversion, sigma calibration, partial participation,
the per-client ledger, and the Gaussian noise's statistics and key dependence."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.ops import privacy

# Table 6 of Jing et al. (ICML 2024), full participation: dataset, target (eps, delta), mu, printed
# sigma (a string: its last digit sets the rounding), T shares, |D|, closed-form eps with
# W = mu/|D| ('zero_out') and with W = sqrt(2) mu/|D| ('replace_one'), and whether the sigma
# calibrated under 'replace_one'/'closed_form' rounds to the printed sigma.
TABLE6 = [
    ('SVHN', 3, 1e-2, 2, '0.0034', 100, 10000, 1.958, 2.871, False),
    ('SVHN', 6, 1e-2, 2, '0.0018', 100, 10000, 3.989, 6.003, True),
    ('SVHN', 3, 1e-4, 2, '0.0048', 100, 10000, 1.875, 2.703, False),
    ('SVHN', 8, 1e-4, 2, '0.0018', 100, 10000, 5.386, 7.979, True),
    ('CIFAR10', 3, 1e-2, 4, '0.01', 50, 5000, 1.877, 2.748, True),
    ('CIFAR10', 6, 1e-2, 4, '0.0052', 50, 5000, 3.893, 5.852, False),
    ('CIFAR10', 3, 1e-4, 4, '0.012', 50, 5000, 2.134, 3.084, True),
    ('CIFAR10', 8, 1e-4, 4, '0.0051', 50, 5000, 5.376, 7.963, True),
    ('CIFAR100', 6, 1e-2, 5, '0.013', 50, 2500, 3.893, 5.852, True),
    ('CIFAR100', 12, 1e-2, 5, '0.0075', 50, 2500, 7.500, 11.649, False),
    ('CIFAR100', 3, 1e-4, 5, '0.04', 50, 2500, 1.580, 2.271, False),
    ('CIFAR100', 8, 1e-4, 5, '0.013', 50, 2500, 5.261, 7.786, True),
]
ROW_IDS = [f'{r[0]}-eps{r[1]}-delta{r[2]:g}' for r in TABLE6]
PRINTED = 5e-4 + 1e-12   # the table's 3 printed decimals


def _lemma65_objective(alpha, sigma, w, shares, delta):
  """Paper Lemma 6.5 at order(s) alpha: T alpha W^2 / (2 sigma^2) + log(1/delta) / (alpha - 1)."""
  return shares * alpha * w * w / (2 * sigma * sigma) + math.log(1 / delta) / (alpha - 1)


def _np_dp_accounting_epsilon(sigma, w, shares, delta, orders):
  """Independent numpy copy of dp_accounting.rdp.compute_epsilon (v0.6.0) for the Gaussian:
  RDP alpha T / (2 (sigma/W)^2); per order eps = 0 when delta^2 + expm1(-rdp) > 0 (the KL bound),
  else rdp + log1p(-1/alpha) - log(delta alpha) / (alpha - 1) for alpha > 1.01 (Canonne et al.
  2020, Prop. 12), else inf; the minimum over orders, clamped at 0."""
  rdp = shares * orders * w * w / (2 * sigma * sigma)
  tight = rdp + np.log1p(-1 / orders) - np.log(delta * orders) / (orders - 1)
  eps = np.where(delta ** 2 + np.expm1(-rdp) > 0, 0.0, np.where(orders > 1.01, tight, np.inf))
  return max(0.0, float(eps.min()))


def _half_ulp(printed):
  """Half a unit in the last printed digit of a decimal string ('0.0034' -> 5e-5)."""
  return 0.5 * 10.0 ** -len(printed.split('.')[1])


# ---- T11: the closed form is the minimum of Lemma 6.5 over alpha; monotonicity ----

@pytest.mark.parametrize('sigma,w,shares,delta', [
    (0.0034, math.sqrt(2) * 2 / 10000, 100, 1e-2), (0.0051, 4 / 5000, 50, 1e-4),
    (0.04, math.sqrt(2) * 5 / 2500, 50, 1e-4), (0.5, 1.0, 1, 1e-5), (0.3, 1.0, 200, 1e-3),
    (5.0, 1.0, 3, 0.3)])
def test_closed_form_is_the_brute_force_minimum_over_alpha(sigma, w, shares, delta):
  u = np.geomspace(1e-3, 1e4, 1_000_001)   # alpha - 1, ratio 1 + 1.6e-5 per step
  alpha = 1 + u
  obj = _lemma65_objective(alpha, sigma, w, shares, delta)
  k = int(np.argmin(obj))
  assert 0 < k < len(u) - 1   # an interior minimum: the grid spans the optimum
  eps = privacy.epsilon(sigma, w, shares, delta, 'closed_form')
  assert eps == pytest.approx(obj[k], rel=1e-9)
  u_star = math.sqrt(2 * sigma ** 2 * math.log(1 / delta) / (shares * w * w))
  assert u[k] == pytest.approx(u_star, rel=1e-4)
  # A perturbed closed form (the 2 under the square root dropped) misses the brute force.
  perturbed = (shares * w * w / (2 * sigma ** 2)
               + math.sqrt(shares * w * w * math.log(1 / delta)) / sigma)
  assert abs(perturbed - obj[k]) > 1e-3 * obj[k]


@pytest.mark.parametrize('accountant', privacy.ACCOUNTANTS)
def test_epsilon_monotone_in_shares_sigma_and_dataset_size(accountant):
  delta = 1e-2

  def eps(sigma=0.0052, n=5000, shares=50):
    return privacy.epsilon(sigma, privacy.sensitivity(4, n), shares, delta, accountant)

  by_shares = [eps(shares=t) for t in (1, 2, 5, 10, 50, 100, 200)]
  by_sigma = [eps(sigma=s) for s in (0.001, 0.002, 0.0052, 0.01, 0.05)]
  by_size = [eps(n=n) for n in (100, 1000, 5000, 10 ** 5, 10 ** 7)]
  assert np.all(np.diff(by_shares) > 0)
  assert np.all(np.diff(by_sigma) < 0)
  assert np.all(np.diff(by_size) < 0)
  assert eps(n=10 ** 9) < 1e-4   # -> 0 as |D| -> inf
  assert eps(shares=0) == 0.0
  assert eps(sigma=0.0) == math.inf


# ---- T12: Table 6 ----

@pytest.mark.parametrize('row', TABLE6, ids=ROW_IDS)
def test_table6_closed_form_reproduces_both_columns(row):
  _, _, delta, mu, sigma, shares, size, eps_zero, eps_replace, _ = row
  sigma = float(sigma)
  w_zero = privacy.sensitivity(mu, size, 'zero_out')
  w_replace = privacy.sensitivity(mu, size, 'replace_one')
  assert w_zero == mu / size and w_replace == math.sqrt(2) * mu / size
  assert privacy.epsilon(sigma, w_zero, shares, delta, 'closed_form') == pytest.approx(
      eps_zero, abs=PRINTED)
  assert privacy.epsilon(sigma, w_replace, shares, delta, 'closed_form') == pytest.approx(
      eps_replace, abs=PRINTED)
  # Dropping the sqrt(2) (zero_out's W) misses the replace_one column by far more than rounding.
  assert abs(privacy.epsilon(sigma, w_zero, shares, delta, 'closed_form') - eps_replace) > 0.5


@pytest.mark.parametrize('row', TABLE6, ids=ROW_IDS)
def test_table6_rdp_within_grid_error_of_closed_form_and_matches_numpy_conversion(row):
  _, _, delta, mu, sigma, shares, size, _, _, _ = row
  sigma = float(sigma)
  w = privacy.sensitivity(mu, size)
  closed = privacy.epsilon(sigma, w, shares, delta, 'closed_form')
  rdp = privacy.epsilon(sigma, w, shares, delta, 'rdp')
  orders = np.asarray(privacy.RDP_ORDERS)
  grid_error = float(np.min(_lemma65_objective(orders, sigma, w, shares, delta))) - closed
  assert 0 <= grid_error <= 1.3e-5 * closed   # the bound stated at RDP_ORDERS
  assert rdp <= closed + grid_error
  assert rdp == pytest.approx(_np_dp_accounting_epsilon(sigma, w, shares, delta, orders),
                              rel=1e-12)
  # The library does not use Lemma 6.5's conversion: that one (closed form on the same grid) is
  # far above it, so a reference re-implementing it would fail the equality above.
  assert closed + grid_error - rdp > 0.3


# ---- calibrate_sigma ----

def _exact_closed_form_sigma(target, delta, w, shares):
  """Positive root in x = 1/sigma of (T W^2 / 2) x^2 + sqrt(2 T W^2 log(1/delta)) x = target."""
  a = shares * w * w / 2
  b = math.sqrt(2 * shares * w * w * math.log(1 / delta))
  return 2 * a / (-b + math.sqrt(b * b + 4 * a * target))


@pytest.mark.parametrize('accountant', privacy.ACCOUNTANTS)
@pytest.mark.parametrize('target,delta,w,shares', [
    (6.0, 1e-2, math.sqrt(2) * 4 / 5000, 50), (1.0, 1e-5, 1.0, 100), (0.2, 1e-3, 0.01, 1)])
def test_calibrate_sigma_meets_the_target(accountant, target, delta, w, shares):
  sigma = privacy.calibrate_sigma(target, delta, w, shares, accountant)
  eps = privacy.epsilon(sigma, w, shares, delta, accountant)
  assert target * (1 - 1e-4) <= eps <= target
  assert privacy.epsilon(sigma * (1 - 1e-5), w, shares, delta, accountant) > target  # smallest
  exact = _exact_closed_form_sigma(target, delta, w, shares)
  if accountant == 'closed_form':
    assert sigma == pytest.approx(exact, rel=2e-6)
  else:
    assert sigma < exact   # the tighter conversion needs less noise
  assert privacy.calibrate_sigma(target, delta, w, 0, accountant) == 0.0


@pytest.mark.parametrize('row', TABLE6, ids=ROW_IDS)
def test_table6_printed_sigma_is_the_replace_one_calibration(row):
  _, target, delta, mu, printed, shares, size, _, _, within_rounding = row
  calibrated = {adj: privacy.calibrate_sigma(target, delta, privacy.sensitivity(mu, size, adj),
                                             shares, 'closed_form')
                for adj in privacy.ADJACENCIES}
  # zero_out's sigma is 1/sqrt(2) of replace_one's (epsilon depends on W / sigma only), and every
  # printed sigma is at least 1.35x it (zero_out would have reached the target with far less
  # noise), while replace_one's is closer on a log scale in every row...
  assert calibrated['zero_out'] / calibrated['replace_one'] == pytest.approx(2 ** -0.5, rel=1e-5)
  assert float(printed) / calibrated['zero_out'] > 1.35
  gap = {adj: abs(math.log(s / float(printed))) for adj, s in calibrated.items()}
  assert gap['replace_one'] < gap['zero_out']
  # ...and within the printed sigma's rounding in 7 of the 12 rows (the others print 2-30% more).
  assert (abs(calibrated['replace_one'] - float(printed)) <= _half_ulp(printed)) == within_rounding


# ---- partial participation ----

def test_sigma_for_participation_rules():
  assert privacy.sigma_for_participation(0.0052, 2, 10, 'none') == 0.0052
  assert privacy.sigma_for_participation(0.0052, 2, 10, 'linear') == pytest.approx(0.00104,
                                                                                   rel=1e-15)
  assert privacy.sigma_for_participation(0.0052, 2, 10, 'sqrt') == pytest.approx(
      0.0052 * math.sqrt(0.2), rel=1e-15)
  assert privacy.sigma_for_participation(0.0052, 10, 10, 'linear') == 0.0052


def test_partial_participation_cifar10_two_of_ten():
  w, delta, rounds, full_sigma = privacy.sensitivity(4, 5000), 1e-2, 50, 0.0052
  shares = rounds * 2 // 10   # T_j = 10 shares per client
  full = privacy.epsilon(full_sigma, w, rounds, delta, 'closed_form')
  linear = privacy.epsilon(privacy.sigma_for_participation(full_sigma, 2, 10, 'linear'), w,
                           shares, delta, 'closed_form')
  root = privacy.epsilon(privacy.sigma_for_participation(full_sigma, 2, 10, 'sqrt'), w, shares,
                         delta, 'closed_form')
  assert full == pytest.approx(5.852, abs=PRINTED)
  assert linear == pytest.approx(16.357, abs=PRINTED)   # ~16.4, not the targeted 6
  assert root == pytest.approx(full, rel=1e-12)         # 5.852: sqrt keeps epsilon
  # Counting T = 50 shares instead of the client's T_j = 10 would report a different number.
  wrong = privacy.epsilon(privacy.sigma_for_participation(full_sigma, 2, 10, 'linear'), w,
                          rounds, delta, 'closed_form')
  assert wrong - linear > 30


# ---- PrivacyLedger ----

@pytest.mark.parametrize('adjacency,accountant', [('replace_one', 'rdp'),
                                                  ('zero_out', 'closed_form')])
def test_ledger_per_client_epsilon_and_memo(monkeypatch, adjacency, accountant):
  sizes = np.array([5000, 2500, 10000, 5000])
  ledger = privacy.PrivacyLedger(sizes, mu=4, sigma=0.0052, delta=1e-2, adjacency=adjacency,
                                 accountant=accountant)
  shares = np.array([10, 3, 0, 7])
  expected = [privacy.epsilon(0.0052, privacy.sensitivity(4, int(n), adjacency), int(t), 1e-2,
                              accountant) for n, t in zip(sizes, shares)]
  calls = []
  real = privacy.epsilon
  monkeypatch.setattr(privacy, 'epsilon', lambda *a: calls.append(a) or real(*a))
  eps = ledger.epsilons(shares)
  assert eps.dtype == np.float64
  np.testing.assert_allclose(eps, expected, rtol=1e-15)
  assert eps[2] == 0.0 and len(set(eps)) == 4   # unequal n and counts give unequal epsilon
  assert ledger.max_epsilon(shares) == max(expected)
  assert len(calls) == 4
  # (10, 5000) is memoised from client 0, so client 3 reaching 10 shares costs no accounting.
  np.testing.assert_allclose(ledger.epsilons(np.array([10, 3, 0, 10])),
                             [expected[0], expected[1], 0.0, expected[0]], rtol=1e-15)
  assert len(calls) == 4


def test_ledger_counts_actual_shares_under_partial_participation():
  rng = np.random.default_rng(0)
  sizes = np.full(10, 5000)
  sigma = privacy.sigma_for_participation(0.0052, 2, 10, 'linear')
  counts = np.zeros(10, np.int64)
  for _ in range(50):
    counts[rng.choice(10, 2, replace=False)] += 1
  assert counts.sum() == 100 and counts.max() > 10   # someone shared more than T m / J = 10
  ledger = privacy.PrivacyLedger(sizes, mu=4, sigma=sigma, delta=1e-2, accountant='closed_form')
  w = privacy.sensitivity(4, 5000)
  np.testing.assert_allclose(
      ledger.epsilons(counts),
      [privacy.epsilon(sigma, w, int(t), 1e-2, 'closed_form') for t in counts], rtol=1e-15)
  average = privacy.epsilon(sigma, w, 10, 1e-2, 'closed_form')
  assert ledger.max_epsilon(counts) > average + 1   # the average count would under-report


# ---- T10: add_noise ----

def test_add_noise_frobenius_moment_and_independent_entries():
  h, sigma, draws = 16, 0.5, 4000
  keys = jax.random.split(jax.random.PRNGKey(3), draws)
  noise = np.asarray(jax.vmap(privacy.add_noise, (0, None, None))(
      keys, jnp.zeros((h, h), jnp.float32), sigma), np.float64)
  sq = np.sum(noise ** 2, axis=(1, 2))
  # ||N||_F^2 / sigma^2 ~ chi^2 with H^2 dof: mean H^2 sigma^2, variance 2 H^2 sigma^4.
  tol = 5 * math.sqrt(2 * h * h * sigma ** 4 / draws)
  assert abs(sq.mean() - h * h * sigma ** 2) < tol
  assert abs(sq.mean() - h * h * sigma) > tol   # sigma read as a variance would fail
  # Not symmetrised: E[N_ij N_ji] = 0 (it would be sigma^2 = 0.25 for (N + N^T) / sqrt 2).
  iu = np.triu_indices(h, 1)
  cross = noise[:, iu[0], iu[1]] * noise[:, iu[1], iu[0]]
  assert abs(cross.mean()) < 5 * sigma ** 2 / math.sqrt(cross.size)


def test_add_noise_depends_only_on_the_key():
  base = jax.random.PRNGKey(7)
  matrix = jnp.asarray(np.random.default_rng(0).normal(size=(6, 6)), jnp.float32)
  client_keys = [jax.random.fold_in(base, j) for j in range(4)]
  forward = [privacy.add_noise(k, matrix, 0.1) for k in client_keys]
  backward = [privacy.add_noise(k, matrix, 0.1) for k in client_keys[::-1]][::-1]
  batched = jax.vmap(privacy.add_noise, (0, None, None))(jnp.stack(client_keys), matrix, 0.1)
  for j in range(4):
    np.testing.assert_array_equal(forward[j], backward[j])
    np.testing.assert_array_equal(forward[j], batched[j])
  assert not np.allclose(forward[0], forward[1])
  jitted = jax.jit(privacy.add_noise)(client_keys[0], matrix, jnp.float32(0.1))  # traced sigma
  np.testing.assert_allclose(jitted, forward[0], rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(privacy.add_noise(base, matrix, 0.0), matrix)
  half = privacy.add_noise(base, matrix.astype(jnp.bfloat16), 0.1)
  assert half.dtype == jnp.bfloat16 and half.shape == (6, 6)


# ---- bad inputs ----

@pytest.mark.parametrize('call,named', [
    (lambda: privacy.sensitivity(-1.0, 10), 'mu = -1.0'),
    (lambda: privacy.sensitivity(2.0, 0), 'n = 0'),
    (lambda: privacy.sensitivity(2.0, 10, 'add_remove'), "adjacency = 'add_remove'"),
    (lambda: privacy.epsilon(-0.1, 1e-3, 10, 1e-2), 'sigma = -0.1'),
    (lambda: privacy.epsilon(0.1, 0.0, 10, 1e-2), 'sensitivity = 0.0'),
    (lambda: privacy.epsilon(0.1, 1e-3, -1, 1e-2), 'shares = -1'),
    (lambda: privacy.epsilon(0.1, 1e-3, 2.5, 1e-2), 'shares = 2.5'),
    (lambda: privacy.epsilon(0.1, 1e-3, 10, 0.0), 'delta = 0.0'),
    (lambda: privacy.epsilon(0.1, 1e-3, 10, 1.0), 'delta = 1.0'),
    (lambda: privacy.epsilon(0.1, 1e-3, 10, 1e-2, 'prv'), "accountant = 'prv'"),
    (lambda: privacy.calibrate_sigma(0.0, 1e-2, 1e-3, 10), 'target_epsilon = 0.0'),
    (lambda: privacy.calibrate_sigma(1.0, 2.0, 1e-3, 10), 'delta = 2.0'),
    (lambda: privacy.sigma_for_participation(0.1, 0, 10, 'linear'), 'clients_per_round = 0'),
    (lambda: privacy.sigma_for_participation(0.1, 11, 10, 'linear'), 'clients_per_round = 11'),
    (lambda: privacy.sigma_for_participation(0.1, 2, 10, 'cube'), "rule = 'cube'"),
    (lambda: privacy.PrivacyLedger([10, 0], 4, 0.1, 1e-2), 'n = array([10,  0])'),
    (lambda: privacy.PrivacyLedger([10, 20], 4, 0.1, 1e-2).epsilons([1]), 'shares = array([1])'),
    (lambda: privacy.PrivacyLedger([10, 20], 4, -0.1, 1e-2), 'sigma = -0.1'),
    (lambda: privacy.add_noise(jax.random.PRNGKey(0), jnp.zeros((2, 2), jnp.int32), 0.1),
     'int32'),
    (lambda: privacy.add_noise(jax.random.PRNGKey(0), jnp.zeros((2, 2)), -1.0), 'sigma = -1.0'),
])
def test_bad_inputs_raise_naming_the_value(call, named):
  with pytest.raises(ValueError) as info:
    call()
  assert named in str(info.value)
