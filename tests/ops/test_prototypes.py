"""ops/prototypes.py: class means, n_avg-prototypes, the server's (leave-one-out) averages, relay
partners, the Eq. 5 discriminator and its clamped BCE, against plain float64 numpy references
written with Python loops; sampling against its exact distribution within binomial tolerances;
gradients against central finite differences; float32 under jit; vmap over a client axis.

Every jitted function is built once at module level and fed one shape throughout, so the file
compiles only a handful of programs (compilation dominates its run time).
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.ops import prototypes as P

# The float64 computations sum at most ~12 O(1) terms (a class's rows, the clients, the C softmax
# entries) in an order that may differ from the reference's: the rounding is ~12 x 1.1e-16 ~ 1e-15
# relative; 1e-12 leaves room for other ISAs and FMA contraction.
RTOL = 1e-12
# Sampling tests compare K draws with the exact probability p at 5 binomial standard deviations
# sqrt(p (1 - p) / K): a false failure has probability < 1e-6 per comparison, while K = 4000 makes
# 5 sigma <= 0.04, well below the gap between the right probability and any plausible wrong one
# (e.g. 1/N instead of 1/(N-1) at N = 5: 0.05; 1/3 instead of 1/2 for a row of a class of 4).
DRAWS = 4000
SIGMAS = 5.0
N_AVG = 2   # n_avg is static: every n_avg-prototype test uses this one value (one compilation)

C = 4
# One client's batch of n = 12 rows: class 0 has 4 valid rows, class 1 three, class 2 two and
# class 3 none (only a padding row carries its label); rows 6, 8, 10 are padding (labels 3, 0, 1:
# they would change classes 0, 1 and 3 if they were counted).
LABELS = np.array([0, 1, 0, 2, 1, 0, 3, 1, 0, 0, 1, 2])
VALID = np.array([1, 1, 1, 1, 1, 1, 0, 1, 0, 1, 0, 1], dtype=bool)
N_ROWS = len(LABELS)

# One row mask with every class at most N_AVG rows (classes 0, 1, 2: rows {0, 2}, {1, 4}, {3, 11}).
SMALL = np.zeros(N_ROWS, dtype=bool)
SMALL[[0, 1, 2, 3, 4, 11]] = True

class_means = jax.jit(P.class_means, static_argnums=3)
class_means_vmap = jax.jit(jax.vmap(P.class_means, (0, 0, 0, None)), static_argnums=3)
global_prototypes = jax.jit(P.global_prototypes)
leave_one_out = jax.jit(P.leave_one_out_prototypes)
prob_product = jax.jit(P.prob_product)
disc_bce = jax.jit(P.disc_bce, static_argnames='reduction')
disc_bce_grad = jax.jit(jax.grad(P.disc_bce), static_argnames='reduction')


# Compilation dominates the run time (a program with the PRNG takes ~0.5-1 s on XLA:CPU), so every
# n_avg-prototype test runs one of these two programs on DRAWS clients [DRAWS, n, ...] (the sampling
# tests give every client the same data), with keys split from one key inside the program.
@jax.jit
def navg_loop(key, features, labels, valid):
  """navg_prototypes of each client in turn (lax.map: a per-client loop): [DRAWS, C, d]."""
  keys = jax.random.split(key, DRAWS)
  return jax.lax.map(lambda a: P.navg_prototypes(*a, C, N_AVG), (keys, features, labels, valid))


@jax.jit
def navg_vmap(key, features, labels, valid):
  """The same keys as navg_loop, vmapped over the client axis: [DRAWS, C, d]."""
  keys = jax.random.split(key, DRAWS)
  return jax.vmap(P.navg_prototypes, (0, 0, 0, 0, None, None))(
      keys, features, labels, valid, C, N_AVG)


@jax.jit
def relay_draws(key):
  """DRAWS draws of relay_partners for N = 5, C = 3 ([DRAWS, 5, 3], per_class False and True) and
  for N = 2, C = 3 ([DRAWS, 2, 3], per_class True), in one program."""
  keys = jax.random.split(key, DRAWS)
  draw = lambda n, per_class: jax.lax.map(lambda k: P.relay_partners(k, n, 3, per_class), keys)
  return draw(5, False), draw(5, True), draw(2, True)


def _same_client(*arrays):
  """Copies of one client's arrays for all DRAWS clients."""
  return [np.broadcast_to(a, (DRAWS,) + a.shape) for a in arrays]


