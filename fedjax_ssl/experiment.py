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
import json
import pathlib
import zipfile
from typing import Any, Dict, Optional, Tuple

from absl import logging
import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl import eval as fs_eval
from fedjax_ssl import models
from fedjax_ssl.algorithms import (fd, fedavg, fedema, fedsc, fedu, fedu2, hetero_ssfl, independent,
                                   repshare, ssl_client)
from fedjax_ssl.algorithms.base import Algorithm
from fedjax_ssl.core import optim, rng, strategies
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.round import RoundConfig
from fedjax_ssl.core.state import FedState
from fedjax_ssl.data import augment, partition, sources
from fedjax_ssl.data.types import Dataset, FedData
from fedjax_ssl.ops import min_norm, privacy, uot

ALGORITHMS = ('fedavg', 'fedu', 'fedema', 'fedu2', 'fedsc', 'hetero_ssfl', 'repshare', 'fd',
              'independent', 'centralized')
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
  c.subset_stats = False          # True: normalise with the kept subset's statistics (repshare code)
  c.num_clients = 10
  c.partition = 'dirichlet'       # iid | dirichlet | classes
  c.alpha = 0.5                   # Dirichlet concentration
  c.classes_per_client = 2        # 'classes' partition
  c.public_size = 0               # public / RAD set carved out before partitioning
  # Method.
  c.algorithm = 'fedavg'          # fedavg | fedu | fedema | fedu2 | fedsc | hetero_ssfl | repshare | fd | independent | centralized
  c.ssl_method = 'byol'           # byol | simsiam | simclr | sc | supervised
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
  c.nt_xent_zero_diagonal = False  # FedU2 code quirk (arXiv:2403.16398; BUILD_NOTES "Losses and evaluation")
  c.ema_tau = 0.99                # BYOL target EMA
  c.byol_target_sync = 'keep'     # keep (EasyFL) | reset (FedSC FedAvg+BYOL)
  c.dapu_threshold = 0.4          # FedU
  c.autoscaler_tau = 0.7          # FedEMA
  c.independent_init = True       # independent: per-client random init
  c.fedu2 = fedu2_config()
  c.fedsc = fedsc_config()
  c.hetero_ssfl = hetero_ssfl_config()
  c.repshare = repshare_config()
  c.fd = fd_config()
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
  c.reset_optimizer = True        # fresh optimiser state every round
  c.strategy = 'auto'             # auto | vmap | map | shard
  c.map_chunk_size = 1
  # Under vmap, regroup the participants still training into a batch this many times narrower
  # whenever that few are left, so a skewed round costs its real steps (0 = run every participant
  # as long as the longest one).
  c.vmap_shrink = 2.0
  c.client_state = 'device'       # device | host (stacked client state in host memory)
  # Evaluation and bookkeeping.
  c.eval_every = 0                # kNN monitor every k rounds (0 = off)
  c.knn_k = 200                   # 0 = no kNN monitor (supervised runs report test_acc)
  c.knn_temperature = 0.1
  c.probe_epochs = 100
  c.probe_batch_size = 512
  c.probe_lr = 3e-3
  c.probe_standardize = False     # z-score features first (not the papers' protocol)
  # > 0: a second probe on z-scored features for that many epochs ('probe_std_acc'), so a result
  # also shows whether the encoder beats random features under a well-conditioned probe.
  c.probe_std_epochs = 0
  c.checkpoint_every = 10
  return c


def fedu2_config() -> ml_collections.ConfigDict:
  """FedU2's keys (algorithm = 'fedu2'); defaults follow BUILD_NOTES "FedU2" decisions A1-A19."""
  f = ml_collections.ConfigDict()
  # FUR (flexible uniform regularizer) on the clients.
  f.fur = 'uot'                   # uot (paper Eqs. 4-6) | swd (official code) | none (ablation)
  f.lambda_u = 0.1                # paper 0.1; the code uses 0.01 with its SWD
  f.tau_a = 0.8
  f.tau_b = 0.8
  f.uot_iters = 100
  f.cost = 'l2'                   # l2 ||z-s|| | sq ||z-s||^2 | sq_max (squared / max)
  f.mass = 1.0                    # per-sample marginal mass (1/B = probability marginals: FUR inactive)
  f.normalize = True              # l2-normalise the projector output first (paper)
  f.swd_projections = 6
  # EUA (efficient unified aggregator) on the server.
  f.eua = True                    # False: data-weighted averaging (ablation)
  f.direction = 'code'            # code 2D/|D| | paper 2D/|D|^2
  f.solver = 'exact'              # exact | admm | admm_literal (ops.min_norm)
  f.solver_iters = 0              # 0 = the solver's default
  f.eta_g = 1.0                   # ADMM: c = eta_g^2 / phi
  f.phi = 0.1
  f.rho = 1.0
  f.scope = 'whole_model'         # whole_model (BYOL target too, code) | online
  f.step = 'fixed'                # fixed: theta -= server_lr d | deviation: |step| = server_lr mean |D|
  f.server_lr = 8.0
  return f


def _validate_fedu2(config: ml_collections.ConfigDict) -> None:
  f = config.fedu2
  if config.ssl_method not in fedu2.METHODS:
    raise cv.ConfigError(f'config.ssl_method = {config.ssl_method!r} is invalid for algorithm '
                         f"'fedu2': must be one of {fedu2.METHODS}")
  cv.check_choice('fedu2.fur', f.fur, uot.FUR_KINDS + ('none',))
  cv.check_choice('fedu2.cost', f.cost, uot.COSTS)
  cv.check_choice('fedu2.direction', f.direction, fedu2.EUA_DIRECTIONS)
  cv.check_choice('fedu2.solver', f.solver, min_norm.METHODS)
  cv.check_choice('fedu2.scope', f.scope, fedu2.EUA_SCOPES)
  cv.check_choice('fedu2.step', f.step, fedu2.EUA_STEPS)
  for key in ('lambda_u', 'tau_a', 'tau_b', 'mass', 'eta_g', 'phi', 'rho', 'server_lr'):
    cv.check_float_range(f'fedu2.{key}', f[key], 0.0, None, inclusive=(key == 'lambda_u', True))
  cv.check_int_range('fedu2.uot_iters', f.uot_iters, 1, 1_000_000)
  cv.check_int_range('fedu2.swd_projections', f.swd_projections, 1, 1_000_000)
  cv.check_int_range('fedu2.solver_iters', f.solver_iters, 0, 10_000_000)


