"""The run's configuration: every key with its default, and the checks that refuse a bad one
before any compute.

  config = configuration.default_config()        # generic keys + every registered algorithm's block
  configuration.validate_config(config)           # ConfigError naming the key, its value, what is allowed

The generic keys (data, federation, optimisation, evaluation) are checked here; each algorithm checks
its own block through the registry (`algorithms.registry.validate`).
"""
from __future__ import annotations

import functools
import math
import pathlib
from typing import Optional, Tuple

from absl import logging
import flax
import jax
import jax.numpy as jnp
import ml_collections

from fedjax_ssl import algorithms
from fedjax_ssl import config_validation as cv
from fedjax_ssl import models
from fedjax_ssl import run_identity
from fedjax_ssl import ssl
from fedjax_ssl.algorithms.fedavg import BYOL_TARGET_SYNC
from fedjax_ssl.core import faults, optim, placement, server_opt, strategies
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.round import RoundConfig
from fedjax_ssl.data import augment, info as data_info, partition, sources
from fedjax_ssl.data.info import DatasetInfo
from fedjax_ssl.eval import finetune
from fedjax_ssl.ops import dp_fedavg
from fedjax_ssl.core import fedbuff

PARTITIONS = ('iid', 'dirichlet', 'classes')
# The server optimizer's keys and defaults (core/server_opt.py): 'sgd' at server_lr 1 is plain
# aggregation. Each hyper-parameter names the optimizers that read it.
SERVER_OPTIMIZER_DEFAULTS = dict(server_optimizer='sgd', server_lr=1.0, server_momentum=0.9,
                                 server_b1=0.9, server_b2=0.99, server_eps=1e-3)
_SERVER_KEY_READERS = {'server_momentum': ('momentum',), 'server_b1': server_opt.ADAPTIVE,
                       'server_b2': ('adam', 'yogi'), 'server_eps': server_opt.ADAPTIVE}
PROBES = ('adam', 'logistic')
FINETUNES = ('none',) + tuple(finetune.PROTOCOLS)
HEADS = tuple(models.HEAD_PRESETS) + ('custom',)