@pytest.fixture(autouse=True)
def _float64():
  """Tests run with x64 on, so jnp arrays (and the library's outputs) are float64."""
  with jax.enable_x64(True):
    yield


def _features(rng, d=5):
  """Features [n, d] with valid rows O(1) and huge padding rows (a counted padding row would show)."""
  x = rng.normal(size=(N_ROWS, d)) + rng.normal(size=d)
  x[~VALID] = 1e6
  return x


# ------------------------------------------------------------------ numpy float64 references (loops)

def np_class_means(features, labels, valid, num_classes):
  means = np.zeros((num_classes, features.shape[1]))
  counts = np.zeros(num_classes)
  for c in range(num_classes):
    rows = [features[i] for i in range(len(labels)) if valid[i] and labels[i] == c]
    counts[c] = len(rows)
    if rows:
      means[c] = sum(rows) / len(rows)
  return means, counts


def np_weighted_average(means, counts, skip=None):
  n, c, d = means.shape
  out = np.zeros((c, d))
  for k in range(c):
    total = sum(counts[u, k] for u in range(n) if u != skip)
    if total > 0:
      out[k] = sum(counts[u, k] * means[u, k] for u in range(n) if u != skip) / total
  return out


def np_softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def np_prob_product(s, t, temperature):
  return np.array([[np.dot(np_softmax(si / temperature), np_softmax(tk / temperature))
                    for tk in t] for si in s])


def np_bce(h, labels, reduction):
  """PyTorch's nn.BCELoss forward (aten binary_cross_entropy):
  (t - 1) max(log1p(-h), -100) - t max(log h, -100)."""
  b, k = h.shape
  loss = np.zeros((b, k))
  with np.errstate(divide='ignore'):
    for i in range(b):
      for j in range(k):
        t = 1.0 if labels[i] == j else 0.0
        loss[i, j] = ((t - 1.0) * max(np.log1p(-h[i, j]), -100.0)
                      - t * max(np.log(h[i, j]), -100.0))
  return loss.mean() if reduction == 'mean' else loss.sum(axis=1).mean()


# ------------------------------------------------------------------------------------- class_means

def test_class_means_ignore_padding_and_zero_empty_classes():
  rng = np.random.default_rng(0)
  x = _features(rng)
  means, counts = class_means(x, LABELS, VALID, C)
  assert counts.dtype == jnp.float64 and means.shape == (C, 5)
  means, counts = np.asarray(means), np.asarray(counts)
  want_means, want_counts = np_class_means(x, LABELS, VALID, C)
  np.testing.assert_array_equal(counts, [4, 3, 2, 0])
  np.testing.assert_array_equal(counts, want_counts)
  np.testing.assert_allclose(means, want_means, rtol=RTOL, atol=RTOL)
  assert np.all(means[3] == 0.0)   # exactly 0, not nan
  # Non-vacuous: counting the padding rows moves classes 0 and 1 by ~1e6 / 5.
  assert np.abs(means[:2] - np_class_means(x, LABELS, np.ones(N_ROWS), C)[0][:2]).min() > 1e4
  # Padding rows holding nan/inf, or a label outside [0, C), change nothing.
  dirty = x.copy()
  dirty[6], dirty[8] = np.nan, np.inf
  labels = LABELS.copy()
  labels[10] = 99
  dirty_means, dirty_counts = class_means(dirty, labels, VALID, C)
  np.testing.assert_array_equal(dirty_means, means)
  np.testing.assert_array_equal(dirty_counts, counts)


# --------------------------------------------------------------------------------- navg_prototypes

def _decoded_subsets(protos, n_avg):
  """From n_avg-prototypes of identity features [K, C, n] (row i = e_i), the rows each draw averaged
  per class as bit masks [K, C] (bit i: row i), asserting each prototype is exactly (1/m) 1_S for a
  set S of m = min(n_avg, n_c) distinct valid rows of its class."""
  protos = np.asarray(protos)
  chosen = protos != 0
  for c in range(C):
    members = VALID & (LABELS == c)
    m = min(n_avg, members.sum())
    assert not chosen[:, c, ~members].any(), c   # never a padding row or another class's row
    np.testing.assert_array_equal(chosen[:, c].sum(1), m)
    if m:
      np.testing.assert_array_equal(protos[:, c][chosen[:, c]], 1.0 / m)   # exactly their mean
  return chosen.astype(np.int64) @ (2 ** np.arange(N_ROWS))