def fedsc_config() -> ml_collections.ConfigDict:
  """FedSC's keys (algorithm = 'fedsc', ssl_method = 'sc'); defaults follow BUILD_NOTES "FedSC"."""
  f = ml_collections.ConfigDict()
  f.share = True                  # False: FedAvg+SC (no correlation matrices, alpha = 1)
  f.share_start = 0               # share in round t (1-indexed) iff t > share_start ...
  f.share_every = 1               # ... and t % share_every == 0 (Table 6: 100/1, 150/1, 100/2)
  f.alpha_schedule = 'linear'     # linear alpha_start -> alpha_end (App. C) | q (alpha_j = q_j, Eq. 5)
  f.alpha_start = 1.0
  f.alpha_end = 0.2
  f.matrix_weights = 'uniform'    # q_j of R̃: uniform 1/J (code) | data |D_j|/|D| (paper)
  f.model_weights = 'uniform'     # model average over participants: uniform (Alg. 1) | data
  f.calr_views = 10               # DP-CalR views per example (code: 5 passes x 2)
  f.calr_batch = 256              # DP-CalR examples per forward pass (memory only)
  f.paper_scale = False           # True: the paper's 1/2-scaled loss (code scale = 2x, A3)
  # Differential privacy of the uploaded matrices (DP-CalR).
  f.dp = False
  f.sigma = 0.0                   # noise std; 0 with dp = calibrate to target_epsilon
  f.target_epsilon = 0.0          # > 0: refuse a run whose ledger would exceed it
  f.delta = 1e-2
  f.adjacency = 'replace_one'     # replace_one sqrt(2) mu/|D_j| | zero_out mu/|D_j| (paper proof)
  f.accountant = 'rdp'            # rdp (dp-accounting) | closed_form (paper Prop. 6.6)
  f.sigma_partial = 'none'        # sigma under partial participation: none | linear (code) | sqrt
  return f


def _validate_fedsc(config: ml_collections.ConfigDict) -> None:
  f = config.fedsc
  if config.ssl_method != 'sc':
    raise cv.ConfigError(f'config.ssl_method = {config.ssl_method!r} is invalid for algorithm '
                         "'fedsc': must be 'sc' (the spectral contrastive loss)")
  if f.share and config.num_clients < 2:
    raise cv.ConfigError(f'config.num_clients = {config.num_clients} is invalid for FedSC with '
                         'fedsc.share = True: R̃_{-j} needs at least 2 clients')
  cv.check_choice('fedsc.alpha_schedule', f.alpha_schedule, fedsc.ALPHA_SCHEDULES)
  cv.check_choice('fedsc.matrix_weights', f.matrix_weights, fedsc.SHARE_WEIGHTS)
  cv.check_choice('fedsc.model_weights', f.model_weights, fedsc.SHARE_WEIGHTS)
  cv.check_choice('fedsc.adjacency', f.adjacency, privacy.ADJACENCIES)
  cv.check_choice('fedsc.accountant', f.accountant, privacy.ACCOUNTANTS)
  cv.check_choice('fedsc.sigma_partial', f.sigma_partial, privacy.PARTIAL_RULES)
  cv.check_int_range('fedsc.share_start', f.share_start, 0, None)
  cv.check_int_range('fedsc.share_every', f.share_every, 1, None)
  cv.check_int_range('fedsc.calr_views', f.calr_views, 1, 10_000)
  cv.check_int_range('fedsc.calr_batch', f.calr_batch, 1, 10_000_000)
  for key in ('alpha_start', 'alpha_end'):
    cv.check_float_range(f'fedsc.{key}', f[key], 0.0, 1.0)
  cv.check_float_range('fedsc.sigma', f.sigma, 0.0, None)
  cv.check_float_range('fedsc.target_epsilon', f.target_epsilon, 0.0, None)
  cv.check_float_range('fedsc.delta', f.delta, 0.0, 1.0, inclusive=(False, False))
  if f.share and not np.any(fedsc.is_share_round(np.arange(1, config.rounds + 1), f.share_start,
                                                  f.share_every)):
    raise cv.ConfigError(f'config.fedsc.share_start = {f.share_start} / share_every = '
                         f'{f.share_every} leave no share round in {config.rounds} rounds: the run '
                         'would be FedAvg+SC; set fedsc.share = False for that')
  if f.dp and f.sigma == 0 and f.sigma_partial != 'none':
    raise cv.ConfigError(f'config.fedsc.sigma_partial = {f.sigma_partial!r} is invalid when sigma is '
                         "calibrated (fedsc.sigma = 0): the calibration already uses each client's "
                         "exact shares; use 'none'")
  if f.dp and not f.share:
    raise cv.ConfigError('config.fedsc.dp = True is invalid with fedsc.share = False: DP-CalR '
                         'noises the shared matrices, and nothing is shared')
  if f.dp and not config.sc_mu > 0:
    raise cv.ConfigError(f'config.sc_mu = {config.sc_mu!r} is invalid with fedsc.dp = True: the '
                         'sensitivity of a matrix is bounded only through NormClip, need sc_mu > 0')
  if f.dp and f.sigma == 0 and f.target_epsilon == 0:
    raise cv.ConfigError('config.fedsc.dp = True needs fedsc.sigma > 0 (a noise level) or '
                         'fedsc.target_epsilon > 0 (sigma calibrated to it); both are 0')
  if not f.dp and (f.sigma or f.target_epsilon):
    raise cv.ConfigError(f'config.fedsc.sigma = {f.sigma!r} / fedsc.target_epsilon = '
                         f'{f.target_epsilon!r} are set but fedsc.dp = False: set fedsc.dp = True '
                         'or leave both 0')


