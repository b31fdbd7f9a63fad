"""Semi-supervised evaluation: fine-tune an encoder plus a linear layer on a class-balanced labelled subset.

Protocol (Hetero-SSFL, App. C of its ICLR 2023 OpenReview version; the subset choice is ours, see
docs/notes/evaluation.md#losses-and-evaluation): a class-balanced random 1% or 10% of the training
set, shared by all clients; each model's whole encoder and a new Dense(num_classes) head are trained jointly
with SGD + Nesterov momentum 0.9, lr 0.05, batch 512 (10%) or 256 (1%), 100 epochs; the encoder runs in
train mode (BatchNorm batch statistics, running averages updated), as in the FedU2 `semi_eval.py`. Test
accuracy on the full test set, encoder in eval mode.

The encoder is a Flax module called as `encoder.apply(variables, x, train=...)` on float32 [B, H, W, C]
normalised images and returning features [B, d]; `variables` = {'params': ..., optional 'batch_stats': ...}.
The encoder and `augment_fn` are static arguments of the jitted training run: reusing the same objects
across calls (e.g. across clients) reuses the compiled program.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_ssl.eval.features import extract_features
from fedjax_ssl.eval.probe import epoch_batches
from fedjax_ssl.eval.probe import slot_mask
from fedjax_ssl.eval.probe import torch_linear_init

# augment_fn(key, images uint8 [B, H, W, C]) -> float32 [B, H, W, C] in [0, 1], e.g.
# functools.partial(augment.augment_batch, cfg=...).
AugmentFn = Callable[[jax.Array, jax.Array], jax.Array]


def class_balanced_subset(labels: Any, fraction: float, seed: int) -> np.ndarray:
  """Random indices with round(fraction * N_c) examples of every class c present (at least 1 each).

  Rounding is half-up (floor(x + 0.5)), so 2.5 -> 3.

  Args:
    labels: int [N], non-negative.
    fraction: in (0, 1], e.g. 0.01 or 0.1.
    seed: numpy Generator seed.
  Returns:
    int64 [sum_c n_c] sorted indices into labels.
  """
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or (labels.size and labels.min() < 0):
    raise ValueError(f'labels must be a 1-D array of non-negative integers, got shape {labels.shape}, '
                     f'dtype {labels.dtype}')
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f'fraction must lie in (0, 1], got {fraction}')
  rng = np.random.default_rng(seed)
  picks = []
  for c in np.unique(labels):
    members = np.flatnonzero(labels == c)
    count = max(1, int(np.floor(fraction * members.size + 0.5)))
    picks.append(rng.choice(members, size=count, replace=False))
  return np.sort(np.concatenate(picks)) if picks else np.zeros((0,), np.int64)


def _encoder_variables(params: Any, batch_stats: Optional[Any]) -> Dict[str, Any]:
  return {'params': params} if batch_stats is None else {'params': params, 'batch_stats': batch_stats}


@functools.lru_cache(maxsize=None)
def _eval_logits_fn(encoder: nn.Module) -> Callable[[Any, jax.Array], jax.Array]:
  """One eval-mode classifier function per (hashable) encoder, so `extract_features` compiles it once."""

  def apply(variables, x):
    h = encoder.apply(_encoder_variables(variables['params']['encoder'], variables.get('batch_stats')), x,
                      train=False)
    return h @ variables['params']['head']['kernel'] + variables['params']['head']['bias']

  return apply


@functools.partial(jax.jit, static_argnames=('encoder', 'momentum', 'nesterov', 'augment_fn'))
def _finetune(encoder, params, batch_stats, x, y, mean, std, batch_idx, aug_keys, lr, *, momentum, nesterov,
              augment_fn):
  """Jitted training run. x uint8 [n, H, W, C], y int [n]; params {'encoder', 'head'};
  batch_idx int32 [epochs, num_batches, batch_size] (`epoch_batches` with wrap=True); aug_keys
  [epochs, num_batches, 2] or None. Returns the final params, batch_stats and last-epoch mean loss."""
  n = x.shape[0]
  # The last batch is filled by wrapping around the permutation (fixed shape, BatchNorm sees real images);
  # the wrapped duplicates are masked out of the loss, so each example counts once per epoch.
  mask = slot_mask(n, *batch_idx.shape[1:])
  opt = optax.sgd(lr, momentum=momentum, nesterov=nesterov)

  def loss_fn(params, batch_stats, xb, yb, m):
    variables = _encoder_variables(params['encoder'], batch_stats)
    if batch_stats is None:
      h = encoder.apply(variables, xb, train=True)
    else:
      h, updates = encoder.apply(variables, xb, train=True, mutable=['batch_stats'])
      batch_stats = updates['batch_stats']
    logits = h @ params['head']['kernel'] + params['head']['bias']
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), yb)
    return jnp.sum(ce * m) / jnp.sum(m), batch_stats

  def batch_step(carry, batch):
    params, batch_stats, opt_state = carry
    idx, m, aug_key = batch
    xb = x[idx]
    xf = xb.astype(jnp.float32) / 255.0 if augment_fn is None else augment_fn(aug_key, xb)
    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, batch_stats, (xf - mean) / std, y[idx], m)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), batch_stats, opt_state), loss * jnp.sum(m)

  def epoch(carry, batches):
    idx, keys = batches
    carry, weighted_losses = jax.lax.scan(batch_step, carry, (idx, mask, keys))
    return carry, jnp.sum(weighted_losses) / n

  (params, batch_stats, _), epoch_losses = jax.lax.scan(
      epoch, (params, batch_stats, opt.init(params)), (batch_idx, aug_keys))
  return params, batch_stats, epoch_losses[-1]


def _check_images_labels(name: str, x: Any, y: Any, num_classes: int) -> None:
  if np.ndim(x) != 4 or np.dtype(x.dtype) != np.uint8 or np.shape(y) != (np.shape(x)[0],) or len(y) == 0:
    raise ValueError(f'{name} images must be uint8 [N, H, W, C] with N >= 1 and labels [N]; got '
                     f'{np.shape(x)} {getattr(x, "dtype", None)} and labels {np.shape(y)}')
  y = np.asarray(y)
  if y.min() < 0 or y.max() >= num_classes:
    raise ValueError(f'{name} labels must lie in [0, {num_classes}), got range [{y.min()}, {y.max()}]')


def semi_supervised_finetune(encoder: nn.Module, variables: Any, train_x: Any, train_y: Any, test_x: Any,
                             test_y: Any, num_classes: int, *, mean: Sequence[float], std: Sequence[float],
                             epochs: int = 100, batch_size: int = 256, lr: float = 0.05,
                             momentum: float = 0.9, nesterov: bool = True, seed: int = 0,
                             augment_fn: Optional[AugmentFn] = None,
                             eval_batch_size: int = 512) -> Dict[str, float]:
  """Fine-tunes `encoder` + a fresh Dense(num_classes) head on labelled images; tests on the test set.

  Args:
    encoder: Flax module, `__call__(x, train)` -> features [B, d].
    variables: the encoder's variables {'params': ..., optional 'batch_stats': ...} (not modified).
    train_x: uint8 [n, H, W, C], the labelled subset (see `class_balanced_subset`); train_y: int [n].
    test_x: uint8 [M, H, W, C]; test_y: int [M].
    num_classes: K.
    mean, std: per-channel normalisation statistics (len C).
    epochs, batch_size, lr, momentum, nesterov: SGD schedule (constant lr, no weight decay). A batch size
      larger than n becomes n (one full batch per epoch, like a PyTorch DataLoader).
    seed: seeds the head init (PyTorch nn.Linear default) and the shuffles (numpy) and the augmentation keys
      (jax.random.PRNGKey(seed)).
    augment_fn: (key, uint8 [B, H, W, C]) -> float32 [0, 1] images, or None for no augmentation.
    eval_batch_size: images per forward pass at test time.
  Returns:
    dict: test_acc (float, after the final epoch, eval mode), final_train_loss (float, mean cross-entropy over
    the last epoch's examples, as seen during training), encoder_variables (the fine-tuned encoder variables,
    same structure as `variables`) and head ({'kernel' [d, K], 'bias' [K]}).
  """
  _check_images_labels('train', train_x, train_y, num_classes)
  _check_images_labels('test', test_x, test_y, num_classes)
  if epochs < 1 or batch_size < 1 or not lr > 0:
    raise ValueError(f'need epochs >= 1, batch_size >= 1, lr > 0; got {epochs}, {batch_size}, {lr}')
  if len(mean) != np.shape(train_x)[-1] or len(std) != np.shape(train_x)[-1]:
    raise ValueError(f'mean/std need one entry per channel ({np.shape(train_x)[-1]}), got {mean}, {std}')
  n = len(train_y)
  batch_size = min(batch_size, n)
  rng = np.random.default_rng(seed)  # host-side randomness keeps PRNG code out of the compiled program.
  probe_x = jnp.zeros((1,) + tuple(np.shape(train_x)[1:]), jnp.float32)
  feature_dim = jax.eval_shape(lambda v, xx: encoder.apply(v, xx, train=False), variables, probe_x).shape[-1]
  params = {'encoder': variables['params'], 'head': torch_linear_init(rng, feature_dim, num_classes)}
  batch_idx = epoch_batches(rng, n, epochs, batch_size, wrap=True)
  aug_keys = None
  if augment_fn is not None:
    aug_keys = jax.random.split(jax.random.PRNGKey(seed), batch_idx.shape[0] * batch_idx.shape[1])
    aug_keys = aug_keys.reshape(batch_idx.shape[:2] + aug_keys.shape[1:])
  params, batch_stats, loss = _finetune(
      encoder, params, variables.get('batch_stats'), jnp.asarray(train_x), jnp.asarray(train_y),
      jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32), batch_idx, aug_keys, lr,
      momentum=momentum, nesterov=nesterov, augment_fn=augment_fn)
  trained = _encoder_variables(params, batch_stats)
  logits = extract_features(_eval_logits_fn(encoder), trained, test_x, mean, std, eval_batch_size)
  test_acc = jnp.mean(jnp.argmax(logits, axis=-1) == jnp.asarray(test_y))
  return {'test_acc': float(test_acc), 'final_train_loss': float(loss),
          'encoder_variables': _encoder_variables(params['encoder'], batch_stats), 'head': params['head']}


def semi_supervised_finetune_stack(encoder: nn.Module, stacked_variables: Any, train_x: Any, train_y: Any,
                                   test_x: Any, test_y: Any, num_classes: int, **kwargs) -> Dict[str, Any]:
  """`semi_supervised_finetune` for C per-client models stacked on a leading axis.

  A Python loop over clients, one at a time: fine-tuning trains a whole encoder per client, and a loop keeps
  the memory of one model while the compiled program is reused (same encoder and arguments for all clients).
  Every client uses the same labelled subset and seed.

  Args:
    stacked_variables: the encoder variables with a leading client axis of size C on every leaf.
    kwargs: keyword arguments of `semi_supervised_finetune` (mean and std are required).
    Other arguments as in `semi_supervised_finetune`.
  Returns:
    dict: test_acc and final_train_loss as float numpy arrays [C], and mean_test_acc, the unweighted client
    mean (as in Hetero-SSFL). The fine-tuned models are not kept (one encoder per client in memory).
  """
  num_clients = {leaf.shape[0] for leaf in jax.tree_util.tree_leaves(stacked_variables)}
  if len(num_clients) != 1:
    raise ValueError(f'every leaf of stacked_variables needs the same leading client axis, got {num_clients}')
  train_x, train_y = jnp.asarray(train_x), jnp.asarray(train_y)  # transferred once for all clients.
  results = [
      semi_supervised_finetune(encoder, jax.tree_util.tree_map(lambda a, c=c: a[c], stacked_variables), train_x,
                               train_y, test_x, test_y, num_classes, **kwargs)
      for c in range(num_clients.pop())
  ]
  out = {key: np.array([r[key] for r in results]) for key in ('test_acc', 'final_train_loss')}
  out['mean_test_acc'] = float(np.mean(out['test_acc']))
  return out
