"""ops/fedca.py: each FedCA primitive against a float64 numpy transcription of its equation (the
dictionary update, the two dictionary-contrastive losses, the alignment loss), in float64 and in
float32 under jit within a bound derived from the computation; the losses without a valid dictionary
row are the plain ones; the negatives' selection; finite gradients; refused shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.ops import fedca
from fedjax_ssl.ssl import losses


def _norm(v):
  v = np.asarray(v, np.float64)
  return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


def _logsumexp(values):
  values = np.asarray(values, np.float64)
  top = values.max()
  return top + np.log(np.sum(np.exp(values - top)))


def np_update_dictionary(old, z0, z1, seen, momentum):
  """Client_CA.comp_dict row by row: m = (z0 + z1) / 2, mixed with the stored row if any, then
  normalised."""
  out = []
  for i in range(len(z0)):
    m = (np.asarray(z0[i], np.float64) + np.asarray(z1[i], np.float64)) / 2
    row = momentum * np.asarray(old[i], np.float64) + (1 - momentum) * m if seen else m
    out.append(row / max(np.linalg.norm(row), 1e-12))
  return np.array(out)


def np_dictionary_nt_xent(z0, z1, dictionary, valid, tau):
  """NT-Xent over the 2B anchors, every other anchor and every valid dictionary row a negative."""
  z = _norm(np.concatenate([z0, z1]))
  n = len(z)
  negs = [np.asarray(dictionary[k], np.float64) for k in range(len(valid)) if valid[k]]
  total = 0.0
  for a in range(n):
    pos = (a + n // 2) % n
    den = [z[a] @ z[b] / tau for b in range(n) if b != a] + [z[a] @ d / tau for d in negs]
    total += -(z[a] @ z[pos]) / tau + _logsumexp(den)
  return total / n


def np_info_nce(z0, z1, tau):
  q, k = _norm(z0), _norm(z1)
  return np.mean([-(q[i] @ k[i]) / tau + _logsumexp([q[i] @ k[j] / tau for j in range(len(k))])
                  for i in range(len(q))])


def np_code_dictionary_loss(z0, z1, dictionary, valid, tau, w):
  """Client_CA.loss: 0.8 InfoNCE + 0.2 CE(z0 other_dictᵀ / τ, arange), other_dict = the valid rows
  in order; queries beyond the number of rows have no target (the code would fail there)."""
  base = np_info_nce(z0, z1, tau)
  rows = [np.asarray(dictionary[k], np.float64) for k in range(len(valid)) if valid[k]]
  if not rows:
    return base
  q = _norm(z0)
  ces = []
  for i in range(min(len(q), len(rows))):
    logits = [q[i] @ r / tau for r in rows]
    ces.append(-logits[i] + _logsumexp(logits))
  return (1 - w) * base + w * np.mean(ces)


def np_alignment_loss(z, ref, normalize):
  a, b = (_norm(z), _norm(ref)) if normalize else (np.asarray(z, np.float64),
                                                   np.asarray(ref, np.float64))
  return np.mean([np.sum((a[i] - b[i]) ** 2) for i in range(len(a))])


def _case(seed, b, k, d, num_valid):
  rng = np.random.RandomState(seed)
  z0, z1 = rng.normal(size=(b, d)), rng.normal(size=(b, d))
  dictionary = _norm(rng.normal(size=(k, d)))
  valid = np.zeros(k, bool)
  valid[rng.choice(k, num_valid, replace=False)] = True
  return z0, z1, dictionary, valid


# float64: O(2B + K) terms of O(1/τ) each, ~1e2 x 1.1e-16 relative. float32: every logit carries
# an error of about d·eps32/τ (a d-term dot product of unit vectors, then / τ), and a cross-entropy
# adds O(1) roundings of its O(1/τ)-sized terms: bound 4·(d + 2B + K)·eps32/τ absolute.
RTOL64 = 1e-12
EPS32 = float(np.finfo(np.float32).eps)


def _bound32(b, k, d, tau):
  return 4 * (d + 2 * b + k) * EPS32 / tau


@pytest.mark.parametrize('b,k,d,num_valid,tau', [(4, 9, 5, 6, 0.1), (3, 5, 8, 5, 0.5),
                                                 (6, 4, 3, 2, 0.1), (1, 3, 2, 0, 0.2)])
def test_dictionary_nt_xent_matches_numpy(b, k, d, num_valid, tau):
  z0, z1, dictionary, valid = _case(b * 10 + k, b, k, d, num_valid)
  want = np_dictionary_nt_xent(z0, z1, dictionary, valid, tau)
  with jax.enable_x64(True):
    got = fedca.dictionary_nt_xent(jnp.asarray(z0), jnp.asarray(z1), jnp.asarray(dictionary),
                                   jnp.asarray(valid), tau)
    assert got.dtype == jnp.float64
  assert float(got) == pytest.approx(want, rel=RTOL64)
  got32 = jax.jit(fedca.dictionary_nt_xent, static_argnums=4)(
      *(jnp.asarray(a, jnp.float32) for a in (z0, z1, dictionary)), jnp.asarray(valid), tau)
  assert abs(float(got32) - want) <= _bound32(b, k, d, tau)
  # Not vacuous: the dictionary rows change the value (when there are any).
  if num_valid:
    assert abs(np_dictionary_nt_xent(z0, z1, dictionary, np.zeros_like(valid), tau) - want) > 1e-3


@pytest.mark.parametrize('b,k,d,num_valid,tau,w', [(4, 9, 5, 6, 0.1, 0.2), (5, 3, 4, 3, 0.3, 0.5),
                                                   (3, 6, 6, 1, 0.1, 0.2), (2, 4, 3, 0, 0.1, 0.2)])
def test_code_dictionary_loss_matches_numpy(b, k, d, num_valid, tau, w):
  """Queries beyond the number of valid rows (num_valid < B) get no dictionary term; with none
  at all the loss is InfoNCE."""
  z0, z1, dictionary, valid = _case(b * 10 + k + 1, b, k, d, num_valid)
  want = np_code_dictionary_loss(z0, z1, dictionary, valid, tau, w)
  with jax.enable_x64(True):
    got = fedca.code_dictionary_loss(jnp.asarray(z0), jnp.asarray(z1), jnp.asarray(dictionary),
                                     jnp.asarray(valid), tau, w)
    assert got.dtype == jnp.float64
  assert float(got) == pytest.approx(want, rel=RTOL64)
  got32 = jax.jit(fedca.code_dictionary_loss, static_argnums=(4, 5))(
      *(jnp.asarray(a, jnp.float32) for a in (z0, z1, dictionary)), jnp.asarray(valid), tau, w)
  assert abs(float(got32) - want) <= _bound32(b, k, d, tau)
  if num_valid:  # the row order matters: reversing the valid rows moves the targets
    rev = dictionary.copy()
    rev[valid] = dictionary[valid][::-1]
    if num_valid > 1:
      assert abs(np_code_dictionary_loss(z0, z1, rev, valid, tau, w) - want) > 1e-3


def test_losses_without_a_valid_row_are_the_plain_ones():
  z0, z1, dictionary, _ = _case(3, 5, 7, 4, 0)
  none = np.zeros(7, bool)
  with jax.enable_x64(True):
    args = (jnp.asarray(z0), jnp.asarray(z1), jnp.asarray(dictionary), jnp.asarray(none))
    assert float(fedca.dictionary_nt_xent(*args, 0.1)) == pytest.approx(
        float(losses.nt_xent(args[0], args[1], 0.1)), rel=1e-14)
    assert float(fedca.code_dictionary_loss(*args, 0.1)) == pytest.approx(
        float(fedca.info_nce(args[0], args[1], 0.1)), rel=1e-14)
  assert float(fedca.info_nce(z0, z1, 0.1)) == pytest.approx(np_info_nce(z0, z1, 0.1), rel=1e-5)


@pytest.mark.parametrize('seen,momentum', [(False, 0.5), (True, 0.5), (True, 0.0), (True, 0.9)])
def test_update_dictionary_matches_numpy(seen, momentum):
  rng = np.random.RandomState(int(seen) * 10 + int(momentum * 10))
  n, d = 6, 5
  old = _norm(rng.normal(size=(n, d)))
  z0, z1 = rng.normal(size=(n, d)) * 3, rng.normal(size=(n, d)) * 3
  want = np_update_dictionary(old, z0, z1, seen, momentum)
  with jax.enable_x64(True):
    entries = fedca.dictionary_entries(jnp.asarray(z0), jnp.asarray(z1))
    got = fedca.update_dictionary(jnp.asarray(old), entries, jnp.asarray(seen), momentum)
    assert got.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-13, atol=1e-15)
  np.testing.assert_allclose(np.linalg.norm(np.asarray(got), axis=1), 1.0, rtol=1e-13)
  got32 = jax.jit(fedca.update_dictionary, static_argnums=3)(
      jnp.asarray(old, jnp.float32), fedca.dictionary_entries(jnp.asarray(z0, jnp.float32),
                                                              jnp.asarray(z1, jnp.float32)),
      jnp.asarray(seen), momentum)
  # A handful of float32 operations per entry of a unit vector: ~d·eps32.
  np.testing.assert_allclose(np.asarray(got32), want, atol=4 * d * EPS32)
  if seen and momentum:   # not vacuous: the stored row matters
    assert np.abs(np_update_dictionary(old, z0, z1, False, momentum) - want).max() > 1e-3


@pytest.mark.parametrize('normalize', [True, False])
def test_alignment_loss_matches_numpy(normalize):
  rng = np.random.RandomState(7)
  z, ref = rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
  want = np_alignment_loss(z, ref, normalize)
  with jax.enable_x64(True):
    got = fedca.alignment_loss(jnp.asarray(z), jnp.asarray(ref), normalize)
    grad = jax.grad(lambda r: fedca.alignment_loss(jnp.asarray(z), r, normalize))(jnp.asarray(ref))
    assert float(jnp.max(jnp.abs(grad))) == 0.0   # the reference is a constant
  assert float(got) == pytest.approx(want, rel=RTOL64)
  got32 = fedca.alignment_loss(jnp.asarray(z, jnp.float32), jnp.asarray(ref, jnp.float32), normalize)
  # d squared differences of entries of size <= 2 (unit rows) or <= 2·max|x|: a few eps32 each.
  scale = 4.0 if normalize else 4 * float(np.max(np.abs(np.concatenate([z, ref])))) ** 2
  assert abs(float(got32) - want) <= 4 * z.shape[1] * EPS32 * scale
  zz = jnp.asarray(z, jnp.float32)
  assert float(fedca.alignment_loss(zz, zz, normalize)) == 0.0


def test_select_negatives_ordered_random_and_all():
  p, d = 12, 3
  dictionary = jnp.asarray(np.arange(p * d, dtype=np.float32).reshape(p, d))
  valid = jnp.asarray(np.array([0, 1, 1, 0, 1, 0, 1, 1, 0, 0, 1, 0], bool))
  rows = np.flatnonzero(np.asarray(valid))
  # K >= P: the dictionary itself.
  got, ok = fedca.select_negatives(jax.random.PRNGKey(0), dictionary, valid, p, ordered=False)
  assert got is dictionary and ok is valid
  # Ordered: the first K valid rows in order; more than the valid count: the tail is invalid.
  got, ok = fedca.select_negatives(jax.random.PRNGKey(0), dictionary, valid, 4, ordered=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(dictionary)[rows[:4]])
  assert np.all(np.asarray(ok))
  got, ok = fedca.select_negatives(jax.random.PRNGKey(0), dictionary, valid, 9, ordered=True)
  np.testing.assert_array_equal(np.asarray(got)[:len(rows)], np.asarray(dictionary)[rows])
  assert np.asarray(ok).tolist() == [True] * len(rows) + [False] * (9 - len(rows))
  # Random: distinct valid rows, each valid row drawn with probability K / #valid.
  counts = np.zeros(p)
  draws = 600
  for s in range(draws):
    got, ok = fedca.select_negatives(jax.random.PRNGKey(s), dictionary, valid, 3, ordered=False)
    picked = np.asarray(got)[:, 0].astype(int) // d
    assert np.all(np.asarray(ok)) and len(set(picked)) == 3 and set(picked) <= set(rows)
    counts[picked] += 1
  freq = counts[rows] / draws
  # Binomial(600, 1/2): std 0.02; 5 std.
  np.testing.assert_allclose(freq, 3 / len(rows), atol=0.1)
  assert counts[~np.asarray(valid)].sum() == 0


def test_float32_gradients_are_finite_without_valid_rows():
  z0, z1, dictionary, _ = _case(5, 4, 6, 3, 0)
  args = [jnp.asarray(a, jnp.float32) for a in (z0, z1, dictionary)]
  for valid in (np.zeros(6, bool), np.array([1, 0, 0, 0, 0, 1], bool)):
    for fn in (lambda a, b: fedca.code_dictionary_loss(a, b, args[2], jnp.asarray(valid), 0.1),
               lambda a, b: fedca.dictionary_nt_xent(a, b, args[2], jnp.asarray(valid), 0.1)):
      loss, grads = jax.value_and_grad(fn, argnums=(0, 1))(args[0], args[1])
      assert np.isfinite(float(loss))
      assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
  # No gradient flows into the dictionary (a constant of the round).
  g = jax.grad(lambda dd: fedca.dictionary_nt_xent(args[0], args[1], dd, jnp.ones(6, bool), 0.1))(
      args[2])
  assert float(jnp.max(jnp.abs(g))) == 0.0


def test_bad_shapes_and_values_are_refused():
  z = jnp.ones((3, 4))
  with pytest.raises(ValueError, match='dictionary'):
    fedca.dictionary_nt_xent(z, z, jnp.ones((5, 3)), jnp.ones(5, bool), 0.1)
  with pytest.raises(ValueError, match='valid'):
    fedca.code_dictionary_loss(z, z, jnp.ones((5, 4)), jnp.ones(4, bool), 0.1)
  with pytest.raises(ValueError, match='temperature'):
    fedca.dictionary_nt_xent(z, z, jnp.ones((5, 4)), jnp.ones(5, bool), 0.0)
  with pytest.raises(ValueError, match='z0'):
    fedca.info_nce(z, jnp.ones((2, 4)), 0.1)
  with pytest.raises(ValueError, match='momentum'):
    fedca.update_dictionary(z, z, jnp.asarray(True), 1.0)
  with pytest.raises(ValueError, match='size'):
    fedca.select_negatives(jax.random.PRNGKey(0), z, jnp.ones(3, bool), 0, ordered=True)