def hetero_ssfl_config() -> ml_collections.ConfigDict:
  """Hetero-SSFL's keys (algorithm = 'hetero_ssfl'); defaults follow BUILD_NOTES "Hetero-SSFL"."""
  h = ml_collections.ConfigDict()
  # Architectures: 'encoder:count,...' covering num_clients ('' = every client config.encoder).
  h.mix = ''
  h.assignment = 'ordered'        # ordered (first counts to the first encoder) | shuffled (by seed)
  h.mu = 0.1                      # v001 / F.2 for CIFAR (v000: 0.5); 0 = standalone local SSL
  h.mu_schedule = 'constant'      # constant | sqrt (FedHeNN: mu * sqrt(round))
  h.rad_batch = 1000              # b_R RAD points per local step (A8); 0 = the whole RAD
  h.sign = 'distance'             # distance 1 - CKA (A1) | similarity + CKA (v000 literal)
  h.centered = True               # False: the paper's uncentred formula (A2)
  h.average = 'kernels'           # kernels K̄ = Σ w K (A3) | features Φ̄ = Σ w Φ (v001 Eq. 2)
  h.kbar_clients = 'all'          # all (stale cache, A4) | participants (this round's, FedHeNN)
  h.bn_mode = 'train'             # BatchNorm on RAD passes: train batch stats (A9) | eval
  h.broadcast = 'kernel'          # what K̄ travels as: kernel [L, L] | representations [N, L, d]
  return h


def hetero_cohorts(config: ml_collections.ConfigDict) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
  """(encoder, sorted client ids) per cohort from hetero_ssfl.mix and .assignment.

  'ordered' gives the first count clients to the first encoder and so on; 'shuffled' does the same
  over a permutation of the clients drawn from the seed (the paper draws architectures at random).
  Raises ConfigError for a malformed mix, an unknown encoder, a repeated encoder, a zero count or
  counts that do not add up to num_clients.
  """
  h, num = config.hetero_ssfl, config.num_clients
  if not h.mix:
    return ((config.encoder, tuple(range(num))),)
  counts = []
  for item in h.mix.split(','):
    name, sep, count = item.strip().partition(':')
    if not sep or not count.strip().isdigit():
      raise cv.ConfigError(f'config.hetero_ssfl.mix = {h.mix!r} is invalid: {item!r} is not '
                           "'encoder:count' (e.g. 'resnet34:3,resnet18:2')")
    name = name.strip()
    cv.check_choice('hetero_ssfl.mix encoder', name, tuple(models.ENCODERS))
    if name in dict(counts):
      raise cv.ConfigError(f'config.hetero_ssfl.mix = {h.mix!r} is invalid: encoder {name!r} '
                           'appears twice')
    if int(count) < 1:
      raise cv.ConfigError(f'config.hetero_ssfl.mix = {h.mix!r} is invalid: encoder {name!r} has '
                           f'{count} clients; every listed encoder needs at least 1')
    counts.append((name, int(count)))
  total = sum(c for _, c in counts)
  if total != num:
    raise cv.ConfigError(f'config.hetero_ssfl.mix = {h.mix!r} is invalid: its counts add up to '
                         f'{total} clients, but config.num_clients = {num}; the mix must cover '
                         'every client exactly once')
  order = np.arange(num)
  if h.assignment == 'shuffled':
    order = np.random.default_rng([config.seed, 0x4e7]).permutation(num)
  out, start = [], 0
  for name, count in counts:
    out.append((name, tuple(sorted(int(i) for i in order[start:start + count]))))
    start += count
  return tuple(out)


def _validate_hetero_ssfl(config: ml_collections.ConfigDict) -> None:
  h = config.hetero_ssfl
  if config.ssl_method not in hetero_ssfl.METHODS:
    raise cv.ConfigError(f'config.ssl_method = {config.ssl_method!r} is invalid for algorithm '
                         f"'hetero_ssfl': must be one of {hetero_ssfl.METHODS} (the aligned "
                         'representation is the predictor output)')
  cv.check_choice('hetero_ssfl.assignment', h.assignment, ('ordered', 'shuffled'))
  cv.check_choice('hetero_ssfl.mu_schedule', h.mu_schedule, hetero_ssfl.MU_SCHEDULES)
  cv.check_choice('hetero_ssfl.sign', h.sign, hetero_ssfl.SIGNS)
  cv.check_choice('hetero_ssfl.average', h.average, hetero_ssfl.AVERAGES)
  cv.check_choice('hetero_ssfl.kbar_clients', h.kbar_clients, hetero_ssfl.KBAR_CLIENTS)
  cv.check_choice('hetero_ssfl.bn_mode', h.bn_mode, hetero_ssfl.BN_MODES)
  cv.check_choice('hetero_ssfl.broadcast', h.broadcast, hetero_ssfl.BROADCASTS)
  if not isinstance(h.centered, bool):
    raise cv.ConfigError(f'config.hetero_ssfl.centered = {h.centered!r} is invalid: must be a bool')
  cv.check_float_range('hetero_ssfl.mu', h.mu, 0.0, None)
  cv.check_int_range('hetero_ssfl.rad_batch', h.rad_batch, 0, 10_000_000)
  groups = hetero_cohorts(config)
  strategy = strategies.resolve_strategy(config.strategy)
  for name, members in groups:  # each cohort fills min(m, C_k) slots under the strategy
    try:
      strategies.check_participants(strategy, min(config.clients_per_round, len(members)),
                                    config.map_chunk_size)
    except ValueError as e:
      raise cv.ConfigError(f'config.hetero_ssfl.mix = {h.mix!r} is invalid: cohort {name!r} trains '
                           f'{min(config.clients_per_round, len(members))} slots per round: {e}') from None
  if h.mu > 0:
    if config.public_size < 1:
      raise cv.ConfigError(f'config.public_size = {config.public_size} is invalid for Hetero-SSFL '
                           f'with hetero_ssfl.mu = {h.mu}: the RAD is carved out of the training '
                           'split, set public_size > 0 (the paper: 5000)')
    b_r = h.rad_batch or config.public_size
    if b_r > config.public_size or config.public_size % b_r:
      raise cv.ConfigError(f'config.hetero_ssfl.rad_batch = {h.rad_batch} is invalid with '
                           f'config.public_size = {config.public_size}: it must divide the RAD '
                           'size (0 = the whole RAD every step)')