def default_config() -> ml_collections.ConfigDict:
  """Every key a run may set, with its default (FedBYOL, EasyFL hyper-parameters).

  Each registered algorithm and each registered objective adds its config block, `c.<name>`
  (`algorithms.register(defaults=)`, `ssl.register(Objective(defaults=))`), so an algorithm or an
  objective registered from a user's file has its keys here too.
  """
  c = ml_collections.ConfigDict()
  c.seed = 0
  # Data.
  c.dataset = 'fashion_mnist'
  c.data_source = 'auto'          # sources.load_dataset `source`
  c.data_dir = ''                 # '' = the source's default location
  c.image_size = 0                # folder / tiny_imagenet: resize to S x S on decoding (0 = stored)
  c.test_fraction = 0.2           # folder without train/ and test/: the test share of each class
  c.train_size = 0                # keep the first k training examples (0 = all; repshare's subsets)
  c.subset_stats = False          # True: normalise with the kept subset's statistics (repshare code)
  c.num_clients = 10
  c.partition = 'dirichlet'       # iid | dirichlet | classes
  c.alpha = 0.5                   # Dirichlet concentration
  c.classes_per_client = 2        # 'classes' partition
  c.public_size = 0               # public / RAD set carved out before partitioning
  # Method.
  c.algorithm = 'fedavg'          # a registered name: fedjax_ssl.algorithms.names()
  c.ssl_method = 'byol'           # a registered objective: fedjax_ssl.ssl.names(); its keys: c.<name>
  c.encoder = 'small_cnn'
  c.conv_impl = 'auto'            # auto | xla | im2col | packed | measured | pallas (GPU only)
  # Compute dtype of convolutions, matmuls and activations: float32 | bfloat16. Parameters, optimizer
  # state, BN statistics, losses and the ops stay float32 (docs/notes/engine.md#eng-58).
  c.precision = 'float32'
  c.heads = 'easyfl'              # a models.HEAD_PRESETS name or 'custom'
  c.proj_hidden = 256             # heads == 'custom'
  c.proj_out = 128
  c.pred_hidden = 256
  c.pred_out = 128
  c.head_bn = True
  c.augmentation = 'byol_easyfl'  # augment.PRESETS name
  c.byol_target_sync = 'keep'     # keep (EasyFL) | reset (FedSC FedAvg+BYOL)
  c.sc_mu = 4.0                   # 'sc': NormClip level mu in the SC loss and FedSC's DP-CalR (0 = off)
  # Federation and optimisation.
  c.rounds = 100
  c.clients_per_round = 10
  c.local_epochs = 5
  c.batch_size = 128
  c.drop_last = True              # False: keep each epoch's ragged last batch ('sc' only)
  c.optimizer = 'sgd'             # sgd | adam
  c.lr = 0.032
  c.momentum = 0.9
  c.nesterov = False
  c.weight_decay = 5e-4
  c.lr_schedule = 'cosine'        # cosine over rounds | constant
  c.grad_clip_norm = 0.0          # 0 = off
  # The predictor head's learning rate as a multiple of lr (objectives with a predictor: BYOL,
  # SimSiam; a faster predictor is one of BYOL's known levers, e.g. DirectPred, Tian et al. 2021).
  c.predictor_lr_scale = 1.0
  c.reset_optimizer = True        # fresh optimiser state every round
  # Server optimizer on the global model (Reddi et al., ICLR 2021; core/server_opt.py), stepping
  # along global - aggregate: sgd | momentum (FedAvgM) | adam | yogi | adagrad, at server_lr;
  # server_momentum for 'momentum'; server_b1 (first moment), server_b2 (second moment, adam / yogi)
  # and server_eps (tau) for the adaptive three. 'sgd' at server_lr = 1 is plain aggregation.
  c.update(SERVER_OPTIMIZER_DEFAULTS)
  # User-level DP-FedAvg (ops/dp_fedavg.py) for algorithms registered with dp=True: each update
  # clipped to clip_norm (flat, or S/sqrt(L) per leaf with per_layer), noise of std
  # noise_multiplier * clip_norm on the sum, fixed denominator clients_per_round; noise_multiplier
  # 0 with target_epsilon > 0 calibrates it to the target over `rounds`.
  c.dp = ml_collections.ConfigDict(dict(enabled=False, clip_norm=1.0, per_layer=False,
                                        noise_multiplier=0.0, delta=1e-5, target_epsilon=0.0,
                                        accountant='rdp'))
  # Buffered asynchronous aggregation, FedBuff (core/fedbuff.py) for the same algorithms as dp:
  # `concurrency` clients train at once, the server updates when `buffer_size` updates arrived,
  # each weighted by staleness (constant | polynomial (1+s)^-staleness_exponent | hinge
  # hinge_a, hinge_b); latency speed_c * LogNormal(0, latency_sigma) per training ('lognormal') or
  # speed_c ('constant'), speed_c ~ LogNormal(0, speed_sigma) once per client. `rounds` counts
  # server steps; server_lr is the paper's eta_g. Every metrics row gets `virtual_time`.
  c.fedbuff = ml_collections.ConfigDict(dict(
      enabled=False, concurrency=10, buffer_size=5, latency='lognormal', latency_sigma=1.0,
      speed_sigma=0.0, staleness='polynomial', staleness_exponent=0.5, hinge_a=10.0, hinge_b=4.0))
  c.strategy = 'auto'             # auto | vmap | map | shard
  c.map_chunk_size = 1
  # Under vmap, regroup the participants still training into a batch this many times narrower
  # whenever that few are left, so a skewed round costs its real steps (0 = run every participant
  # as long as the longest one).
  c.vmap_shrink = 2.0
  c.client_state = 'device'       # device | host (stacked client state in host memory)
  # replicated | divided: with several processes, each holds only its block of the clients' data
  # and (client_state='host') state (core/placement.py).
  c.placement = 'replicated'
  # Faults inside a round (core/faults.py): a participant whose upload is not finite is left out of
  # the aggregate and rolled back to the start of the round; a round in which more than
  # max_failed_fraction of the participants failed stops the run as diverged.
  c.max_failed_fraction = 0.5
  c.dropout_rate = 0.0            # each participant's upload is lost after training with this probability
  c.inject_client_faults = ''     # experiment knob: 'ROUND:CLIENT,...' fail on purpose (rounds from 1)
  # Evaluation and bookkeeping.
  c.eval_every = 0                # kNN monitor every k rounds (0 = off)
  c.knn_k = 200                   # 0 = no kNN monitor (supervised runs report test_acc)
  c.knn_temperature = 0.1
  # The final linear probe: 'logistic' = the field's protocol, the default of every table
  # (eval/protocol.py: standardised features, L2 logistic regression by L-BFGS with C chosen on a
  # held-out 10%, at each of label_fractions, label_draws stratified draws each, and kNN at knn_k and
  # knn_k_small on the same labelled subsets; the raw-pixel reference row with it) | 'adam' = the
  # papers' probe (probe_epochs of Adam on frozen features; the probe_* keys below), kept to compare
  # with the papers' own numbers and for fast tests.
  c.probe = 'logistic'
  c.label_fractions = (1.0, 0.1, 0.01)
  c.label_draws = 3
  c.knn_k_small = 20              # 'logistic': a second kNN k (0 = none)
  c.probe_epochs = 100
  c.probe_batch_size = 512
  c.probe_lr = 3e-3
  c.probe_standardize = False     # z-score features first (not the papers' protocol)
  # > 0: a second probe on z-scored features for that many epochs ('probe_std_acc'), so a result
  # also shows whether the encoder beats random features under a well-conditioned probe.
  c.probe_std_epochs = 0
  # Semi-supervised fine-tuning of the evaluated encoder(s) with a new linear head, in the final
  # evaluation: 'none' | 'fedu2' (FedU2's FT 1% / 10%) | 'hetero_ssfl' (Hetero-SSFL's Tables 5-6),
  # the protocols of eval/finetune.PROTOCOLS, on a stratified subset of each of finetune_fractions
  # of the training split (ft_acc_1pct, ft_acc_10pct). finetune_epochs > 0 replaces the protocol's
  # epochs (its test epochs scaled alike), 0 keeps them.
  c.finetune = 'none'
  c.finetune_fractions = (0.01, 0.1)
  c.finetune_epochs = 0
  # Per-client results (docs/notes/evaluation.md#eval-25): after the last round, each client's own
  # model (where it keeps one) and the global model (where there is one) scored on the client's
  # held-out split of the test set and on the whole test set: results.json's 'per_client' list and
  # the spread over clients ('<score>_<model>_<data>_<stat>', eval/per_client.py).
  c.per_client_eval = False
  c.checkpoint_every = 10
  for kind, registered, block in (('algorithm', algorithms.names(), algorithms.get),
                                  ('objective', ssl.names(), ssl.get)):
    for name in registered:
      if name in c:  # both kinds of block and the generic keys share the top level
        raise ValueError(f'{kind} {name!r} is invalid: config.{name} is taken by another key or '
                         'block; register it under another name')
      c[name] = block(name).defaults()
  return c


