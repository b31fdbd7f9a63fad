"""Evaluation of a federated state: the global encoder, or every client's personal encoder (the
client mean, and each cohort's mean when a federation mixes architectures). It reads the
algorithms' state layouts, so it sits beside the runner, above `algorithms/` and `eval/` (whose
primitives, features, probes, kNN and fine-tuning, know nothing of federations)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any, Callable, Dict, List, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from fedjax_ssl import algorithms
from fedjax_ssl import config_validation as cv
from fedjax_ssl.algorithms import ssl_client
from fedjax_ssl.core import placement
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import Algorithm
from fedjax_ssl.core.state import FedState
from fedjax_ssl.data import augment, partition
from fedjax_ssl.data.types import Dataset, FedData, Rows
from fedjax_ssl.eval import features as fs_features
from fedjax_ssl.eval import finetune as fs_finetune
from fedjax_ssl.eval import knn as fs_knn
from fedjax_ssl.eval import per_client as fs_per_client
from fedjax_ssl.eval import probe as fs_probe
from fedjax_ssl.eval import protocol as fs_protocol


def encoder_features(algo: Algorithm, variables: Any, per_client: bool, images: np.ndarray,
                     dataset: Dataset, batch_size: int = 1000) -> jax.Array:
  """Frozen backbone features of `images`: [N, d], or [C, N, d] for personalised models."""
  fn = fs_features.extract_features_stacked if per_client else fs_features.extract_features
  return fn(algo.encoder_apply, variables, images, dataset.mean, dataset.std, batch_size=batch_size)


# The training split's features of one shared encoder: (algo, variables) -> [N_train, d]; under
# placement 'divided' each process embeds the rows it holds and one gather assembles the split
# (run_setup.TrainFeatures).
TrainFeaturesFn = Callable[[Algorithm, Any], np.ndarray]


def evaluate(config: ml_collections.ConfigDict, algo: Algorithm, state: FedState, dataset: Dataset,
             *, probe: bool = True, knn: bool = True,
             train_features: Optional[TrainFeaturesFn] = None,
             client_blocks: Optional[Sequence[placement.StateBlock]] = None) -> Dict[str, Any]:
  """Linear probe (full train -> full test) and kNN monitor on the frozen encoder(s), and with
  config.finetune != 'none' (and `probe`) the semi-supervised fine-tune (`finetune_metrics`).

  Personalised models are evaluated client by client; the result is the unweighted client mean
  (per-client accuracies under '<metric>_clients', in client-id order). With several cohorts
  (architectures) each cohort's mean is reported too, as '<metric>_<cohort name>'.
  `train_features` replaces the extraction of dataset.train_x's features (a shared encoder only).
  `client_blocks` (placement 'divided', personalised models): per cohort, the block of its
  clients whose models `state` holds (`round.state_blocks`); each process scores its own clients
  and one gather (`placement.exchange`) brings every client's scores to every process.
  """
  variables, per_client = algo.eval_variables(state)
  encoders = encoder_modules(config) if probe and config.finetune != 'none' else None
  if not per_client:
    return _evaluate_encoder(config, algo, variables, False, dataset, probe=probe, knn=knn,
                             encoder=encoders[0] if encoders else None,
                             train_features=train_features)
  if train_features is not None:
    raise ValueError(f'{algo.name}: train_features serves a shared encoder; this algorithm '
                     'evaluates one encoder per client')
  # Every client's model (a held block under 'divided': the federation's size is the block's num).
  num_models = (client_blocks[0].num if client_blocks is not None else
                len(jax.tree_util.tree_leaves(variables)[0]))
  groups = (tuple(zip(algo.cohorts, variables)) if algo.cohorts else
            ((rd.cohorts(algo, num_models)[0], variables),))
  if encoders is not None and len(encoders) != len(groups):
    raise ValueError(f'{algo.name} evaluates {len(groups)} cohorts but the config names '
                     f'{len(encoders)} encoders: fine-tuning needs one per cohort')
  per_cohort = [_evaluate_encoder(config, c.client, v, True, dataset, probe=probe, knn=knn,
                                  encoder=encoders[i] if encoders else None)
                for i, (c, v) in enumerate(groups)]
  if client_blocks is not None:
    per_cohort = [_gather_scores(res, block) for res, block in zip(per_cohort, client_blocks)]
  out: Dict[str, Any] = {}
  for key in per_cohort[0]:
    accs = np.zeros(sum(len(c.members) for c, _ in groups))
    for (cohort, _), res in zip(groups, per_cohort):
      accs[list(cohort.members)] = res[key]
      if algo.cohorts:
        out[f'{key}_{cohort.name}'] = float(np.mean(res[key]))
    out[key] = float(np.mean(accs))
    out[f'{key}_client_std'] = float(np.std(accs))
    if key != 'knn_acc':
      out[f'{key}_clients'] = [float(a) for a in accs]
  return out


def _gather_scores(scores: Dict[str, List[float]], block: placement.StateBlock
                   ) -> Dict[str, List[float]]:
  """Every client's scores of one cohort, in member order, from each process's `scores` of the
  clients it holds (`block`): one all-gather, values moved and never summed."""
  # Moved as their float64 bits: the all-gather moves JAX arrays, float32 unless x64 is enabled.
  held = {k: np.asarray(v, np.float64)[:, None].view(np.uint32) for k, v in scores.items()}
  owner = placement.owners(np.arange(block.num), block.num, block.process_count)
  return {k: [float(a) for a in np.asarray(v).view(np.float64)[:, 0]]
          for k, v in placement.exchange(held, owner, block.process_count).items()}


def encoder_modules(config: ml_collections.ConfigDict) -> List[nn.Module]:
  """The backbone module of each of the run's cohorts (one without cohorts), in cohort order: what
  fine-tuning trains (the algorithms' `encoder_apply` is inference only). Modules compare equal
  across calls, so the compiled fine-tuning program is reused by every evaluation of a run."""
  return [ssl_client.encoder_from_config(config, name)
          for _, name in algorithms.registry.encoders(config)]


def _evaluate_encoder(config: ml_collections.ConfigDict, algo: Algorithm, variables: Any,
                      per_client: bool, dataset: Dataset, *, probe: bool, knn: bool,
                      encoder: Optional[nn.Module] = None,
                      train_features: Optional[TrainFeaturesFn] = None) -> Dict[str, Any]:
  """{metric: accuracy} for one shared encoder, or {metric: [C] accuracies} for stacked ones.

  Supervised models (`algo.classifier_apply`) also report 'test_acc', the whole classifier's
  accuracy on the test split. `encoder`, the backbone module of `variables`, is fine-tuned by
  config.finetune's protocol (`finetune_metrics`); None = no fine-tuning. Features are extracted
  only when the kNN monitor (knn_k > 0) or a probe needs them. With config.probe = 'logistic' the
  probe is the field's protocol (`protocol.evaluate_features`: its metric names, e.g. probe_acc,
  probe_acc_1pct, knn_acc, knn_acc_1pct_k20), which also gives the kNN accuracies.
  """
  out: Dict[str, Any] = {}
  if algo.classifier_apply is not None:
    logits = encoder_features(dataclasses.replace(algo, encoder_apply=algo.classifier_apply),
                              variables, per_client, dataset.test_x, dataset)
    correct = np.asarray(jnp.argmax(logits, axis=-1)) == dataset.test_y
    acc = correct.mean(axis=-1)
    out['test_acc'] = [float(a) for a in acc] if per_client else float(acc)
  if encoder is not None:
    out.update(finetune_metrics(config, encoder, variables, per_client, dataset))
  knn = knn and config.knn_k > 0
  logistic = probe and config.probe == 'logistic'
  probe = logistic or (probe and (config.probe_epochs > 0 or config.probe_std_epochs > 0))
  if not (knn or probe):
    return out
  train_f = (train_features(algo, variables) if train_features is not None else
             encoder_features(algo, variables, per_client, dataset.train_x, dataset))
  test_f = encoder_features(algo, variables, per_client, dataset.test_x, dataset)
  if logistic:
    per = [protocol_metrics(config, a, b, dataset) for a, b in
           (zip(train_f, test_f) if per_client else [(train_f, test_f)])]
    out.update({k: [r[k] for r in per] if per_client else per[0][k] for k in per[0]})
    return out
  if knn:
    knn_fn = lambda a, b: float(fs_knn.knn_monitor(
        a, dataset.train_y, b, dataset.test_y, dataset.num_classes, k=config.knn_k,
        temperature=config.knn_temperature))
    out['knn_acc'] = ([knn_fn(a, b) for a, b in zip(train_f, test_f)] if per_client else
                      knn_fn(train_f, test_f))
  probes = [('probe_acc', config.probe_epochs, config.probe_standardize),
            ('probe_std_acc', config.probe_std_epochs, True)]
  for key, epochs, standardize in probes:
    if not probe or epochs == 0:
      continue
    kw = dict(epochs=epochs, batch_size=config.probe_batch_size, lr=config.probe_lr,
              seed=config.seed, standardize=standardize)
    if per_client:
      res = fs_probe.linear_probe_stack(train_f, dataset.train_y, test_f, dataset.test_y,
                                       dataset.num_classes, **kw)
      out[key] = [float(a) for a in np.asarray(res['test_acc'])]
    else:
      res = fs_probe.linear_probe(train_f, dataset.train_y, test_f, dataset.test_y,
                                 dataset.num_classes, **kw)
      out[key] = float(res['test_acc'])
  return out


def finetune_subset(config: ml_collections.ConfigDict, dataset: Dataset, fraction: float
                    ) -> np.ndarray:
  """Sorted indices [m] of the labelled training images fine-tuned on at `fraction`: stratified by
  class (`protocol.stratified_subset`), drawn from (config.seed, 0, fraction) so that every encoder
  of a run, random-init included, gets the same images, which are also the logistic probe's first
  draw at that fraction."""
  return fs_protocol.stratified_subset(dataset.train_y, dataset.num_classes, fraction,
                                       fs_protocol.fraction_rng(config.seed, 0, fraction))


@functools.lru_cache(maxsize=None)
def _augment_fn(cfg: augment.AugmentConfig) -> fs_finetune.AugmentFn:
  """One augment_fn object per pipeline: a static argument of the jitted fine-tuning, so reusing it
  reuses the compiled program."""
  return functools.partial(augment.augment_batch, cfg=cfg)


def finetune_augment_fn(name: str, dataset: Dataset) -> Optional[fs_finetune.AugmentFn]:
  """The augment_fn of augment.PRESETS[name] at the dataset's image size (None for 'none': the
  identity, without running the pipeline)."""
  return None if name == 'none' else _augment_fn(augment.preset(name, dataset.image_shape[0]))


def finetune_metrics(config: ml_collections.ConfigDict, encoder: nn.Module, variables: Any,
                     per_client: bool, dataset: Dataset) -> Dict[str, Any]:
  """config.finetune's protocol (`finetune.protocol_settings`) at each of config.finetune_fractions.

  Args:
    encoder: the backbone module of `variables`.
    variables: the model's variables ({'params': {'encoder': ...}, ...}), stacked [C, ...] on every
      leaf when per_client.
  Returns:
    {'ft_acc<tag>': accuracy} with the fraction tag of `protocol.fraction_tag` (ft_acc_1pct,
    ft_acc_10pct): a float, or a [C] list of each client's accuracy when per_client.
  """
  return _finetune_encoder(config, encoder, ssl_client.encoder_variables(variables), per_client,
                           dataset)


def finetune_keys(config: ml_collections.ConfigDict) -> List[str]:
  """The metric names `finetune_metrics` returns under `config` (none without fine-tuning)."""
  if config.finetune == 'none':
    return []
  return ['ft_acc' + fs_protocol.fraction_tag(f) for f in config.finetune_fractions]


def _finetune_encoder(config: ml_collections.ConfigDict, encoder: nn.Module, variables: Any,
                      per_client: bool, dataset: Dataset, augment: bool = True) -> Dict[str, Any]:
  """`finetune_metrics` of the encoder's own variables ({'params', optional 'batch_stats'});
  augment=False trains without the protocol's augmentation."""
  out: Dict[str, Any] = {}
  for fraction, key in zip(config.finetune_fractions, finetune_keys(config)):
    idx = finetune_subset(config, dataset, fraction)
    settings = fs_finetune.protocol_settings(config.finetune, fraction, config.finetune_epochs)
    augmentation = settings.pop('augmentation')
    augment_fn = finetune_augment_fn(augmentation if augment else 'none', dataset)
    kw = dict(settings, mean=dataset.mean, std=dataset.std, seed=config.seed, augment_fn=augment_fn)
    args = (dataset.train_x[idx], dataset.train_y[idx], dataset.test_x, dataset.test_y,
            dataset.num_classes)
    if per_client:
      res = fs_finetune.semi_supervised_finetune_stack(encoder, variables, *args, **kw)
      out[key] = [float(a) for a in res['test_acc']]
    else:
      out[key] = fs_finetune.semi_supervised_finetune(encoder, variables, *args, **kw)['test_acc']
  return out


