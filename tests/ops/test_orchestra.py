"""ops/orchestra.py against float64 numpy transcriptions of the release's equations (Lubana et al.,
ICML 2022; ekdeepslubana/OrchestraFL models.py): Sinkhorn-Knopp with its stopping rule and its
equal-size marginals, the FIFO and setup memory banks, local clustering (an empty cluster
included), global clustering with a hand-derived gradient, the clustering loss with softmax and
Sinkhorn targets, the rotations; and float32 under jit within bounds derived from the rounding.

Tolerances. float64 against float64: the same operations in another order, so the difference is
rounding: a sum of n positive terms is off by at most (n - 1) u relative (u = 1.1e-16), and
Sinkhorn's scaling map does not amplify relative errors (it is non-expansive in Hilbert's projective
metric), so after I iterations of dots of length <= N + K the assignments are within
I (N + K + 4) u: <= 100 * 50 * 1.1e-16 = 5.5e-13 for every problem here; RTOL64 = 1e-11 leaves 20x.
Global clustering repeats 500 normalised SGD steps whose map is Lipschitz with constant ~1 at
these step sizes (lr 0.01 times a gradient of norm <= 2 / T), so its error stays within a small
multiple of the per-step one: RTOL_GLOBAL = 1e-9.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.ops import orchestra as ops

RTOL64 = 1e-11
RTOL_GLOBAL = 1e-9
U32 = float(np.finfo(np.float32).eps) / 2   # float32 unit roundoff, 6.0e-8


def _unit(rs, n, d):
  x = rs.normal(size=(n, d))
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def np_normalize(x):
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def np_softmax(s):
  e = np.exp(s - s.max(axis=1, keepdims=True))
  return e / e.sum(axis=1, keepdims=True)


def np_sinkhorn(scores, lam=25.0, max_iters=100, tol=1e-2, check_every=10, return_iters=False):
  """The release's sknopp, line by line in float64 (loops over rows and columns)."""
  scores = np.asarray(scores, np.float64)
  n, k = scores.shape
  p = np_softmax(lam * scores).T                  # [K, N]
  r = np.full(k, 1.0 / k)
  c = np.full(n, 1.0 / n)
  err, done_at = 1e3, max_iters
  for it in range(max_iters):
    r = np.array([(1.0 / k) / sum(p[a, b] * c[b] for b in range(n)) for a in range(k)])
    c_new = np.array([(1.0 / n) / sum(r[a] * p[a, b] for a in range(k)) for b in range(n)])
    if it % check_every == 0:
      ratio = np.abs(c / c_new - 1)
      err = np.sum(ratio[~np.isnan(ratio)])
    c = c_new
    if err < tol:
      done_at = it + 1
      break
  q = np.array([[n * c[b] * p[a, b] * r[a] for a in range(k)] for b in range(n)])
  return (q, done_at) if return_iters else q


def np_local_clustering(memory, init_idx, fallback_idx, lam=25.0, sinkhorn_iters=10):
  """The release's local_clustering with the random rows given: init_idx [L], fallback_idx
  [iters, L] (the row an empty cluster takes in each iteration)."""
  z = np.asarray(memory, np.float64)
  cent = z[np.asarray(init_idx)].copy()
  for it in range(len(fallback_idx)):
    assigns = np_sinkhorn(z @ cent.T, lam, sinkhorn_iters)
    choice = np.argmax(assigns, axis=1)
    for index in range(len(cent)):
      selected = z[choice == index]
      if selected.shape[0] == 0:
        selected = z[[fallback_idx[it][index]]]
      cent[index] = np_normalize(selected.mean(axis=0))
  return cent


def np_global_clustering_grad(w, z, q, temperature):
  """d/dW of -(1/N) sum_n cos(q_n, softmax(normalize(z_n) W^T / T)), by hand."""
  zn = np_normalize(np.asarray(z, np.float64))
  p = np_softmax(zn @ w.T / temperature)
  n = len(z)
  ds = np.zeros_like(p)
  for i in range(n):
    nq, np_ = np.linalg.norm(q[i]), np.linalg.norm(p[i])
    dot = q[i] @ p[i]
    g = q[i] / (nq * np_) - dot * p[i] / (nq * np_ ** 3)          # d cos / d p
    ds[i] = -(p[i] * g - p[i] * (p[i] @ g)) / n                   # softmax Jacobian, mean, minus
  return ds.T @ zn / temperature


def np_global_clustering_loss(w, z, q, temperature):
  p = np_softmax(np_normalize(z) @ w.T / temperature)
  cos = [q[i] @ p[i] / (np.linalg.norm(q[i]) * np.linalg.norm(p[i])) for i in range(len(z))]
  return -np.mean(cos)