def _check_per_client_eval(config: ml_collections.ConfigDict) -> None:
  """config.per_client_eval is a bool and has a score to report: the kNN (knn_k > 0) or a
  supervised objective's classifier. The clients' split sizes are checked once the data is
  partitioned (`evaluation.client_test_splits`)."""
  if not isinstance(config.per_client_eval, bool):
    raise cv.ConfigError(f'config.per_client_eval = {config.per_client_eval!r} is invalid: must be '
                         'True or False')
  if (config.per_client_eval and config.knn_k == 0
      and not ssl.get(config.ssl_method).classifier):
    raise cv.ConfigError(f'config.per_client_eval = True with config.knn_k = 0 is invalid for '
                         f'ssl_method {config.ssl_method!r}: the per-client score is the kNN '
                         '(knn_k > 0) or a supervised classifier\'s accuracy')


def _check_placement(config: ml_collections.ConfigDict) -> None:
  """config.placement is known, and 'divided' is not combined with what reads every client's data
  or state on each process. The process count is checked when the run starts
  (`placement.check_processes`), and the algorithm's pre-round step and per-client results of
  cohorts when it is built (runs/run_setup.py)."""
  cv.check_choice('placement', config.placement, placement.PLACEMENTS)
  if config.placement != 'divided':
    return
  if config.fedbuff.enabled:
    raise cv.ConfigError("config.placement = 'divided' is invalid with config.fedbuff.enabled = "
                         'True: its pending updates and clock are one state of all clients; use '
                         "'replicated'")


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises cv.ConfigError naming the bad key, its value and what is allowed. Runs no compute.

  Besides each key's own range it checks the keys against each other and against the dataset's
  sizes and image shape, known without loading it (`dataset_info`): train_size, public_size and
  num_clients against the training split, knn_k against the kNN memory bank, the encoder against
  the image size. Loads no data and builds no model (the encoder is traced abstractly, no FLOPs).
  """
  cv.check_choice('algorithm', config.algorithm, algorithms.names())
  run_identity.check_no_moved_keys(config)
  cv.check_known_keys(config, default_config())
  ssl.registry.validate(config)
  cv.check_choice('dataset', config.dataset, sources.NAMES)
  cv.check_choice('data_source', config.data_source, sources.SOURCES)
  cv.check_choice('partition', config.partition, PARTITIONS)
  cv.check_choice('encoder', config.encoder, tuple(models.ENCODERS))
  cv.check_choice('conv_impl', config.conv_impl, models.layers.CONV_IMPLS)
  if config.conv_impl == 'pallas' and jax.default_backend() not in models.layers.PALLAS_BACKENDS:
    raise cv.ConfigError(
        f"config.conv_impl = 'pallas' is invalid on the {jax.default_backend()!r} backend: needs one "
        f"of {models.layers.PALLAS_BACKENDS} (its Triton kernel); use 'packed', 'measured', 'xla' "
        "or 'im2col'")
  cv.check_choice('precision', config.precision, tuple(models.PRECISIONS))
  cv.check_choice('heads', config.heads, HEADS)
  cv.check_choice('augmentation', config.augmentation, tuple(augment.PRESETS))
  cv.check_choice('byol_target_sync', config.byol_target_sync, BYOL_TARGET_SYNC)
  cv.check_choice('optimizer', config.optimizer, optim.OPTIMIZERS)
  cv.check_choice('lr_schedule', config.lr_schedule, optim.LR_SCHEDULES)
  cv.check_choice('strategy', config.strategy, ('auto',) + strategies.STRATEGIES)
  if not isinstance(config.data_dir, str):
    raise cv.ConfigError(f'config.data_dir = {config.data_dir!r} is invalid: must be a path string '
                         "('' = the source's default location)")
  cv.check_int_range('image_size', config.image_size, 0, 4096)
  if config.image_size and config.dataset not in sources.FOLDER_NAMES:
    raise cv.ConfigError(f'config.image_size = {config.image_size} is invalid for config.dataset = '
                         f'{config.dataset!r}: only {sources.FOLDER_NAMES} are resized (keep 0)')
  cv.check_float_range('test_fraction', config.test_fraction, 0.0, 1.0, inclusive=False)
  cv.check_int_range('seed', config.seed, 0, 2**31 - 1)
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
  cv.check_int_range('knn_k', config.knn_k, 0, 10_000_000)
  cv.check_choice('probe', config.probe, PROBES)
  cv.check_int_range('label_draws', config.label_draws, 1, 1_000)
  cv.check_int_range('knn_k_small', config.knn_k_small, 0, 10_000_000)
  if config.probe == 'logistic' and config.knn_k_small and config.knn_k_small == config.knn_k:
    raise cv.ConfigError(f'config.knn_k_small = {config.knn_k_small} is invalid: equal to '
                         'config.knn_k it reports the same kNN twice; use another k or 0 (none)')
  _check_fractions('label_fractions', config.label_fractions, '(1.0, 0.1, 0.01)')
  cv.check_choice('finetune', config.finetune, FINETUNES)
  _check_fractions('finetune_fractions', config.finetune_fractions, '(0.01, 0.1)')
  cv.check_int_range('finetune_epochs', config.finetune_epochs, 0, 100_000)
  cv.check_int_range('probe_epochs', config.probe_epochs, 0, 100_000)
  cv.check_int_range('probe_std_epochs', config.probe_std_epochs, 0, 100_000)
  cv.check_int_range('probe_batch_size', config.probe_batch_size, 1, 10_000_000)
  cv.check_float_range('lr', config.lr, 0.0, None, inclusive=(False, True))
  cv.check_float_range('momentum', config.momentum, 0.0, 1.0, inclusive=(True, False))
  cv.check_float_range('weight_decay', config.weight_decay, 0.0, None)
  cv.check_float_range('grad_clip_norm', config.grad_clip_norm, 0.0, None)
  cv.check_float_range('predictor_lr_scale', config.predictor_lr_scale, 0.0, None,
                       inclusive=(False, True))
  if config.predictor_lr_scale != 1.0 and not ssl.get(config.ssl_method).predictor:
    raise cv.ConfigError(
        f'config.predictor_lr_scale = {config.predictor_lr_scale!r} is invalid with ssl_method '
        f'{config.ssl_method!r}, which has no predictor: keep it at 1.0 (objectives with one: '
        f"{', '.join(n for n in ssl.names() if ssl.get(n).predictor)})")
  _check_server_optimizer(config)
  _check_dp(config)
  _check_fedbuff(config)
  cv.check_float_range('knn_temperature', config.knn_temperature, 0.0, None,
                       inclusive=(False, True))
  cv.check_float_range('probe_lr', config.probe_lr, 0.0, None, inclusive=(False, True))
  if config.partition == 'dirichlet':
    cv.check_float_range('alpha', config.alpha, 0.0, None, inclusive=(False, True))
  if config.partition == 'classes':
    cv.check_int_range('classes_per_client', config.classes_per_client, 1, 1_000_000)
  info = dataset_info(config)
  algorithms.registry.validate(config, info)
  if algorithms.registry.dp_enabled(config):  # a target the schedule cannot meet: refused now
    algorithms.registry.dp_noise_multiplier(config)
  if (not ssl.get(config.ssl_method).classifier and config.knn_k == 0 and config.probe == 'adam'
      and config.probe_epochs == 0 and config.probe_std_epochs == 0 and config.finetune == 'none'):
    raise cv.ConfigError(f'config.knn_k = 0 with probe_epochs = 0 and probe_std_epochs = 0 is '
                         f'invalid for ssl_method {config.ssl_method!r}: the run would report no '
                         'accuracy; keep the kNN monitor (knn_k > 0) or a probe')
  _check_per_client_eval(config)
  cv.check_float_range('sc_mu', config.sc_mu, 0.0, None)
  if not config.drop_last and not ssl.get(config.ssl_method).ragged_batches:
    raise cv.ConfigError(f'config.drop_last = False is invalid with ssl_method '
                         f"{config.ssl_method!r}: its loss does not read the ragged last batch's "
                         f"mask (objectives that do: "
                         f"{', '.join(n for n in ssl.names() if ssl.get(n).ragged_batches)})")
  if config.heads == 'custom':
    for key in ('proj_hidden', 'proj_out', 'pred_hidden', 'pred_out'):
      cv.check_int_range(key, config[key], 1, 1_000_000)
  cv.check_choice('client_state', config.client_state, rd.CLIENT_STATES)
  _check_placement(config)
  cv.check_float_range('max_failed_fraction', config.max_failed_fraction, 0.0, 1.0, (True, False))
  cv.check_float_range('dropout_rate', config.dropout_rate, 0.0, 1.0, (True, False))
  try:
    injected = faults.parse(config.inject_client_faults)
  except ValueError as e:
    raise cv.ConfigError(str(e)) from None
  for r, cid in injected:
    if r >= config.rounds or cid >= config.num_clients:
      raise cv.ConfigError(f'config.inject_client_faults entry {r + 1}:{cid} is invalid: the round '
                           f'must be in [1, rounds={config.rounds}] and the client in '
                           f'[0, num_clients={config.num_clients})')
  if config.vmap_shrink != 0:
    cv.check_float_range('vmap_shrink', config.vmap_shrink, 1.0, None, inclusive=(False, True))
  try:
    strategies.check_participants(strategies.resolve_strategy(config.strategy),
                                  config.clients_per_round, config.map_chunk_size)
  except ValueError as e:  # its messages already name the key and the value
    raise cv.ConfigError(f'config.{e}') from None
  _check_data_source(config)
  if info is not None:  # None: sizes only known once loaded (experiments.train checks them then)
    check_data_config(config, info)


def _check_fractions(key: str, fractions, example: str) -> None:
  """config.<key>: distinct label fractions in (0, 1], at least one (`example`: a valid value)."""
  fractions = tuple(fractions)
  if not fractions or len(set(fractions)) != len(fractions) or not all(
      isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1 for f in fractions):
    raise cv.ConfigError(f'config.{key} = {fractions!r} is invalid: must be distinct numbers in '
                         f'(0, 1] (e.g. {example}), at least one')


def _check_server_optimizer(config: ml_collections.ConfigDict) -> None:
  """The server optimizer's name and ranges, and no hyper-parameter set that it does not read."""
  name = cv.check_choice('server_optimizer', config.server_optimizer, server_opt.OPTIMIZERS)
  cv.check_float_range('server_lr', config.server_lr, 0.0, None, inclusive=(False, True))
  for key in ('server_momentum', 'server_b1', 'server_b2'):
    cv.check_float_range(key, config[key], 0.0, 1.0, inclusive=(True, False))
  cv.check_float_range('server_eps', config.server_eps, 0.0, None, inclusive=(False, True))
  for key, readers in _SERVER_KEY_READERS.items():
    if name not in readers and config[key] != SERVER_OPTIMIZER_DEFAULTS[key]:
      raise cv.ConfigError(f'config.{key} = {config[key]!r} is invalid with server_optimizer = '
                           f'{name!r}: only {readers} read it')