def test_navg_prototypes_average_distinct_valid_rows_uniformly():
  """Identity features make a prototype reveal the rows it averages: min(n_avg, n_c) distinct valid
  rows of the class, each subset of that size equally often (so each row with probability
  min(n_avg, n_c) / n_c). Classes here: 4 rows (6 subsets), 3 rows (3), 2 rows (always both), and
  an empty class with a padding row of its label."""
  eye = np.eye(N_ROWS)
  protos = np.asarray(navg_loop(jax.random.key(0), *_same_client(eye, LABELS, VALID)))
  assert protos.shape == (DRAWS, C, N_ROWS)
  subsets = _decoded_subsets(protos, N_AVG)
  np.testing.assert_array_equal(protos[:, 3], 0.0)
  for c in range(3):
    members = np.flatnonzero(VALID & (LABELS == c))
    m = min(N_AVG, len(members))
    # Each subset of m rows has probability 1 / binom(n_c, m).
    options = [sum(2 ** i for i in rows) for rows in itertools.combinations(members, m)]
    p = 1.0 / len(options)
    tol = SIGMAS * np.sqrt(p * (1 - p) / DRAWS)
    assert set(np.unique(subsets[:, c])) <= set(options)
    for option in options:
      assert abs(np.mean(subsets[:, c] == option) - p) <= tol, (c, option, p)
    q = m / len(members)
    for i in members:   # each row: picked with probability m / n_c
      picked = np.mean(protos[:, c, i] != 0)
      assert abs(picked - q) <= SIGMAS * np.sqrt(q * (1 - q) / DRAWS), (c, i, picked, q)
  # Non-vacuous: the tolerance separates a row of class 0 (1/2) from one of class 1 (2/3).
  assert SIGMAS * np.sqrt(0.25 / DRAWS) < 2 / 3 - 1 / 2


def test_navg_prototypes_with_n_avg_above_class_sizes_equal_class_means():
  """With every class at most n_avg rows (the mask SMALL) the n_avg-prototypes are the class means,
  whatever the key (up to the summation order)."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(DRAWS, N_ROWS, N_ROWS))
  labels, valid = _same_client(LABELS, SMALL)
  protos = np.asarray(navg_loop(jax.random.key(7), x, labels, valid))
  means = np.asarray(class_means_vmap(x, labels, valid, C)[0])
  np.testing.assert_allclose(protos, means, rtol=RTOL, atol=RTOL)
  for u in range(3):
    np.testing.assert_allclose(means[u], np_class_means(x[u], LABELS, SMALL, C)[0],
                               rtol=RTOL, atol=RTOL)
  with pytest.raises(ValueError, match='n_avg'):
    P.navg_prototypes(jax.random.key(0), x[0], LABELS, VALID, C, 0)


def test_vmap_over_clients_equals_the_per_client_loop():
  """class_means and navg_prototypes vmapped over a client axis [N, n, ...] give the per-client
  loop's values (navg: the same key per client in both)."""
  rng = np.random.default_rng(2)
  x = rng.normal(size=(DRAWS, N_ROWS, N_ROWS))
  labels = rng.permuted(np.broadcast_to(LABELS, (DRAWS, N_ROWS)), axis=1)
  valid = rng.permuted(np.broadcast_to(VALID, (DRAWS, N_ROWS)), axis=1)
  means, counts = (np.asarray(a) for a in class_means_vmap(x, labels, valid, C))
  for u in range(3):
    m, n = class_means(x[u], labels[u], valid[u], C)
    np.testing.assert_allclose(means[u], m, rtol=RTOL, atol=RTOL)
    np.testing.assert_array_equal(counts[u], n)
    np.testing.assert_allclose(m, np_class_means(x[u], labels[u], valid[u], C)[0],
                               rtol=RTOL, atol=RTOL)
  key = jax.random.key(3)
  looped = np.asarray(navg_loop(key, x, labels, valid))
  # A different subset would move a prototype by O(1); the same one agrees to rounding.
  np.testing.assert_allclose(navg_vmap(key, x, labels, valid), looped, rtol=RTOL, atol=RTOL)
  assert np.abs(looped - means).max() > 0.1   # n_avg < some class sizes: not the class means