def np_global_clustering(local, centroids, temperature, iters=500, lr=0.01, momentum=0.9,
                         weight_decay=1e-4, lam=25.0, sinkhorn_iters=100):
  """The release's global_clustering: torch SGD (momentum, weight decay) on the centroids with
  Sinkhorn targets, rows renormalised after every step."""
  z = np.asarray(local, np.float64)
  w = np.asarray(centroids, np.float64).copy()
  buf = np.zeros_like(w)
  for _ in range(iters):
    q = np_sinkhorn(z @ w.T, lam, sinkhorn_iters)
    g = np_global_clustering_grad(w, z, q, temperature) + weight_decay * w
    buf = momentum * buf + g
    w = np_normalize(w - lr * buf)
  return w


def np_cluster_loss(z_online, z_target, centroids, temperature, targets='softmax', lam=25.0):
  logits = np_normalize(z_online) @ centroids.T / temperature
  logp = logits - logits.max(axis=1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(axis=1, keepdims=True))
  s = np_normalize(z_target) @ centroids.T
  q = np_softmax(s / temperature) if targets == 'softmax' else np_sinkhorn(s, lam, 100)
  return -np.mean(np.sum(q * logp, axis=1))


PROBLEMS = [(12, 4, 6), (30, 5, 8), (7, 3, 4), (5, 8, 6)]   # (N, K, D), K > N included


@pytest.mark.parametrize('n,k,d', PROBLEMS)
@pytest.mark.parametrize('lam,iters,tol', [(25.0, 100, 1e-2), (25.0, 10, 1e-2), (5.0, 40, 0.0)])
def test_sinkhorn_matches_the_release_in_float64(n, k, d, lam, iters, tol):
  rs = np.random.RandomState(n * 10 + k)
  scores = _unit(rs, n, d) @ _unit(rs, k, d).T
  want = np_sinkhorn(scores, lam, iters, tol)
  with jax.enable_x64(True):
    got = ops.sinkhorn_knopp(jnp.asarray(scores), lam, iters, tol)
    assert got.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL64, atol=0)


@pytest.mark.parametrize('n,k,d', PROBLEMS)
def test_sinkhorn_marginals_are_equal_size(n, k, d):
  """Rows sum to 1 after every iteration count (the last c update makes them so); columns sum to
  N/K at the fixed point, and within tol / (1 - tol) of N/K where the release's rule stopped: at
  the stop every c_prev / c_new lies in [1 - tol, 1 + tol], and column k's sum is (N/K) times a
  c_new / c_prev-weighted average."""
  rs = np.random.RandomState(n + k)
  scores = _unit(rs, n, d) @ _unit(rs, k, d).T
  with jax.enable_x64(True):
    converged = np.asarray(ops.sinkhorn_knopp(jnp.asarray(scores), 25.0, 3000, 0.0))
    stopped = np.asarray(ops.sinkhorn_knopp(jnp.asarray(scores), 25.0, 100, 1e-2))
  _, done_at = np_sinkhorn(scores, 25.0, 100, 1e-2, return_iters=True)
  assert done_at < 100   # the rule stopped early here
  for q in (converged, stopped):
    assert np.all(q >= 0)
    np.testing.assert_allclose(q.sum(axis=1), 1.0, rtol=0, atol=(k + 4) * 1.2e-16)
  # Converged: the fixed point up to the rounding of one iteration's sums.
  np.testing.assert_allclose(converged.sum(axis=0), n / k, rtol=(n + k + 4) * 1.2e-16 * 4)
  np.testing.assert_allclose(stopped.sum(axis=0), n / k, rtol=1e-2 / (1 - 1e-2))
  # Equal size, so every cluster takes mass: a hard argmax of equal-size soft columns is not
  # guaranteed equal, but no column is empty of mass.
  assert np.all(converged.sum(axis=0) > 0)


def test_sinkhorn_float32_under_jit_within_the_rounding_bound():
  """float32, 100 iterations without early stop, against float64: the softmax of lam * s with s
  rounded to (D + 2) u (a D-term dot) moves P by lam (D + 2) u relative; each iteration's dots add
  (N + K + 4) u; over 100 iterations <= 100 (N + K + 4) u + lam (D + 2) u = 2.2e-4 (N=30, K=5,
  D=8). Checked at 4e-4."""
  rs = np.random.RandomState(3)
  zs, cs = _unit(rs, 30, 8), _unit(rs, 5, 8)
  want = np_sinkhorn(zs @ cs.T, 25.0, 100, 0.0)
  got = jax.jit(lambda z, c: ops.sinkhorn_knopp(z @ c.T, 25.0, 100, 0.0))(
      jnp.asarray(zs, jnp.float32), jnp.asarray(cs, jnp.float32))
  assert got.dtype == jnp.float32
  bound = (100 * (30 + 5 + 4) + 25 * (8 + 2)) * U32
  assert bound < 4e-4
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=4e-4, atol=1e-7)