def repshare_config() -> ml_collections.ConfigDict:
  """Representation sharing's keys (algorithm = 'repshare'); defaults: BUILD_NOTES "Representation
  sharing" decisions A1-A22 (the paper's lambda_kd = 10, lambda_disc = 1, n_avg = 10)."""
  r = ml_collections.ConfigDict()
  r.lambda_kd = 10.0
  r.lambda_disc = 1.0
  r.n_avg = 10                    # samples per relayed n_avg-prototype
  r.reduction = 'mean'            # mean (author code: MSE / BCE means, A1) | sum (paper's sums)
  r.partner = 'user'              # user (one other user, all classes, A6) | per_class
  r.init_prototypes = 'model'     # model (from the untrained models, A8) | random U(-1, 1)
  r.upload_batch = 500            # images per eval forward when summarising (memory only)
  return r


def fd_config() -> ml_collections.ConfigDict:
  """Federated distillation's keys (algorithm = 'fd'; Jeong et al., A5)."""
  f = ml_collections.ConfigDict()
  f.weight = 1.0                  # distillation weight
  f.temperature = 1.0
  f.upload_batch = 500            # images per eval forward when averaging logits (memory only)
  return f


def _validate_relay(config: ml_collections.ConfigDict) -> None:
  """repshare / fd: supervised classifiers, at least two clients."""
  name = config.algorithm
  if config.ssl_method != 'supervised':
    raise cv.ConfigError(f'config.ssl_method = {config.ssl_method!r} is invalid for algorithm '
                         f"{name!r}: it trains classifiers, must be 'supervised'")
  if config.num_clients < 2:
    raise cv.ConfigError(f'config.num_clients = {config.num_clients} is invalid for algorithm '
                         f"{name!r}: clients distil from the other clients' averages, need >= 2")
  if config.reset_optimizer:
    logging.warning('config.reset_optimizer = True with algorithm %r: the paper keeps each '
                    "client's Adam state across rounds (reset_optimizer = False)", name)
  if config.augmentation != 'none':
    logging.warning("config.augmentation = %r with algorithm %r: the paper uses none ('none')",
                    config.augmentation, name)
  if name == 'repshare':
    r = config.repshare
    cv.check_float_range('repshare.lambda_kd', r.lambda_kd, 0.0, None)
    cv.check_float_range('repshare.lambda_disc', r.lambda_disc, 0.0, None)
    cv.check_int_range('repshare.n_avg', r.n_avg, 1, 1_000_000)
    cv.check_choice('repshare.reduction', r.reduction, ('mean', 'sum'))
    cv.check_choice('repshare.partner', r.partner, repshare.PARTNERS)
    cv.check_choice('repshare.init_prototypes', r.init_prototypes, repshare.INIT_PROTOTYPES)
    cv.check_int_range('repshare.upload_batch', r.upload_batch, 1, 10_000_000)
  else:
    cv.check_float_range('fd.weight', config.fd.weight, 0.0, None)
    cv.check_float_range('fd.temperature', config.fd.temperature, 0.0, None,
                         inclusive=(False, True))
    cv.check_int_range('fd.upload_batch', config.fd.upload_batch, 1, 10_000_000)


def run_keys(config: ml_collections.ConfigDict) -> Tuple[jax.Array, jax.Array]:
  """(init_key, run_key) of a run: the model init and every round's randomness
  (round r uses rng.round_key(run_key, r))."""
  init_key, run_key = jax.random.split(jax.random.PRNGKey(config.seed))
  return init_key, run_key


def planned_shares(config: ml_collections.ConfigDict) -> np.ndarray:
  """int [J]: how many matrices each client will upload in the whole run (FedSC).

  Participants are a pure function of the run key, so the share count of every client is known
  before training: everyone at the first share round, then the sampled clients of each later
  share round. The privacy check and calibration use these exact counts, not an expectation.
  """
  f, num_clients = config.fedsc, config.num_clients
  t = np.arange(1, config.rounds + 1)
  share = np.asarray(fedsc.is_share_round(t, f.share_start, f.share_every))
  counts = np.zeros(num_clients, np.int64)
  if not share.any():
    return counts
  first = int(np.argmax(share))
  counts += 1
  later = np.flatnonzero(share[first + 1:]) + first + 1
  if len(later):
    run_key = run_keys(config)[1]
    ids = jax.vmap(lambda r: rd.sample_participants(rng.round_key(run_key, r), num_clients,
                                                    config.clients_per_round))(jnp.asarray(later))
    np.add.at(counts, np.asarray(ids).ravel(), 1)
  return counts


def privacy_plan(config: ml_collections.ConfigDict, client_sizes: np.ndarray
                 ) -> Tuple[float, Optional[privacy.PrivacyLedger], Dict[str, Any]]:
  """FedSC's noise level, its ledger and the run's planned privacy, before any training.

  sigma = fedsc.sigma (scaled by fedsc.sigma_partial under partial participation) or, when it is
  0, the smallest sigma whose planned epsilon meets fedsc.target_epsilon for every client. Raises
  ConfigError when a target is set and the schedule cannot meet it with the given sigma.

  Returns:
    (sigma, ledger or None without DP, summary dict for results.json).
  """
  f = config.fedsc
  if config.algorithm != 'fedsc' or not (f.share and f.dp):
    return 0.0, None, {}
  sizes = np.asarray(client_sizes)
  shares = planned_shares(config)
  sens = [privacy.sensitivity(config.sc_mu, int(n), f.adjacency) for n in sizes]
  if f.sigma > 0:
    sigma = privacy.sigma_for_participation(f.sigma, config.clients_per_round, config.num_clients,
                                            f.sigma_partial)
  else:
    sigma = max(privacy.calibrate_sigma(f.target_epsilon, f.delta, w, int(s), f.accountant)
                for w, s in zip(sens, shares))
  ledger = privacy.PrivacyLedger(sizes, config.sc_mu, sigma, f.delta, f.adjacency, f.accountant)
  planned = ledger.max_epsilon(shares)
  if f.target_epsilon > 0 and planned > f.target_epsilon:
    raise cv.ConfigError(
        f'config.fedsc.target_epsilon = {f.target_epsilon!r} cannot be met: with fedsc.sigma = '
        f'{f.sigma!r} (sigma_partial {f.sigma_partial!r} -> {sigma:.4g}), the schedule '
        f'(share_start {f.share_start}, share_every {f.share_every}, {config.rounds} rounds, '
        f'{config.clients_per_round}/{config.num_clients} clients per round) makes a client share '
        f'up to {int(shares.max())} times, and the {f.accountant} ledger (delta {f.delta}, '
        f'{f.adjacency}, |D_j| >= {int(sizes.min())}) gives epsilon = {planned:.3f}. Raise '
        'fedsc.sigma, share less, or set fedsc.sigma = 0 to calibrate it to the target')
  summary = {'sigma': sigma, 'planned_epsilon': planned, 'planned_shares_max': int(shares.max()),
             'delta': f.delta, 'adjacency': f.adjacency, 'accountant': f.accountant}
  return sigma, ledger, summary


