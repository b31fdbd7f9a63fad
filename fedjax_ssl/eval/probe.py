"""Linear probe on frozen features: Dense(num_classes) with bias, Adam, shuffled minibatches.

The papers' protocol (Hetero-SSFL, arXiv:2205.12493, §5.1: Adam lr 3e-3, batch 512, 100 epochs; the FedSC official
code: the same with 200 epochs). The whole training run is one jitted program: `lax.scan` over epochs, each a `lax.scan`
over minibatches of a fresh permutation. The last, partial minibatch is padded to the fixed batch shape and
its padding is masked out of the loss, so every example is used once per epoch and the loss of that batch
is the mean over its real examples (PyTorch `drop_last=False`).

The randomness (head initialisation, per-epoch permutations) is drawn on the host from
`np.random.default_rng(seed)` and passed in: the jitted program stays free of PRNG code, whose XLA compile
time dominated on CPU, and the program is compiled once per (shapes, epochs, batch_size).
"""
from __future__ import annotations

import functools
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np
import optax


def torch_linear_init(rng: np.random.Generator, in_dim: int, out_dim: int) -> Dict[str, np.ndarray]:
  """PyTorch `nn.Linear` default init: weight and bias ~ U(-1/sqrt(in_dim), 1/sqrt(in_dim)).

  Returns:
    {'kernel': float32 [in_dim, out_dim], 'bias': float32 [out_dim]} (numpy).
  """
  bound = 1.0 / np.sqrt(in_dim)
  return {
      'kernel': rng.uniform(-bound, bound, (in_dim, out_dim)).astype(np.float32),
      'bias': rng.uniform(-bound, bound, (out_dim,)).astype(np.float32),
  }


def epoch_batches(rng: np.random.Generator, n: int, epochs: int, batch_size: int, wrap: bool) -> np.ndarray:
  """Per-epoch shuffled minibatch indices, int32 [epochs, ceil(n / batch_size), batch_size].

  The slots past n in the last batch hold index 0 (wrap=False) or wrap around to the start of the same
  permutation (wrap=True); either way they are meant to be masked out of the loss (see `slot_mask`).
  """
  num_batches = -(-n // batch_size)
  perms = np.stack([rng.permutation(n) for _ in range(epochs)])
  slots = np.arange(num_batches * batch_size)
  idx = perms[:, slots % n] if wrap else np.pad(perms, ((0, 0), (0, num_batches * batch_size - n)))
  return idx.reshape(epochs, num_batches, batch_size).astype(np.int32)


def slot_mask(n: int, num_batches: int, batch_size: int) -> jax.Array:
  """float32 [num_batches, batch_size]: 1 for the first n slots of an epoch, 0 for the padding."""
  return (jnp.arange(num_batches * batch_size) < n).astype(jnp.float32).reshape(num_batches, batch_size)


def _logits(params: Dict[str, jax.Array], features: jax.Array) -> jax.Array:
  return features @ params['kernel'] + params['bias']


def _masked_ce(params, features, labels, mask):
  ce = optax.softmax_cross_entropy_with_integer_labels(_logits(params, features), labels)
  return jnp.sum(ce * mask) / jnp.sum(mask)


def _accuracy(params, features, labels):
  return jnp.mean(jnp.argmax(_logits(params, features), axis=-1) == labels)


def _train_probe(train_f, train_y, test_f, test_y, params, batch_idx, lr, *, standardize):
  """One probe run: train_f [N, d], train_y [N], test_f [M, d], test_y [M], params the initial head,
  batch_idx int32 [epochs, num_batches, batch_size] (`epoch_batches`); returns scalars."""
  train_f = train_f.astype(jnp.float32)
  test_f = test_f.astype(jnp.float32)
  if standardize:  # statistics of the training features only, applied to both splits.
    mean = jnp.mean(train_f, axis=0)
    std = jnp.maximum(jnp.std(train_f, axis=0), 1e-6)
    train_f, test_f = (train_f - mean) / std, (test_f - mean) / std
  n = train_f.shape[0]
  mask = slot_mask(n, *batch_idx.shape[1:])
  opt = optax.adam(lr)

  def batch_step(carry, batch):
    params, opt_state = carry
    idx, m = batch
    grads = jax.grad(_masked_ce)(params, train_f[idx], train_y[idx], m)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), None

  def epoch(carry, idx):
    carry, _ = jax.lax.scan(batch_step, carry, (idx, mask))
    return carry, _accuracy(carry[0], test_f, test_y)

  (params, _), test_accs = jax.lax.scan(epoch, (params, opt.init(params)), batch_idx)
  return {
      'train_acc': _accuracy(params, train_f, train_y),
      'test_acc': test_accs[-1],
      'best_test_acc': jnp.max(test_accs),
      'final_loss': _masked_ce(params, train_f, train_y, jnp.ones((n,), jnp.float32)),
  }


_train_probe_jit = jax.jit(_train_probe, static_argnames='standardize')