def test_sinkhorn_refuses_bad_arguments():
  with pytest.raises(ValueError, match=r'scores \(3,\) must be \[N, K\]'):
    ops.sinkhorn_knopp(jnp.ones(3))
  with pytest.raises(ValueError, match='lam = 0.0 must be > 0'):
    ops.sinkhorn_knopp(jnp.ones((3, 2)), lam=0.0)


def test_memory_push_and_fill_match_numpy():
  rs = np.random.RandomState(0)
  mem, z = rs.normal(size=(6, 3)).astype(np.float32), rs.normal(size=(4, 3)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(ops.memory_push(jnp.asarray(mem), jnp.asarray(z))),
                                np.concatenate([mem[4:], z]))
  big = rs.normal(size=(9, 3)).astype(np.float32)   # B > m: the last m rows of the batch
  np.testing.assert_array_equal(np.asarray(ops.memory_push(jnp.asarray(mem), jnp.asarray(big))),
                                big[-6:])
  m1, f1 = ops.memory_fill(jnp.asarray(mem), jnp.int32(0), jnp.asarray(z))
  np.testing.assert_array_equal(np.asarray(m1), np.concatenate([z, mem[4:]]))
  assert int(f1) == 4
  m2, f2 = ops.memory_fill(m1, f1, jnp.asarray(z + 1))
  np.testing.assert_array_equal(np.asarray(m2), np.concatenate([z, (z + 1)[:2]]))
  assert int(f2) == 6
  m3, f3 = ops.memory_fill(m2, f2, jnp.asarray(z + 2))    # full: nothing changes
  np.testing.assert_array_equal(np.asarray(m3), np.asarray(m2))
  assert int(f3) == 6


def _random_rows(key, m, num_clusters, iters):
  """The rows local_clustering draws (its keys, as the function splits them)."""
  k_init, k_loop = jax.random.split(key)
  init = np.asarray(jax.random.choice(k_init, m, (num_clusters,), replace=False))
  fallback = [np.asarray(jax.random.randint(jax.random.fold_in(k_loop, i), (num_clusters,), 0, m))
              for i in range(iters)]
  return init, fallback


def test_local_clustering_matches_the_release_in_float64():
  rs = np.random.RandomState(1)
  m, d, num_clusters = 16, 5, 4
  memory = _unit(rs, m, d)
  key = jax.random.PRNGKey(11)
  init, fallback = _random_rows(key, m, num_clusters, 5)
  want = np_local_clustering(memory, init, fallback)
  with jax.enable_x64(True):
    got = np.asarray(ops.local_clustering(jnp.asarray(memory), key, num_clusters))
  np.testing.assert_allclose(got, want, rtol=RTOL64, atol=1e-14)
  np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-14)


def test_local_clustering_gives_an_empty_cluster_a_row_of_the_bank():
  """A bank of one repeated row a plus one row b, clustered into 3: clusters started on a have
  equal columns, one takes every argmax of a's rows and the others are empty and take a drawn bank
  row. Which of the tied clusters wins depends on rounding, so the result is compared with the
  numpy reference (same draws) as a set of rows."""
  rs = np.random.RandomState(3)
  a, b = _unit(rs, 2, 4)
  memory = np.stack([a] * 7 + [b])
  key = jax.random.PRNGKey(5)
  init, fallback = _random_rows(key, 8, 3, 5)
  want = np_local_clustering(memory, init, fallback)
  with jax.enable_x64(True):
    got = np.asarray(ops.local_clustering(jnp.asarray(memory), key, 3))
  rows = lambda x: sorted(tuple(np.round(r, 9)) for r in x)
  assert rows(got) == rows(want)
  # A bank of a single repeated row: two of the three clusters are empty in every iteration, so
  # their centroids are fallback rows, which can only be that row.
  with jax.enable_x64(True):
    same = np.asarray(ops.local_clustering(jnp.asarray(np.stack([a] * 8)), key, 3))
  np.testing.assert_allclose(same, np.stack([a] * 3), rtol=0, atol=1e-15)


def test_local_clustering_refuses_more_clusters_than_rows():
  with pytest.raises(ValueError, match=r'num_clusters = 5 must be in \[1, m = 4\]'):
    ops.local_clustering(jnp.ones((4, 3)), jax.random.PRNGKey(0), 5)


