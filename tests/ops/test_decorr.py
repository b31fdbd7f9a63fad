"""ops/decorr.py: FedDecorr's loss against a float64 numpy loop over the dimension pairs, its closed
form on perfectly correlated dimensions, the one-row batch, and float32 under jit against a
rounding-error bound derived from the computation."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.ops import decorr


def np_feddecorr(z, eps=1e-8):
  """The definition written out: per-dimension standardisation with the unbiased variance, then the
  mean of the squared pairwise inner products over ordered pairs j != l, divided by N."""
  z = np.asarray(z, np.float64)
  n, d = z.shape
  cols = []
  for j in range(d):
    c = z[:, j] - z[:, j].sum() / n
    cols.append(c / np.sqrt(eps + (c @ c) / (n - 1)))
  total = sum(float(cols[j] @ cols[l]) ** 2 for j, l in itertools.permutations(range(d), 2))
  return total / (d * (d - 1)) / n


def _data(rng, n, d):
  """Correlated columns with unequal scales and means (so the standardisation matters)."""
  mix = rng.normal(size=(d, d))
  return rng.normal(size=(n, d)) @ mix * rng.uniform(0.1, 5.0, d) + rng.normal(size=d) * 3


# Both sides add up ~N d² products of O(1) numbers in different orders: ~1e3 x 1.1e-16 relative;
# 1e-12 leaves room for FMA contraction and other ISAs.
RTOL64 = 1e-12


@pytest.mark.parametrize('n,d', [(2, 2), (5, 3), (33, 17)])
def test_matches_numpy_float64(n, d):
  rng = np.random.default_rng(n * 100 + d)
  z = _data(rng, n, d)
  with jax.enable_x64(True):
    got = jax.jit(decorr.feddecorr_loss)(jnp.asarray(z))
    assert got.dtype == jnp.float64
  want = np_feddecorr(z)
  assert float(got) == pytest.approx(want, rel=RTOL64)
  # Not vacuous: a larger eps gives another value, far outside the tolerance.
  assert abs(np_feddecorr(z, eps=1.0) - want) > 1e-4 * want


def test_correlated_dimensions_give_the_closed_form():
  """Identical columns: every correlation is 1, so K_jl = (N - 1) v / (v + eps) for every pair
  and the loss is ((N - 1) v / (v + eps))² / N."""
  rng = np.random.default_rng(1)
  n, d = 10, 4
  col = rng.normal(size=n)
  z = np.repeat(col[:, None], d, axis=1)
  v = np.var(col, ddof=1)
  with jax.enable_x64(True):
    got = float(decorr.feddecorr_loss(jnp.asarray(z)))
  assert got == pytest.approx(((n - 1) * v / (v + 1e-8)) ** 2 / n, rel=RTOL64)


def test_one_row_is_zero_and_one_dimension_is_refused():
  assert float(decorr.feddecorr_loss(jnp.ones((1, 5)))) == 0.0
  with pytest.raises(ValueError, match=r'd >= 2'):
    decorr.feddecorr_loss(jnp.ones((4, 1)))


def test_float32_jit_within_the_rounding_bound():
  """float32 under jit (as in training) against float64 on the same float32 inputs.

  Bound (u = 2^-24): each standardised entry carries a relative error of at most (N + 4) u (the
  mean and the variance are N-term sums, then a square root and a division), so an inner product
  K_jl of N such products errs by at most δ = (3N + 8) u Σ_i |ẑ_ij ẑ_il| <= (3N + 8) u (N - 1)
  (Cauchy-Schwarz, Σ_i ẑ_ij² <= N - 1), and the loss, a mean of K_jl² / N with |K_jl| <= N - 1,
  by at most (2 (N - 1) δ + δ²) / N.
  """
  rng = np.random.default_rng(7)
  n, d = 64, 32
  z = _data(rng, n, d).astype(np.float32)
  with jax.enable_x64(False):
    got = jax.jit(decorr.feddecorr_loss)(z)
    assert got.dtype == jnp.float32
  want = np_feddecorr(z.astype(np.float64))
  u = 2.0 ** -24
  delta = (3 * n + 8) * u * (n - 1)
  bound = (2 * (n - 1) * delta + delta ** 2) / n
  assert bound < 1e-2 * want   # tight enough to catch a lower precision or a dropped term
  assert abs(float(got) - want) <= bound