def _check_dp(config: ml_collections.ConfigDict) -> None:
  """config.dp's ranges (ops/dp_fedavg.py), checked whether or not it is enabled."""
  d = config.dp
  cv.check_float_range('dp.clip_norm', d.clip_norm, 0.0, None, inclusive=(False, True))
  cv.check_float_range('dp.noise_multiplier', d.noise_multiplier, 0.0, None)
  cv.check_float_range('dp.delta', d.delta, 0.0, 1.0, inclusive=(False, False))
  cv.check_float_range('dp.target_epsilon', d.target_epsilon, 0.0, None)
  cv.check_choice('dp.accountant', d.accountant, dp_fedavg.ACCOUNTANTS)
  if (d.enabled and d.accountant == 'pld'
      and config.clients_per_round < config.num_clients):
    raise cv.ConfigError(f"config.dp.accountant = 'pld' is invalid with clients_per_round = "
                         f'{config.clients_per_round} < num_clients = {config.num_clients}: '
                         "dp-accounting's PLD cannot account sampling without replacement; use "
                         "'rdp' or full participation")


def _check_fedbuff(config: ml_collections.ConfigDict) -> None:
  """config.fedbuff (core/fedbuff.py), checked whether or not it is enabled; with it on, the
  settings FedBuff cannot run with."""
  try:
    fedbuff.check(algorithms.registry.fedbuff_config(config),
                  config.num_clients if config.fedbuff.enabled else None)
  except ValueError as e:
    raise cv.ConfigError(f'config.{e}') from None
  if not config.fedbuff.enabled:
    return
  if config.dp.enabled:
    raise cv.ConfigError('config.fedbuff.enabled = True is invalid with config.dp.enabled = True: '
                         'DP-FedAvg accounts synchronous rounds of a fixed cohort; turn one off')
  if config.client_state != 'device':
    raise cv.ConfigError(f'config.client_state = {config.client_state!r} is invalid with '
                         "config.fedbuff.enabled = True: the pending updates live on the device; "
                         "use 'device'")