# --------------------------------------------------------------------- global and leave-one-out

# Four clients, five classes, unequal counts: class 3 is client 0's alone, class 4 nobody's.
COUNTS = np.array([[3., 0., 2., 1., 0.],
                   [1., 5., 0., 0., 0.],
                   [0., 2., 4., 0., 0.],
                   [2., 1., 0., 0., 0.]])


def _client_means(rng):
  means = rng.normal(size=COUNTS.shape + (3,)) + 2.0
  means[COUNTS == 0] = 0.0   # as class_means returns them
  return means


def test_global_prototypes_weight_by_counts():
  rng = np.random.default_rng(4)
  means = _client_means(rng)
  got = np.asarray(global_prototypes(means, COUNTS))
  want = np_weighted_average(means, COUNTS)
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL)
  assert np.all(got[4] == 0.0)
  # Sample-weighted, not the plain mean of the clients holding the class (class 0: 3:1:2).
  assert np.abs(got[0] - means[[0, 1, 3], 0].mean(0)).max() > 1e-2
  # A zero-count entry is ignored whatever it holds.
  means[1, 2] = np.nan
  np.testing.assert_array_equal(global_prototypes(means, COUNTS), got)


def test_leave_one_out_prototypes_exclude_the_client():
  rng = np.random.default_rng(5)
  means = _client_means(rng)
  batched = np.asarray(jax.jit(jax.vmap(P.leave_one_out_prototypes, (None, None, 0)))(
      means, COUNTS, jnp.arange(4, dtype=jnp.int32)))
  for u in range(4):
    got = np.asarray(leave_one_out(means, COUNTS, jnp.int32(u)))   # u traced
    np.testing.assert_allclose(got, np_weighted_average(means, COUNTS, skip=u),
                               rtol=RTOL, atol=RTOL)
    np.testing.assert_array_equal(batched[u], got)
    assert np.all(got[4] == 0.0)
  # Class 3 is client 0's alone: nobody else has it.
  assert np.all(batched[0, 3] == 0.0)
  np.testing.assert_allclose(batched[1, 3], means[0, 3], rtol=RTOL)
  # Client 1 alone holds 5 of class 1's 8 rows: leaving it out moves that prototype.
  assert np.abs(batched[1, 1] - np.asarray(global_prototypes(means, COUNTS))[1]).max() > 1e-2


# ---------------------------------------------------------------------------------- relay_partners

def test_relay_partners_are_uniform_over_the_other_clients():
  n, c = 5, 3
  shared, independent, pair = (np.asarray(a) for a in relay_draws(jax.random.key(11)))
  p = 1.0 / (n - 1)
  tol = SIGMAS * np.sqrt(p * (1 - p) / DRAWS)
  for partners in (shared, independent):
    assert partners.shape == (DRAWS, n, c) and partners.dtype == np.int32
    assert partners.min() >= 0 and partners.max() < n
    assert np.all(partners != np.arange(n)[None, :, None])   # never oneself
    for u in range(n):
      for col in range(c):
        for v in range(n):
          if v != u:
            assert abs(np.mean(partners[:, u, col] == v) - p) <= tol, (u, col, v)
  # per_class=False: one partner per client; True: independent columns agree with probability
  # 1 / (N - 1) (tolerance over DRAWS x N pairs; sharing would give 1).
  assert np.all(shared == shared[:, :, :1])
  same = np.mean(independent[:, :, 0] == independent[:, :, 1])
  assert abs(same - p) <= SIGMAS * np.sqrt(p * (1 - p) / (DRAWS * n))
  # N = 2: the partner is forced.
  np.testing.assert_array_equal(pair, np.broadcast_to([[1, 1, 1], [0, 0, 0]], pair.shape))


def test_relay_partners_need_two_clients():
  with pytest.raises(ValueError, match=r'num_clients.*>= 2'):
    P.relay_partners(jax.random.key(0), 1, 3)


