"""Differential privacy of FedSC's shared correlation matrices (Jing et al., ICML 2024, Sec. 6).

Each client j uploads R_j [H, H] = 1/(|D_j| V) sum_samples sum_views z z^T with z clipped to norm
sqrt(mu), so ||z z^T||_F <= mu, plus i.i.d. N(0, sigma^2) on each of the H^2 entries, with fresh
noise at every upload ("share"). One share is a Gaussian mechanism of l2 sensitivity W:

  * 'zero_out'    W = mu / |D_j|: one sample's term set to zero (the value in the paper's proof);
  * 'replace_one' W = sqrt(2) mu / |D_j| (default): one sample replaced by another. A sample's
    term (its views' mean of z z^T) is PSD with norm <= mu, and for PSD A, B
    ||A - B||_F^2 = ||A||^2 + ||B||^2 - 2 <A, B> <= 2 mu^2 as <A, B> >= 0; orthogonal rank-one
    terms attain it.

A share is (alpha, alpha W^2 / (2 sigma^2))-RDP and T shares compose additively. Two conversions to
(epsilon, delta)-DP are offered (`ACCOUNTANTS`):

  * 'closed_form': the paper's Lemma 6.5, eps = eps_RDP + log(1/delta) / (alpha - 1), minimised
    over alpha > 1 in closed form (Prop. 6.6):
      eps = T W^2 / (2 sigma^2) + sqrt(2 T W^2 log(1/delta)) / sigma;
  * 'rdp' (default): Google's dp-accounting RdpAccountant on the grid `RDP_ORDERS`. Its conversion
    (Canonne et al. 2020, Prop. 12) is tighter than Lemma 6.5 at every order, so up to the grid
    error (<= 1.3e-5 eps, see RDP_ORDERS) 'rdp' <= 'closed_form'.

Under partial participation (m of J clients a round) a client shares about T m / J times;
`sigma_for_participation` gives the official code's linear rescaling of sigma and a sqrt rescaling
that keeps epsilon. `PrivacyLedger` turns each client's actual share count into its epsilon.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, Tuple

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

ADJACENCIES = ('replace_one', 'zero_out')
ACCOUNTANTS = ('rdp', 'closed_form')
PARTIAL_RULES = ('none', 'linear', 'sqrt')

# RDP orders alpha = 1 + u with u log-spaced by 1% from 0.011 to 506 (1,080 orders, alpha from
# 1.011 to 507). For the Gaussian the Lemma 6.5 objective is c + c u + L / u (c = T W^2/(2 sigma^2),
# L = log(1/delta)), and c u + L / u = sqrt(cL) (t + 1/t) with t = u / u*: on a grid with ratio
# 1.01 in u, |log t| <= log(1.01) / 2, so the grid costs at most sqrt(cL) (cosh(0.005) - 1) * 2
# <= 1.3e-5 eps, uniformly in sigma, T and delta, as long as u* = sqrt(L / c) lies in the grid's
# span. The span starts just above alpha = 1.01, below which dp-accounting's conversion returns
# inf; u* < 0.011 means eps > 2 L / 0.011 (hundreds). Past alpha = 507 (u* > 506, eps < 2 L / 506,
# below 0.05 for delta >= 1e-5) the largest order still gives a valid, only looser, bound.
RDP_ORDERS = 1.0 + np.exp(np.arange(math.log(0.011), math.log(511.0), math.log(1.01)))
RDP_ORDERS.setflags(write=False)


def _check_choice(name: str, value, allowed: Tuple[str, ...]) -> None:
  if value not in allowed:
    raise ValueError(f'{name} = {value!r} is invalid: must be one of {allowed}')


def _check_count(name: str, value, minimum: int) -> int:
  """An integer >= minimum (Python or NumPy integer, not bool), returned as int."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ValueError(f'{name} = {value!r} is invalid: need an integer >= {minimum}')
  return int(value)


def _check_real(name: str, value, need: str, ok) -> float:
  """A finite real number with ok(value) true; `need` says what is allowed."""
  if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
      or not ok(value)):
    raise ValueError(f'{name} = {value!r} is invalid: need {need}')
  return float(value)


def _check_delta(delta) -> float:
  return _check_real('delta', delta, 'a number in (0, 1)', lambda d: 0.0 < d < 1.0)


def _check_sigma(sigma) -> float:
  return _check_real('sigma', sigma, 'a finite number >= 0', lambda s: s >= 0.0)


def _check_sensitivity(value) -> float:
  return _check_real('sensitivity', value, 'a finite number > 0', lambda w: w > 0.0)