_ONE_SOURCE = sources.SINGLE_SOURCE_NAMES


def _check_data_source(config: ml_collections.ConfigDict) -> None:
  """data_source / data_dir against the dataset (what load_dataset would reject, checked early)."""
  name, source, data_dir = config.dataset, config.data_source, config.data_dir
  if name in _ONE_SOURCE and source != 'auto':
    raise cv.ConfigError(f'config.data_source = {source!r} is invalid for config.dataset = '
                         f"{name!r}: must be 'auto' (the dataset has a single source)")
  if source == 'idx':
    if name not in sources.IDX_NAMES:
      raise cv.ConfigError(f"config.data_source = 'idx' is invalid for config.dataset = {name!r}: "
                           f"IDX files exist for {sources.IDX_NAMES} only; use 'auto' or 'tfds'")
    directory = data_dir or sources._DEFAULT_IDX_DIRS.get(name)  # pylint: disable=protected-access
    if directory is None:
      raise cv.ConfigError(f"config.data_dir = '' is invalid for config.data_source = 'idx' and "
                           f'config.dataset = {name!r}: must name the directory of the IDX files')
    if not sources._has_idx_files(directory):  # pylint: disable=protected-access
      raise cv.ConfigError(
          f'config.data_dir = {data_dir!r} is invalid for config.data_source = \'idx\': '
          f'{directory} does not hold the IDX files {list(sources.IDX_FILES.values())} (each '
          f'optionally .gz)' + ('; install the Debian package dataset-fashion-mnist or set '
                                'config.data_dir' if not data_dir else ''))
  if name in sources.FOLDER_NAMES and not (data_dir and pathlib.Path(data_dir).is_dir()):
    layout = ('PATH/train/<class>/*.png|jpg and PATH/test/<class>/..., or PATH/<class>/...'
              if name == 'folder' else 'the released tiny-imagenet-200 folder (train/, val/)')
    raise cv.ConfigError(f'config.data_dir = {data_dir!r} is invalid for config.dataset = {name!r}: '
                         f'must be an existing folder holding {layout}')
  if (name in sources.CATALOG_NAMES and source != 'idx' and data_dir
      and not pathlib.Path(data_dir).is_dir() and not sources._has_idx_files(data_dir)):  # pylint: disable=protected-access
    raise cv.ConfigError(
        f'config.data_dir = {data_dir!r} is invalid for config.dataset = {name!r}: no such folder; '
        f'give the folder `{sources.prepare_command(name, "FOLDER")}` prepared (copied here from '
        "a machine with internet), or '' for the tfds default")
  if name in sources.UNLABELLED_SPLITS:
    if config.partition != 'iid':
      raise cv.ConfigError(f'config.partition = {config.partition!r} is invalid for config.dataset '
                           f"= {name!r}: its clients train on unlabelled images; must be 'iid'")
    if ssl.get(config.ssl_method).classifier:
      raise cv.ConfigError(f'config.ssl_method = {config.ssl_method!r} is invalid for '
                           f'config.dataset = {name!r}: a supervised objective needs labels, and '
                           f"its clients' images have none (use {name.split('_')[0]!r})")
  if name == 'fashion_mnist_subset' and data_dir and not pathlib.Path(data_dir).is_file():
    raise cv.ConfigError(f'config.data_dir = {data_dir!r} is invalid for config.dataset = '
                         "'fashion_mnist_subset': must be the path of the subset's .npz file "
                         "('' = the shipped tests/data/fashion_mnist_subset.npz)")