@functools.partial(jax.jit, static_argnames='standardize')
def _train_probe_stack_jit(train_f, train_y, test_f, test_y, params, batch_idx, lr, *, standardize):
  # Per-client features [C, ...] share the labels, the initial head and the shuffling order.
  run = functools.partial(_train_probe, standardize=standardize)
  return jax.vmap(run, in_axes=(0, None, 0, None, None, None, None))(
      train_f, train_y, test_f, test_y, params, batch_idx, lr)


def _host_randomness(seed, n, d, num_classes, epochs, batch_size):
  rng = np.random.default_rng(seed)
  params = torch_linear_init(rng, d, num_classes)
  return params, epoch_batches(rng, n, epochs, batch_size, wrap=False)


def _check_probe_args(train_f, train_y, test_f, test_y, num_classes, epochs, batch_size, lr, feat_ndim):
  tf, ty, sf, sy = (np.shape(a) for a in (train_f, train_y, test_f, test_y))
  if len(tf) != feat_ndim or len(sf) != feat_ndim:
    raise ValueError(f'features must have {feat_ndim} dims, got train {tf}, test {sf}')
  if tf[:-2] != sf[:-2] or tf[-1] != sf[-1]:
    raise ValueError(f'train/test features disagree in client axis or feature dim: {tf} vs {sf}')
  if ty != (tf[-2],) or sy != (sf[-2],):
    raise ValueError(f'labels must be [N] matching the features; got train_y {ty} for {tf}, test_y {sy} for {sf}')
  if tf[-2] < 1 or sf[-2] < 1:
    raise ValueError(f'need at least one train and one test example, got {tf[-2]} and {sf[-2]}')
  for name, y in (('train_y', train_y), ('test_y', test_y)):
    y = np.asarray(y)
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= num_classes:
      raise ValueError(f'{name} must be integers in [0, {num_classes}), got dtype {y.dtype}, '
                       f'range [{y.min()}, {y.max()}]')
  if epochs < 1 or batch_size < 1 or not lr > 0:
    raise ValueError(f'need epochs >= 1, batch_size >= 1, lr > 0; got {epochs}, {batch_size}, {lr}')


def linear_probe(train_f: Any, train_y: Any, test_f: Any, test_y: Any, num_classes: int, *,
                 epochs: int = 100, batch_size: int = 512, lr: float = 3e-3, seed: int = 0,
                 standardize: bool = False) -> Dict[str, float]:
  """Trains a linear classifier on frozen features and tests it.

  Args:
    train_f: float [N, d] training features (un-augmented, frozen encoder in eval mode).
    train_y: int [N] labels in [0, num_classes).
    test_f: float [M, d]; test_y: int [M].
    num_classes: K, the width of the Dense head.
    epochs, batch_size, lr: Adam training schedule (no weight decay).
    seed: seeds the head initialisation (PyTorch nn.Linear default) and the per-epoch shuffles.
    standardize: z-score every feature with the training mean/std first (not part of the papers' protocol).
  Returns:
    dict of floats: train_acc and final_loss (cross-entropy) on the full training set and test_acc, all after
    the final epoch; best_test_acc, the best test accuracy over epochs (FedSC, ICML 2024, does not say which
    epoch it reports, so both are kept).
  """
  _check_probe_args(train_f, train_y, test_f, test_y, num_classes, epochs, batch_size, lr, feat_ndim=2)
  params, batch_idx = _host_randomness(seed, *np.shape(train_f), num_classes, epochs, batch_size)
  out = _train_probe_jit(jnp.asarray(train_f), jnp.asarray(train_y), jnp.asarray(test_f), jnp.asarray(test_y),
                         params, batch_idx, lr, standardize=standardize)
  return {k: float(v) for k, v in out.items()}


def linear_probe_stack(train_f: Any, train_y: Any, test_f: Any, test_y: Any, num_classes: int, *,
                       epochs: int = 100, batch_size: int = 512, lr: float = 3e-3, seed: int = 0,
                       standardize: bool = False) -> Dict[str, Any]:
  """`linear_probe` for C per-client models at once (vmapped), on the same labelled examples.

  Client c's result equals `linear_probe(train_f[c], train_y, test_f[c], test_y, ..., seed=seed)`: every
  client uses the same seed, so the same head initialisation and shuffling order.

  Args:
    train_f: float [C, N, d]; test_f: float [C, M, d]; train_y: int [N]; test_y: int [M] (shared by clients).
    Other arguments as in `linear_probe`.
  Returns:
    dict: train_acc, test_acc, best_test_acc, final_loss as float numpy arrays [C], and mean_test_acc, the
    unweighted mean of test_acc over clients (Hetero-SSFL's personalised models, arXiv:2205.12493).
  """
  _check_probe_args(train_f, train_y, test_f, test_y, num_classes, epochs, batch_size, lr, feat_ndim=3)
  params, batch_idx = _host_randomness(seed, *np.shape(train_f)[1:], num_classes, epochs, batch_size)
  out = _train_probe_stack_jit(jnp.asarray(train_f), jnp.asarray(train_y), jnp.asarray(test_f),
                               jnp.asarray(test_y), params, batch_idx, lr, standardize=standardize)
  out = {k: np.asarray(v, np.float64) for k, v in out.items()}
  out['mean_test_acc'] = float(np.mean(out['test_acc']))
  return out