# ------------------------------------------------------------------ discriminator and its BCE

B, K = 3, 5   # a batch of 3 samples against 5 class prototypes


def _logits(rng):
  return rng.normal(size=(B, K)) * 2.0, rng.normal(size=(K, K)) * 2.0


@pytest.mark.parametrize('temperature', [1.0, 2.5])
def test_prob_product_matches_reference(temperature):
  rng = np.random.default_rng(6)
  s, t = _logits(rng)
  got = np.asarray(prob_product(s, t, temperature))
  np.testing.assert_allclose(got, np_prob_product(s, t, temperature), rtol=RTOL)
  assert got.shape == (B, K) and np.all((got > 0) & (got < 1))
  # Identical one-hot-like distributions give ~1, disjoint ones ~0.
  peaked = np.eye(K)[:B] * 60.0
  np.testing.assert_allclose(prob_product(peaked, np.eye(K) * 60.0, 1.0), np.eye(K)[:B],
                             atol=1e-20)


def _h_with_edges(rng):
  """h [B, K] in (0, 1) with exact 0 and 1 at a target and at a non-target entry each."""
  h = rng.uniform(0.05, 0.95, size=(B, K))
  labels = np.array([0, 3, 4])
  h[0, 0], h[0, 1] = 0.0, 1.0   # target at 0 (log clamped), non-target at 1 (log(1-h) clamped)
  h[1, 3], h[1, 2] = 1.0, 0.0   # target at 1, non-target at 0: both exact, loss 0
  return h, labels


@pytest.mark.parametrize('reduction', P.REDUCTIONS)
def test_disc_bce_matches_pytorch_clamped_reference(reduction):
  rng = np.random.default_rng(7)
  h, labels = _h_with_edges(rng)
  got = float(disc_bce(h, labels, reduction=reduction))
  want = np_bce(h, labels, reduction)
  assert np.isfinite(got) and got == pytest.approx(want, rel=RTOL)
  assert want > 200.0 / (B * K if reduction == 'mean' else B)   # the two clamped logs count 100 each
  # 'sum' sums over the K prototypes: K times 'mean'.
  other = 'sum' if reduction == 'mean' else 'mean'
  ratio = K if reduction == 'sum' else 1.0 / K
  assert got == pytest.approx(ratio * float(disc_bce(h, labels, reduction=other)), rel=RTOL)
  # A rounding overshoot above 1 (prob_product can land 1 ulp over) counts as 1.
  over = h.copy()
  over[0, 1] = np.nextafter(1.0, 2.0)
  assert float(disc_bce(over, labels, reduction=reduction)) == got


def test_disc_bce_matches_torch():
  torch = pytest.importorskip('torch')
  rng = np.random.default_rng(8)
  h, labels = _h_with_edges(rng)
  want = torch.nn.functional.binary_cross_entropy(
      torch.tensor(h), torch.nn.functional.one_hot(torch.tensor(labels), K).double())
  assert float(disc_bce(h, labels)) == pytest.approx(float(want), rel=RTOL)


def test_disc_bce_rejects_unknown_reduction():
  with pytest.raises(ValueError, match=r"mean.*sum.*'none'"):
    P.disc_bce(np.full((B, K), 0.5), np.zeros(B, int), reduction='none')


@pytest.mark.parametrize('reduction', P.REDUCTIONS)
def test_disc_bce_gradient_is_finite_at_zero_and_one(reduction):
  """The gradient of the clamped loss: -t/h + (1 - t)/(1 - h) per entry (over B K for 'mean', B
  for 'sum') where no log is clamped; at h = 0 or 1 the clamped log contributes 0 and the other
  term its derivative at that point (1 for a non-target at 0, -1 for a target at 1)."""
  rng = np.random.default_rng(9)
  h, labels = _h_with_edges(rng)
  grad = np.asarray(disc_bce_grad(h, labels, reduction=reduction))
  assert np.all(np.isfinite(grad))
  t = np.eye(K)[labels]
  with np.errstate(divide='ignore', invalid='ignore'):
    want = np.where(t == 1, np.where(h > 0, -1.0 / h, 0.0),
                    np.where(h < 1, 1.0 / (1.0 - h), 0.0))
  want /= B * K if reduction == 'mean' else B
  np.testing.assert_allclose(grad, want, rtol=RTOL)
  assert grad[0, 0] == 0.0 and grad[0, 1] == 0.0   # both logs clamped
  scale = B * K if reduction == 'mean' else B
  assert grad[1, 3] == -1.0 / scale and grad[1, 2] == 1.0 / scale   # exact 1 and 0, unclamped


