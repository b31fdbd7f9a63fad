"""Semi-supervised evaluation: fine-tune an encoder plus a linear layer on a labelled subset.

Two protocols, `PROTOCOLS` (config.finetune; `protocol_settings` gives one label fraction's keyword
arguments of `semi_supervised_finetune`):

* 'hetero_ssfl': Hetero-SSFL's Tables 5-6 (App. C of its ICLR 2023 OpenReview version): each model's
  whole encoder and a new Dense(num_classes) head trained jointly with SGD + Nesterov momentum 0.9,
  lr 0.05, batch 512 (10%) or 256 (1%), 100 epochs, no augmentation; tested after the last epoch.
* 'fedu2': FedU2's Table 1 FT 1% / FT 10% (its code's `semi_eval.py`): SGD momentum 0.9 with lr 1e-3
  for the encoder and 0.3 for the head, batch 128, 200 epochs, RandomResizedCrop (scale 0.64-1,
  ratio 1) + flip; tested at epochs 100 and 200, the best reported.

Both: the encoder runs in train mode (BatchNorm batch statistics, running averages updated), constant
learning rates, no weight decay; test accuracy on the full test set, encoder in eval mode. The
labelled subset is the caller's (`fedjax_ssl/evaluation.py` draws a stratified one with
`protocol.stratified_subset`; docs/notes/evaluation.md#eval-11).

The encoder is a Flax module called as `encoder.apply(variables, x, train=...)` on float32 [B, H, W, C]
normalised images and returning features [B, d]; `variables` = {'params': ..., optional 'batch_stats': ...}.
The encoder and `augment_fn` are static arguments of the jitted training run: reusing the same objects
across calls (e.g. across clients) reuses the compiled program.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

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

# The protocols' hyper-parameters, each with where it comes from: the FedU2 spec §3.5 ("Semi-supervised
# fine-tuning", the code's semi_eval.py) and the Hetero-SSFL spec §3.8 ("Semi-supervised evaluation",
# v001 App. C, which also fixes the setting of its Tables 5-6). `batch_size` is an int or a mapping
# {label fraction: batch size} (`protocol_batch_size`); `augmentation` names an augment.PRESETS entry.
PROTOCOLS: Dict[str, Dict[str, Any]] = {
    'fedu2': dict(
        epochs=200,                # §3.5: 200 epochs
        eval_epochs=(100, 200),    # §3.5: "Test at epochs 100 and 200; report the best"
        batch_size=128,            # §3.5
        lr=1e-3,                   # §3.5: the encoder's learning rate
        head_lr=0.3,               # §3.5: the classifier's learning rate
        momentum=0.9,              # §3.5: SGD momentum 0.9, PyTorch's default form (not Nesterov)
        nesterov=False,
        augmentation='fedu2_finetune',  # §3.5: RandomResizedCrop(scale (0.64, 1), ratio (1, 1)) + HFlip
    ),
    'hetero_ssfl': dict(
        epochs=100,                # §3.8: "fine-tune the local models ... for 100 epochs"
        eval_epochs=(100,),        # §3.8 names no intermediate test: the last epoch only
        batch_size={0.01: 256, 0.1: 512},  # §3.8: "batch 512 for 10% labels, 256 for 1% labels"
        lr=0.05,                   # §3.8: one learning rate for encoder and head
        head_lr=0.05,
        momentum=0.9,              # §3.8: SGD with Nesterov momentum 0.9
        nesterov=True,
        # §3.8 gives none; the protocol is "as described in FedU and FedEMA", whose code (EasyFL
        # applications/fedssl/dataset.py, fine_tune_transform) only resizes and converts to tensors.
        augmentation='none',
    ),
}


class Pixels(nn.Module):
  """The identity encoder: normalised images [B, H, W, C] -> their pixels [B, H*W*C], with no
  parameters (variables {'params': {}}). Fine-tuned by a protocol it is that protocol's linear
  classifier on the normalised pixels: the raw-pixel reference of the fine-tuning metrics, trained
  on the same labelled images with the same optimiser, epochs and test epochs as every encoder it
  is compared with (`evaluation.raw_pixel_metrics`, which leaves out the protocol's augmentation)."""

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    del train  # no BatchNorm, no dropout: the same map in both modes
    return x.reshape(x.shape[0], -1)


def protocol_batch_size(batch_size: Union[int, Mapping[float, int]], fraction: float) -> int:
  """A protocol's batch size at label `fraction`: the int itself, or from a {fraction: batch size}
  mapping the entry of the largest listed fraction <= `fraction` (the smallest one's below them all),
  so Hetero-SSFL's 256 (1%) / 512 (10%) gives 256 under 10% and 512 from 10% up."""
  if isinstance(batch_size, int):
    return batch_size
  listed = sorted(batch_size)
  below = [f for f in listed if f <= fraction]
  return batch_size[below[-1] if below else listed[0]]


def scaled_eval_epochs(eval_epochs: Sequence[int], protocol_epochs: int, epochs: int) -> Tuple[int, ...]:
  """A protocol's test epochs moved to a run of `epochs` instead of `protocol_epochs`: the same
  fractions of the run, e * epochs / protocol_epochs rounded half up, at least 1, without repeats
  (FedU2's (100, 200) of 200 becomes (10, 20) of 20, and (1,) of 1)."""
  scaled = (max(1, math.floor(e * epochs / protocol_epochs + 0.5)) for e in eval_epochs)
  return tuple(sorted(set(scaled)))


def protocol_settings(name: str, fraction: float, epochs: int = 0) -> Dict[str, Any]:
  """`PROTOCOLS[name]` at label `fraction`: the keyword arguments of `semi_supervised_finetune`
  (epochs, eval_epochs, batch_size, lr, head_lr, momentum, nesterov) plus 'augmentation' (an
  augment.PRESETS name, for the caller to turn into an `augment_fn`).

  Args:
    name: a PROTOCOLS key.
    fraction: the label fraction in (0, 1], which picks the batch size.
    epochs: > 0 replaces the protocol's epochs, its test epochs scaled alike (`scaled_eval_epochs`);
      0 keeps them.
  """
  if name not in PROTOCOLS:
    raise ValueError(f'fine-tuning protocol {name!r} is unknown: must be one of {sorted(PROTOCOLS)}')
  if not 0.0 < fraction <= 1.0 or epochs < 0:
    raise ValueError(f'need a label fraction in (0, 1] and epochs >= 0 (0 = the protocol\'s), got '
                     f'{fraction!r} and {epochs!r}')
  settings = dict(PROTOCOLS[name])
  settings['batch_size'] = protocol_batch_size(settings['batch_size'], fraction)
  if epochs:
    settings['eval_epochs'] = scaled_eval_epochs(settings['eval_epochs'], settings['epochs'], epochs)
    settings['epochs'] = epochs
  return settings


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


def _optimizer(lr: Any, head_lr: Any, momentum: float, nesterov: bool) -> optax.GradientTransformation:
  """SGD with momentum on params {'encoder', 'head'}, each part with its own learning rate (PyTorch's
  parameter groups: one momentum buffer per parameter, the step scaled by its group's lr)."""
  return optax.multi_transform(
      {part: optax.sgd(rate, momentum=momentum, nesterov=nesterov)
       for part, rate in (('encoder', lr), ('head', head_lr))},
      {'encoder': 'encoder', 'head': 'head'})


@functools.partial(jax.jit, static_argnames=('encoder', 'momentum', 'nesterov', 'augment_fn'))
def _finetune(encoder, params, batch_stats, opt_state, x, y, mean, std, batch_idx, aug_keys, lr, head_lr, *,
              momentum, nesterov, augment_fn):
  """Jitted training epochs. x uint8 [n, H, W, C], y int [n]; params {'encoder', 'head'}; opt_state of
  `_optimizer` (carried across calls, so a run split into segments trains as one); batch_idx int32
  [epochs, num_batches, batch_size] (`epoch_batches` with wrap=True); aug_keys [epochs, num_batches, 2] or
  None; lr, head_lr traced scalars. Returns the params, batch_stats, opt_state and last-epoch mean loss."""
  n = x.shape[0]
  # The last batch is filled by wrapping around the permutation (fixed shape, BatchNorm sees real images);
  # the wrapped duplicates are masked out of the loss, so each example counts once per epoch.
  mask = slot_mask(n, *batch_idx.shape[1:])
  opt = _optimizer(lr, head_lr, momentum, nesterov)

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

  (params, batch_stats, opt_state), epoch_losses = jax.lax.scan(
      epoch, (params, batch_stats, opt_state), (batch_idx, aug_keys))
  return params, batch_stats, opt_state, epoch_losses[-1]


def _check_eval_epochs(eval_epochs: Sequence[int], epochs: int) -> Tuple[int, ...]:
  """eval_epochs as a tuple of increasing ints in [1, epochs] ending at epochs (else ValueError)."""
  eval_epochs = tuple(eval_epochs)
  if (not eval_epochs or eval_epochs[-1] != epochs
      or any(not isinstance(e, (int, np.integer)) or isinstance(e, bool) for e in eval_epochs)
      or any(b <= a for a, b in zip((0,) + eval_epochs, eval_epochs))):
    raise ValueError(f'eval_epochs = {eval_epochs!r} is invalid: must be increasing epochs in [1, {epochs}] '
                     f'ending at epochs = {epochs}')
  return tuple(int(e) for e in eval_epochs)


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
                             head_lr: Optional[float] = None, momentum: float = 0.9, nesterov: bool = True,
                             eval_epochs: Optional[Sequence[int]] = None, seed: int = 0,
                             augment_fn: Optional[AugmentFn] = None,
                             eval_batch_size: int = 512) -> Dict[str, Any]:
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
    head_lr: the head's learning rate (None = lr; FedU2 trains the head at 0.3, the encoder at 1e-3).
    eval_epochs: the epochs after which the model is tested, increasing, ending at `epochs` (None = the
      last only). Testing does not change the training run: the final model is the same for any choice.
    seed: seeds the head init (PyTorch nn.Linear default) and the shuffles (numpy) and the augmentation keys
      (jax.random.PRNGKey(seed)).
    augment_fn: (key, uint8 [B, H, W, C]) -> float32 [0, 1] images, or None for no augmentation.
    eval_batch_size: images per forward pass at test time.
  Returns:
    dict: test_acc (float, eval mode: the best over eval_epochs, which is FedU2's "test at epochs 100 and
    200, report the best"; after the final epoch by default), test_accs (float numpy [len(eval_epochs)], the
    accuracy at each of eval_epochs), final_train_loss (float, mean cross-entropy over the last epoch's
    examples, as seen during training), encoder_variables (the final fine-tuned encoder variables, same
    structure as `variables`) and head ({'kernel' [d, K], 'bias' [K]}, final).
  """
  _check_images_labels('train', train_x, train_y, num_classes)
  _check_images_labels('test', test_x, test_y, num_classes)
  head_lr = lr if head_lr is None else head_lr
  if epochs < 1 or batch_size < 1 or not lr > 0 or not head_lr > 0:
    raise ValueError(f'need epochs >= 1, batch_size >= 1, lr > 0, head_lr > 0; got {epochs}, {batch_size}, '
                     f'{lr}, {head_lr}')
  eval_epochs = _check_eval_epochs((epochs,) if eval_epochs is None else eval_epochs, epochs)
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
  batch_stats = variables.get('batch_stats')
  opt_state = _optimizer(lr, head_lr, momentum, nesterov).init(params)
  train_x, train_y = jnp.asarray(train_x), jnp.asarray(train_y)
  mean_a, std_a = jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32)
  test_accs = []
  # Train between consecutive test epochs; the shuffles and augmentation keys of the whole run were drawn
  # above, so the segments train exactly as one run would.
  for start, stop in zip((0,) + eval_epochs, eval_epochs):
    params, batch_stats, opt_state, loss = _finetune(
        encoder, params, batch_stats, opt_state, train_x, train_y, mean_a, std_a, batch_idx[start:stop],
        None if aug_keys is None else aug_keys[start:stop], lr, head_lr, momentum=momentum, nesterov=nesterov,
        augment_fn=augment_fn)
    test_accs.append(_test_accuracy(encoder, _encoder_variables(params, batch_stats), test_x, test_y, mean,
                                    std, eval_batch_size))
  return {'test_acc': max(test_accs), 'test_accs': np.array(test_accs), 'final_train_loss': float(loss),
          'encoder_variables': _encoder_variables(params['encoder'], batch_stats), 'head': params['head']}


def _test_accuracy(encoder: nn.Module, variables: Dict[str, Any], test_x: Any, test_y: Any, mean: Any, std: Any,
                   batch_size: int) -> float:
  """Eval-mode accuracy of encoder + head; variables {'params': {'encoder', 'head'}, optional 'batch_stats'}."""
  logits = extract_features(_eval_logits_fn(encoder), variables, test_x, mean, std, batch_size)
  return float(jnp.mean(jnp.argmax(logits, axis=-1) == jnp.asarray(test_y)))


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
    dict: test_acc and final_train_loss as float numpy arrays [C] (test_acc: each client's best over
    eval_epochs), test_accs [C, len(eval_epochs)], and mean_test_acc, the unweighted client mean of test_acc
    (as in Hetero-SSFL). The fine-tuned models are not kept (one encoder per client in memory).
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
  out = {key: np.array([r[key] for r in results]) for key in ('test_acc', 'test_accs', 'final_train_loss')}
  out['mean_test_acc'] = float(np.mean(out['test_acc']))
  return out