def dataset_info(config: ml_collections.ConfigDict) -> Optional[DatasetInfo]:
  """What is known of the configured dataset before loading it (None where it cannot be known)."""
  return data_info.dataset_info(config.dataset, config.data_source, config.data_dir,
                                config.image_size)


@functools.lru_cache(maxsize=None)
def _encoder_input_error(encoder: str, input_shape: Tuple[int, int, int]) -> Optional[str]:
  """Why `encoder` cannot take [B, *input_shape] images (None if it can). Traced abstractly with
  `jax.eval_shape`: no parameters are allocated and nothing is computed. Cached: a table validates
  hundreds of cells over a few encoders and shapes, and tracing a ResNet takes about a second."""
  module = models.get_encoder(encoder, conv_impl='xla')  # same shapes as im2col, no backend query
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  x = jax.ShapeDtypeStruct((2,) + tuple(input_shape), jnp.float32)
  try:
    jax.eval_shape(lambda k, v: module.init(k, v, train=False), key, x)
  except (ValueError, TypeError, flax.errors.FlaxError) as e:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
  return None


def check_data_config(config: ml_collections.ConfigDict, info: DatasetInfo) -> None:
  """The checks of `config` against the dataset's sizes and image shape.

  validate_config runs them with `dataset_info(config)`, before any data is loaded;
  experiments.train runs them on the loaded dataset (`DatasetInfo.of`) when its sizes were not
  known beforehand.
  """
  split = f'the {info.name} training split'
  if config.train_size > info.num_train:
    raise cv.ConfigError(f'config.train_size = {config.train_size} is invalid: must be <= '
                         f'{info.num_train}, the size of {split} (0 = all of it)')
  n = config.train_size or info.num_train
  source = f'config.train_size = {config.train_size}' if config.train_size else f'all of {split}'
  pool = info.num_unlabeled or n  # the images the clients (and the public set) draw from
  pool_source = (f'the unlabelled images of {info.name}' if info.num_unlabeled else source)
  if config.public_size >= pool:
    raise cv.ConfigError(f'config.public_size = {config.public_size} is invalid: must be < {pool}, '
                         f'the number of training examples ({pool_source})')
  left = pool - config.public_size
  left_text = (f'{left} training examples ({pool_source}, minus config.public_size = '
               f'{config.public_size})' if config.public_size else
               f'{left} training examples ({pool_source})')
  # Every client needs examples to train on; the Dirichlet partition redraws until each has at
  # least partition.DEFAULT_MIN_SIZE.
  per_client = partition.DEFAULT_MIN_SIZE if config.partition == 'dirichlet' else 1
  if left < config.num_clients * per_client:
    raise cv.ConfigError(
        f'config.num_clients = {config.num_clients} is invalid: {left_text} cannot give every '
        f'client {"at least " if per_client > 1 else ""}{per_client} example'
        f'{"s" if per_client > 1 else ""} (config.partition = {config.partition!r}); must be <= '
        f'{left // per_client}')
  if config.partition == 'classes':
    k, num_classes = config.classes_per_client, info.num_classes
    if k > num_classes:
      raise cv.ConfigError(f'config.classes_per_client = {k} is invalid: must be <= {num_classes}, '
                           f'the number of classes of {info.name}')
    slots = config.num_clients * k
    if slots > num_classes and slots % num_classes:
      raise cv.ConfigError(
          f'config.classes_per_client = {k} is invalid with config.num_clients = '
          f'{config.num_clients}: num_clients * classes_per_client = {slots} exceeds the '
          f'{num_classes} classes of {info.name}, so classes are shared between clients (shard '
          f'mode) and {slots} must be a multiple of {num_classes}')
  if config.knn_k > n:
    raise cv.ConfigError(f'config.knn_k = {config.knn_k} is invalid: must be <= {n}, the number of '
                         f'training examples in the kNN memory bank ({source})')
  # The labelled subsets (protocol.stratified_subset: round-half-up(f * n) images) need every class.
  for key, used in (('label_fractions', config.probe == 'logistic'),
                    ('finetune_fractions', config.finetune != 'none')):
    for f in config[key] if used else ():
      labelled = math.floor(f * n + 0.5)
      if labelled < info.num_classes:
        raise cv.ConfigError(
            f'config.{key} = {tuple(config[key])!r} is invalid: {f} of the {n} training examples '
            f'({source}) is {labelled} labelled images, fewer than the {info.num_classes} classes; '
            'every class needs at least one')
  h, w, c = info.image_shape
  out_h, out_w = augment.preset(config.augmentation, h).output_hw(h, w)
  for key, encoder in algorithms.registry.encoders(config):
    reason = _encoder_input_error(encoder, (out_h, out_w, c))
    if reason is not None:
      fits = [e for e in models.ENCODERS if _encoder_input_error(e, (out_h, out_w, c)) is None]
      raise cv.ConfigError(f'{key} = {encoder!r} is invalid for the {out_h}x{out_w}x{c} images '
                           f'of {info.name} ({reason}); encoders that take them: {fits}')
  average = left // config.num_clients
  if config.batch_size > average:
    logging.warning(
        'config.batch_size = %d exceeds the average client size %d (%s over %d clients): clients '
        'with fewer than batch_size examples make one step per local epoch on a batch that repeats '
        'their examples', config.batch_size, average, left_text, config.num_clients)


