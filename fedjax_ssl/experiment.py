"""From an ml_collections config to data, algorithm, round step and evaluation.

The binaries (`experiments/train.py`, `experiments/benchmark.py`) and research code share these
builders:

  config = experiment.default_config(); config.update(...)
  experiment.validate_config(config)                 # every error before any compute
  dataset = experiment.load_data(config)
  fed_data, info = experiment.build_fed_data(config, dataset)
  algo = experiment.build_algorithm(config, dataset)
  round_step = core.make_round_step(algo, experiment.round_config(config), config.num_clients)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple

import jax
import ml_collections
import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl import eval as fs_eval
from fedjax_ssl import models
from fedjax_ssl.algorithms import fedavg, fedema, fedu, independent, ssl_client
from fedjax_ssl.algorithms.base import Algorithm
from fedjax_ssl.core import optim, strategies
from fedjax_ssl.core.round import RoundConfig
from fedjax_ssl.core.state import FedState
from fedjax_ssl.data import augment, partition, sources
from fedjax_ssl.data.types import Dataset, FedData

ALGORITHMS = ('fedavg', 'fedu', 'fedema', 'independent', 'centralized')
PARTITIONS = ('iid', 'dirichlet', 'classes')
HEADS = tuple(models.HEAD_PRESETS) + ('custom',)


def default_config() -> ml_collections.ConfigDict:
  """Every key a run may set, with its default (FedBYOL, EasyFL hyper-parameters)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  # Data.
  c.dataset = 'fashion_mnist'
  c.data_source = 'auto'          # sources.load_dataset `source`
  c.data_dir = ''                 # '' = the source's default location
  c.train_size = 0                # keep the first k training examples (0 = all; repshare's subsets)
  c.num_clients = 10
  c.partition = 'dirichlet'       # iid | dirichlet | classes
  c.alpha = 0.5                   # Dirichlet concentration
  c.classes_per_client = 2        # 'classes' partition
  c.public_size = 0               # public / RAD set carved out before partitioning
  # Method.
  c.algorithm = 'fedavg'          # fedavg | fedu | fedema | independent | centralized
  c.ssl_method = 'byol'           # byol | simsiam | simclr | supervised
  c.encoder = 'small_cnn'
  c.conv_impl = 'auto'            # auto | xla | im2col
  c.heads = 'easyfl'              # a models.HEAD_PRESETS name or 'custom'
  c.proj_hidden = 256             # heads == 'custom'
  c.proj_out = 128
  c.pred_hidden = 256
  c.pred_out = 128
  c.head_bn = True
  c.augmentation = 'byol_easyfl'  # augment.PRESETS name
  c.temperature = 0.5             # SimCLR NT-Xent
  c.nt_xent_zero_diagonal = False  # FedU2 code quirk (specs/fedu2.md A18)
  c.ema_tau = 0.99                # BYOL target EMA
  c.byol_target_sync = 'keep'     # keep (EasyFL) | reset (FedSC FedAvg+BYOL)
  c.dapu_threshold = 0.4          # FedU
  c.autoscaler_tau = 0.7          # FedEMA
  c.independent_init = True       # independent: per-client random init
  # Federation and optimisation.
  c.rounds = 100
  c.clients_per_round = 10
  c.local_epochs = 5
  c.batch_size = 128
  c.optimizer = 'sgd'             # sgd | adam
  c.lr = 0.032
  c.momentum = 0.9
  c.nesterov = False
  c.weight_decay = 5e-4
  c.lr_schedule = 'cosine'        # cosine over rounds | constant
  c.grad_clip_norm = 0.0          # 0 = off
  c.reset_optimizer = True        # fresh optimiser state every round
  c.strategy = 'auto'             # auto | vmap | map | shard
  c.map_chunk_size = 1
  # Evaluation and bookkeeping.
  c.eval_every = 0                # kNN monitor every k rounds (0 = off)
  c.knn_k = 200
  c.knn_temperature = 0.1
  c.probe_epochs = 100
  c.probe_batch_size = 512
  c.probe_lr = 3e-3
  c.probe_standardize = False     # z-score features first (not the papers' protocol)
  c.checkpoint_every = 10
  return c


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises cv.ConfigError naming the bad key, its value and what is allowed. Runs no compute."""
  cv.check_known_keys(config, default_config())
  cv.check_choice('algorithm', config.algorithm, ALGORITHMS)
  cv.check_choice('ssl_method', config.ssl_method, ssl_client.SSL_METHODS)
  cv.check_choice('dataset', config.dataset, sources.NAMES)
  cv.check_choice('partition', config.partition, PARTITIONS)
  cv.check_choice('encoder', config.encoder, tuple(models.ENCODERS))
  cv.check_choice('conv_impl', config.conv_impl, models.layers.CONV_IMPLS)
  cv.check_choice('heads', config.heads, HEADS)
  cv.check_choice('augmentation', config.augmentation, tuple(augment.PRESETS))
  cv.check_choice('byol_target_sync', config.byol_target_sync, fedavg.BYOL_TARGET_SYNC)
  cv.check_choice('optimizer', config.optimizer, optim.OPTIMIZERS)
  cv.check_choice('lr_schedule', config.lr_schedule, optim.LR_SCHEDULES)
  cv.check_choice('strategy', config.strategy, ('auto',) + strategies.STRATEGIES)
  cv.check_int_range('num_clients', config.num_clients, 1, 1_000_000)
  cv.check_int_range('clients_per_round', config.clients_per_round, 1, config.num_clients)
  cv.check_int_range('rounds', config.rounds, 1, 10_000_000)
  cv.check_int_range('local_epochs', config.local_epochs, 1, 10_000)
  cv.check_int_range('batch_size', config.batch_size, 2, 1_000_000)
  cv.check_int_range('map_chunk_size', config.map_chunk_size, 1, 1_000_000)
  cv.check_int_range('public_size', config.public_size, 0, 10_000_000)
  cv.check_int_range('train_size', config.train_size, 0, 100_000_000)
  cv.check_int_range('eval_every', config.eval_every, 0, 10_000_000)
  cv.check_int_range('checkpoint_every', config.checkpoint_every, 1, 10_000_000)
  cv.check_int_range('knn_k', config.knn_k, 1, 10_000_000)
  cv.check_int_range('probe_epochs', config.probe_epochs, 0, 100_000)
  cv.check_int_range('probe_batch_size', config.probe_batch_size, 1, 10_000_000)
  cv.check_float_range('lr', config.lr, 0.0, float('inf'), inclusive=(False, True))
  cv.check_float_range('momentum', config.momentum, 0.0, 1.0, inclusive=(True, False))
  cv.check_float_range('weight_decay', config.weight_decay, 0.0, float('inf'))
  cv.check_float_range('grad_clip_norm', config.grad_clip_norm, 0.0, float('inf'))
  cv.check_float_range('ema_tau', config.ema_tau, 0.0, 1.0)
  cv.check_float_range('temperature', config.temperature, 0.0, float('inf'), inclusive=(False, True))
  cv.check_float_range('knn_temperature', config.knn_temperature, 0.0, float('inf'),
                       inclusive=(False, True))
  cv.check_float_range('probe_lr', config.probe_lr, 0.0, float('inf'), inclusive=(False, True))
  cv.check_float_range('dapu_threshold', config.dapu_threshold, 0.0, float('inf'),
                       inclusive=(False, True))
  cv.check_float_range('autoscaler_tau', config.autoscaler_tau, 0.0, float('inf'),
                       inclusive=(False, True))
  if config.partition == 'dirichlet':
    cv.check_float_range('alpha', config.alpha, 0.0, float('inf'), inclusive=(False, True))
  if config.algorithm == 'centralized' and config.num_clients != 1:
    raise cv.ConfigError(f'config.num_clients = {config.num_clients} is invalid for algorithm '
                         f"'centralized': it must be 1 (all data on one client)")
  if config.algorithm in ('fedu', 'fedema') and config.ssl_method not in fedu.METHODS:
    raise cv.ConfigError(f'config.ssl_method = {config.ssl_method!r} is invalid for algorithm '
                         f'{config.algorithm!r}: must be one of {fedu.METHODS} (needs a predictor)')
  if config.heads == 'custom':
    for key in ('proj_hidden', 'proj_out', 'pred_hidden', 'pred_out'):
      cv.check_int_range(key, config[key], 1, 1_000_000)
  strategies.check_participants(strategies.resolve_strategy(config.strategy),
                                config.clients_per_round, config.map_chunk_size)


def load_data(config: ml_collections.ConfigDict) -> Dataset:
  """The configured dataset, in host memory (the first `train_size` training examples if > 0, as
  the representation-sharing code's `load_data(reduced=f)`; the test split stays whole)."""
  ds = sources.load_dataset(config.dataset, source=config.data_source,
                            data_dir=config.data_dir or None, seed=config.seed)
  if config.train_size:
    if config.train_size > len(ds.train_y):
      raise cv.ConfigError(f'config.train_size = {config.train_size} is invalid: the {ds.name} '
                           f'training split has only {len(ds.train_y)} examples')
    ds = dataclasses.replace(ds, train_x=ds.train_x[:config.train_size],
                             train_y=ds.train_y[:config.train_size])
  return ds


def build_fed_data(config: ml_collections.ConfigDict, dataset: Dataset) -> Tuple[FedData, Dict]:
  """Partitions `dataset` into the stacked on-device client layout; info has the class histogram."""
  kw = {}
  if config.partition == 'dirichlet':
    kw['alpha'] = config.alpha
  elif config.partition == 'classes':
    kw['classes_per_client'] = config.classes_per_client
  return partition.build_fed_data(dataset, config.num_clients, config.partition, seed=config.seed,
                                  public_size=config.public_size, **kw)


def build_model(config: ml_collections.ConfigDict, num_classes: int):
  encoder = models.get_encoder(config.encoder, conv_impl=config.conv_impl)
  if config.ssl_method == 'supervised':
    return models.Classifier(encoder, num_classes)
  with_pred = config.ssl_method in ('byol', 'simsiam')
  if config.heads == 'custom':
    projector = models.MLPHead(config.proj_hidden, config.proj_out, config.head_bn)
    predictor = models.MLPHead(config.pred_hidden, config.pred_out, config.head_bn) if with_pred else None
  else:
    projector, predictor = models.make_heads(config.heads, with_pred)
  return models.SSLModel(encoder, projector, predictor)


def client_spec(config: ml_collections.ConfigDict, dataset: Dataset) -> ssl_client.ClientSpec:
  h, w, c = dataset.image_shape
  tx = optim.make_optimizer(config.optimizer, momentum=config.momentum, nesterov=config.nesterov,
                            weight_decay=config.weight_decay, grad_clip_norm=config.grad_clip_norm)
  return ssl_client.ClientSpec(
      method=config.ssl_method, model=build_model(config, dataset.num_classes), tx=tx,
      aug=augment.preset(config.augmentation, h), mean=tuple(dataset.mean), std=tuple(dataset.std),
      input_shape=(h, w, c), temperature=config.temperature,
      nt_xent_zero_diagonal=config.nt_xent_zero_diagonal, ema_tau=config.ema_tau,
      reset_optimizer=config.reset_optimizer)


def build_algorithm(config: ml_collections.ConfigDict, dataset: Dataset) -> Algorithm:
  spec = client_spec(config, dataset)
  if config.algorithm == 'fedavg':
    return fedavg.make(spec, byol_target_sync=config.byol_target_sync)
  if config.algorithm == 'centralized':
    return fedavg.make(spec, byol_target_sync=config.byol_target_sync, name='centralized')
  if config.algorithm == 'fedu':
    return fedu.make(spec, dapu_threshold=config.dapu_threshold)
  if config.algorithm == 'fedema':
    return fedema.make(spec, autoscaler_tau=config.autoscaler_tau)
  return independent.make(spec, independent_init=config.independent_init)


def round_config(config: ml_collections.ConfigDict) -> RoundConfig:
  base_lr, schedule, rounds = float(config.lr), config.lr_schedule, int(config.rounds)
  return RoundConfig(
      clients_per_round=config.clients_per_round, local_epochs=config.local_epochs,
      batch_size=config.batch_size,
      lr_fn=lambda r: optim.round_lr(base_lr, schedule, r, rounds),
      strategy=config.strategy, map_chunk_size=config.map_chunk_size)


def encoder_features(algo: Algorithm, variables: Any, per_client: bool, images: np.ndarray,
                     dataset: Dataset, batch_size: int = 1000) -> jax.Array:
  """Frozen backbone features of `images`: [N, d], or [C, N, d] for personalised models."""
  fn = fs_eval.extract_features_stacked if per_client else fs_eval.extract_features
  return fn(algo.encoder_apply, variables, images, dataset.mean, dataset.std, batch_size=batch_size)


def evaluate(config: ml_collections.ConfigDict, algo: Algorithm, state: FedState, dataset: Dataset,
             *, probe: bool = True, knn: bool = True) -> Dict[str, float]:
  """Linear probe (full train -> full test) and kNN monitor on the frozen encoder(s).

  Personalised models are evaluated client by client; the result is the unweighted client mean
  (per-client accuracies under 'probe_acc_clients').
  """
  variables, per_client = algo.eval_variables(state)
  train_f = encoder_features(algo, variables, per_client, dataset.train_x, dataset)
  test_f = encoder_features(algo, variables, per_client, dataset.test_x, dataset)
  out: Dict[str, Any] = {}
  if knn:
    if per_client:
      accs = [fs_eval.knn_monitor(a, dataset.train_y, b, dataset.test_y, dataset.num_classes,
                                  k=config.knn_k, temperature=config.knn_temperature)
              for a, b in zip(train_f, test_f)]
      out['knn_acc'] = float(np.mean(accs))
    else:
      out['knn_acc'] = float(fs_eval.knn_monitor(train_f, dataset.train_y, test_f, dataset.test_y,
                                                 dataset.num_classes, k=config.knn_k,
                                                 temperature=config.knn_temperature))
  if probe and config.probe_epochs > 0:
    kw = dict(epochs=config.probe_epochs, batch_size=config.probe_batch_size, lr=config.probe_lr,
              seed=config.seed, standardize=config.probe_standardize)
    if per_client:
      res = fs_eval.linear_probe_stack(train_f, dataset.train_y, test_f, dataset.test_y,
                                       dataset.num_classes, **kw)
      out['probe_acc'] = float(res['mean_test_acc'])
      out['probe_acc_clients'] = [float(a) for a in np.asarray(res['test_acc'])]
    else:
      res = fs_eval.linear_probe(train_f, dataset.train_y, test_f, dataset.test_y,
                                 dataset.num_classes, **kw)
      out['probe_acc'] = float(res['test_acc'])
  return out
