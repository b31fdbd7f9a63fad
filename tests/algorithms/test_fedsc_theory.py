"""FedSC's theory (Jing et al., ICML 2024) checked numerically in float64.

The paper's statements about the spectral contrastive (SC) loss are identities between finite
averages once every expectation is a finite one. The toy below makes them so: an encoder
z(a; θ) = tanh(W a + b), a handful of data points x̄ per client, and K equally likely augmentations
x̄ + o_k of every point. Then

  L(θ; D) = ½ E_{x,x⁻~A(·|D)}[(z(x)ᵀz(x⁻))²] − E_{x̄~D} E_{x,x⁺~A(·|x̄)}[z(x)ᵀz(x⁺)]

is a double loop over all (point, augmentation) pairs, and the statements (Eq. 1, 3, 4, 6) must hold
to float64 rounding. The library enters through the pair enumeration: listing every ordered pair
(k, k') of augmentations of every point (k = k' included, x and x⁺ are i.i.d.) as a row of (z0, z1)
makes `multiview_correlations` return the population matrices (E R(x̄), E R⁺(x̄)) and
`spectral_contrastive_loss` return exactly 2 L (the code's scale).

The remaining tests check the batch estimators (Eq. 33), the code/paper loss scales, NormClip,
DP-CalR's sensitivity and the server's bookkeeping (Alg. 1) against numpy loops. Every identity is
paired with a perturbed version (a wrong constant, a dropped normaliser, ...) that must miss by a
clear margin, so a test cannot pass because its comparison is vacuous.

Lemma B.7 of the paper is false as stated and nothing here relies on it.
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.ops import correlation
from fedjax_ssl.ssl import losses

EPS = np.finfo(np.float64).eps
# Elementwise results (a clip, a rescale, one product) are a few roundings away from the reference.
TIGHT = 64 * EPS
# Sums of up to ~1e3 products of O(1) numbers, taken in a different order by numpy loops and by XLA:
# the rounding error is at most ~1e3 x eps ~ 2e-13 of the largest term; 1e-10 leaves 500x headroom
# (for other ISAs / FMA contraction) and is 1e8 x below the smallest perturbation margin, MISS.
RTOL = 1e-10
# A perturbed formula must miss by at least 1% (relative): far outside rounding.
MISS = 1e-2


@pytest.fixture(autouse=True)
def _float64():
  """Every test runs with x64 on, so jnp arrays (and the library's outputs) are float64."""
  with jax.enable_x64(True):
    yield


def rel_err(got, want):
  """Max-norm error relative to the max-norm of the reference (scale-aware, one number)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def flat(tree):
  """The encoder-gradient pytree {'w', 'b'} as one float64 vector."""
  return np.concatenate([np.asarray(tree['w'], np.float64).ravel(),
                         np.asarray(tree['b'], np.float64).ravel()])


# ----------------------------------------------------------------------------- the exact toy
D_IN, H, K = 3, 3, 3                  # input dim, representation dim, augmentations per point
_rng = np.random.default_rng(20240721)
THETA = {'w': 0.8 * _rng.normal(size=(H, D_IN)), 'b': 0.3 * _rng.normal(size=H)}
OFFSETS = 0.5 * _rng.normal(size=(K, D_IN))     # augmentation k of x̄ is x̄ + OFFSETS[k]
CLIENT_SIZES = (2, 3, 5)                         # unequal |D_j|
# Different centres and spreads make the clients' R_j differ (non-iid), so the gap of Eq. (3) and the
# FedAvg-vs-FedSC gradient difference are far from zero.
_CENTRES = np.array([[-1.0, 0.0, 0.5], [1.0, 1.0, -0.5], [0.0, -1.5, 1.0]])
_SPREADS = (0.5, 1.0, 0.7)
CLIENTS = tuple(c + s * _rng.normal(size=(n, D_IN))
                for c, s, n in zip(_CENTRES, _SPREADS, CLIENT_SIZES))
CLIENT_Q = np.array(CLIENT_SIZES, np.float64) / sum(CLIENT_SIZES)   # q_j = |D_j| / |D|
J = len(CLIENTS)
X_ALL = np.concatenate(CLIENTS)   # D: every point equally likely, i.e. client j drawn w.p. q_j


# numpy float64 references: explicit loops over points, augmentations and pairs.

def np_views(theta, x):
  """z(x̄_i + o_k) for every point i and augmentation k, [n, K, H], one sample at a time."""
  z = np.empty((len(x), K, H))
  for i, k in itertools.product(range(len(x)), range(K)):
    z[i, k] = np.tanh(theta['w'] @ (x[i] + OFFSETS[k]) + theta['b'])
  return z


def np_pairwise_loss(z):
  """The paper's SC loss by enumeration (paper scale) from z [n, K, H].

  x, x⁻ are independent draws from the marginal A(·|D) (all n·K views, same-point pairs included);
  x, x⁺ are i.i.d. augmentations of the same point (k = k' included).
  """
  n = len(z)
  views = z.reshape(n * K, H)
  neg = sum((u @ v) ** 2 for u in views for v in views) / (n * K) ** 2
  pos = sum(z[i, a] @ z[i, c] for i in range(n) for a in range(K) for c in range(K)) / (n * K * K)
  return 0.5 * neg - pos


def np_pop_matrices(z):
  """(E_x̄ R(x̄), E_x̄ R⁺(x̄)) from z [n, K, H] by sums of outer products, and the per-point R(x̄)."""
  n = len(z)
  r_point = np.array([sum(np.outer(z[i, a], z[i, a]) for a in range(K)) / K for i in range(n)])
  r_plus = sum(np.outer(z[i, a], z[i, c])
               for i in range(n) for a in range(K) for c in range(K)) / (n * K * K)
  return r_point.mean(0), r_plus, r_point


def np_pairwise_grad(theta, x):
  """Analytic ∇_θ of `np_pairwise_loss(np_views(theta, x))`, in loops.

  With N = nK views: ∂/∂z_x of ½ N⁻² Σ_{x,x'} (z_xᵀz_x')² is 2 N⁻² Σ_x' (z_xᵀz_x') z_x' (z_x sits in
  both slots of the ordered pairs), and ∂/∂z_{ik} of the positive term is −2/(nK²) Σ_k' z_{ik'};
  then z = tanh(u) gives ∂u = ∂z ⊙ (1 − z²) and u = W a + b gives ∂W = Σ ∂u aᵀ, ∂b = Σ ∂u.
  """
  z = np_views(theta, x)
  n = len(x)
  views = z.reshape(n * K, H)
  gw, gb = np.zeros_like(theta['w']), np.zeros_like(theta['b'])
  for i, a in itertools.product(range(n), range(K)):
    gz = 2.0 / (n * K) ** 2 * sum((z[i, a] @ v) * v for v in views)
    gz = gz - 2.0 / (n * K * K) * sum(z[i, c] for c in range(K))
    gu = gz * (1.0 - z[i, a] ** 2)
    gw += np.outer(gu, x[i] + OFFSETS[a])
    gb += gu
  return {'w': gw, 'b': gb}


def np_leave_one_out(rs, q, j):
  """R_{-j} = Σ_{k≠j} q_k R_k / (1 − q_j), as a loop."""
  return sum(q[k] * rs[k] for k in range(len(rs)) if k != j) / (1.0 - q[j])


# jax: the library route (pair enumeration) and a direct route (einsum formulas, no library).

def pair_views(theta, x):
  """Both members of every ordered augmentation pair: zs [2K², n, H], view p pairs with p + K².

  Pair p = k·K + k' has first member x̄ + o_k and second x̄ + o_k' (k = k' included), so the batch
  estimators of `multiview_correlations` over these 2K² views are the population matrices.
  """
  first = jnp.asarray(x)[None] + jnp.asarray(OFFSETS)[:, None]          # [K, n, d]
  a = jnp.concatenate([jnp.repeat(first, K, axis=0), jnp.tile(first, (K, 1, 1))])
  return jnp.tanh(a @ theta['w'].T + theta['b'])


def _split(zs):
  """[2V, n, H] -> (z0, z1), each [V·n, H]: row-aligned first and second members of the pairs."""
  v = zs.shape[0] // 2
  return zs[:v].reshape(-1, H), zs[v:].reshape(-1, H)


def _lib_matrices(theta, x):
  """(E R, E R⁺) of a data set through `multiview_correlations` on the pair-enumerated views."""
  return correlation.multiview_correlations(pair_views(theta, x))


def _lib_global_loss(theta, x):
  """L(θ; D) through the library: the code loss is 2 x the paper loss."""
  return losses.spectral_contrastive_loss(*_split(pair_views(theta, x))) / 2


def _lib_local_losses(theta, clients):
  """[L_j(θ; R̄_{-j})]_j as ½ x the code's FedSC local loss (alpha = q_j, r_global = R̄_{-j}).

  R̄_{-j} is built by the server helpers (weighted_sum, leave_one_out) from the same θ on purpose:
  the loss stops its gradient, which is what makes it the constant "held at R_{-j}(θ)" of Eq. (6).
  """
  q = jnp.asarray(CLIENT_Q)
  zs = [pair_views(theta, x) for x in clients]
  rs = jnp.stack([correlation.multiview_correlations(z)[0] for z in zs])
  total = correlation.weighted_sum(rs, q)
  return [losses.spectral_contrastive_loss(
      *_split(z), alpha=q[j], r_global=correlation.leave_one_out(total, rs[j], q[j])) / 2
          for j, z in enumerate(zs)]


def _lib_eq4(theta, clients):
  """Eq. (4)'s right-hand side assembled from library estimators and server helpers."""
  q = jnp.asarray(CLIENT_Q)
  mats = [_lib_matrices(theta, x) for x in clients]
  rs = jnp.stack([r for r, _ in mats])
  total = correlation.weighted_sum(rs, q)
  return sum(q[j] * (-jnp.trace(r_plus) + 0.5 * q[j] * jnp.sum(r * r) + 0.5 * (1 - q[j])
                     * jnp.trace(r @ correlation.leave_one_out(total, r, q[j])))
             for j, (r, r_plus) in enumerate(mats))


@jax.jit
def toy_library_values(theta):
  """Everything T1–T4 read from the library on the toy, in one compiled program."""
  return {'matrices': _lib_matrices(theta, X_ALL),
          'client_matrices': [_lib_matrices(theta, x) for x in CLIENTS],
          'global_loss': _lib_global_loss(theta, X_ALL),
          'client_losses': [_lib_global_loss(theta, x) for x in CLIENTS],
          'local_losses': _lib_local_losses(theta, CLIENTS),
          'eq4': _lib_eq4(theta, CLIENTS)}


def _jnp_matrices(theta, x):
  """(R, R⁺) by einsum, independent of the library: R⁺(x̄) = m mᵀ with m = E_k z(x̄ + o_k)."""
  z = jnp.tanh((jnp.asarray(x)[:, None] + jnp.asarray(OFFSETS)[None]) @ theta['w'].T + theta['b'])
  n = z.shape[0]
  m = jnp.mean(z, axis=1)
  return jnp.einsum('nkh,nkg->hg', z, z) / (n * K), m.T @ m / n


def _direct_weighted_local_sum(theta, clients, third):
  """Σ_j q_j (−Tr R⁺_j + ½ q_j ‖R_j‖² + third·(1 − q_j) Tr{R_j sg(R_{-j})}).

  third = 1 is Eq. (6); third = ½ keeps the ½ of Eq. (4) (a wrong local objective).
  """
  mats = [_jnp_matrices(theta, x) for x in clients]
  held = [jax.lax.stop_gradient(r) for r, _ in mats]
  out = 0.0
  for j, (r, r_plus) in enumerate(mats):
    r_minus = sum(CLIENT_Q[k] * held[k] for k in range(J) if k != j) / (1.0 - CLIENT_Q[j])
    out += CLIENT_Q[j] * (-jnp.trace(r_plus) + 0.5 * CLIENT_Q[j] * jnp.sum(r * r)
                          + third * (1.0 - CLIENT_Q[j]) * jnp.trace(r @ r_minus))
  return out


def _direct_fedavg_sum(theta, clients):
  """Σ_j q_j L(θ; D_j): each client's own SC loss, no shared matrix (FedAvg + SC)."""
  out = 0.0
  for j, x in enumerate(clients):
    r, r_plus = _jnp_matrices(theta, x)
    out += CLIENT_Q[j] * (-jnp.trace(r_plus) + 0.5 * jnp.sum(r * r))
  return out


@jax.jit
def toy_gradients(theta):
  """∇_θ of the global loss and of the three weighted local-objective sums, one compiled program.

  The weighted local sums are differentiated as sums: the gradient is linear, so ∇ Σ_j q_j L_j is
  Σ_j q_j ∇ L_j, the right-hand side of Eq. (6).
  """
  # The direct objective is affine in `third`; both values share one vmapped gradient graph.
  direct = jax.vmap(jax.grad(_direct_weighted_local_sum), in_axes=(None, None, 0))(
      theta, CLIENTS, jnp.array([1.0, 0.5]))
  return {'global': jax.grad(_lib_global_loss)(theta, X_ALL),
          'library': jax.grad(lambda th: sum(q * l for q, l in zip(
              CLIENT_Q, _lib_local_losses(th, CLIENTS))))(theta),
          'direct': jax.tree_util.tree_map(lambda g: g[0], direct),
          'half': jax.tree_util.tree_map(lambda g: g[1], direct),
          'fedavg': jax.grad(_direct_fedavg_sum)(theta, CLIENTS)}


# ----------------------------------------------------------------------------- T1: Eq. (1)

def test_eq1_pairwise_sc_loss_equals_trace_and_frobenius_form_exactly():
  z = np_views(THETA, X_ALL)
  pairwise = np_pairwise_loss(z)
  r, r_plus, r_point = np_pop_matrices(z)
  eq1 = -np.trace(r_plus) + 0.5 * np.sum(r ** 2)
  assert rel_err(eq1, pairwise) <= RTOL
  # The library's pair-enumerated estimators are the population matrices, and its loss is 2 L.
  lib = toy_library_values(THETA)
  r_lib, r_plus_lib = lib['matrices']
  assert r_lib.dtype == jnp.float64
  assert rel_err(r_lib, r) <= RTOL and rel_err(r_plus_lib, r_plus) <= RTOL
  assert rel_err(lib['global_loss'], pairwise) <= RTOL
  # Negative checks, each a plausible misreading of Eq. (1):
  #  * ‖E R‖² without the ½;
  assert rel_err(-np.trace(r_plus) + np.sum(r ** 2), pairwise) > 0.5
  #  * the square inside the expectation, ½ E_x̄ ‖R(x̄)‖² (Jensen: only equal if all R(x̄) agree);
  jensen = -np.trace(r_plus) + 0.5 * np.mean(np.sum(r_point ** 2, axis=(1, 2)))
  assert rel_err(jensen, pairwise) > 0.5
  #  * x⁺ a *different* augmentation than x (k ≠ k'), i.e. not i.i.d. draws.
  r_plus_distinct = sum(np.outer(z[i, a], z[i, c]) for i in range(len(z))
                        for a in range(K) for c in range(K) if a != c) / (len(z) * K * (K - 1))
  assert rel_err(-np.trace(r_plus_distinct) + 0.5 * np.sum(r ** 2), pairwise) > 0.02


# ----------------------------------------------------------------------------- T2: Eq. (4)

def test_eq4_global_loss_decomposes_over_clients_with_leave_one_out_matrices():
  pairwise = np_pairwise_loss(np_views(THETA, X_ALL))
  mats = [np_pop_matrices(np_views(THETA, x))[:2] for x in CLIENTS]
  rs = [r for r, _ in mats]
  q = CLIENT_Q

  def eq4(third_coef=0.5, normalise=True):
    total = 0.0
    for j, (r, r_plus) in enumerate(mats):
      r_minus = np_leave_one_out(rs, q, j) * (1.0 if normalise else 1.0 - q[j])
      total += q[j] * (-np.trace(r_plus) + 0.5 * q[j] * np.sum(r ** 2)
                       + third_coef * (1 - q[j]) * np.trace(r @ r_minus))
    return total

  assert rel_err(eq4(), pairwise) <= RTOL
  # The same sum assembled from the library: per-client estimators, weighted_sum, leave_one_out.
  lib = toy_library_values(THETA)
  for (r_lib, r_plus_lib), (r, r_plus) in zip(lib['client_matrices'], mats):
    assert rel_err(r_lib, r) <= RTOL and rel_err(r_plus_lib, r_plus) <= RTOL
  assert rel_err(lib['eq4'], pairwise) <= RTOL
  # Negative checks: dropping the 1/(1 − q_j) of R_{-j}, or the ½ on the cross term.
  assert rel_err(eq4(normalise=False), pairwise) > 0.05
  assert rel_err(eq4(third_coef=1.0), pairwise) > 0.05


# ----------------------------------------------------------------------------- T3: Eq. (6)

def test_eq6_weighted_local_gradients_equal_the_global_gradient():
  g_np = flat(np_pairwise_grad(THETA, X_ALL))
  grads = {k: flat(v) for k, v in toy_gradients(THETA).items()}
  # Anchor: jax.grad of the library's global loss is the analytic gradient of the pairwise form.
  assert rel_err(grads['global'], g_np) <= RTOL
  # Eq. (6) through the library (code loss with alpha = q_j and r_global = R_{-j}) ...
  assert rel_err(grads['library'], g_np) <= RTOL
  # ... and through the paper's formula written directly (stop-gradient on R_{-j}).
  assert rel_err(grads['direct'], g_np) <= RTOL
  # Negative: keeping the ½ of Eq. (4) on the cross term is not the gradient of the global loss.
  assert rel_err(grads['half'], g_np) > 0.1
  # Negative: FedAvg + SC (each client's own loss, no shared matrix) misses by ∇ of Eq. (3)'s gap.
  assert rel_err(grads['fedavg'], g_np) > 0.1


def test_eq6_code_local_loss_is_twice_the_paper_local_objective():
  """The local objective's value on the toy, through `spectral_contrastive_loss` (alpha = q_j)."""
  mats = [np_pop_matrices(np_views(THETA, x))[:2] for x in CLIENTS]
  rs = [r for r, _ in mats]
  local = toy_library_values(THETA)['local_losses']
  for j, (r, r_plus) in enumerate(mats):
    r_minus = np_leave_one_out(rs, CLIENT_Q, j)
    want = (-np.trace(r_plus) + 0.5 * CLIENT_Q[j] * np.sum(r ** 2)
            + (1 - CLIENT_Q[j]) * np.trace(r @ r_minus))
    got = local[j]
    assert rel_err(got, want) <= RTOL
    # Negative: the ½ of Eq. (4) on the cross term is a different number.
    half = want - 0.5 * (1 - CLIENT_Q[j]) * np.trace(r @ r_minus)
    assert rel_err(got, half) > 0.05


# ----------------------------------------------------------------------------- T4: Eq. (3)

def test_eq3_global_loss_is_weighted_local_losses_minus_heterogeneity_gap():
  global_loss = np_pairwise_loss(np_views(THETA, X_ALL))
  local = [np_pairwise_loss(np_views(THETA, x)) for x in CLIENTS]
  rs = [np_pop_matrices(np_views(THETA, x))[0] for x in CLIENTS]
  r_bar = sum(q * r for q, r in zip(CLIENT_Q, rs))
  gap = 0.5 * sum(q * np.sum((r - r_bar) ** 2) for q, r in zip(CLIENT_Q, rs))
  weighted = sum(q * l for q, l in zip(CLIENT_Q, local))
  assert rel_err(weighted - gap, global_loss) <= RTOL
  # Each L(θ; D_j) through the library as well.
  for got, l in zip(toy_library_values(THETA)['client_losses'], local):
    assert rel_err(got, l) <= RTOL
  # Non-iid clients: the gap is strictly positive and not negligible, so the identity is not
  # "Σ q_j L_j = L" in disguise; a flipped sign or a missing ½ misses.
  assert gap > 0.05 * abs(global_loss)
  assert rel_err(weighted, global_loss) > 0.05
  assert rel_err(weighted + gap, global_loss) > 0.05
  assert rel_err(weighted - 2 * gap, global_loss) > 0.05


def test_eq3_gap_vanishes_when_clients_hold_identical_data():
  # Clients of sizes 2, 4, 6 holding 1, 2, 3 copies of the same two points: equal distributions
  # but unequal q_j, so the union is the same distribution as every client.
  base = CLIENTS[0]
  clients = [np.concatenate([base] * c) for c in (1, 2, 3)]
  q = np.array([len(c) for c in clients], np.float64) / sum(len(c) for c in clients)
  global_loss = np_pairwise_loss(np_views(THETA, np.concatenate(clients)))
  local = [np_pairwise_loss(np_views(THETA, x)) for x in clients]
  rs = [np_pop_matrices(np_views(THETA, x))[0] for x in clients]
  r_bar = sum(qj * r for qj, r in zip(q, rs))
  gap = 0.5 * sum(qj * np.sum((r - r_bar) ** 2) for qj, r in zip(q, rs))
  # The R_j differ only by rounding, so the gap is a square of rounding errors.
  assert gap <= (RTOL * np.max(np.abs(r_bar))) ** 2
  assert rel_err(sum(qj * l for qj, l in zip(q, local)), global_loss) <= RTOL


# ----------------------------------------------------------------------------- T6: Eq. (33)

def test_multiview_trace_of_r_plus_is_eq33_and_matrices_match_loops():
  rng = np.random.default_rng(6)
  v, b = 2, 5
  zs = rng.normal(size=(2 * v, b, H))
  r_hat, r_plus = correlation.multiview_correlations(jnp.asarray(zs))
  assert r_hat.dtype == jnp.float64
  eq33 = sum(zs[i, n] @ zs[i + v, n] for n in range(b) for i in range(v)) / (b * v)
  assert rel_err(np.trace(r_plus), eq33) <= RTOL
  # Entrywise definitions, one scalar product at a time.
  want_r, want_rp = np.zeros((H, H)), np.zeros((H, H))
  for h, g in itertools.product(range(H), range(H)):
    want_r[h, g] = sum(zs[i, n, h] * zs[i, n, g] for i in range(2 * v) for n in range(b))
    want_rp[h, g] = sum(zs[i, n, h] * zs[i + v, n, g] + zs[i + v, n, h] * zs[i, n, g]
                        for i in range(v) for n in range(b))
  assert rel_err(r_hat, want_r / (2 * b * v)) <= RTOL
  assert rel_err(r_plus, want_rp / (2 * b * v)) <= RTOL
  # Negative: pairing view v with v + 1 (instead of v + V) is not Eq. (33).
  wrong_pairs = sum(zs[2 * i, n] @ zs[2 * i + 1, n] for n in range(b) for i in range(v)) / (b * v)
  assert rel_err(np.trace(r_plus), wrong_pairs) > 0.1


def test_multiview_mask_equals_dropping_the_masked_rows():
  rng = np.random.default_rng(7)
  v, b = 2, 7
  zs = rng.normal(size=(2 * v, b, H))
  mask = np.array([True, False, True, True, False, True, True])
  zs[:, ~mask] = 1e3   # padding rows hold garbage; the mask must remove them entirely
  got = correlation.multiview_correlations(jnp.asarray(zs), jnp.asarray(mask))
  want = correlation.multiview_correlations(jnp.asarray(zs[:, mask]))
  real = zs[:, mask]
  eq33 = sum(real[i, n] @ real[i + v, n] for n in range(mask.sum()) for i in range(v))
  assert rel_err(np.trace(got[1]), eq33 / (mask.sum() * v)) <= RTOL
  for g, w in zip(got, want):
    assert rel_err(g, w) <= RTOL
  # Negative: normalising by all B = 7 rows instead of the 5 real ones.
  assert rel_err(np.trace(got[1]), eq33 / (b * v)) > 0.2


# ----------------------------------------------------------------------------- T7: loss scales

def np_paper_batch_loss(z0, z1, alpha, r_tilde, third=1.0):
  """−Tr R̂⁺ + ½ α ‖R̂‖² + third·(1 − α) Tr{R̂ R̃} with R̂, R̂⁺ as sums of outer products."""
  b = len(z0)
  r = sum(np.outer(z0[n], z0[n]) + np.outer(z1[n], z1[n]) for n in range(b)) / (2 * b)
  r_plus = sum(np.outer(z0[n], z1[n]) + np.outer(z1[n], z0[n]) for n in range(b)) / (2 * b)
  return -np.trace(r_plus) + 0.5 * alpha * np.sum(r ** 2) + third * (1 - alpha) * np.trace(r @ r_tilde)


_sc_loss = jax.jit(losses.spectral_contrastive_loss)
_sc_value_and_grad = jax.jit(jax.value_and_grad(losses.spectral_contrastive_loss, argnums=(0, 1)))


@pytest.mark.parametrize('alpha', [0.3, 0.75])
def test_code_loss_is_twice_the_paper_batch_loss(alpha):
  rng = np.random.default_rng(8)
  z0, z1 = rng.normal(size=(6, 4)), rng.normal(size=(6, 4))
  r_tilde = 0.5 * rng.normal(size=(4, 4))   # non-symmetric, as a DP-noised matrix is
  got = _sc_loss(jnp.asarray(z0), jnp.asarray(z1), alpha=alpha, r_global=jnp.asarray(r_tilde))
  paper = np_paper_batch_loss(z0, z1, alpha, r_tilde)
  assert rel_err(got, 2 * paper) <= RTOL
  # Without r_global the loss is the plain SC batch loss (alpha -> 1), again at 2x.
  assert rel_err(_sc_loss(jnp.asarray(z0), jnp.asarray(z1)),
                 2 * np_paper_batch_loss(z0, z1, 1.0, r_tilde)) <= RTOL
  # Negatives: the ½ of Eq. (4) kept on the cross term; the paper scale (1x) instead of 2x.
  assert rel_err(got, 2 * np_paper_batch_loss(z0, z1, alpha, r_tilde, third=0.5)) > MISS
  assert rel_err(got, paper) > 0.4


def test_alpha_one_reduces_fedsc_loss_to_fedavg_sc_loss():
  rng = np.random.default_rng(9)
  z0, z1 = jnp.asarray(rng.normal(size=(6, 4))), jnp.asarray(rng.normal(size=(6, 4)))
  r_tilde = jnp.asarray(rng.normal(size=(4, 4)))
  fedavg, g_fedavg = _sc_value_and_grad(z0, z1)
  fedsc, g_fedsc = _sc_value_and_grad(z0, z1, alpha=1.0, r_global=r_tilde)
  # 2(1 − alpha) is an exact 0 at alpha = 1: the shared matrix drops out of value and gradient.
  assert abs(float(fedsc - fedavg)) <= TIGHT * abs(float(fedavg))
  for a, b in zip(g_fedsc, g_fedavg):
    assert rel_err(a, b) <= TIGHT
  # Negative: alpha = 0.9 still sees the shared matrix.
  near, g_near = _sc_value_and_grad(z0, z1, alpha=0.9, r_global=r_tilde)
  assert rel_err(near, fedavg) > MISS
  assert rel_err(g_near[0], g_fedavg[0]) > 0.05


def test_code_loss_with_mask_equals_the_loss_on_the_real_rows():
  rng = np.random.default_rng(10)
  b, real = 8, np.array([True, True, False, True, True, False, True, False])
  z0, z1 = rng.normal(size=(b, 4)), rng.normal(size=(b, 4))
  z0[~real], z1[~real] = 1e3, -1e3       # garbage in the padding rows
  r_tilde = jnp.asarray(0.3 * rng.normal(size=(4, 4)))
  kw = dict(alpha=0.4, r_global=r_tilde, mu=2.0)   # every branch: shared matrix and NormClip
  value, grads = _sc_value_and_grad(jnp.asarray(z0), jnp.asarray(z1), mask=jnp.asarray(real), **kw)
  want, want_grads = _sc_value_and_grad(jnp.asarray(z0[real]), jnp.asarray(z1[real]), **kw)
  assert rel_err(value, want) <= RTOL
  for g, w in zip(grads, want_grads):
    assert rel_err(np.asarray(g)[real], w) <= RTOL
    assert np.all(np.asarray(g)[~real] == 0.0)   # padding rows get no gradient at all
  # Negative: zero padding without the mask counts B = 8 rows instead of 5.
  zero_pad = [np.where(real[:, None], z, 0.0) for z in (z0, z1)]
  assert rel_err(_sc_loss(*map(jnp.asarray, zero_pad), **kw), want) > 0.1


# ----------------------------------------------------------------------------- T8: NormClip

MU = 0.5            # mu < 1, so √mu > mu and a "norm <= mu" bound would be visibly wrong
SQRT_MU = np.sqrt(MU)
# Norms on both sides of √mu ≈ 0.7071, two of them within 2% of it.
_CLIP_NORMS = np.array([0.1, 0.5, 0.69, 0.72, 1.3, 4.0, 25.0])


def _clip_rows(seed):
  rng = np.random.default_rng(seed)
  d = rng.normal(size=(len(_CLIP_NORMS), H))
  return d / np.linalg.norm(d, axis=1, keepdims=True) * _CLIP_NORMS[:, None]


def test_norm_clip_bounds_and_identity_below_the_threshold():
  z = _clip_rows(11)
  out = np.asarray(correlation.norm_clip(jnp.asarray(z), SQRT_MU))
  assert out.dtype == np.float64
  norms, below = np.linalg.norm(out, axis=1), _CLIP_NORMS < SQRT_MU
  assert np.all(norms <= SQRT_MU * (1 + TIGHT))
  assert np.array_equal(out[below], z[below])                  # bitwise identity inside the ball
  assert np.all(np.abs(norms[~below] - SQRT_MU) <= TIGHT * SQRT_MU)   # onto the sphere outside
  np.testing.assert_allclose(out, z * np.minimum(1.0, SQRT_MU / _CLIP_NORMS)[:, None],
                             rtol=TIGHT, atol=0)
  outer_norms = np.array([np.linalg.norm(np.outer(r, r)) for r in out])
  assert np.all(np.abs(outer_norms - norms ** 2) <= TIGHT * norms ** 2)
  assert np.all(outer_norms <= MU * (1 + TIGHT))
  # Negative: the bound is √mu on the norm (and mu on ‖ž žᵀ‖), not mu on the norm.
  assert norms.max() > MU * 1.4


_clip_jvp = jax.jit(lambda z, t: jax.jvp(lambda a: correlation.norm_clip(a, SQRT_MU), (z,), (t,))[1])
_clip_grad = jax.jit(jax.grad(lambda z, w: jnp.sum(correlation.norm_clip(z, SQRT_MU) * w)))


def np_clip_jacobian_product(z, t, scale_is_constant=False):
  """J t per row: t inside the ball; √mu (t/‖z‖ − z zᵀt/‖z‖³) outside (J is symmetric, so also Jᵀt).

  scale_is_constant drops the second term, i.e. treats √mu/‖z‖ as a constant (a wrong gradient).
  """
  out = np.empty_like(z)
  for n, (zn, tn) in enumerate(zip(z, t)):
    norm = np.sqrt(zn @ zn)
    if norm < SQRT_MU:
      out[n] = tn
    else:
      out[n] = SQRT_MU * tn / norm - (0.0 if scale_is_constant else SQRT_MU * zn * (zn @ tn) / norm ** 3)
  return out


def test_norm_clip_gradient_matches_the_analytic_jacobian():
  z = _clip_rows(12)
  rng = np.random.default_rng(13)
  t, w = rng.normal(size=z.shape), rng.normal(size=z.shape)
  jvp = np.asarray(_clip_jvp(jnp.asarray(z), jnp.asarray(t)))
  vjp = np.asarray(_clip_grad(jnp.asarray(z), jnp.asarray(w)))
  assert rel_err(jvp, np_clip_jacobian_product(z, t)) <= RTOL
  assert rel_err(vjp, np_clip_jacobian_product(z, w)) <= RTOL
  # Negative: the gradient flows through the rescaling; treating √mu/‖z‖ as constant is wrong.
  clipped = _CLIP_NORMS >= SQRT_MU
  wrong = np_clip_jacobian_product(z, w, scale_is_constant=True)
  assert rel_err(vjp[clipped], wrong[clipped]) > 0.1


# ----------------------------------------------------------------------------- T9: DP-CalR

_view_sum = jax.jit(correlation.view_sum_correlation, static_argnums=1)


def dpcalr_matrix(z, n, sqrt_mu=SQRT_MU, mask=None):
  """R̃ = view_sum_correlation(z, √mu, mask) / (V·n) with n the (public) client size."""
  mask = np.ones(z.shape[1], bool) if mask is None else mask
  return np.asarray(_view_sum(jnp.asarray(z), sqrt_mu, jnp.asarray(mask))) / (z.shape[0] * n)


def np_dpcalr_matrix(z, n, mask):
  """The same in loops: clip each view row, sum outer products of the real rows, divide by V·n."""
  out = np.zeros((z.shape[2], z.shape[2]))
  for v, b in itertools.product(range(z.shape[0]), range(z.shape[1])):
    if mask[b]:
      row = z[v, b] * min(1.0, SQRT_MU / np.linalg.norm(z[v, b]))
      out += np.outer(row, row)
  return out / (z.shape[0] * n)


def _random_views(rng, v, n, h):
  """Views with log-uniform norms from 0.1 to 30, so some rows are clipped and some are not."""
  d = rng.normal(size=(v, n, h))
  return d / np.linalg.norm(d, axis=-1, keepdims=True) * np.exp(rng.uniform(np.log(0.1),
                                                                             np.log(30.0), (v, n, 1)))


def test_dpcalr_replace_one_sensitivity_is_sqrt2_mu_over_n_and_attained():
  rng = np.random.default_rng(14)
  v, n, h = 2, 5, 4
  bound = np.sqrt(2) * MU / n
  worst = 0.0
  for _ in range(40):
    z = _random_views(rng, v, n, h)
    z2 = z.copy()
    z2[:, rng.integers(n)] = _random_views(rng, v, 1, h)[:, 0]   # one sample's views replaced
    worst = max(worst, np.linalg.norm(dpcalr_matrix(z, n) - dpcalr_matrix(z2, n)))
  assert worst <= bound * (1 + TIGHT)
  assert rel_err(dpcalr_matrix(z, n), np_dpcalr_matrix(z, n, np.ones(n, bool))) <= RTOL
  # Adversarial neighbours, V = 1: a large e1 replaced by a large e2. Both clip to √mu, and
  # ‖mu e1e1ᵀ − mu e2e2ᵀ‖_F / n = √2 mu / n, so the bound is attained.
  z = _random_views(rng, 1, n, h)
  z[0, 0], z2 = 10.0 * np.eye(h)[0], z.copy()
  z2[0, 0] = 10.0 * np.eye(h)[1]
  adversarial = np.linalg.norm(dpcalr_matrix(z, n) - dpcalr_matrix(z2, n))
  assert bound * (1 + TIGHT) >= adversarial >= 0.99 * bound
  # Negative: mu / n (the zero-out constant) is not a replace-one bound.
  assert adversarial > 1.4 * MU / n


def test_dpcalr_zero_out_sensitivity_is_mu_over_n_with_a_fixed_normaliser():
  rng = np.random.default_rng(15)
  v, n, h = 2, 5, 4
  worst = 0.0
  for _ in range(40):
    z = _random_views(rng, v, n, h)
    drop = np.ones(n, bool)
    drop[rng.integers(n)] = False          # the sample's contribution removed, n kept as normaliser
    worst = max(worst, np.linalg.norm(dpcalr_matrix(z, n) - dpcalr_matrix(z, n, mask=drop)))
  assert worst <= MU / n * (1 + TIGHT)
  # Attained: both views of the removed sample large and along e1, Σ_v ž žᵀ = V mu e1e1ᵀ.
  z = _random_views(rng, v, n, h)
  z[:, 0] = 7.0 * np.eye(h)[0]
  drop = np.arange(n) != 0
  attained = np.linalg.norm(dpcalr_matrix(z, n) - dpcalr_matrix(z, n, mask=drop))
  assert MU / n * (1 + TIGHT) >= attained >= 0.99 * MU / n
  assert rel_err(dpcalr_matrix(z, n, mask=drop), np_dpcalr_matrix(z, n, drop)) <= RTOL
  # Negative: renormalising the neighbour by its own size n − 1 breaks mu / n. With the others all
  # clipped along e2 and the removed one along e1 (V = 1) the change is mu (e1e1ᵀ − e2e2ᵀ) / n.
  z = np.zeros((1, n, h))
  z[0, :] = 5.0 * np.eye(h)[1]
  z[0, 0] = 5.0 * np.eye(h)[0]
  variable = np.linalg.norm(dpcalr_matrix(z, n) - dpcalr_matrix(z, n - 1, mask=drop))
  assert variable > 1.4 * MU / n


def test_dpcalr_noiseless_matrix_is_symmetric_psd_and_bounded_by_mu():
  rng = np.random.default_rng(16)
  v, n, h = 3, 6, 4
  z = _random_views(rng, v, n, h)
  # Padded to 8 rows of garbage-filled chunks: the accumulator over two masked chunks is the
  # whole client's sum, divided by V·n once.
  pad = np.concatenate([z, np.full((v, 2, h), 1e3)], axis=1)
  first, second = np.arange(8) < 3, (np.arange(8) >= 3) & (np.arange(8) < n)
  r = sum(np.asarray(_view_sum(jnp.asarray(pad), SQRT_MU, jnp.asarray(m))) for m in (first, second))
  r = r / (v * n)
  assert rel_err(r, np_dpcalr_matrix(z, n, np.ones(n, bool))) <= RTOL
  assert np.max(np.abs(r - r.T)) <= TIGHT * np.max(np.abs(r))
  assert np.linalg.eigvalsh(r).min() >= -TIGHT * MU
  assert np.linalg.norm(r) <= MU
  # All rows clipped and aligned: ‖R̃‖_F = mu exactly (the bound is tight).
  aligned = np.broadcast_to(9.0 * np.eye(h)[2], (v, n, h)).copy()
  assert abs(np.linalg.norm(dpcalr_matrix(aligned, n)) - MU) <= TIGHT * MU
  # Negative: without NormClip the same data exceed the bound by far.
  assert np.linalg.norm(dpcalr_matrix(z, n, sqrt_mu=None)) > 2 * MU


# ----------------------------------------------------------------------------- T13: server

def test_server_incremental_updates_equal_the_weighted_sum_from_scratch():
  rng = np.random.default_rng(17)
  jj, h, rounds = 5, 3, 8
  q = rng.integers(1, 20, jj).astype(np.float64)
  q /= q.sum()
  cache = rng.normal(size=(jj, h, h))        # non-symmetric: DP-noised uploads are
  total = correlation.weighted_sum(jnp.asarray(cache), jnp.asarray(q))
  forgetful, equal_weight = np.asarray(total).copy(), np.asarray(total).copy()
  for _ in range(rounds):
    for j in rng.choice(jj, size=rng.integers(1, jj + 1), replace=False):
      new = rng.normal(size=(h, h))
      total = correlation.replace_matrix(total, jnp.asarray(cache[j]), jnp.asarray(new), q[j])
      # Wrong bookkeeping kept alongside: adding without removing the old matrix, or weight 1/J.
      forgetful = forgetful + q[j] * new
      equal_weight = equal_weight + (new - cache[j]) / jj
      cache[j] = new
    from_scratch = sum(q[k] * cache[k] for k in range(jj))
    assert rel_err(total, from_scratch) <= RTOL
    assert rel_err(correlation.weighted_sum(jnp.asarray(cache), jnp.asarray(q)), from_scratch) <= RTOL
  assert rel_err(forgetful, from_scratch) > 0.1
  assert rel_err(equal_weight, from_scratch) > 0.05


def test_leave_one_out_removes_client_j_and_renormalises():
  rng = np.random.default_rng(18)
  jj, h = 4, 3
  rs = rng.normal(size=(jj, h, h))
  for q in (np.array([0.1, 0.2, 0.3, 0.4]), np.full(jj, 1.0 / jj)):
    total = correlation.weighted_sum(jnp.asarray(rs), jnp.asarray(q))
    for j in range(jj):
      got = correlation.leave_one_out(total, jnp.asarray(rs[j]), q[j])
      assert rel_err(got, np_leave_one_out(rs, q, j)) <= RTOL
      # Negative: without the 1/(1 − q_j) the result is Σ_{k≠j} q_k R_k, off by 1 − q_j.
      assert rel_err(np.asarray(got) * (1 - q[j]), np_leave_one_out(rs, q, j)) > 0.05
      if q[0] == q[-1]:
        # Uniform q = 1/J: the plain average of the other clients' matrices.
        assert rel_err(got, (rs.sum(0) - rs[j]) / (jj - 1)) <= RTOL
        assert rel_err(got, (rs.sum(0) - rs[j]) / jj) > 0.2