def round_config(config: ml_collections.ConfigDict) -> RoundConfig:
  base_lr, schedule, rounds = float(config.lr), config.lr_schedule, int(config.rounds)
  return RoundConfig(
      clients_per_round=config.clients_per_round, local_epochs=config.local_epochs,
      batch_size=config.batch_size,
      lr_fn=lambda r: optim.round_lr(base_lr, schedule, r, rounds),
      strategy=config.strategy, map_chunk_size=config.map_chunk_size,
      drop_last=bool(config.drop_last), vmap_shrink=float(config.vmap_shrink),
      client_state=config.client_state, placement=config.placement,
      dropout_rate=float(config.dropout_rate),
      inject_faults=faults.parse(config.inject_client_faults),
      dp=(dp_fedavg.DpAggregation(float(config.dp.clip_norm),
                                  algorithms.registry.dp_noise_multiplier(config),
                                  bool(config.dp.per_layer))
          if algorithms.registry.dp_enabled(config) else None))


# The one switch that shrinks any documented command to a smoke run (what the docs test applies to
# the blocks that train for minutes or more; docs/notes/harness.md#harness-24). Set to 1, the train
# binary runs its config through `smoke` and the reproduce binary runs the first cell at the first
# seed, shrunk likewise.
SMOKE_ENV = 'FEDJAX_SSL_SMOKE'
# train_size's limit is 2,000 images for the clients beside the public set, which keeps its size
# (Hetero-SSFL's RAD batches must divide it).
# num_clients: the smoke data (2,000 images) cannot give every client of a cross-device federation
# (configs/dp/table.py: 500) the 2 examples a partition needs; clients_per_round follows it down.
SMOKE_LIMITS = dict(rounds=2, local_epochs=1, train_size=2000, num_clients=100, finetune_epochs=1)
# Keys whose 0 means "all" (train_size: every example; finetune_epochs: the protocol's 100 or 200):
# above any limit.
_ZERO_IS_ALL = ('train_size', 'finetune_epochs')
# The protocol's probe at full labels only: the 1 % fits at weak penalty run to max_iter on raw
# pixels, most of a smoke run's time (docs/notes/harness.md#harness-24).
SMOKE_SETTINGS = dict(label_fractions=(1.0,))