def protocol_metrics(config: ml_collections.ConfigDict, train_f: Any, test_f: Any,
                     dataset: Dataset) -> Dict[str, float]:
  """The field's probe and kNN (`protocol.evaluate_features`) on features train_f [N, d] and
  test_f [M, d] of `dataset`'s splits, at config.label_fractions."""
  ks = tuple(k for k in (config.knn_k, config.knn_k_small) if k > 0)
  return fs_protocol.evaluate_features(
      np.asarray(train_f), dataset.train_y, np.asarray(test_f), dataset.test_y,
      dataset.num_classes, fractions=tuple(float(f) for f in config.label_fractions),
      draws=config.label_draws, seed=config.seed, knn_k=ks,
      knn_temperature=config.knn_temperature)


def check_protocol_plan(config: ml_collections.ConfigDict, dataset: Dataset) -> None:
  """cv.ConfigError when config.label_fractions cannot be evaluated on `dataset`'s training labels
  (a fraction whose labelled subset leaves the probe's held-out split empty): the labels are known
  once the data is loaded, before the first evaluation or round."""
  if config.probe != 'logistic':
    return
  try:
    fs_protocol.fraction_plans(dataset.train_y, dataset.num_classes,
                               tuple(float(f) for f in config.label_fractions))
  except ValueError as e:
    raise cv.ConfigError(
        f'config.label_fractions = {tuple(config.label_fractions)!r} is invalid for the '
        f'{len(dataset.train_y)} labelled training images of {dataset.name} ({e}): drop the '
        'smallest fraction or raise config.train_size') from None