def test_distillation_loss_gradient_matches_central_differences():
  """d/d(s, t) disc_bce(prob_product(s, t, T), y) against (f(x + e v) - f(x - e v)) / 2e along
  random unit directions. e = 1e-5: truncation e² |f'''| / 6 ~ 1e-11 and rounding ~1e-16 / e ~
  1e-11 for O(1) values, so 1e-7 ||grad|| is a 1e4 margin while a wrong gradient is off by
  O(||grad||). ('sum' is K times 'mean', as test_disc_bce_matches_pytorch_clamped_reference checks.)"""
  rng = np.random.default_rng(10)
  s, t = _logits(rng)
  labels = np.array([2, 0, 4])
  temperature = 1.7

  def loss(s, t):
    return P.disc_bce(P.prob_product(s, t, temperature), labels)

  value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  grads = value_and_grad(s, t)[1]
  e = 1e-5
  for argnum, x in enumerate((s, t)):
    grad = np.asarray(grads[argnum])
    norm = np.linalg.norm(grad)
    assert norm > 1e-3
    for _ in range(4):
      v = rng.normal(size=x.shape)
      v /= np.linalg.norm(v)
      plus, minus = [s, t], [s, t]
      plus[argnum], minus[argnum] = x + e * v, x - e * v
      fd = (float(value_and_grad(*plus)[0]) - float(value_and_grad(*minus)[0])) / (2 * e)
      assert abs(fd - np.sum(grad * v)) <= 1e-7 * norm


# ------------------------------------------------------------------------------- float32 under jit

def test_float32_under_jit():
  """x64 off, float32 inputs: outputs stay float32 and agree with float64 on the same inputs to
  1e-5 relative. Each output is a sum of <= 12 O(1) terms plus a division (or a softmax and a log),
  so its float32 rounding is <= ~15 x 2^-24 ~ 1e-6 relative: 1e-5 is a 10x margin, while a
  computation with bfloat16 (2^-8) or TF32 (2^-11) inputs would miss by 40x or more."""
  rng = np.random.default_rng(12)
  x = _features(rng).astype(np.float32)
  means = _client_means(rng).astype(np.float32)
  s, t = (z.astype(np.float32) for z in _logits(rng))
  h, labels = _h_with_edges(rng)
  h = h.astype(np.float32)
  with jax.enable_x64(False):
    m, n = class_means(x, LABELS, VALID, C)
    g = global_prototypes(means, COUNTS.astype(np.float32))
    loo = leave_one_out(means, COUNTS.astype(np.float32), jnp.int32(1))
    pp = prob_product(s, t, 2.0)
    bce = disc_bce(h, labels, reduction='sum')
    # log(1 - h) as log1p(-h): a non-target at h = 1e-8 costs 1e-8 (1 - h rounds to 1 in float32).
    tiny = disc_bce(np.where(np.eye(K)[labels] == 1, 1.0, 1e-8).astype(np.float32), labels,
                    reduction='sum')
    for out in (m, n, g, loo, pp, bce, tiny):
      assert out.dtype == jnp.float32
  tol = dict(rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(m, np_class_means(x.astype(np.float64), LABELS, VALID, C)[0], **tol)
  np.testing.assert_array_equal(n, [4, 3, 2, 0])
  np.testing.assert_allclose(g, np_weighted_average(means.astype(np.float64), COUNTS), **tol)
  np.testing.assert_allclose(loo, np_weighted_average(means.astype(np.float64), COUNTS, skip=1),
                             **tol)
  np.testing.assert_allclose(pp, np_prob_product(s.astype(np.float64), t.astype(np.float64), 2.0),
                             **tol)
  assert float(bce) == pytest.approx(np_bce(h.astype(np.float64), labels, 'sum'), rel=1e-5)
  assert float(tiny) == pytest.approx((K - 1) * 1e-8, rel=1e-5)