def smoke_requested(environ) -> bool:
  """Whether `environ` (os.environ) asks for smoke runs; a value other than '', '0' or '1' is a
  ConfigError naming it."""
  value = environ.get(SMOKE_ENV, '')
  if value not in ('', '0', '1'):
    raise cv.ConfigError(f'${SMOKE_ENV} = {value!r} is invalid: set it to 1 (smoke runs) or 0 / '
                         'unset (the command as configured)')
  return value == '1'


def smoke(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of `config` at smoke size: each key of SMOKE_LIMITS lowered to its limit (train_size 0,
  all examples, and finetune_epochs 0, the protocol's, count as above it), everything else as
  configured, so the smoke run exercises the same data source, model, algorithm, evaluation and
  files as the full one, with SMOKE_SETTINGS."""
  small = ml_collections.ConfigDict(config.to_dict())
  small.update(SMOKE_SETTINGS)
  for key, limit in SMOKE_LIMITS.items():
    value = int(small[key])
    limit += int(small.public_size) if key == 'train_size' else 0
    small[key] = limit if (key in _ZERO_IS_ALL and value == 0) else min(value, limit)
  small.clients_per_round = min(int(small.clients_per_round), int(small.num_clients))
  if small.eval_every:
    small.eval_every = min(int(small.eval_every), small.rounds)
  if small.checkpoint_every:
    small.checkpoint_every = min(int(small.checkpoint_every), small.rounds)
  return small