def sensitivity(mu: float, n: int, adjacency: str = 'replace_one') -> float:
  """l2 sensitivity W of one client's correlation matrix (Frobenius norm, matrix units).

  Args:
    mu: bound on ||z z^T||_F = ||z||^2 after clipping (the squared clip norm), > 0.
    n: the client's dataset size |D_j|, an integer >= 1.
    adjacency: one of ADJACENCIES ('replace_one' sqrt(2) mu / n, 'zero_out' mu / n).
  """
  mu = _check_real('mu', mu, 'a finite number > 0 (the squared clip norm)', lambda m: m > 0.0)
  n = _check_count('n', n, 1)
  _check_choice('adjacency', adjacency, ADJACENCIES)
  return (math.sqrt(2.0) if adjacency == 'replace_one' else 1.0) * mu / n


def _closed_form_epsilon(sigma: float, sens: float, shares: int, delta: float) -> float:
  """Prop. 6.6: T W^2 / (2 sigma^2) + sqrt(2 T W^2 log(1/delta)) / sigma, for sigma > 0."""
  tw2 = shares * sens * sens
  return tw2 / (2.0 * sigma * sigma) + math.sqrt(2.0 * tw2 * math.log(1.0 / delta)) / sigma


def _closed_form_sigma(target_epsilon: float, delta: float, sens: float, shares: int) -> float:
  """The sigma at which `_closed_form_epsilon` equals target_epsilon, for shares >= 1.

  With x = 1 / sigma, eps = a x^2 + b x (a = T W^2 / 2, b = sqrt(2 T W^2 log(1/delta))), increasing
  in x > 0; the positive root is written as 2 eps / (b + sqrt(b^2 + 4 a eps)) to avoid cancellation.
  """
  a = shares * sens * sens / 2.0
  b = math.sqrt(2.0 * shares * sens * sens * math.log(1.0 / delta))
  x = 2.0 * target_epsilon / (b + math.sqrt(b * b + 4.0 * a * target_epsilon))
  return 1.0 / x


def epsilon(sigma: float, sensitivity: float, shares: int, delta: float,
            accountant: str = 'rdp') -> float:
  """epsilon of (epsilon, delta)-DP for `shares` Gaussian releases of noise std sigma.

  Args:
    sigma: noise standard deviation per entry (>= 0, same units as the sensitivity).
    sensitivity: l2 sensitivity W of one release (> 0), e.g. `sensitivity(mu, n)`.
    shares: number of releases T (an integer >= 0), each with fresh noise.
    delta: target delta in (0, 1).
    accountant: one of ACCOUNTANTS.
  Returns:
    epsilon (0.0 for no shares, inf for sigma = 0 with shares).
  """
  sigma = _check_sigma(sigma)
  sens = _check_sensitivity(sensitivity)
  shares = _check_count('shares', shares, 0)
  delta = _check_delta(delta)
  _check_choice('accountant', accountant, ACCOUNTANTS)
  if shares == 0:
    return 0.0
  if sigma == 0.0:
    return math.inf
  if accountant == 'closed_form':
    return _closed_form_epsilon(sigma, sens, shares, delta)
  acc = dp_accounting.rdp.RdpAccountant(orders=RDP_ORDERS)
  acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=sigma / sens), shares)
  return float(acc.get_epsilon(delta))


def calibrate_sigma(target_epsilon: float, delta: float, sensitivity: float, shares: int,
                    accountant: str = 'rdp', rtol: float = 1e-6) -> float:
  """The smallest sigma (to relative tolerance rtol) with epsilon(sigma, ...) <= target_epsilon.

  epsilon is decreasing in sigma, so a bracket [lo, hi] with eps(lo) > target >= eps(hi) is
  bisected in log-space until hi / lo <= 1 + rtol; hi is returned, so its epsilon never exceeds the
  target. The bracket starts around the exact 'closed_form' solution (a close guess for 'rdp' too)
  and widens by factors of 2 until it brackets. No shares need no noise: 0.0.
  """
  target = _check_real('target_epsilon', target_epsilon, 'a finite number > 0',
                       lambda e: e > 0.0)
  delta = _check_delta(delta)
  sens = _check_sensitivity(sensitivity)
  shares = _check_count('shares', shares, 0)
  _check_choice('accountant', accountant, ACCOUNTANTS)
  if shares == 0:
    return 0.0

  def eps(s):
    return epsilon(s, sens, shares, delta, accountant)

  guess = _closed_form_sigma(target, delta, sens, shares)
  lo, hi = guess / 2.0, guess * 2.0
  while eps(lo) <= target:
    lo, hi = lo / 2.0, lo
  while eps(hi) > target:
    lo, hi = hi, hi * 2.0
  while hi > lo * (1.0 + rtol):
    mid = math.sqrt(lo * hi)
    if eps(mid) <= target:
      hi = mid
    else:
      lo = mid
  return hi


