"""ops/cka.py: CKA against a float64 numpy reference that builds the L x L kernels, its invariances,
the uncentred variant, gradients against central finite differences, the aggregate forms against
each other, and a float32 run under jit against an a-priori rounding-error bound.

Every comparison runs in float64 except the float32 test; every identity is paired with a perturbed
version (an anisotropic scaling, a dropped centring, a moved client, ...) that must miss by a clear
margin, so a test cannot pass because its comparison is vacuous.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.ops import cka

# The library (feature space) and the reference (L x L kernels) sum up to ~L² d ~ 1e5 products of
# O(1) numbers in different orders: the rounding is at most ~1e5 x 2.2e-16 ~ 2e-11 of the largest
# term and far less in practice; 1e-10 leaves room for other ISAs / FMA contraction and is 1e8 x
# below MISS.
RTOL = 1e-10
# A perturbed input or formula must move CKA by at least this much (absolute): far outside rounding.
MISS = 1e-2
L = 37
# Shapes are shared between tests (widths 5, 11 and 64 > L; one cohort layout) so that each jitted
# function compiles only a few times: compilation dominates the run time.
PAIRS = ((11, 5), (64, 11))
SPEC = ((3, 5), (2, 64))   # two cohorts [J_g, L, d_g] of different widths


def _jit(fn):
  """jax.jit with `centered` static, always passed so that a call with the default shares the cache
  entry of one that spells it out."""
  jitted = jax.jit(fn, static_argnames='centered')
  return lambda *args, centered=True: jitted(*args, centered=centered)


linear_cka = _jit(cka.linear_cka)
_rbf_cka = _jit(cka.rbf_cka)
aggregate_kernel = jax.jit(cka.aggregate_kernel)
to_kernel = _jit(cka.cka_distance_to_kernel)
to_aggregate = _jit(cka.cka_distance_to_aggregate)


def rbf_cka(x, y, sigma_frac=0.5, centered=True):
  return _rbf_cka(x, y, sigma_frac, centered=centered)


# Value and gradient with respect to the representation(s), shared by the gradient and zero tests.
linear_cka_vg = jax.jit(jax.value_and_grad(cka.linear_cka, argnums=(0, 1)))
rbf_cka_vg = jax.jit(jax.value_and_grad(cka.rbf_cka))
to_kernel_vg = jax.jit(jax.value_and_grad(cka.cka_distance_to_kernel))
to_aggregate_vg = jax.jit(jax.value_and_grad(cka.cka_distance_to_aggregate))


@pytest.fixture(autouse=True)
def _float64():
  """Tests run with x64 on, so jnp arrays (and the library's outputs) are float64."""
  with jax.enable_x64(True):
    yield


def _data(rng, *shape):
  """Gaussian data with a non-zero mean and unequal column scales (so centring matters)."""
  return rng.normal(size=shape) * rng.uniform(0.5, 2.0, shape[-1]) + rng.normal(size=shape[-1])


def _cohorts(rng, length, spec):
  """Groups [J_g, L, d_g] and positive weights [J_g] for spec = ((J_g, d_g), ...)."""
  return ([_data(rng, j, length, d) for j, d in spec],
          [rng.uniform(0.1, 1.0, j) for j, _ in spec])


# ----------------------------------------------------------------- numpy float64 reference (L x L)

def np_hsic(k, m, centered=True):
  """tr(K H M H) with H = I - 11ᵀ/L (tr(K M) uncentred)."""
  if centered:
    h = np.eye(len(k)) - 1.0 / len(k)
    k, m = h @ k @ h, h @ m @ h
  return np.trace(k @ m)


def np_cka(k, m, centered=True, eps=1e-12):
  return np_hsic(k, m, centered) / np.sqrt(
      np_hsic(k, k, centered) * np_hsic(m, m, centered) + eps)


def np_rbf(x, sigma_frac=0.5, include_diagonal=True):
  """Kornblith's gram_rbf: sigma² = sigma_frac² · np.median of the squared distances."""
  sq = np.sum((x[:, None, :] - x[None, :, :]) ** 2, axis=-1)
  med = np.median(sq if include_diagonal else sq[~np.eye(len(x), dtype=bool)])
  return np.exp(-sq / (2 * sigma_frac ** 2 * med))


def np_aggregate(others, weights):
  """Σ_j w_j A_j A_jᵀ [L, L]."""
  return sum(np.einsum('j,jlp,jmp->lm', w, g, g) for g, w in zip(others, weights))


# --------------------------------------------------------------------------- against the reference

@pytest.mark.parametrize('centered', [True, False])
def test_linear_and_rbf_cka_match_the_kernel_reference(centered):
  rng = np.random.default_rng(centered)
  for d1, d2 in PAIRS:
    x, y = _data(rng, L, d1), _data(rng, L, d2)
    got = float(linear_cka(x, y, centered=centered))
    assert got == pytest.approx(np_cka(x @ x.T, y @ y.T, centered), rel=RTOL)
    assert 0.0 < got < 1.0
    if d1 == PAIRS[0][0]:   # once: it compiles slowly (d > L for RBF: the invariance test)
      frac = 0.5 if centered else 0.8   # the default and another bandwidth
      got = float(rbf_cka(x, y, sigma_frac=frac, centered=centered))
      assert got == pytest.approx(np_cka(np_rbf(x, frac), np_rbf(y, frac), centered), rel=RTOL)
      assert 0.0 < got < 1.0


@pytest.mark.parametrize('length', [36, L])   # L² even (two middle entries averaged) and odd
def test_rbf_median_includes_the_diagonal(length):
  """The bandwidth is Kornblith's: np.median over the full matrix, its zero diagonal included; the
  median over the off-diagonal pairs alone gives a measurably different value."""
  rng = np.random.default_rng(length)
  x, y = _data(rng, length, 11), _data(rng, length, 5)
  got = float(rbf_cka(x, y))
  assert got == pytest.approx(np_cka(np_rbf(x), np_rbf(y)), rel=RTOL)
  off = np_cka(np_rbf(x, include_diagonal=False), np_rbf(y, include_diagonal=False))
  assert abs(got - off) > 1e-3   # ~1e-2 here: 1e7 x RTOL


@pytest.mark.parametrize('centered', [True, False])
def test_aggregate_forms_match_the_kernel_reference(centered):
  rng = np.random.default_rng(10 + centered)
  others, weights = _cohorts(rng, L, SPEC)
  kbar = np_aggregate(others, weights)
  np.testing.assert_allclose(aggregate_kernel(others, weights), kbar,
                             rtol=RTOL, atol=RTOL * np.abs(kbar).max())
  a = _data(rng, L, 11)
  want = 1.0 - np_cka(a @ a.T, kbar, centered)
  assert float(to_kernel(a, kbar, centered=centered)) == pytest.approx(want, rel=RTOL)
  assert float(to_aggregate(a, others, weights, centered=centered)) == pytest.approx(want, rel=RTOL)


# ------------------------------------------------------------------------------------- properties

@pytest.mark.parametrize('fn,d', [(linear_cka, 11), (linear_cka, 64), (rbf_cka, 64)],
                         ids=['linear-11', 'linear-64', 'rbf-64'])
def test_cka_identity_invariances_and_symmetry(fn, d):
  rng = np.random.default_rng(d)
  x, y = _data(rng, L, d), _data(rng, L, d)
  q, _ = np.linalg.qr(rng.normal(size=(d, d)))
  base = float(fn(x, y))
  assert 0.0 < base < 1.0
  np_kernel = np_rbf if fn is rbf_cka else lambda z: z @ z.T
  assert base == pytest.approx(np_cka(np_kernel(x), np_kernel(y)), rel=RTOL)
  assert float(fn(x, x)) == pytest.approx(1.0, rel=RTOL)
  assert float(fn(y, x)) == pytest.approx(base, rel=RTOL)
  for moved in (x @ q, 7.5 * x, 0.01 * x, x + 3.0):   # rotation, isotropic scalings, shift
    assert float(fn(moved, y)) == pytest.approx(base, rel=RTOL)
  assert float(fn(x, -4.0 * y @ q)) == pytest.approx(base, rel=RTOL)
  stretched = x * np.logspace(-1.5, 1.5, d)   # anisotropic: CKA is not invariant to it
  assert abs(float(fn(stretched, y)) - base) > MISS
  # A noisy copy: close to 1, but not 1.
  near = float(fn(x, x + 0.05 * rng.normal(size=x.shape)))
  assert 0.9 < near < 1.0 - 1e3 * RTOL


def test_uncentred_formula_differs_from_centred_on_shifted_data():
  """centered=False is <x xᵀ, y yᵀ> / (||x xᵀ|| ||y yᵀ||); a non-zero mean changes it, not CKA."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(L, 11)) + 2.0
  y = rng.normal(size=(L, 5)) - 1.0
  uncentred = float(linear_cka(x, y, centered=False))
  want = np.sum((x @ x.T) * (y @ y.T)) / np.sqrt(
      np.sum((x @ x.T) ** 2) * np.sum((y @ y.T) ** 2) + 1e-12)
  assert uncentred == pytest.approx(want, rel=RTOL)
  centred = float(linear_cka(x, y))
  assert abs(uncentred - centred) > MISS
  # Removing the means first makes the two agree.
  xc, yc = x - x.mean(0), y - y.mean(0)
  assert float(linear_cka(xc, yc, centered=False)) == pytest.approx(centred, rel=RTOL)


def test_zero_representation_is_finite_with_finite_gradient():
  """eps under the square root (and the RBF bandwidth's floor): CKA(0, ·) = 0 (distance 1) with
  zero, not NaN, gradients."""
  rng = np.random.default_rng(5)
  zero, y = np.zeros((L, 11)), _data(rng, L, 5)
  others, weights = _cohorts(rng, L, SPEC)
  kbar = np_aggregate(others, weights)
  for want, (value, grad) in ((0.0, linear_cka_vg(zero, y)), (0.0, rbf_cka_vg(zero, y)),
                              (1.0, to_kernel_vg(zero, kbar)),
                              (1.0, to_aggregate_vg(zero, others, weights))):
    # Exactly 0 / 1 in exact arithmetic; the centring sums leave float64 rounding (-1.1e-24 under
    # XLA:CPU's loop emitters), far under any CKA a representation carries.
    assert abs(float(value) - want) <= 1e-15
    for g in jax.tree_util.tree_leaves(grad):
      assert np.all(np.asarray(g) == 0.0)


def test_mismatched_groups_raise():
  a = np.zeros((L, 4))
  with pytest.raises(ValueError):
    cka.cka_distance_to_aggregate(a, [np.zeros((2, L, 3))], [np.ones(3)])
  with pytest.raises(ValueError):
    cka.cka_distance_to_aggregate(a, [np.zeros((2, L + 1, 3))], [np.ones(2)])
  with pytest.raises(ValueError):
    cka.aggregate_kernel([np.zeros((2, L, 3)), np.zeros((1, L - 1, 3))], [np.ones(2), np.ones(1)])


# ------------------------------------------------------------------------------ aggregate forms

@pytest.mark.parametrize('spec', [((4, 5),), SPEC], ids=['one-group', 'two-widths'])
def test_distance_to_aggregate_equals_kernel_forms(spec):
  rng = np.random.default_rng(len(spec))
  a = _data(rng, L, 11)
  others, weights = _cohorts(rng, L, spec)
  kbar = np_aggregate(others, weights)
  via_kernel = to_kernel(a, np.asarray(aggregate_kernel(others, weights)))
  got = float(to_aggregate(a, others, weights))
  assert got == pytest.approx(float(via_kernel), rel=RTOL)
  assert got == pytest.approx(1.0 - np_cka(a @ a.T, kbar), rel=RTOL)
  # On a mini-batch of the public set the kernel form takes the sub-block of K̄.
  idx = rng.choice(L, 16, replace=False)
  sub = to_kernel(a[idx], kbar[np.ix_(idx, idx)])
  assert float(sub) == pytest.approx(1.0 - np_cka(a[idx] @ a[idx].T, kbar[np.ix_(idx, idx)]),
                                     rel=RTOL)
  # Scaling all weights leaves CKA unchanged; re-weighting one client does not.
  scaled = to_aggregate(a, others, [2.5 * w for w in weights])
  assert float(scaled) == pytest.approx(got, rel=RTOL)
  tilted = [w.copy() for w in weights]
  tilted[0][0] *= 30.0
  assert abs(float(to_aggregate(a, others, tilted)) - got) > MISS


def test_zero_weight_client_has_no_effect():
  rng = np.random.default_rng(11)
  a = _data(rng, L, 11)
  others, weights = _cohorts(rng, L, SPEC)
  weights[0][1] = 0.0
  weights[1][0] = 0.0
  base = float(to_aggregate(a, others, weights))
  assert base == pytest.approx(1.0 - np_cka(a @ a.T, np_aggregate(others, weights)), rel=RTOL)
  moved = [g.copy() for g in others]
  moved[0][1] = 10.0 * _data(rng, L, 5)
  moved[1][0] = -3.0 * _data(rng, L, 64)
  # The zero-weight terms are exact zeros, so the value does not move at all.
  assert float(to_aggregate(a, moved, weights)) == base
  # Moving a client with a non-zero weight does move it.
  moved[0][0] = _data(rng, L, 5) ** 3
  assert abs(float(to_aggregate(a, moved, weights)) - base) > MISS


# ---------------------------------------------------------------------------------- gradients

def _directional_check(value_and_grad, args, argnum, rng, name):
  """<∇f, v> against the central difference (f(x + h v) - f(x - h v)) / 2h for random unit v.

  h = 1e-5: the truncation error h² |f'''| / 6 ~ 2e-11 and the rounding error ~eps |f| / h ~ 2e-11
  for O(1) values and unit directions, so the two agree to ~1e-10 ||∇f||; 1e-7 ||∇f|| leaves a
  1000x margin, while a wrong gradient (a missing term) is off by O(||∇f||) in almost every
  direction.
  """
  h = 1e-5
  grad = value_and_grad(*args)[1]
  grad = np.asarray(grad[argnum] if isinstance(grad, tuple) else grad)
  norm = np.linalg.norm(grad)
  assert norm > 1e-3, name
  x = np.asarray(args[argnum])
  for _ in range(6):
    v = rng.normal(size=x.shape)
    v /= np.linalg.norm(v)
    plus, minus = list(args), list(args)
    plus[argnum], minus[argnum] = x + h * v, x - h * v
    fd = (float(value_and_grad(*plus)[0]) - float(value_and_grad(*minus)[0])) / (2 * h)
    assert abs(fd - np.sum(grad * v)) <= 1e-7 * norm, name


def test_gradients_match_central_differences():
  rng = np.random.default_rng(17)
  a, y = _data(rng, L, 11), _data(rng, L, 5)
  others, weights = _cohorts(rng, L, SPEC)
  kbar = np_aggregate(others, weights)
  _directional_check(linear_cka_vg, (a, y), 0, rng, 'linear_cka, x')
  _directional_check(linear_cka_vg, (a, y), 1, rng, 'linear_cka, y')
  _directional_check(to_kernel_vg, (a, kbar), 0, rng, 'cka_distance_to_kernel')
  _directional_check(to_aggregate_vg, (a, others, weights), 0, rng, 'cka_distance_to_aggregate')


# ------------------------------------------------------------------------------- float32 under jit

U32 = 2.0 ** -24   # unit roundoff of float32


def _gamma(n):
  return n * U32 / (1 - n * U32)


def _hsic_and_error(terms, length):
  """S = Σ w ||u_cᵀ v_c||_F² over terms (w >= 0, u [L, p], v [L, q]) and a bound on |Ŝ - S| for
  the library's float32 computation.

  Centring u_c = u - mean(u) in float32 is off by <= gamma_{L+2} e_u entrywise, e_u = |u_c| +
  mean|u| (the mean: L terms summed and scaled; the subtraction). An inner product of length L over
  the perturbed columns adds gamma_L, so every entry of G = u_cᵀ v_c is off by <= gamma_{3L+4} F,
  F = e_uᵀ e_v (to first order; Higham, Accuracy and Stability of Numerical Algorithms, Ch. 3),
  whatever the order of the sums and whether or not they use FMA. The squares then change the sum by
  <= D = Σ w (2 |G| gamma F + (gamma F)²). The outer sum has n non-negative terms (each with a
  square and at most two weight products): within gamma_{n+4} of its value in any order.
  """
  g3 = _gamma(3 * length + 4)
  s = d = 0.0
  n = 0
  for w, u, v in terms:
    uc, vc = u - u.mean(0), v - v.mean(0)
    g = uc.T @ vc
    f = (np.abs(uc) + np.abs(u).mean(0)).T @ (np.abs(vc) + np.abs(v).mean(0))
    s += w * np.sum(g ** 2)
    d += w * np.sum(2 * np.abs(g) * g3 * f + (g3 * f) ** 2)
    n += g.size
  return s, _gamma(n + 4) * (s + d) + d


def _cka_and_tol(cross, kk, mm, length):
  """CKA from the three (terms) lists and its float32 tolerance: first order, the relative errors of
  the numerator and half those of the two factors under the square root, plus the product, eps,
  sqrt, division and a final 1 - x (5 roundings)."""
  (s_km, e_km), (s_kk, e_kk), (s_mm, e_mm) = (_hsic_and_error(t, length) for t in (cross, kk, mm))
  value = s_km / np.sqrt(s_kk * s_mm + 1e-12)
  return value, value * (e_km / s_km + 0.5 * e_kk / s_kk + 0.5 * e_mm / s_mm) + 5 * U32


def test_float32_jit_within_the_rounding_bound():
  """float32 under jit (x64 off, as in training) against float64 on the same float32 inputs, to the
  worst-case bound of `_hsic_and_error` / `_cka_and_tol` (evaluated on the data). The bound is
  asserted to be small, so the comparison is not vacuous; the realised error is far below it."""
  rng = np.random.default_rng(23)
  a = _data(rng, L, 16).astype(np.float32)
  y = _data(rng, L, 11).astype(np.float32)
  others, weights = _cohorts(rng, L, ((3, 5), (2, 16)))
  others = [g.astype(np.float32) for g in others]
  weights = [w.astype(np.float32) for w in weights]
  with jax.enable_x64(False):
    lin = jax.jit(cka.linear_cka)(a, y)
    agg = jax.jit(cka.cka_distance_to_aggregate)(a, others, weights)
    assert lin.dtype == jnp.float32 and agg.dtype == jnp.float32

  a64, y64 = a.astype(np.float64), y.astype(np.float64)
  clients = [(float(w), g.astype(np.float64))
             for gs, ws in zip(others, weights) for g, w in zip(gs, ws)]
  lin_want, lin_tol = _cka_and_tol([(1.0, y64, a64)], [(1.0, a64, a64)], [(1.0, y64, y64)], L)
  assert lin_want == pytest.approx(np_cka(a64 @ a64.T, y64 @ y64.T), rel=RTOL)
  pairs = [(wj * wk, gj, gk) for wj, gj in clients for wk, gk in clients]
  agg_cka, agg_tol = _cka_and_tol([(w, g, a64) for w, g in clients], [(1.0, a64, a64)], pairs, L)
  kbar = np_aggregate([g.astype(np.float64) for g in others],
                      [w.astype(np.float64) for w in weights])
  assert agg_cka == pytest.approx(np_cka(a64 @ a64.T, kbar), rel=RTOL)

  assert max(lin_tol, agg_tol) < 1e-3   # tight enough to catch a computation in a lower precision
  assert abs(float(lin) - lin_want) <= lin_tol
  assert abs(float(agg) - (1.0 - agg_cka)) <= agg_tol


def test_aggregate_at_paper_scale_builds_no_l_by_l_buffer():
  """L = 5000 RAD points, 5 clients of width 2048 (the paper's setting), compiled abstractly (no
  compute): no [L, L] buffer in the program, and its scratch memory (measured 807 MiB on XLA:CPU) is set
  by the pairwise Grams, not by L."""
  a = jax.ShapeDtypeStruct((5000, 2048), jnp.float32)
  others = (jax.ShapeDtypeStruct((5, 5000, 2048), jnp.float32),)
  weights = (jax.ShapeDtypeStruct((5,), jnp.float32),)
  compiled = jax.jit(cka.cka_distance_to_aggregate).lower(a, others, weights).compile()
  assert '5000,5000' not in compiled.as_text()
  # Scratch = a few copies of the 5 x 5 x 2048 x 2048 float32 pairwise Grams (420 MB each), which do
  # not grow with L; an L² buffer at L = 5000 would add 100 MB per copy.
  assert compiled.memory_analysis().temp_size_in_bytes < 3 * 5 * 5 * 2048 * 2048 * 4