def load_run_config(workdir: pathlib.Path) -> ml_collections.ConfigDict:
  """The run's config.json over today's defaults (keys added since the run get their defaults)."""
  path = workdir / 'config.json'
  if not path.exists():
    raise FileNotFoundError(f'{path} not found: --workdir must be an experiments.train workdir')
  config = default_config()
  config.update(json.loads(path.read_text()))
  return config


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises cv.ConfigError naming the bad key, its value and what is allowed. Runs no compute.

  Besides each key's own range it checks the keys against each other and against the dataset's
  sizes and image shape, known without loading it (`dataset_info`): train_size, public_size and
  num_clients against the training split, knn_k against the kNN memory bank, the encoder against
  the image size. Loads no data and builds no model (the encoder is traced abstractly, no FLOPs).
  """
  cv.check_known_keys(config, default_config())
  cv.check_choice('algorithm', config.algorithm, ALGORITHMS)
  cv.check_choice('ssl_method', config.ssl_method, ssl_client.SSL_METHODS)
  cv.check_choice('dataset', config.dataset, sources.NAMES)
  cv.check_choice('data_source', config.data_source, sources.SOURCES)
  cv.check_choice('partition', config.partition, PARTITIONS)
  cv.check_choice('encoder', config.encoder, tuple(models.ENCODERS))
  cv.check_choice('conv_impl', config.conv_impl, models.layers.CONV_IMPLS)
  cv.check_choice('heads', config.heads, HEADS)
  cv.check_choice('augmentation', config.augmentation, tuple(augment.PRESETS))
  cv.check_choice('byol_target_sync', config.byol_target_sync, fedavg.BYOL_TARGET_SYNC)
  cv.check_choice('optimizer', config.optimizer, optim.OPTIMIZERS)
  cv.check_choice('lr_schedule', config.lr_schedule, optim.LR_SCHEDULES)
  cv.check_choice('strategy', config.strategy, ('auto',) + strategies.STRATEGIES)
  if not isinstance(config.data_dir, str):
    raise cv.ConfigError(f'config.data_dir = {config.data_dir!r} is invalid: must be a path string '
                         "('' = the source's default location)")
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
  cv.check_int_range('probe_epochs', config.probe_epochs, 0, 100_000)
  cv.check_int_range('probe_std_epochs', config.probe_std_epochs, 0, 100_000)
  cv.check_int_range('probe_batch_size', config.probe_batch_size, 1, 10_000_000)
  cv.check_float_range('lr', config.lr, 0.0, None, inclusive=(False, True))
  cv.check_float_range('momentum', config.momentum, 0.0, 1.0, inclusive=(True, False))
  cv.check_float_range('weight_decay', config.weight_decay, 0.0, None)
  cv.check_float_range('grad_clip_norm', config.grad_clip_norm, 0.0, None)
  cv.check_float_range('ema_tau', config.ema_tau, 0.0, 1.0)
  cv.check_float_range('temperature', config.temperature, 0.0, None, inclusive=(False, True))
  cv.check_float_range('knn_temperature', config.knn_temperature, 0.0, None,
                       inclusive=(False, True))
  cv.check_float_range('probe_lr', config.probe_lr, 0.0, None, inclusive=(False, True))
  cv.check_float_range('dapu_threshold', config.dapu_threshold, 0.0, None,
                       inclusive=(False, True))
  cv.check_float_range('autoscaler_tau', config.autoscaler_tau, 0.0, None,
                       inclusive=(False, True))
  if config.partition == 'dirichlet':
    cv.check_float_range('alpha', config.alpha, 0.0, None, inclusive=(False, True))
  if config.partition == 'classes':
    cv.check_int_range('classes_per_client', config.classes_per_client, 1, 1_000_000)
  if config.algorithm == 'centralized' and config.num_clients != 1:
    raise cv.ConfigError(f'config.num_clients = {config.num_clients} is invalid for algorithm '
                         f"'centralized': it must be 1 (all data on one client)")
  if config.algorithm in ('fedu', 'fedema') and config.ssl_method not in fedu.METHODS:
    raise cv.ConfigError(f'config.ssl_method = {config.ssl_method!r} is invalid for algorithm '
                         f'{config.algorithm!r}: must be one of {fedu.METHODS} (needs a predictor)')
  if config.algorithm == 'fedu2':
    _validate_fedu2(config)
  if config.algorithm == 'fedsc':
    _validate_fedsc(config)
  if config.algorithm == 'hetero_ssfl':
    _validate_hetero_ssfl(config)
  elif config.hetero_ssfl.mix:
    raise cv.ConfigError(f'config.hetero_ssfl.mix = {config.hetero_ssfl.mix!r} is invalid with '
                         f'algorithm {config.algorithm!r}: several architectures in one federation '
                         "need algorithm 'hetero_ssfl'")
  if config.algorithm in ('repshare', 'fd'):
    _validate_relay(config)
  if (config.ssl_method != 'supervised' and config.knn_k == 0 and config.probe_epochs == 0
      and config.probe_std_epochs == 0):
    raise cv.ConfigError(f'config.knn_k = 0 with probe_epochs = 0 and probe_std_epochs = 0 is '
                         f'invalid for ssl_method {config.ssl_method!r}: the run would report no '
                         'accuracy; keep the kNN monitor (knn_k > 0) or a probe')
  cv.check_float_range('sc_mu', config.sc_mu, 0.0, None)
  if not config.drop_last and config.ssl_method != 'sc':
    raise cv.ConfigError(f'config.drop_last = False is invalid with ssl_method '
                         f"{config.ssl_method!r}: only the 'sc' loss honours the ragged last "
                         "batch's mask")
  if config.heads == 'custom':
    for key in ('proj_hidden', 'proj_out', 'pred_hidden', 'pred_out'):
      cv.check_int_range(key, config[key], 1, 1_000_000)
  cv.check_choice('client_state', config.client_state, rd.CLIENT_STATES)
  if config.vmap_shrink != 0:
    cv.check_float_range('vmap_shrink', config.vmap_shrink, 1.0, None, inclusive=(False, True))
  reads_clients = {'fd': True, 'repshare': config.repshare.init_prototypes == 'model',
                   'hetero_ssfl': config.hetero_ssfl.mu > 0}
  if config.client_state == 'host' and reads_clients.get(config.algorithm, False):
    raise cv.ConfigError(f"config.client_state = 'host' is invalid for algorithm "
                         f"{config.algorithm!r} in this setting: its pre-round step reads every "
                         "client's model on the device (round 0's prototypes / representations); "
                         "use 'device'")
  try:
    strategies.check_participants(strategies.resolve_strategy(config.strategy),
                                  config.clients_per_round, config.map_chunk_size)
  except ValueError as e:  # its messages already name the key and the value
    raise cv.ConfigError(f'config.{e}') from None
  _check_data_source(config)
  info = dataset_info(config)
  if info is not None:  # None: sizes only known once loaded (experiments.train checks them then)
    check_data_config(config, info)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What the config checks need to know of a dataset: sizes, image shape, number of classes."""
  name: str
  num_train: int
  num_test: int
  image_shape: Tuple[int, int, int]
  num_classes: int

  @classmethod
  def of(cls, dataset: Dataset) -> 'DatasetInfo':
    """The info of a loaded dataset (after load_data's train_size cut)."""
    return cls(dataset.name, len(dataset.train_y), len(dataset.test_y),
               tuple(int(s) for s in dataset.image_shape), int(dataset.num_classes))