def sigma_for_participation(sigma: float, clients_per_round: int, num_clients: int,
                            rule: str) -> float:
  """Noise std when m = clients_per_round of J = num_clients clients share each round.

  A client then shares about T m / J times instead of T, and epsilon depends on T W^2 / sigma^2:
    'none'   sigma: fewer shares, smaller epsilon than full participation;
    'linear' sigma m / J (the official code): T W^2 / sigma^2 grows by J / m, so epsilon grows;
    'sqrt'   sigma sqrt(m / J): T W^2 / sigma^2 is unchanged for T m / J shares, so epsilon is
             that of full participation (exactly for 'closed_form').
  """
  sigma = _check_sigma(sigma)
  m = _check_count('clients_per_round', clients_per_round, 1)
  j = _check_count('num_clients', num_clients, 1)
  if m > j:
    raise ValueError(f'clients_per_round = {m} is invalid: need <= num_clients = {j}')
  _check_choice('rule', rule, PARTIAL_RULES)
  if rule == 'linear':
    return sigma * m / j
  if rule == 'sqrt':
    return sigma * math.sqrt(m / j)
  return sigma


def add_noise(key: jax.Array, matrix: jax.Array, sigma) -> jax.Array:
  """matrix + sigma * N(0, 1), i.i.d. on every entry (the H^2 entries of R_j, not symmetrised).

  The noise depends only on `key` (the caller derives it from the client's own key, so it does not
  depend on the order in which clients run). Jittable; sigma may be a traced scalar. Same shape
  and dtype as matrix, which must be floating.
  """
  matrix = jnp.asarray(matrix)
  if not jnp.issubdtype(matrix.dtype, jnp.floating):
    raise ValueError(f'add_noise: matrix dtype {matrix.dtype} is invalid: need a floating dtype')
  if isinstance(sigma, numbers.Real):
    _check_sigma(sigma)
  noise = jax.random.normal(key, matrix.shape, matrix.dtype)
  return matrix + jnp.asarray(sigma, matrix.dtype) * noise


class PrivacyLedger:
  """Per-client epsilon of FedSC's shares, from each client's own share count and dataset size.

  The caller counts the shares each client actually made (under partial participation these differ
  between clients), so no client's epsilon is under-reported by assuming the average count. sigma
  is the noise std actually used (after `sigma_for_participation`). epsilon is memoised per
  (shares, n): it is queried every round on the host and a client's count changes by at most one.
  """

  def __init__(self, n, mu: float, sigma: float, delta: float,
               adjacency: str = 'replace_one', accountant: str = 'rdp'):
    """n: [J] integer dataset sizes |D_j| (>= 1); the rest as in `sensitivity` and `epsilon`."""
    n = np.asarray(n)
    if n.ndim != 1 or n.size == 0 or not np.issubdtype(n.dtype, np.integer) or np.any(n < 1):
      raise ValueError(f'PrivacyLedger: n = {n!r} is invalid: need a non-empty 1-D integer array '
                       'of dataset sizes >= 1')
    self._n = n.astype(np.int64)
    self._sensitivity = {int(k): sensitivity(mu, int(k), adjacency) for k in np.unique(self._n)}
    self._sigma = _check_sigma(sigma)
    self._delta = _check_delta(delta)
    _check_choice('accountant', accountant, ACCOUNTANTS)
    self._accountant = accountant
    self._cache: Dict[Tuple[int, int], float] = {}

  def _epsilon(self, shares: int, n: int) -> float:
    key = (shares, n)
    if key not in self._cache:
      self._cache[key] = epsilon(self._sigma, self._sensitivity[n], shares, self._delta,
                                 self._accountant)
    return self._cache[key]

  def epsilons(self, shares) -> np.ndarray:
    """[J] float64 epsilon of each client given shares [J] (integers >= 0, its own count)."""
    shares = np.asarray(shares)
    if (shares.shape != self._n.shape or not np.issubdtype(shares.dtype, np.integer)
        or np.any(shares < 0)):
      raise ValueError(f'PrivacyLedger.epsilons: shares = {shares!r} is invalid: need '
                       f'{self._n.shape[0]} integers >= 0 (one count per client)')
    return np.array([self._epsilon(int(t), int(k)) for t, k in zip(shares, self._n)],
                    dtype=np.float64)

  def max_epsilon(self, shares) -> float:
    """The largest per-client epsilon (the federation's guarantee)."""
    return float(np.max(self.epsilons(shares)))
