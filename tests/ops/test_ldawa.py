"""ops/ldawa.py: L-DAWA's aggregation against a float64 numpy loop over clients and layers (uniform
and data-size weights), the clip at 1, zero-norm layers, negative cosines and 0-dim leaves."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl.ops import ldawa

M = 4
SHAPES = {'conv': {'kernel': (3, 3, 2, 5), 'bias': (5,)}, 'dense': {'kernel': (7, 3)},
          'count': ()}


def np_ldawa(clients, glob, weights):
  """The release's rule written out: per client and layer, scale by the cosine with the global
  layer if both norms are > 0 (clipped at 1), then the weighted sum; 0-dim layers plainly."""
  out = {}
  for name, g in glob.items():
    if isinstance(g, dict):
      out[name] = np_ldawa([c[name] for c in clients], g, weights)
      continue
    g = np.asarray(g, np.float64)
    total = np.zeros_like(g)
    for w, c in zip(weights, clients):
      x = np.asarray(c[name], np.float64)
      scale = 1.0
      if g.ndim and np.linalg.norm(x) > 0 and np.linalg.norm(g) > 0:
        scale = min(float(np.sum(x * g)) / (np.linalg.norm(x) * np.linalg.norm(g)), 1.0)
      total = total + w * scale * x
    out[name] = total
  return out


def _tree(rng, shapes):
  return {k: _tree(rng, v) if isinstance(v, dict) else rng.normal(size=v) + 0.5
          for k, v in shapes.items()}


def _stack(trees):
  return jax.tree_util.tree_map(lambda *a: jnp.asarray(np.stack(a)), *trees)


def _clients(rng, glob):
  """Clients near the global model, and special layers: a multiple of the global layer (cosine 1 up
  to rounding, clipped), its negative (cosine -1), a zero layer."""
  clients = [jax.tree_util.tree_map(lambda g: g + rng.normal(size=np.shape(g)) * 0.7, glob)
             for _ in range(M)]
  clients[0]['dense']['kernel'] = 3.0 * glob['dense']['kernel']
  clients[1]['dense']['kernel'] = -glob['dense']['kernel']
  clients[2]['conv']['bias'] = np.zeros(5)
  return clients


@pytest.fixture(autouse=True)
def _float64():
  with jax.enable_x64(True):
    yield


# Per leaf: a cosine (sums of <= 90 products) and a sum of M scaled layers, all in float64:
# rounding ~1e2 x 1.1e-16 relative to the leaf's magnitude.
RTOL = 1e-13


def _assert_close(got, want):
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert np.asarray(g).dtype == np.float64
    np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=RTOL * np.max(np.abs(w)))


@pytest.mark.parametrize('size_weights', [False, True])
def test_matches_numpy_float64(size_weights):
  rng = np.random.default_rng(int(size_weights))
  glob = _tree(rng, SHAPES)
  clients = _clients(rng, glob)
  weights = rng.uniform(1, 10, M) if size_weights else np.ones(M)
  weights = weights / weights.sum()
  got = jax.jit(ldawa.aggregate)(_stack(clients),
                                 jax.tree_util.tree_map(jnp.asarray, glob),
                                 jnp.asarray(weights) if size_weights else None)
  want = np_ldawa(clients, glob, weights)
  _assert_close(got, want)
  # Not vacuous: the plain weighted mean is far from it.
  mean = jax.tree_util.tree_map(lambda *a: sum(w * x for w, x in zip(weights, a)), *clients)
  assert np.max(np.abs(np.asarray(got['dense']['kernel']) - mean['dense']['kernel'])) > 0.1


def test_scales_clip_at_one_and_skip_zero_layers():
  rng = np.random.default_rng(3)
  glob = _tree(rng, SHAPES)
  clients = _clients(rng, glob)
  scales = ldawa.layer_scales(_stack(clients), jax.tree_util.tree_map(jnp.asarray, glob))
  # A multiple of the global layer: cosine 1 up to rounding, never above.
  assert float(scales['dense']['kernel'][0]) == pytest.approx(1.0, abs=1e-15)
  assert float(scales['dense']['kernel'][1]) == pytest.approx(-1.0, abs=1e-15)
  assert float(scales['conv']['bias'][2]) == 1.0              # zero client layer: unscaled
  assert np.all(np.asarray(scales['count']) == 1.0)           # 0-dim: averaged plainly
  assert all(np.all(np.asarray(s) <= 1.0) for s in jax.tree_util.tree_leaves(scales))
  zero_glob = jax.tree_util.tree_map(jnp.zeros_like, jax.tree_util.tree_map(jnp.asarray, glob))
  for leaf in jax.tree_util.tree_leaves(ldawa.layer_scales(_stack(clients), zero_glob)):
    assert np.all(np.asarray(leaf) == 1.0)                    # zero global layer: unscaled


def test_float32_stays_float32():
  rng = np.random.default_rng(5)
  glob = _tree(rng, SHAPES)
  clients = _clients(rng, glob)
  with jax.enable_x64(False):
    got = ldawa.aggregate(_stack(clients), jax.tree_util.tree_map(jnp.asarray, glob))
    assert all(a.dtype == jnp.float32 for a in jax.tree_util.tree_leaves(got))