# The tfds catalog splits (tfds.builder(name).info.splits / features; fixed by the datasets' own
# definitions). The original MNIST / Fashion-MNIST IDX files hold the same splits.
CATALOG_INFO = {
    'cifar10': DatasetInfo('cifar10', 50_000, 10_000, (32, 32, 3), 10),
    'cifar100': DatasetInfo('cifar100', 50_000, 10_000, (32, 32, 3), 100),
    'mnist': DatasetInfo('mnist', 60_000, 10_000, (28, 28, 1), 10),
    'fashion_mnist': DatasetInfo('fashion_mnist', 60_000, 10_000, (28, 28, 1), 10),
    'svhn': DatasetInfo('svhn', 73_257, 26_032, (32, 32, 3), 10),
}
_ONE_SOURCE = ('synthetic', 'fashion_mnist_subset')


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
  if name == 'fashion_mnist_subset' and data_dir and not pathlib.Path(data_dir).is_file():
    raise cv.ConfigError(f'config.data_dir = {data_dir!r} is invalid for config.dataset = '
                         "'fashion_mnist_subset': must be the path of the subset's .npz file "
                         "('' = the shipped tests/data/fashion_mnist_subset.npz)")


def _npz_shapes(path: pathlib.Path, keys) -> Dict[str, Tuple[int, ...]]:
  """The shapes of arrays `keys` of an .npz file, reading only their .npy headers."""
  shapes = {}
  with zipfile.ZipFile(path) as zf:
    for key in keys:
      with zf.open(f'{key}.npy') as f:
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                np.lib.format.read_array_header_2_0)
        shapes[key] = tuple(read(f)[0])
  return shapes


def dataset_info(config: ml_collections.ConfigDict) -> Optional[DatasetInfo]:
  """Sizes and image shape of the configured dataset (before load_data's train_size cut), known
  without loading it: the tfds catalog's constants, the synthetic set's defaults, and the headers of
  the shipped subset's .npz or of the IDX files `load_data` would read. None where the files do not
  exist or cannot be read (load_data then reports the problem)."""
  name, source, data_dir = config.dataset, config.data_source, config.data_dir or None
  try:
    if name == 'synthetic':  # load_data passes no overrides: the defaults of make_synthetic
      d = sources._SYNTHETIC_DEFAULTS  # pylint: disable=protected-access
      return DatasetInfo(name, d['num_train'], d['num_test'], tuple(d['image_shape']),
                         d['num_classes'])
    if name == 'fashion_mnist_subset':
      path = pathlib.Path(data_dir) if data_dir else sources.subset_path()
      shapes = _npz_shapes(path, ('train_x', 'test_x'))
      return DatasetInfo(name, shapes['train_x'][0], shapes['test_x'][0],
                         tuple(shapes['train_x'][1:]), 10)
    idx_dir = None  # the same resolution as sources.load_dataset
    default_dir = sources._DEFAULT_IDX_DIRS.get(name)  # pylint: disable=protected-access
    has_idx = sources._has_idx_files  # pylint: disable=protected-access
    if name in sources.IDX_NAMES and source == 'idx':
      idx_dir = data_dir or default_dir
    elif name in sources.IDX_NAMES and source == 'auto':
      if has_idx(data_dir):
        idx_dir = data_dir
      elif data_dir is None and has_idx(default_dir):
        idx_dir = default_dir
    if idx_dir is None:
      return CATALOG_INFO[name]
    find = sources._find_idx_file  # pylint: disable=protected-access
    train = sources.read_idx_shape(find(pathlib.Path(idx_dir), sources.IDX_FILES['train_x']))
    test = sources.read_idx_shape(find(pathlib.Path(idx_dir), sources.IDX_FILES['test_x']))
    return DatasetInfo(name, train[0], test[0], tuple(train[1:]) + (1,), 10)
  except (OSError, ValueError, KeyError, IndexError, TypeError, zipfile.BadZipFile):
    return None