def has_raw_pixel_reference(config: ml_collections.ConfigDict) -> bool:
  """Whether a run of `config` records the raw-pixel reference row (`raw_pixel_metrics`): for the
  field's probe and kNN (config.probe = 'logistic') and for fine-tuning (config.finetune), not on
  the synthetic set, whose classes differ in their mean image by construction
  (sources.make_synthetic), so that a smoke run does not grind on separable pixels."""
  return config.dataset != 'synthetic' and (config.probe == 'logistic' or
                                            config.finetune != 'none')


def raw_pixel_metrics(config: ml_collections.ConfigDict, dataset: Dataset) -> Dict[str, float]:
  """The reference row of every table: with config.probe = 'logistic' the same probe and kNN
  (`protocol_metrics`) on the pixels themselves, [N, H*W*C], each pixel standardised with the mean
  and std of the training split; with config.finetune, the protocol's fine-tuning of the identity
  encoder (`finetune.Pixels`), a linear classifier on the normalised pixels trained on the same
  labelled images with the protocol's optimiser, rates, batch and epochs, without its
  augmentation: a linear model on pixels has no invariance a crop could teach, and FedU2's crop +
  flip lowers its accuracy (docs/notes/evaluation.md#eval-24).

  Standardised pixels are the strongest of the pixel inputs measured for the kNN (against one
  global mean/std and [0, 1] pixels; docs/notes/evaluation.md#eval-13), so the row is the bar a
  reader would set, not a weak one. The probe standardises its inputs anyway."""
  out: Dict[str, float] = {}
  if config.probe == 'logistic':
    pixels = lambda x: np.asarray(x, np.float32).reshape(len(x), -1)
    train_p, test_p = fs_protocol.standardize(pixels(dataset.train_x), pixels(dataset.test_x))
    out.update(protocol_metrics(config, train_p, test_p, dataset))
  if config.finetune != 'none':
    out.update(_finetune_encoder(config, fs_finetune.Pixels(), {'params': {}}, False, dataset,
                                 augment=False))
  return out