def test_global_clustering_loss_and_gradient_match_the_hand_derivation():
  rs = np.random.RandomState(2)
  z, w = _unit(rs, 12, 6), rs.normal(size=(4, 6)) * 0.3
  q = np_sinkhorn(z @ w.T, 25.0, 100)
  with jax.enable_x64(True):
    args = (jnp.asarray(w), jnp.asarray(z), jnp.asarray(q), 0.1)
    loss = float(ops.global_clustering_loss(*args))
    grad = np.asarray(jax.grad(ops.global_clustering_loss)(*args))
  assert loss == pytest.approx(np_global_clustering_loss(w, z, q, 0.1), rel=1e-13)
  np.testing.assert_allclose(grad, np_global_clustering_grad(w, z, q, 0.1), rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize('iters,n,k', [(30, 12, 4), (500, 10, 3)])
def test_global_clustering_matches_the_release_in_float64(iters, n, k):
  rs = np.random.RandomState(iters + n)
  local = _unit(rs, n, 6)
  start = rs.uniform(-1 / np.sqrt(6), 1 / np.sqrt(6), size=(k, 6))   # torch Linear's init
  want = np_global_clustering(local, start, 0.1, iters=iters)
  with jax.enable_x64(True):
    got = np.asarray(ops.global_clustering(jnp.asarray(local), jnp.asarray(start), 0.1,
                                           iters=iters))
  np.testing.assert_allclose(got, want, rtol=RTOL_GLOBAL, atol=1e-12)
  np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-14)
  # The clustering did its job: the objective (with targets at the end point) went down.
  q0, q1 = np_sinkhorn(local @ start.T), np_sinkhorn(local @ want.T)
  assert (np_global_clustering_loss(want, local, q1, 0.1)
          < np_global_clustering_loss(np_normalize(start), local, q0, 0.1))


def test_global_clustering_float32_under_jit():
  """30 steps in float32 against float64: each step's gradient carries ~(N K + D) u relative
  rounding, the step moves W by lr |g| <= 0.01 * 2 / T = 0.2, so 30 steps add at most
  30 * 0.2 * (N K + D + 100 (N + K)) u ~ 0.2 * 30 * 2000 * 6e-8 = 7e-4 to rows of norm 1; checked
  at 2e-3 absolute."""
  rs = np.random.RandomState(5)
  local, start = _unit(rs, 12, 6), _unit(rs, 4, 6)
  want = np_global_clustering(local, start, 0.1, iters=30)
  got = jax.jit(lambda a, b: ops.global_clustering(a, b, 0.1, iters=30))(
      jnp.asarray(local, jnp.float32), jnp.asarray(start, jnp.float32))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=2e-3)


@pytest.mark.parametrize('targets', ['softmax', 'sinkhorn'])
def test_cluster_loss_matches_numpy_and_only_the_online_side_gets_a_gradient(targets):
  rs = np.random.RandomState(4)
  zo, zt, c = rs.normal(size=(9, 5)), rs.normal(size=(9, 5)), _unit(rs, 6, 5)
  want = np_cluster_loss(zo, zt, c, 0.1, targets)
  with jax.enable_x64(True):
    args = (jnp.asarray(zo), jnp.asarray(zt), jnp.asarray(c))
    got = float(ops.cluster_loss(*args, 0.1, targets))
    grads = jax.grad(lambda a, b, cc: ops.cluster_loss(a, b, cc, 0.1, targets),
                     argnums=(0, 1, 2))(*args)
    # Central differences of the loss in z_online (one coordinate per row).
    eps = 1e-6
    for i in range(9):
      e = np.zeros_like(zo)
      e[i, i % 5] = eps
      fd = (np_cluster_loss(zo + e, zt, c, 0.1, targets)
            - np_cluster_loss(zo - e, zt, c, 0.1, targets)) / (2 * eps)
      assert float(grads[0][i, i % 5]) == pytest.approx(fd, rel=1e-6, abs=1e-8)
    assert not np.any(np.asarray(grads[1])) and not np.any(np.asarray(grads[2]))
  assert got == pytest.approx(want, rel=1e-12)
  got32 = jax.jit(lambda a, b, cc: ops.cluster_loss(a, b, cc, 0.1, targets))(
      *(jnp.asarray(v, jnp.float32) for v in (zo, zt, c)))
  # logits up to 1/T = 10 rounded to ~(D + 2) u * 10; the sum over K and the batch mean add
  # (K + B) u relative: |error| <= 10 (D + 2 + K + B) u |loss| ~ 1.3e-5 |loss|.
  assert float(got32) == pytest.approx(want, rel=2e-5)


def test_rotate90_is_counter_clockwise_per_image():
  x = np.arange(2 * 3 * 3 * 1).reshape(2, 3, 3, 1)
  k = np.array([1, 3])
  got = np.asarray(ops.rotate90(jnp.asarray(x), jnp.asarray(k)))
  for i in range(2):
    np.testing.assert_array_equal(got[i], np.rot90(x[i], k[i], axes=(0, 1)))
  # Counter-clockwise: the top-right pixel moves to the top-left.
  assert got[0, 0, 0, 0] == x[0, 0, 2, 0]
  with pytest.raises(ValueError, match='square'):
    ops.rotate90(jnp.ones((1, 3, 4, 1)), jnp.zeros(1, jnp.int32))
