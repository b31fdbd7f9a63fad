"""Evaluation: feature extraction, linear probe, kNN monitor, class-balanced subsets, semi-supervised fine-tune.

Models are tiny self-written Flax MLPs and data are synthetic, so these tests do not depend on
fedjax_ssl.models or fedjax_ssl.data.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

from fedjax_ssl import eval as ev

MEAN, STD = (0.4,), (0.2,)


class TinyEncoder(nn.Module):
  """Flatten -> Dense(hidden) -> [BatchNorm] -> ReLU -> Dense(features)."""
  features: int = 6
  hidden: int = 16
  use_bn: bool = True

  @nn.compact
  def __call__(self, x, train):
    h = nn.Dense(self.hidden)(x.reshape((x.shape[0], -1)))
    if self.use_bn:
      h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
    return nn.Dense(self.features)(nn.relu(h))


def np_tiny_encoder(variables, images_uint8):
  """Independent float64 numpy forward of TinyEncoder in eval mode (flax BatchNorm eps = 1e-5)."""
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), variables['params'])
  x = (images_uint8.astype(np.float64) / 255.0 - MEAN[0]) / STD[0]
  h = x.reshape(len(x), -1) @ p['Dense_0']['kernel'] + p['Dense_0']['bias']
  if 'batch_stats' in variables:
    s = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), variables['batch_stats'])['BatchNorm_0']
    h = (h - s['mean']) / np.sqrt(s['var'] + 1e-5) * p['BatchNorm_0']['scale'] + p['BatchNorm_0']['bias']
  return np.maximum(h, 0) @ p['Dense_1']['kernel'] + p['Dense_1']['bias']


def init_encoder(encoder, seed, image_shape=(4, 4, 1)):
  """Variables with non-trivial BatchNorm statistics and affine parameters (so eval mode matters)."""
  variables = encoder.init(jax.random.PRNGKey(seed), jnp.zeros((1,) + image_shape), train=False)
  variables = jax.tree_util.tree_map(np.asarray, variables)
  if 'batch_stats' in variables:
    rng = np.random.default_rng(seed)
    stats = variables['batch_stats']['BatchNorm_0']
    stats['mean'] = rng.normal(size=stats['mean'].shape).astype(np.float32)
    stats['var'] = rng.uniform(0.5, 2.0, size=stats['var'].shape).astype(np.float32)
    variables['params']['BatchNorm_0']['scale'] = rng.uniform(0.5, 1.5, encoder.hidden).astype(np.float32)
  return variables


def random_images(rng, n, shape=(4, 4, 1)):
  return rng.integers(0, 256, size=(n,) + shape, dtype=np.uint8)


# ----------------------------------------------------------------------------- features

def test_extract_features_matches_numpy_forward():
  encoder = TinyEncoder()
  variables = init_encoder(encoder, 0)
  images = random_images(np.random.default_rng(0), 10)
  apply_fn = functools.partial(encoder.apply, train=False)
  feats = ev.extract_features(apply_fn, variables, images, MEAN, STD, batch_size=4)  # 4 + 4 + 2 (padded)
  assert feats.shape == (10, 6) and feats.dtype == jnp.float32
  np.testing.assert_allclose(feats, np_tiny_encoder(variables, images), rtol=1e-5, atol=1e-5)
  # Device-resident images give the same result.
  np.testing.assert_allclose(ev.extract_features(apply_fn, variables, jnp.asarray(images), MEAN, STD, 4), feats,
                             rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match='uint8'):
    ev.extract_features(apply_fn, variables, images.astype(np.float32), MEAN, STD, 4)
  with pytest.raises(ValueError, match='per channel'):
    ev.extract_features(apply_fn, variables, images, (0.1, 0.2), (0.3, 0.3), 4)


@pytest.mark.parametrize('client_strategy', ['vmap', 'map'])
def test_extract_features_stacked_matches_per_client(client_strategy):
  encoder = TinyEncoder()
  per_client = [init_encoder(encoder, seed) for seed in range(3)]
  stacked = jax.tree_util.tree_map(lambda *a: np.stack(a), *per_client)
  images = random_images(np.random.default_rng(1), 7)
  feats = ev.extract_features_stacked(functools.partial(encoder.apply, train=False), stacked, images, MEAN, STD,
                                      batch_size=3, client_strategy=client_strategy)
  assert feats.shape == (3, 7, 6)
  for c in range(3):
    np.testing.assert_allclose(feats[c], np_tiny_encoder(per_client[c], images), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- linear probe

def gaussian_blobs(rng, num_classes, dim, per_class, separation):
  centers = rng.normal(size=(num_classes, dim)) * separation
  y = np.repeat(np.arange(num_classes), per_class)
  return (centers[y] + rng.normal(size=(len(y), dim))).astype(np.float32), y.astype(np.int32)


def test_linear_probe_separable_and_shuffled_labels():
  k = 10
  # Train and test points around the same class centres: draw jointly, then split.
  xall, yall = gaussian_blobs(np.random.default_rng(0), k, 32, 100, separation=3.0)
  xtr, ytr, xte, yte = xall[0::2], yall[0::2], xall[1::2], yall[1::2]   # 500 / 500
  res = ev.linear_probe(xtr, ytr, xte, yte, k, epochs=30, batch_size=128, lr=3e-3)
  assert res['test_acc'] >= 0.98 and res['train_acc'] >= 0.98
  assert res['best_test_acc'] >= res['test_acc']
  # Labels independent of the features: test accuracy is Binomial(500, 1/K) / 500.
  perm = np.random.default_rng(1)
  shuffled = ev.linear_probe(xtr, perm.permutation(ytr), xte, perm.permutation(yte), k, epochs=30, batch_size=128)
  sigma = np.sqrt(0.1 * 0.9 / len(yte))
  assert abs(shuffled['test_acc'] - 1.0 / k) <= 4 * sigma


def test_linear_probe_reaches_logistic_regression_optimum():
  """Overlapping classes: the probe's final training loss approaches the float64 L-BFGS optimum of the same
  (unregularised) multinomial logistic regression. N = 130 with batch 128 makes the last batch 2 real + 126
  padded slots, so a padding/masking error would pull the solution away from the optimum."""
  rng = np.random.default_rng(0)
  k, d, n = 3, 4, 130
  centers = rng.normal(size=(k, d))
  y = rng.integers(0, k, n)
  x = centers[y] + rng.normal(size=(n, d))

  def nll(w):
    logits = x @ w[:d * k].reshape(d, k) + w[d * k:]
    logits -= logits.max(axis=1, keepdims=True)
    return np.mean(np.log(np.exp(logits).sum(axis=1)) - logits[np.arange(n), y])

  opt = scipy.optimize.minimize(nll, np.zeros(d * k + k), method='L-BFGS-B',
                                options=dict(gtol=1e-12, ftol=1e-15, maxiter=10000))
  assert opt.success and opt.fun > 0.3   # not separable: a finite optimum exists
  res = ev.linear_probe(x.astype(np.float32), y, x.astype(np.float32), y, k, epochs=300, batch_size=128, lr=1e-2)
  assert opt.fun - 1e-5 <= res['final_loss'] <= opt.fun + 0.02
  predicted_opt = np.argmax(x @ opt.x[:d * k].reshape(d, k) + opt.x[d * k:], axis=1)
  assert abs(res['train_acc'] - np.mean(predicted_opt == y)) <= 0.03


def test_linear_probe_stack_matches_single_runs():
  rng = np.random.default_rng(4)
  xtr = rng.normal(size=(2, 70, 5)).astype(np.float32)
  xte = rng.normal(size=(2, 30, 5)).astype(np.float32)
  ytr, yte = rng.integers(0, 3, 70), rng.integers(0, 3, 30)
  xtr[1] += np.eye(3, 5)[ytr] * 2.0   # client 1 has informative features, client 0 does not
  xte[1] += np.eye(3, 5)[yte] * 2.0
  kw = dict(epochs=5, batch_size=32, lr=1e-2, seed=3)
  stack = ev.linear_probe_stack(xtr, ytr, xte, yte, 3, **kw)
  for c in range(2):
    single = ev.linear_probe(xtr[c], ytr, xte[c], yte, 3, **kw)
    for key in ('train_acc', 'test_acc', 'best_test_acc'):
      assert stack[key][c] == pytest.approx(single[key], abs=1e-6)
    assert stack['final_loss'][c] == pytest.approx(single['final_loss'], rel=1e-5)
  assert stack['mean_test_acc'] == pytest.approx(np.mean(stack['test_acc']))
  assert stack['test_acc'][1] > stack['test_acc'][0]


def test_linear_probe_standardize_equals_prestandardized_features():
  rng = np.random.default_rng(9)
  scale, shift = [1.0, 10.0, 0.1, 3.0, 0.5], [0.0, 5.0, -2.0, 1.0, 0.0]
  xtr = rng.normal(size=(70, 5)) * scale + shift   # shapes as in the stack test: the reference run reuses
  xte = rng.normal(size=(30, 5)) * scale + shift   # its compiled program
  ytr, yte = rng.integers(0, 3, 70), rng.integers(0, 3, 30)
  mu, sd = xtr.mean(0), xtr.std(0)
  kw = dict(epochs=5, batch_size=32, lr=1e-2, seed=1)
  got = ev.linear_probe(xtr.astype(np.float32), ytr, xte.astype(np.float32), yte, 3, standardize=True, **kw)
  ref = ev.linear_probe(((xtr - mu) / sd).astype(np.float32), ytr, ((xte - mu) / sd).astype(np.float32), yte, 3,
                        **kw)
  assert got['final_loss'] == pytest.approx(ref['final_loss'], rel=1e-4)
  assert got['test_acc'] == pytest.approx(ref['test_acc'])


def test_linear_probe_bad_inputs():
  x, y = np.zeros((4, 2), np.float32), np.array([0, 1, 2, 3])
  with pytest.raises(ValueError, match=r'\[0, 3\)'):
    ev.linear_probe(x, y, x, y, 3)
  with pytest.raises(ValueError, match='labels'):
    ev.linear_probe(x, y[:3], x, y, 4)


# ----------------------------------------------------------------------------- kNN

def np_knn_predict(train_f, train_y, test_f, num_classes, k, temperature):
  """Brute force in float64: sort all similarities, weighted vote in loops."""
  bank = train_f / np.linalg.norm(train_f, axis=1, keepdims=True)
  preds = []
  for q in test_f:
    sims = bank @ (q / np.linalg.norm(q))
    order = np.argsort(-sims)[:k]
    scores = np.zeros(num_classes)
    for i in order:
      scores[train_y[i]] += np.exp(sims[i] / temperature)
    preds.append(int(np.argmax(scores)))
  return np.array(preds)


@pytest.mark.parametrize('k,temperature', [(10, 0.1), (60, 0.5), (1, 0.1)])
def test_knn_matches_brute_force(k, temperature):
  rng = np.random.default_rng(5)
  train_f, test_f = rng.normal(size=(60, 8)), rng.normal(size=(25, 8))
  train_y, test_y = rng.integers(0, 4, 60), rng.integers(0, 4, 25)
  ref = np_knn_predict(train_f, train_y, test_f, 4, k, temperature)
  got = ev.knn_predict(train_f.astype(np.float32), train_y, test_f.astype(np.float32), 4, k, temperature,
                       batch_size=7)   # 7 + 7 + 7 + 4 (padded chunk)
  np.testing.assert_array_equal(got, ref)
  acc = ev.knn_monitor(train_f.astype(np.float32), train_y, test_f.astype(np.float32), test_y, 4, k, temperature,
                       batch_size=7)
  assert acc == pytest.approx(np.mean(ref == test_y))


def test_knn_k_larger_than_bank_raises():
  x, y = np.ones((5, 3), np.float32), np.zeros(5, np.int32)
  with pytest.raises(ValueError, match='k must lie in'):
    ev.knn_monitor(x, y, x, y, 2, k=6)


# ----------------------------------------------------------------------------- semi-supervised fine-tune

def test_class_balanced_subset_counts():
  labels = np.concatenate([np.full(10, 0), np.full(25, 1), np.full(3, 2), np.full(100, 3)])
  np.random.default_rng(0).shuffle(labels)
  idx = ev.class_balanced_subset(labels, 0.1, seed=0)
  # round-half-up(0.1 * N_c), at least 1: 10 -> 1, 25 -> 2.5 -> 3, 3 -> 0.3 -> 1, 100 -> 10.
  np.testing.assert_array_equal(np.bincount(labels[idx], minlength=4), [1, 3, 1, 10])
  assert len(np.unique(idx)) == len(idx) and np.all(np.diff(idx) > 0)
  np.testing.assert_array_equal(ev.class_balanced_subset(labels, 0.1, seed=0), idx)
  assert not np.array_equal(ev.class_balanced_subset(labels, 0.1, seed=1), idx)
  np.testing.assert_array_equal(ev.class_balanced_subset(labels, 1.0, seed=0), np.arange(len(labels)))
  with pytest.raises(ValueError, match='fraction'):
    ev.class_balanced_subset(labels, 0.0, seed=0)


def stripe_images(rng, n, num_classes=4):
  """Class c: a bright row c on a noisy 4x4 background (invariant to horizontal flips)."""
  y = rng.integers(0, num_classes, n)
  x = rng.integers(0, 90, size=(n, 4, 4, 1))
  x[np.arange(n), y, :, 0] += 160
  return x.astype(np.uint8), y.astype(np.int32)


def random_hflip(key, images_uint8):
  """A stand-in augment_fn: per-image horizontal flip, returns float32 in [0, 1]."""
  flip = jax.random.bernoulli(key, 0.5, (images_uint8.shape[0], 1, 1, 1))
  return jnp.where(flip, images_uint8[:, :, ::-1], images_uint8).astype(jnp.float32) / 255.0


def test_semi_supervised_finetune_learns_and_stack_matches():
  rng = np.random.default_rng(6)
  train_x, train_y = stripe_images(rng, 40)
  test_x, test_y = stripe_images(rng, 200)
  encoder = TinyEncoder(features=3)
  kw = dict(mean=MEAN, std=STD, epochs=15, batch_size=16, lr=0.05, seed=0, augment_fn=random_hflip)
  res = ev.semi_supervised_finetune(encoder, init_encoder(encoder, 0), train_x, train_y, test_x, test_y, 4, **kw)
  assert res['test_acc'] >= 0.9
  assert res['final_train_loss'] < 0.5 * np.log(4)
  # test_acc is the eval-mode (running BatchNorm statistics) accuracy of the returned model.
  head = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), res['head'])
  logits = np_tiny_encoder(res['encoder_variables'], test_x) @ head['kernel'] + head['bias']
  assert res['test_acc'] == pytest.approx(np.mean(np.argmax(logits, axis=1) == test_y), abs=1e-6)
  initial = init_encoder(encoder, 0)
  # The encoder was trained and its BatchNorm running statistics were updated.
  assert not np.allclose(res['encoder_variables']['params']['Dense_0']['kernel'],
                         initial['params']['Dense_0']['kernel'])
  assert not np.allclose(res['encoder_variables']['batch_stats']['BatchNorm_0']['mean'],
                         initial['batch_stats']['BatchNorm_0']['mean'])
  # Per-example evaluation (batch of 1) gives the same accuracy: nothing depends on the test batch.
  one_by_one = ev.semi_supervised_finetune(encoder, init_encoder(encoder, 0), train_x, train_y, test_x, test_y,
                                           4, eval_batch_size=1, **kw)
  assert one_by_one['test_acc'] == pytest.approx(res['test_acc'])
  # The same run with a negligible learning rate (about the initial model) stays far below.
  frozen = ev.semi_supervised_finetune(encoder, init_encoder(encoder, 0), train_x, train_y, test_x, test_y, 4,
                                       **{**kw, 'lr': 1e-6})
  assert frozen['test_acc'] < 0.7 and frozen['final_train_loss'] > 1.0
  per_client = [init_encoder(encoder, s) for s in range(2)]
  stacked = jax.tree_util.tree_map(lambda *a: np.stack(a), *per_client)
  stack = ev.semi_supervised_finetune_stack(encoder, stacked, train_x, train_y, test_x, test_y, 4, **kw)
  assert stack['test_acc'][0] == pytest.approx(res['test_acc'])
  single1 = ev.semi_supervised_finetune(encoder, per_client[1], train_x, train_y, test_x, test_y, 4, **kw)
  assert stack['test_acc'][1] == pytest.approx(single1['test_acc'])
  assert stack['mean_test_acc'] == pytest.approx(np.mean(stack['test_acc']))


def test_semi_supervised_finetune_without_batch_stats():
  rng = np.random.default_rng(7)
  train_x, train_y = stripe_images(rng, 40)
  test_x, test_y = stripe_images(rng, 100)
  encoder = TinyEncoder(features=3, use_bn=False)
  variables = init_encoder(encoder, 1)
  assert 'batch_stats' not in variables
  res = ev.semi_supervised_finetune(encoder, variables, train_x, train_y, test_x, test_y, 4, mean=MEAN, std=STD,
                                    epochs=15, batch_size=64)   # batch 64 > 40 examples -> one batch of 40
  assert res['test_acc'] >= 0.9


def np_finetune_no_bn(variables, x_uint8, y, num_classes, epochs, batch_size, lr, momentum, seed, head_lr=None,
                      nesterov=True):
  """float64 numpy reference of the fine-tuning run for TinyEncoder(use_bn=False): manual backprop, SGD with
  (Nesterov) momentum (PyTorch form), the head at head_lr (default lr), following the documented protocol:
  rng = default_rng(seed) draws the head (PyTorch nn.Linear init: kernel then bias), then one permutation per
  epoch; the last batch is filled by wrapping around the permutation and the wrapped duplicates carry zero loss
  weight."""
  p = {k: np.asarray(v, np.float64) for k, v in (
      ('w0', variables['params']['Dense_0']['kernel']), ('b0', variables['params']['Dense_0']['bias']),
      ('w1', variables['params']['Dense_1']['kernel']), ('b1', variables['params']['Dense_1']['bias']))}
  rng = np.random.default_rng(seed)
  bound = 1 / np.sqrt(p['w1'].shape[1])
  p['wh'] = rng.uniform(-bound, bound, (p['w1'].shape[1], num_classes)).astype(np.float32).astype(np.float64)
  p['bh'] = rng.uniform(-bound, bound, (num_classes,)).astype(np.float32).astype(np.float64)
  x = ((x_uint8.astype(np.float64) / 255.0 - MEAN[0]) / STD[0]).reshape(len(x_uint8), -1)
  n = len(y)
  num_batches = -(-n // batch_size)
  buf = {k: np.zeros_like(v) for k, v in p.items()}
  for _ in range(epochs):
    perm = rng.permutation(n)
    epoch_loss = 0.0
    for b in range(num_batches):
      slots = np.arange(b * batch_size, (b + 1) * batch_size)
      idx, w = perm[slots % n], (slots < n).astype(np.float64)
      xb, yb = x[idx], y[idx]
      h = xb @ p['w0'] + p['b0']
      a = np.maximum(h, 0)
      f = a @ p['w1'] + p['b1']
      logits = f @ p['wh'] + p['bh']
      logits -= logits.max(axis=1, keepdims=True)
      prob = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
      ce = -np.log(prob[np.arange(len(yb)), yb])
      epoch_loss += np.sum(ce * w)
      dlogits = (prob - np.eye(num_classes)[yb]) * (w / w.sum())[:, None]
      df = dlogits @ p['wh'].T
      dh = (df @ p['w1'].T) * (h > 0)
      grads = {'wh': f.T @ dlogits, 'bh': dlogits.sum(0), 'w1': a.T @ df, 'b1': df.sum(0),
               'w0': xb.T @ dh, 'b0': dh.sum(0)}
      for k in p:
        buf[k] = momentum * buf[k] + grads[k]
        rate = head_lr if head_lr is not None and k in ('wh', 'bh') else lr
        p[k] = p[k] - rate * (grads[k] + momentum * buf[k] if nesterov else buf[k])
  return p, epoch_loss / n


def test_semi_supervised_finetune_matches_numpy_reference():
  rng = np.random.default_rng(8)
  train_x, train_y = stripe_images(rng, 10)
  test_x, test_y = stripe_images(rng, 20)
  encoder = TinyEncoder(features=3, use_bn=False)
  variables = init_encoder(encoder, 2)
  res = ev.semi_supervised_finetune(encoder, variables, train_x, train_y, test_x, test_y, 4, mean=MEAN, std=STD,
                                    epochs=2, batch_size=4, lr=0.05, seed=5)   # batches 4 + 4 + (2 + 2 wrapped)
  ref, ref_loss = np_finetune_no_bn(variables, train_x, train_y, 4, epochs=2, batch_size=4, lr=0.05,
                                    momentum=0.9, seed=5)
  got = res['encoder_variables']['params']
  for name, value in (('w0', got['Dense_0']['kernel']), ('b0', got['Dense_0']['bias']),
                      ('w1', got['Dense_1']['kernel']), ('b1', got['Dense_1']['bias']),
                      ('wh', res['head']['kernel']), ('bh', res['head']['bias'])):
    np.testing.assert_allclose(value, ref[name], rtol=1e-4, atol=1e-5, err_msg=name)
  assert res['final_train_loss'] == pytest.approx(ref_loss, rel=1e-4)


def test_pixels_fine_tuned_is_the_protocols_linear_classifier_on_the_pixels():
  """`finetune.Pixels` (the fine-tuning metrics' raw-pixel reference) has no parameters, so the
  protocol trains the head alone on the normalised pixels: float64 numpy softmax regression with
  the same head draw, shuffles, wrapped last batch and Nesterov momentum."""
  rng = np.random.default_rng(11)
  train_x, train_y = stripe_images(rng, 10)
  test_x, test_y = stripe_images(rng, 40)
  kw = dict(mean=MEAN, std=STD, epochs=3, batch_size=4, lr=0.05, seed=6)  # batches 4 + 4 + (2 + 2)
  res = ev.semi_supervised_finetune(ev.finetune.Pixels(), {'params': {}}, train_x, train_y, test_x,
                                    test_y, 4, **kw)
  assert res['encoder_variables'] == {'params': {}}
  rng = np.random.default_rng(6)
  bound = 1 / np.sqrt(16)
  w = rng.uniform(-bound, bound, (16, 4)).astype(np.float32).astype(np.float64)
  b = rng.uniform(-bound, bound, (4,)).astype(np.float32).astype(np.float64)
  norm = lambda x: ((x.astype(np.float64) / 255.0 - MEAN[0]) / STD[0]).reshape(len(x), -1)
  x, n = norm(train_x), len(train_y)
  buf_w, buf_b = np.zeros_like(w), np.zeros_like(b)
  for _ in range(3):
    perm = rng.permutation(n)
    for first in range(0, n, 4):
      slots = np.arange(first, first + 4)
      idx, m = perm[slots % n], (slots < n).astype(np.float64)
      logits = x[idx] @ w + b
      prob = np.exp(logits - logits.max(1, keepdims=True))
      prob /= prob.sum(1, keepdims=True)
      d = (prob - np.eye(4)[train_y[idx]]) * (m / m.sum())[:, None]
      grads = (x[idx].T @ d, d.sum(0))
      buf_w, buf_b = 0.9 * buf_w + grads[0], 0.9 * buf_b + grads[1]
      w, b = w - 0.05 * (grads[0] + 0.9 * buf_w), b - 0.05 * (grads[1] + 0.9 * buf_b)
  # float32 against float64 over 9 steps on inputs of magnitude <= 2 / 0.2 = 10.
  np.testing.assert_allclose(res['head']['kernel'], w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(res['head']['bias'], b, rtol=1e-5, atol=1e-6)
  assert res['test_acc'] == pytest.approx(np.mean(np.argmax(norm(test_x) @ w + b, 1) == test_y))


def test_fedu2_preset_moves_the_head_at_0p3_and_the_encoder_at_1e_3():
  settings = ev.finetune.protocol_settings('fedu2', 0.01, epochs=1)
  assert settings == dict(epochs=1, eval_epochs=(1,), batch_size=128, lr=1e-3, head_lr=0.3, momentum=0.9,
                          nesterov=False, augmentation='fedu2_finetune')
  del settings['augmentation']   # the pipeline is tested in tests/data/test_augment.py
  rng = np.random.default_rng(9)
  train_x, train_y = stripe_images(rng, 10)    # 10 images < batch 128: one step on one full batch
  test_x, test_y = stripe_images(rng, 20)
  encoder = TinyEncoder(features=3, use_bn=False)
  variables = init_encoder(encoder, 3)
  res = ev.semi_supervised_finetune(encoder, variables, train_x, train_y, test_x, test_y, 4, mean=MEAN, std=STD,
                                    seed=4, **settings)
  # One SGD step from a zero momentum buffer is p - rate * grad: the reference's gradients, each part at its
  # own rate (0.3 would move the encoder 300 times further, 1e-3 the head 300 times less).
  ref, _ = np_finetune_no_bn(variables, train_x, train_y, 4, epochs=1, batch_size=10, lr=1e-3, momentum=0.9,
                             seed=4, head_lr=0.3, nesterov=False)
  got = res['encoder_variables']['params']
  for name, value in (('w0', got['Dense_0']['kernel']), ('b0', got['Dense_0']['bias']),
                      ('w1', got['Dense_1']['kernel']), ('b1', got['Dense_1']['bias']),
                      ('wh', res['head']['kernel']), ('bh', res['head']['bias'])):
    np.testing.assert_allclose(value, ref[name], rtol=1e-5, atol=1e-7, err_msg=name)
  same_rate, _ = np_finetune_no_bn(variables, train_x, train_y, 4, epochs=1, batch_size=10, lr=1e-3,
                                   momentum=0.9, seed=4, nesterov=False)
  init_head = ev.finetune.torch_linear_init(np.random.default_rng(4), 3, 4)['kernel']
  np.testing.assert_allclose(res['head']['kernel'] - init_head, 300 * (same_rate['wh'] - init_head), rtol=1e-3,
                             atol=1e-6)


def test_test_accuracy_at_eval_epochs_and_the_best_reported():
  rng = np.random.default_rng(10)
  train_x, train_y = stripe_images(rng, 24)
  test_x, test_y = stripe_images(rng, 60)
  encoder = TinyEncoder(features=3)
  kw = dict(mean=MEAN, std=STD, epochs=6, batch_size=8, lr=0.02, head_lr=0.1, seed=1, augment_fn=random_hflip)
  run = lambda **extra: ev.semi_supervised_finetune(encoder, init_encoder(encoder, 4), train_x, train_y, test_x,
                                                    test_y, 4, **kw, **extra)
  once, split = run(), run(eval_epochs=(2, 4, 6))
  assert once['test_accs'].shape == (1,) and split['test_accs'].shape == (3,)
  assert split['test_acc'] == max(split['test_accs'])
  # Testing in between does not change training: the same final model, loss and last accuracy.
  assert split['test_accs'][-1] == pytest.approx(once['test_acc'])
  assert split['final_train_loss'] == pytest.approx(once['final_train_loss'], rel=1e-5)
  jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
                         (split['encoder_variables'], split['head']), (once['encoder_variables'], once['head']))
  for bad in ((3,), (4, 2, 6), (0, 6), ()):
    with pytest.raises(ValueError, match=r'eval_epochs = .* is invalid: must be increasing epochs in \[1, 6\]'):
      run(eval_epochs=bad)
  stack = ev.semi_supervised_finetune_stack(
      encoder, jax.tree_util.tree_map(lambda *a: np.stack(a), init_encoder(encoder, 4), init_encoder(encoder, 5)),
      train_x, train_y, test_x, test_y, 4, eval_epochs=(2, 4, 6), **kw)
  assert stack['test_accs'].shape == (2, 3)
  np.testing.assert_allclose(stack['test_accs'][0], split['test_accs'])
  np.testing.assert_array_equal(stack['test_acc'], stack['test_accs'].max(axis=1))


def test_protocol_settings():
  fedu2, hetero = (functools.partial(ev.finetune.protocol_settings, name) for name in ('fedu2', 'hetero_ssfl'))
  assert fedu2(0.1) == dict(ev.finetune.PROTOCOLS['fedu2'])   # its own epochs, one batch size
  assert fedu2(0.1, 20)['epochs'] == 20 and fedu2(0.1, 20)['eval_epochs'] == (10, 20)
  assert fedu2(0.1, 15)['eval_epochs'] == (8, 15)
  # Hetero-SSFL: 256 at 1%, 512 at 10%; between them the smaller, from 10% up the larger.
  assert [hetero(f)['batch_size'] for f in (0.005, 0.01, 0.05, 0.1, 0.5)] == [256, 256, 256, 512, 512]
  assert hetero(0.1) == dict(epochs=100, eval_epochs=(100,), batch_size=512, lr=0.05, head_lr=0.05,
                             momentum=0.9, nesterov=True, augmentation='none')
  assert hetero(0.1, 7)['eval_epochs'] == (7,)
  with pytest.raises(ValueError, match="fine-tuning protocol 'byol' is unknown"):
    ev.finetune.protocol_settings('byol', 0.1)