def _encoder_input_error(encoder: str, input_shape: Tuple[int, int, int]) -> Optional[str]:
  """Why `encoder` cannot take [B, *input_shape] images (None if it can). Traced abstractly with
  `jax.eval_shape`: no parameters are allocated and nothing is computed."""
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
  if config.public_size >= n:
    raise cv.ConfigError(f'config.public_size = {config.public_size} is invalid: must be < {n}, '
                         f'the number of training examples ({source})')
  left = n - config.public_size
  left_text = (f'{left} training examples ({source}, minus config.public_size = '
               f'{config.public_size})' if config.public_size else
               f'{left} training examples ({source})')
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
  h, w, c = info.image_shape
  out_h, out_w = augment.preset(config.augmentation, h).output_hw(h, w)
  encoders = [('config.encoder', config.encoder)]
  if config.algorithm == 'hetero_ssfl' and config.hetero_ssfl.mix:
    encoders = [('config.hetero_ssfl.mix encoder', e) for e, _ in hetero_cohorts(config)]
  for key, encoder in encoders:
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


def load_data(config: ml_collections.ConfigDict) -> Dataset:
  """The configured dataset, in host memory (the first `train_size` training examples if > 0, as
  the representation-sharing code's `load_data(reduced=f)`; the test split stays whole)."""
  ds = sources.load_dataset(config.dataset, source=config.data_source,
                            data_dir=config.data_dir or None, seed=config.seed)
  if config.train_size:
    if config.train_size > len(ds.train_y):
      raise cv.ConfigError(f'config.train_size = {config.train_size} is invalid: the {ds.name} '
                           f'training split has only {len(ds.train_y)} examples')
    mean, std = ds.mean, ds.std
    if config.subset_stats:  # the representation-sharing code's load_data normalises after reducing
      mean, std = sources.channel_stats(ds.train_x[:config.train_size])
    ds = dataclasses.replace(ds, train_x=ds.train_x[:config.train_size],
                             train_y=ds.train_y[:config.train_size], mean=mean, std=std)
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


def build_model(config: ml_collections.ConfigDict, num_classes: int, encoder_name: str = ''):
  """The client model around `encoder_name` (default config.encoder)."""
  encoder = models.get_encoder(encoder_name or config.encoder, conv_impl=config.conv_impl)
  if config.ssl_method == 'supervised':
    return models.Classifier(encoder, num_classes)
  with_pred = config.ssl_method in ('byol', 'simsiam')
  if config.heads == 'custom':
    projector = models.MLPHead(config.proj_hidden, config.proj_out, config.head_bn)
    predictor = models.MLPHead(config.pred_hidden, config.pred_out, config.head_bn) if with_pred else None
  else:
    projector, predictor = models.make_heads(config.heads, with_pred)
  return models.SSLModel(encoder, projector, predictor)


def fur_regularizer(f: ml_collections.ConfigDict):
  """FedU2's per-view FUR term (z [B, d], key) -> lambda_u * L_u(z), or None ('none' or 0)."""
  if f.fur == 'none' or f.lambda_u == 0:
    return None
  lam = float(f.lambda_u)
  if f.fur == 'swd':
    return lambda z, key: lam * uot.tangent_swd_loss(z, key, num_projections=f.swd_projections,
                                                     normalize=f.normalize)
  kw = dict(tau_a=float(f.tau_a), tau_b=float(f.tau_b), num_iters=int(f.uot_iters), cost=f.cost,
            mass=float(f.mass), normalize=bool(f.normalize))
  return lambda z, key: lam * uot.fur_uot_loss(z, key, **kw)[0]


def client_spec(config: ml_collections.ConfigDict, dataset: Dataset, encoder_name: str = ''
                ) -> ssl_client.ClientSpec:
  """The local learning problem of a client with encoder `encoder_name` (default config.encoder)."""
  h, w, c = dataset.image_shape
  tx = optim.make_optimizer(config.optimizer, momentum=config.momentum, nesterov=config.nesterov,
                            weight_decay=config.weight_decay, grad_clip_norm=config.grad_clip_norm)
  return ssl_client.ClientSpec(
      method=config.ssl_method, model=build_model(config, dataset.num_classes, encoder_name),
      tx=tx,
      aug=augment.preset(config.augmentation, h), mean=tuple(dataset.mean), std=tuple(dataset.std),
      input_shape=(h, w, c), temperature=config.temperature,
      nt_xent_zero_diagonal=config.nt_xent_zero_diagonal, ema_tau=config.ema_tau,
      reset_optimizer=config.reset_optimizer,
      feature_regularizer=fur_regularizer(config.fedu2) if config.algorithm == 'fedu2' else None,
      sc_mu=float(config.sc_mu) or None,
      sc_scale=0.5 if config.algorithm == 'fedsc' and config.fedsc.paper_scale else 1.0)