# The config values `raw_pixel_metrics` reads (through `protocol_metrics`), and with fine-tuning
# also those of `finetune_metrics`: a run without fine-tuning keeps the key it always had.
_RAW_PIXEL_KEYS = ('label_fractions', 'label_draws', 'seed', 'knn_k', 'knn_k_small',
                   'knn_temperature')
_RAW_PIXEL_FINETUNE_KEYS = ('probe', 'finetune', 'finetune_epochs', 'finetune_fractions')


def raw_pixel_key(config: ml_collections.ConfigDict, dataset: Dataset) -> str:
  """A 16-hex-digit digest of every input `raw_pixel_metrics` reads: both splits' images and labels
  (dtype, shape and bytes), the class count and the protocol's config values. Runs with equal keys
  get equal metrics from the same code, so the runs of a table at one seed (every row reads the same
  pixels) can share one evaluation; the protocol's code constants (its C grid, held-out share) are
  not in the key, so a cache written before a change to them is stale and must be deleted."""
  h = hashlib.sha256(f'{dataset.num_classes}'.encode())
  for a in (dataset.train_x, dataset.train_y, dataset.test_x, dataset.test_y):
    h.update(f'{a.dtype.str}{a.shape}'.encode())
    # Rows left in their source stream through the digest: the same bytes, none kept.
    for chunk in a.chunks(4096) if isinstance(a, Rows) else (a,):
      h.update(memoryview(np.ascontiguousarray(chunk)).cast('B'))
  keys = _RAW_PIXEL_KEYS + (_RAW_PIXEL_FINETUNE_KEYS if config.finetune != 'none' else ())
  values = {k: config[k] for k in keys}
  if config.finetune != 'none':
    # Keyed apart from the first version of the row (2026-11-29), which kept the augmentation.
    values['finetune_pixels_augmentation'] = 'none'
  h.update(json.dumps(values, sort_keys=True, default=list).encode())
  return h.hexdigest()[:16]


