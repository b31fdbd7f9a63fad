"""FedSC (Jing et al., "FedSC: Provable Federated Self-supervised Learning with Spectral Contrastive
Objective over Non-i.i.d. Data", ICML 2024): spectral contrastive local training with an
inter-client term built from the other clients' shared, optionally DP-noised, correlation matrices.

Round t (1-indexed; decisions in docs/notes/fedsc.md):
  prepare      if t is a share round, the uploaders (every client at the first share round, as
               Alg. 1's t = 1 branch, taken in before the hook by `Prepare.summarize` / `absorb`
               where the clients' rows are; the round's participants afterwards) compute DP-CalR
               (Alg. 2) on the global model: `calr_views` augmented views of each of their examples through
               the encoder + projector in inference mode, NormClip(sqrt(mu)), the mean of ž žᵀ, plus
               i.i.d. N(0, sigma²) on all H² entries from the client's own key. The server keeps the
               latest matrix of every client (stale for the others) and counts its shares.
  personalize  participant j receives alpha_t and R̃_{-j} = Σ_{k≠j} q_k R̃_k / (1 - q_j); before the
               first share it trains the local SC loss (alpha = 1, no inter-client term).
  local        SC batch loss in the code's scale (ssl_client 'sc'), optimiser reset every round.
  aggregate    uniform mean of the participants' encoder + projector (Alg. 1; BN statistics too).

FedAvg+SC is `share=False`: the same loop without matrices (alpha = 1).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl.algorithms import fedavg, registry, ssl_client
from fedjax_ssl.core.algorithm import (Algorithm, GlobalModel, Prepare, replicate, uniform_weights,
                                        weighted_mean)
from fedjax_ssl.core import comm, rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.ops import correlation, privacy

SHARE_WEIGHTS = ('uniform', 'data')
ALPHA_SCHEDULES = ('linear', 'q')
# fold_in tag of DP-CalR under a client's round key (the training streams use 0, 1, 2: core/rng.py),
# and the two sibling streams under it: the views (then view v, then example row) and the noise.
CALR_STREAM = 0xCA1
VIEW_STREAM = 0
NOISE_STREAM = 1


def _float():
  """float32, or float64 when x64 is enabled (a float64 state stays float64)."""
  return jax.dtypes.canonicalize_dtype(jnp.float64)


def alpha_at(t: jax.Array, num_rounds: int, alpha_start: float, alpha_end: float) -> jax.Array:
  """alpha_t = alpha_start + (alpha_end - alpha_start) (t - 1) / T for round t = 1..T (App. C:
  1 -> 0.2 linearly; the code's 1 - 0.8 t / T with t = 0..T-1)."""
  frac = (jnp.asarray(t, _float()) - 1.0) / num_rounds
  return alpha_start + (alpha_end - alpha_start) * frac


def is_share_round(t, share_start: int, share_every: int):
  """Table 6's schedules: clients share in round t (1-indexed) iff t > share_start and
  t % share_every == 0 (share_start 0, share_every 1: every round)."""
  return (t > share_start) & (t % share_every == 0)


def share_weights(n: jax.Array, kind: str) -> jax.Array:
  """q [J]: 'uniform' 1/J (the code, A6) or 'data' |D_j| / |D| (the paper's q_j)."""
  if kind == 'uniform':
    return jnp.full(n.shape, 1.0 / n.shape[0], _float())
  return n.astype(_float()) / jnp.sum(n).astype(_float())


def calr_matrix(spec: ssl_client.ClientSpec, variables, x: jax.Array, n: jax.Array,
                key: jax.Array, *, views: int, chunk: int, sqrt_mu: Optional[float]) -> jax.Array:
  """DP-CalR before the noise (Alg. 2) for one client: (1 / (V n)) Σ_{b<n} Σ_v ž_{b,v} ž_{b,v}ᵀ.

  Args:
    spec: the client spec (model, augmentation, normalisation).
    variables: {'params', 'batch_stats'} of the global encoder + projector.
    x: uint8 [n_max, H, W, C], the client's rows (the first n are real).
    n: int32 scalar.
    key: the client's DP-CalR view key; view v of row r is augmented with
      fold_in(fold_in(key, v), r), so the result does not depend on `chunk`.
    views: V augmented views per example (the code: 5 passes x 2 views = 10).
    chunk: examples per forward pass (memory only).
    sqrt_mu: NormClip radius, or None.
  Returns:
    float [H, H], symmetric PSD.
  """
  n_max = x.shape[0]
  num_chunks = -(-n_max // chunk)

  def forward(c, v):
    rows = c * chunk + jnp.arange(chunk)
    valid = rows < n
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, v), r))(rows)
    img = jax.vmap(lambda k, im: augment.augment(k, im, spec.aug))(
        keys, x[jnp.minimum(rows, n_max - 1)])
    img = augment.normalize(img, spec.mean, spec.std)
    z = spec.model.apply(variables, img, train=False, with_predictor=False)['z']
    return correlation.view_sum_correlation(z[None], sqrt_mu, valid)

  def body(acc, i):
    return acc + forward(i // views, i % views), None

  shape = jax.eval_shape(lambda: forward(0, 0))
  acc, _ = jax.lax.scan(body, jnp.zeros(shape.shape, shape.dtype), jnp.arange(num_chunks * views))
  return acc / (views * n).astype(acc.dtype)


def make(spec: ssl_client.ClientSpec, *, num_rounds: int, share: bool = True,
         share_start: int = 0, share_every: int = 1, alpha_schedule: str = 'linear',
         alpha_start: float = 1.0, alpha_end: float = 0.2, matrix_weights: str = 'uniform',
         model_weights: str = 'uniform', sigma: float = 0.0, calr_views: int = 10,
         calr_batch: int = 256, mu: Optional[float] = None,
         ledger: Optional[privacy.PrivacyLedger] = None) -> Algorithm:
  """FedSC over an 'sc' client spec.

  Args:
    spec: ClientSpec with method 'sc' (hparams['mu'] = config.sc_mu clips inside the loss, A4).
    num_rounds: T, for the alpha schedule.
    share: False gives FedAvg+SC (no matrices, alpha = 1).
    share_start, share_every: the share-round schedule (`is_share_round`).
    alpha_schedule: 'linear' (alpha_start -> alpha_end over the rounds, App. C) or 'q' (alpha_j =
      q_j, Eq. 5, the setting of the gradient-alignment theorem).
    matrix_weights, model_weights: 'uniform' or 'data' (see `share_weights`).
    sigma: DP noise std on every uploaded entry (0 = no DP, A24).
    calr_views, calr_batch: DP-CalR's views per example and examples per forward pass.
    mu: DP-CalR's NormClip level (None = no clip).
    ledger: privacy ledger whose epsilon is reported after every round (`host_metrics`).
  """
  if spec.method != 'sc':
    raise ValueError(f"FedSC needs the spectral contrastive client (method 'sc'), got "
                     f'{spec.method!r}')
  for name, value, allowed in (('matrix_weights', matrix_weights, SHARE_WEIGHTS),
                               ('model_weights', model_weights, SHARE_WEIGHTS),
                               ('alpha_schedule', alpha_schedule, ALPHA_SCHEDULES)):
    if value not in allowed:
      raise ValueError(f'{name} = {value!r} is invalid: must be one of {allowed}')
  names = spec.shared
  sqrt_mu = None if mu is None else float(np.sqrt(mu))
  h = spec.model.projector.out

  def init(key, num_clients):
    client = ssl_client.init_client(spec, key)
    server = {'model': fedavg.shared_subset(spec, client)}
    if share:
      if num_clients < 2:
        raise ValueError(f'num_clients = {num_clients} is invalid for FedSC with sharing: '
                         'R̃_{-j} needs at least one other client')
      server.update(cov=jnp.zeros((num_clients, h, h), _float()),
                    shares=jnp.zeros((num_clients,), jnp.int32),
                    q=jnp.full((num_clients,), 1.0 / num_clients, _float()),
                    alpha=jnp.ones((), _float()))
    return replicate(client, num_clients), server

  def upload_matrix(server, data, cid, key):
    ckey = jax.random.fold_in(rng.client_key(key, cid), CALR_STREAM)
    x, _, n = data.client(cid)
    r = calr_matrix(spec, server['model'], x, n,
                    jax.random.fold_in(ckey, VIEW_STREAM), views=calr_views, chunk=calr_batch,
                    sqrt_mu=sqrt_mu)
    if sigma > 0:
      r = privacy.add_noise(jax.random.fold_in(ckey, NOISE_STREAM), r, sigma)
    return r.astype(server['cov'].dtype)

  # The first share round (1-indexed): Alg. 1's all-clients branch, every client's matrix from its
  # own rows (`Prepare.summarize`, computed where the rows are: by block under 'divided').
  first_share = (share_start // share_every + 1) * share_every

  def everyone(server, stacks, data, ids, key):
    del stacks
    (cids,) = ids
    return (jax.lax.map(lambda c: upload_matrix(server, data, c, key), cids),)

  def take_everyone(server, rows):
    (cov,) = rows
    return dict(server, cov=cov, shares=server['shares'] + 1)

  def prepare(state, data, ids, key):
    server, t = state.server, state.round + 1
    cov, shares = server['cov'], server['shares']

    def nobody():
      return cov, shares

    def participants():
      return (cov.at[ids].set(jax.lax.map(lambda c: upload_matrix(server, data, c, key), ids)),
              shares.at[ids].add(1))

    # The first share round's uploads were taken in before (`take_everyone`); later share rounds
    # upload the participants' matrices.
    later = is_share_round(t, share_start, share_every) & (t != first_share)
    cov, shares = jax.lax.cond(later, participants, nobody)
    # Cast to the state's own dtypes, so a float64 state (x64) stays float64.
    return dict(server, cov=cov, shares=shares,
                q=share_weights(data.n, matrix_weights).astype(server['q'].dtype),
                alpha=alpha_at(t, num_rounds, alpha_start, alpha_end).astype(server['alpha'].dtype))

  def personalize(msg, cid):
    has = jnp.any(msg['shares'] > 0)
    q = msg['q'].astype(msg['cov'].dtype)
    total = correlation.weighted_sum(msg['cov'], q)
    r_other = correlation.leave_one_out(total, msg['cov'][cid], q[cid])
    alpha = msg['alpha'] if alpha_schedule == 'linear' else msg['q'][cid]
    return {'model': msg['model'], 'alpha': jnp.where(has, alpha, 1.0),
            'r_other': jnp.where(has, r_other, 0.0)}

  def begin(client, msg, key):
    del key
    return fedavg.adopt_global(spec, ssl_client.begin_round(spec, client), msg['model'], names)

  def local_step(client, batch, key, msg, lr):
    shared = (msg['alpha'], msg['r_other']) if share else None
    return ssl_client.local_step(spec, client, batch, key, msg, lr, shared=shared)

  def aggregate(server, payloads, weights, ids):
    if model_weights == 'uniform':
      weights = uniform_weights(weights)
    return dict(server, model=weighted_mean(payloads, weights))

  def prepare_upload_bytes(state, after):
    """Bytes of the matrices uploaded before training this round (one [H, H] per new share): every
    client's at the first share round (taken in before `prepare`, so counted by the round: the
    'host' and 'divided' steps take them in before `state`), the new shares' after it."""
    fresh = jnp.where(state.round + 1 == first_share, after['shares'].shape[0],
                      jnp.sum(after['shares'] - state.server['shares'])).astype(jnp.float32)
    return fresh * float(comm.tree_bytes(after['cov'][0]))

  def host_metrics(state):
    shares = np.asarray(state.server['shares'])
    return {'epsilon': ledger.max_epsilon(shares), 'shares_max': float(shares.max())}

  return Algorithm(
      name='fedsc' if share else 'fedavg_sc', init=init,
      broadcast=lambda server: server if share else {'model': server['model']},
      begin=begin, local_step=local_step,
      upload=lambda client, msg, local: fedavg.shared_subset(spec, client), aggregate=aggregate,
      eval_variables=lambda state: (state.server['model'], False),
      encoder_apply=lambda v, x: spec.model.encoder.apply(ssl_client.encoder_variables(v), x,
                                                          train=False),
      # The first share round uploads every client's matrix (Alg. 1), from every client's data.
      prepare=(Prepare(prepare, upload_bytes=prepare_upload_bytes, summarize=everyone,
                       absorb=take_everyone, summarize_reads_data=True,
                       summarize_when=lambda r: r + 1 == first_share) if share else None),
      personalize=personalize if share else None,
      host_metrics=host_metrics if (share and ledger is not None) else None,
      ragged_batches=True,
      global_model=GlobalModel(
          get=lambda server: server['model']['params'],
          set=lambda server, params: dict(server, model=dict(server['model'], params=params))))


def config_block() -> ml_collections.ConfigDict:
  """FedSC's keys, `config.fedsc`; defaults follow the decisions in docs/notes/fedsc.md."""
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


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  """Ranges, choices and the share / privacy rules of `config.fedsc` (ConfigError)."""
  del dataset_info
  f = config.fedsc
  if f.share and config.num_clients < 2:
    raise cv.ConfigError(f'config.num_clients = {config.num_clients} is invalid for FedSC with '
                         'fedsc.share = True: R̃_{-j} needs at least 2 clients')
  cv.check_choice('fedsc.alpha_schedule', f.alpha_schedule, ALPHA_SCHEDULES)
  cv.check_choice('fedsc.matrix_weights', f.matrix_weights, SHARE_WEIGHTS)
  cv.check_choice('fedsc.model_weights', f.model_weights, SHARE_WEIGHTS)
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
  if f.share and not np.any(is_share_round(np.arange(1, config.rounds + 1), f.share_start,
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


def planned_shares(config: ml_collections.ConfigDict) -> np.ndarray:
  """int [J]: how many matrices each client will upload in the whole run (FedSC).

  Participants are a pure function of the run key, so the share count of every client is known
  before training: everyone at the first share round, then the sampled clients of each later
  share round. The privacy check and calibration use these exact counts, not an expectation.
  """
  f, num_clients = config.fedsc, config.num_clients
  t = np.arange(1, config.rounds + 1)
  share = np.asarray(is_share_round(t, f.share_start, f.share_every))
  counts = np.zeros(num_clients, np.int64)
  if not share.any():
    return counts
  first = int(np.argmax(share))
  counts += 1
  later = np.flatnonzero(share[first + 1:]) + first + 1
  if len(later):
    run_key = rng.run_keys(config.seed)[1]
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
  if not (f.share and f.dp):
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


def plan(config: ml_collections.ConfigDict, info: DataInfo) -> Optional[registry.Plan]:
  """The privacy plan of a DP run (None without DP)."""
  sigma, ledger, summary = privacy_plan(config, info.client_sizes)
  del sigma
  if ledger is None:
    return None
  text = (f'DP-CalR: sigma {summary["sigma"]:.4g}, planned epsilon {summary["planned_epsilon"]:.3f} '
          f'(delta {summary["delta"]}, {summary["accountant"]}, {summary["adjacency"]}, up to '
          f'{summary["planned_shares_max"]} shares per client)')
  return registry.Plan('privacy', summary, text, final_metrics=('epsilon',))


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  """FedSC (or FedAvg+SC with fedsc.share = False). With DP, `info.client_sizes` is required (the
  noise level and the ledger depend on |D_j|); ConfigError if the privacy target cannot be met."""
  f = config.fedsc
  if f.share and f.dp and info.client_sizes is None:
    raise ValueError('FedSC with fedsc.dp = True needs DataInfo.client_sizes (fed_data.n) for its '
                     'ledger')
  spec = ssl_client.spec_from_config(config, info)
  spec = dataclasses.replace(spec, hparams=dict(spec.hparams, scale=0.5 if f.paper_scale else 1.0))
  sigma, ledger, _ = privacy_plan(config, info.client_sizes)
  return make(spec, num_rounds=config.rounds, share=f.share, share_start=f.share_start,
              share_every=f.share_every, alpha_schedule=f.alpha_schedule,
              alpha_start=f.alpha_start, alpha_end=f.alpha_end, matrix_weights=f.matrix_weights,
              model_weights=f.model_weights, sigma=sigma, calr_views=f.calr_views,
              calr_batch=f.calr_batch, mu=float(config.sc_mu) or None, ledger=ledger)


# Why config.dp (DP-FedAvg, ops/dp_fedavg.py) is refused.
_DP_REFUSAL = ('its clients also upload correlation matrices, which the clipped-noised mean does '
               'not cover (their own DP is config.fedsc.dp)')
registry.register('fedsc', build, dp_refusal=_DP_REFUSAL,
                  defaults=config_block, validate=validate, methods=('sc',),
                  methods_note='the spectral contrastive loss', plan=plan,
                  doc='spectral contrastive learning with shared correlation matrices')