def build_algorithm(config: ml_collections.ConfigDict, dataset: Dataset,
                    client_sizes: Optional[np.ndarray] = None) -> Algorithm:
  """The configured Algorithm. client_sizes (int [J], `fed_data.n`) is needed by FedSC with DP (its
  noise level and privacy ledger depend on |D_j|); ConfigError if its target cannot be met."""
  spec = client_spec(config, dataset)
  if config.algorithm == 'hetero_ssfl':
    h, groups = config.hetero_ssfl, hetero_cohorts(config)
    return hetero_ssfl.make(
        [(name, client_spec(config, dataset, name)) for name, _ in groups],
        [members for _, members in groups], rad_size=config.public_size, mu=float(h.mu),
        rad_batch=h.rad_batch, mu_schedule=h.mu_schedule, sign=h.sign, centered=h.centered,
        average=h.average, kbar_clients=h.kbar_clients, bn_mode=h.bn_mode, broadcast=h.broadcast)
  if config.algorithm == 'repshare':
    r = config.repshare
    return repshare.make(spec, num_classes=dataset.num_classes,
                         feature_dim=models.feature_dim(config.encoder), lambda_kd=r.lambda_kd,
                         lambda_disc=r.lambda_disc, n_avg=r.n_avg, reduction=r.reduction,
                         partner=r.partner, init_prototypes=r.init_prototypes,
                         upload_batch=r.upload_batch)
  if config.algorithm == 'fd':
    return fd.make(spec, num_classes=dataset.num_classes, weight=config.fd.weight,
                   temperature=config.fd.temperature, upload_batch=config.fd.upload_batch)
  if config.algorithm == 'fedsc':
    f = config.fedsc
    if f.share and f.dp and client_sizes is None:
      raise ValueError('FedSC with fedsc.dp = True needs client_sizes (fed_data.n) for its ledger')
    sigma, ledger, _ = privacy_plan(config, client_sizes)
    return fedsc.make(spec, num_rounds=config.rounds, share=f.share, share_start=f.share_start,
                      share_every=f.share_every, alpha_schedule=f.alpha_schedule,
                      alpha_start=f.alpha_start, alpha_end=f.alpha_end,
                      matrix_weights=f.matrix_weights, model_weights=f.model_weights,
                      sigma=sigma, calr_views=f.calr_views, calr_batch=f.calr_batch,
                      mu=float(config.sc_mu) or None, ledger=ledger)
  if config.algorithm == 'fedavg':
    return fedavg.make(spec, byol_target_sync=config.byol_target_sync)
  if config.algorithm == 'centralized':
    return fedavg.make(spec, byol_target_sync=config.byol_target_sync, name='centralized')
  if config.algorithm == 'fedu':
    return fedu.make(spec, dapu_threshold=config.dapu_threshold)
  if config.algorithm == 'fedema':
    return fedema.make(spec, autoscaler_tau=config.autoscaler_tau)
  if config.algorithm == 'fedu2':
    f = config.fedu2
    return fedu2.make(spec, clients_per_round=config.clients_per_round, eua=f.eua,
                      eua_direction=f.direction, eua_solver=f.solver,
                      eua_solver_iters=f.solver_iters, eua_scope=f.scope, eua_step=f.step,
                      server_lr=f.server_lr, admm_c=f.eta_g ** 2 / f.phi, admm_rho=f.rho,
                      byol_target_sync=config.byol_target_sync)
  return independent.make(spec, independent_init=config.independent_init)


def round_config(config: ml_collections.ConfigDict) -> RoundConfig:
  base_lr, schedule, rounds = float(config.lr), config.lr_schedule, int(config.rounds)
  return RoundConfig(
      clients_per_round=config.clients_per_round, local_epochs=config.local_epochs,
      batch_size=config.batch_size,
      lr_fn=lambda r: optim.round_lr(base_lr, schedule, r, rounds),
      strategy=config.strategy, map_chunk_size=config.map_chunk_size,
      drop_last=bool(config.drop_last), vmap_shrink=float(config.vmap_shrink),
      client_state=config.client_state)


def encoder_features(algo: Algorithm, variables: Any, per_client: bool, images: np.ndarray,
                     dataset: Dataset, batch_size: int = 1000) -> jax.Array:
  """Frozen backbone features of `images`: [N, d], or [C, N, d] for personalised models."""
  fn = fs_eval.extract_features_stacked if per_client else fs_eval.extract_features
  return fn(algo.encoder_apply, variables, images, dataset.mean, dataset.std, batch_size=batch_size)


def evaluate(config: ml_collections.ConfigDict, algo: Algorithm, state: FedState, dataset: Dataset,
             *, probe: bool = True, knn: bool = True) -> Dict[str, Any]:
  """Linear probe (full train -> full test) and kNN monitor on the frozen encoder(s).

  Personalised models are evaluated client by client; the result is the unweighted client mean
  (per-client accuracies under '<metric>_clients', in client-id order). With several cohorts
  (architectures) each cohort's mean is reported too, as '<metric>_<cohort name>'.
  """
  variables, per_client = algo.eval_variables(state)
  if not per_client:
    return _evaluate_encoder(config, algo, variables, False, dataset, probe=probe, knn=knn)
  groups = (tuple(zip(algo.cohorts, variables)) if algo.cohorts else
            ((rd.cohorts(algo, len(jax.tree_util.tree_leaves(variables)[0]))[0], variables),))
  per_cohort = [_evaluate_encoder(config, c.client, v, True, dataset, probe=probe, knn=knn)
                for c, v in groups]
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


def _evaluate_encoder(config: ml_collections.ConfigDict, algo: Algorithm, variables: Any,
                      per_client: bool, dataset: Dataset, *, probe: bool, knn: bool
                      ) -> Dict[str, Any]:
  """{metric: accuracy} for one shared encoder, or {metric: [C] accuracies} for stacked ones.

  Supervised models (`algo.classifier_apply`) also report 'test_acc', the whole classifier's
  accuracy on the test split. Features are extracted only when the kNN monitor (knn_k > 0) or a
  probe needs them.
  """
  out: Dict[str, Any] = {}
  if algo.classifier_apply is not None:
    logits = encoder_features(dataclasses.replace(algo, encoder_apply=algo.classifier_apply),
                              variables, per_client, dataset.test_x, dataset)
    correct = np.asarray(jnp.argmax(logits, axis=-1)) == dataset.test_y
    acc = correct.mean(axis=-1)
    out['test_acc'] = [float(a) for a in acc] if per_client else float(acc)
  knn = knn and config.knn_k > 0
  probe = probe and (config.probe_epochs > 0 or config.probe_std_epochs > 0)
  if not (knn or probe):
    return out
  train_f = encoder_features(algo, variables, per_client, dataset.train_x, dataset)
  test_f = encoder_features(algo, variables, per_client, dataset.test_x, dataset)
  if knn:
    knn_fn = lambda a, b: float(fs_eval.knn_monitor(
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
      res = fs_eval.linear_probe_stack(train_f, dataset.train_y, test_f, dataset.test_y,
                                       dataset.num_classes, **kw)
      out[key] = [float(a) for a in np.asarray(res['test_acc'])]
    else:
      res = fs_eval.linear_probe(train_f, dataset.train_y, test_f, dataset.test_y,
                                 dataset.num_classes, **kw)
      out[key] = float(res['test_acc'])
  return out