# The config values `evaluate` reads besides `_RAW_PIXEL_KEYS`: the earlier probes', fine-tuning's
# and those that build the encoder modules applying the variables.
_EVALUATE_KEYS = ('probe', 'probe_epochs', 'probe_batch_size', 'probe_lr', 'probe_standardize',
                  'probe_std_epochs', 'finetune', 'finetune_epochs', 'finetune_fractions',
                  'conv_impl', 'precision')


def evaluation_key(config: ml_collections.ConfigDict, algo: Algorithm, state: FedState,
                   dataset: Dataset) -> str:
  """A 16-hex-digit digest of every input `evaluate(config, algo, state, dataset)` reads: the data
  and protocol values (`raw_pixel_key`), the evaluated variables (`algo.eval_variables`: tree
  structure, dtypes, shapes and bytes), the encoders applying them and the cohorts they belong to,
  whether the model has a classifier, and the other evaluation config values. The random-init
  encoders of two rows of a table at one seed are often the same arrays (FedBYOL and FedU start
  from one initialisation): their keys are equal and one evaluation serves both."""
  variables, per_client = algo.eval_variables(state)
  h = hashlib.sha256(raw_pixel_key(config, dataset).encode())
  leaves, treedef = jax.tree_util.tree_flatten(variables)
  described = {'treedef': str(treedef), 'per_client': per_client,
               'encoders': [name for _, name in algorithms.registry.encoders(config)],
               'cohorts': [[c.name, list(c.members)] for c in algo.cohorts or ()],
               'classifier': algo.classifier_apply is not None,
               **{k: config[k] for k in _EVALUATE_KEYS}}
  h.update(json.dumps(described, sort_keys=True, default=list).encode())
  for leaf in leaves:
    a = np.asarray(jax.device_get(leaf))
    h.update(f'{a.dtype.name}{a.shape}'.encode())
    h.update(a.tobytes())  # not a memoryview: bfloat16 arrays have no buffer format
  return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------
# Per-client results (config.per_client_eval): the design and its cost are
# docs/notes/evaluation.md#eval-25; the primitives are eval/per_client.py.
# ------------------------------------------------------------------------------------------------
# A client's held-out split needs this many test images: an accuracy over fewer moves by more than
# 10 points per image.
MIN_CLIENT_TEST = 10
_BANK_BATCH = 256   # feature batch of a client's own images (small clients pad less than 1000)


def client_test_splits(config: ml_collections.ConfigDict, dataset: Dataset,
                       hist: np.ndarray) -> List[np.ndarray]:
  """Each client's held-out split of the test set (`partition.held_out_splits`: the test images of
  every class shared out like the client's training images, drawn from config.seed), refused in one
  line (cv.ConfigError) when a client gets fewer than MIN_CLIENT_TEST images or the clients' images
  have no labels. Cheap (numpy over the labels): called before training.

  Args:
    hist: int [C, K], each client's training images per class (`partition.draw_rows`' histogram).
  Returns:
    C sorted int64 index arrays into dataset.test_x, pairwise disjoint.
  """
  if dataset.unlabeled_x is not None:
    raise cv.ConfigError(f'config.per_client_eval = True is invalid for {dataset.name}: its clients '
                         'train on unlabelled images, so no client has labels to score with')
  splits = partition.held_out_splits(dataset.test_y, hist, seed=config.seed)
  sizes = np.array([s.size for s in splits])
  small = np.flatnonzero(sizes < MIN_CLIENT_TEST)
  if small.size:
    c = int(small[np.argmin(sizes[small])])
    raise cv.ConfigError(
        f'config.per_client_eval = True is invalid here: client {c} (trains on {hist[c].sum()} '
        f'images) gets {sizes[c]} held-out test images, fewer than the minimum of '
        f'{MIN_CLIENT_TEST} ({small.size} of {sizes.size} clients are below it); use fewer '
        'clients, a larger test split, or per_client_eval = False')
  return splits


def client_models(algo: Algorithm, state: FedState) -> List[tuple]:
  """The clients' own models as [(the Algorithm applying them, variables stacked [C_g, ...],
  global client ids [C_g])], one group per cohort; [] when the clients keep no model.

  Personalised algorithms (`eval_variables` per client: independent, Hetero-SSFL's cohorts,
  representation sharing, FD) give theirs. An algorithm evaluated through a global model whose
  stored client state still holds each client's network in the global model's layout (FedU,
  FedEMA: `{'params', 'batch_stats'}` per client, not stateless) gives that network, as its last
  local training left it (a client that never took part keeps its initial one)."""
  variables, per_client = algo.eval_variables(state)
  if per_client:
    if algo.cohorts:
      return [(c.client, v, np.asarray(c.members)) for c, v in zip(algo.cohorts, variables)]
    cohort = rd.cohorts(algo, len(jax.tree_util.tree_leaves(variables)[0]))[0]
    return [(algo, variables, np.asarray(cohort.members))]
  clients = state.clients
  if (algo.stateless is not None or algo.cohorts or not isinstance(clients, dict)
      or not isinstance(clients.get('params'), dict) or 'encoder' not in clients['params']
      or not isinstance(variables, dict) or 'params' not in variables):
    return []
  own = {'params': clients['params'], 'batch_stats': clients.get('batch_stats', {})}
  try:
    mine, glob = ssl_client.encoder_variables(own), ssl_client.encoder_variables(variables)
  except (KeyError, TypeError):
    return []
  same = (jax.tree_util.tree_structure(mine) == jax.tree_util.tree_structure(glob) and all(
      np.shape(a)[1:] == np.shape(b) for a, b in zip(jax.tree_util.tree_leaves(mine),
                                                     jax.tree_util.tree_leaves(glob))))
  num_clients = len(jax.tree_util.tree_leaves(mine)[0]) if same else 0
  return [(algo, own, np.arange(num_clients))] if same else []


def _model_scores(config: ml_collections.ConfigDict, algo: Algorithm, variables: Any,
                  dataset: Dataset, bank_x: np.ndarray, bank_y: np.ndarray,
                  splits: Dict[str, np.ndarray], test_f: Optional[np.ndarray] = None,
                  test_correct: Optional[np.ndarray] = None) -> Dict[str, Dict[str, float]]:
  """{data name: {score: accuracy}} of one model (variables without a client axis) for one client:
  kNN with the client's own images bank_x / bank_y as the memory bank, and with a classifier its
  own predictions, on the test rows of each of `splits`. test_f [M, d] / test_correct [M] are the
  model's test features / classifier hits when already computed (the global model's, shared by
  every client)."""
  out: Dict[str, Dict[str, float]] = {name: {} for name in splits}
  if config.knn_k > 0:
    if test_f is None:
      test_f = encoder_features(algo, variables, False, dataset.test_x, dataset)
    bank_f = fs_features.extract_features(algo.encoder_apply, variables, bank_x, dataset.mean,
                                          dataset.std, batch_size=_BANK_BATCH)
    for name, acc in fs_per_client.knn_scores(
        bank_f, bank_y, test_f, dataset.test_y, splits, dataset.num_classes, k=config.knn_k,
        temperature=config.knn_temperature).items():
      out[name]['knn_acc'] = acc
  if algo.classifier_apply is not None:
    if test_correct is None:
      test_correct = _classifier_correct(algo, variables, dataset)
    for name, acc in fs_per_client.correct_rates(test_correct, splits).items():
      out[name]['test_acc'] = acc
  return out


def _classifier_correct(algo: Algorithm, variables: Any, dataset: Dataset) -> np.ndarray:
  """bool [M]: the model's own classifier is right on each test image."""
  logits = encoder_features(dataclasses.replace(algo, encoder_apply=algo.classifier_apply),
                            variables, False, dataset.test_x, dataset)
  return np.asarray(jnp.argmax(logits, axis=-1)) == dataset.test_y


def per_client_results(config: ml_collections.ConfigDict, algo: Algorithm, state: FedState,
                       dataset: Dataset, fed_data: FedData | placement.LocalClients,
                       splits: List[np.ndarray]) -> tuple:
  """Every client's own model (`client_models`) and the global model (where the algorithm
  evaluates one) scored on the client's held-out split (`client_test_splits`) and on the whole
  test set (docs/notes/evaluation.md#eval-25).

  The score is the weighted kNN of the protocol (config.knn_k, capped at the bank size, and
  config.knn_temperature) with the client's own labelled training images as the memory bank and
  the scored model's features, and, for a model with a classifier, its own predictions
  ('test_acc').

  Under placement 'divided' `fed_data` is this process's `placement.LocalClients` and `state`
  holds its block of the clients' states (a single cohort: a client's rows and model on one
  process): each process scores the clients it holds and one gather brings every client's entry.

  Returns:
    (per_client, summary): results.json's 'per_client' list, one entry per client in id order,
    {'client', 'n_train', 'n_test', 'own': {'split': {score: acc}, 'test': {...}} (clients with a
    model), 'global': {...} (when there is a global model)}, and the spread of every score over the
    clients (`per_client.summary`: '<score>_<model>_<data>_<stat>').
  """
  variables, per_client = algo.eval_variables(state)
  local = fed_data if isinstance(fed_data, placement.LocalClients) else None
  if local is not None and algo.cohorts:
    raise ValueError(f'{algo.name}: per-client results under placement \'divided\' need a '
                     "single cohort (a cohort's models are cut by member, its rows by client id)")
  lo = local.lo if local is not None else 0
  x, y, n = np.asarray(fed_data.x), np.asarray(fed_data.y), np.asarray(fed_data.n)
  # The held clients lo, lo + 1, ...: their rows in `x` (a LocalClients' offsets are its own).
  rows = {lo + i: slice(int(o), int(o) + int(n[lo + i]))
          for i, o in enumerate(np.asarray(fed_data.offsets))}
  every = np.arange(len(dataset.test_y))
  queries = {c: {'split': splits[c], 'test': every} for c in rows}
  entries = {c: {'client': c, 'n_train': int(r.stop - r.start), 'n_test': int(splits[c].size)}
             for c, r in rows.items()}
  if not per_client:
    test_f = (encoder_features(algo, variables, False, dataset.test_x, dataset)
              if config.knn_k > 0 else None)
    test_correct = (_classifier_correct(algo, variables, dataset)
                    if algo.classifier_apply is not None else None)
    for c, r in rows.items():
      entries[c]['global'] = _model_scores(config, algo, variables, dataset, x[r], y[r],
                                           queries[c], test_f, test_correct)
  for group_algo, stacked, members in client_models(algo, state):
    for i, m in enumerate(members):  # under 'divided' the held block's rows: clients lo + i
      c = lo + int(m)
      mine = jax.tree_util.tree_map(lambda a, i=i: a[i], stacked)
      entries[c]['own'] = _model_scores(config, group_algo, mine, dataset, x[rows[c]],
                                        y[rows[c]], queries[c])
  listed = [entries[c] for c in sorted(entries)]
  if local is not None and local.process_count > 1:
    listed = _gather_entries(listed, local.process_count)
  return listed, fs_per_client.summary(listed)


def _gather_entries(entries: List[dict], process_count: int) -> List[dict]:
  """Every process's entries (its clients', in id order), concatenated in process order (= client
  id order): each process's list as JSON bytes, one all-gather of the sizes and one of the bytes
  (`placement.exchange`, bytes moved, never summed; floats round-trip exactly through JSON)."""
  blob = np.frombuffer(json.dumps(entries, default=float).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([blob.size], np.int64))).ravel()
  owner = np.repeat(np.arange(process_count), sizes)
  data = np.asarray(placement.exchange(blob, owner, process_count)).tobytes()
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  return [e for p in range(process_count)
          for e in json.loads(data[bounds[p]:bounds[p + 1]].decode())]
