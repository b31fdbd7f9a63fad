"""FedU2 (Liao et al., CVPR 2024): FUR on the clients, EUA on the server.

Clients train the base SSL method (SimCLR, SimSiam or BYOL) with lambda_u * (L_u(Z^1) + L_u(Z^2))
added (FUR: `ops.uot.fur_uot_loss`, or the official code's `tangent_swd_loss`), through
`ClientSpec.feature_regularizer`.

The server's EUA (Eqs. 7-12) treats each participant's deviation Delta_k = theta_g - theta_k as an
objective u_k = ||Delta_k||^2 and moves the global model along the min-norm point of the convex hull
of the per-client directions g_k (MGDA):

  g_k = 2 Delta_k / ||Delta_k||    ('code': the official code, = ||Delta_k|| grad log u_k)
      | 2 Delta_k / ||Delta_k||^2  ('paper': grad_{theta_g} log ||Delta_k||^2)
  p*  = argmin_{p in simplex} p^T G p,  G_kl = <g_k, g_l>        (ops.min_norm.simplex_min_norm)
  theta_g <- theta_g - eta_s d,  d = sum_k p*_k g_k                 (server SGD, no momentum)

eta_s (`server_lr`) stands for the paper's eta * eta_g / phi. `eua_step='deviation'` instead sets
the step's norm to eta_s * sum_k w_k ||Delta_k|| (w = data weights), so that eta_s = 1 with identical
clients is exactly FedAvg (not in the paper: the code's fixed step moves the global model by up to
2 eta_s in parameter norm whatever the model's scale). BatchNorm statistics are data-weighted means.

`eua_scope='whole_model'` (the code) runs EUA on every trainable tensor, the BYOL target included:
the server keeps a global target and every participant adopts it; 'online' leaves the target local
as FedBYOL does. With `eua=False` (the ablation "without EUA") the same payloads are averaged.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict

import jax
import jax.numpy as jnp
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl.algorithms import fedavg, registry, ssl_client
from fedjax_ssl.core.algorithm import Algorithm, GlobalModel, present, weighted_mean
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.ops import min_norm, uot

EUA_DIRECTIONS = ('code', 'paper')
EUA_SCOPES = ('whole_model', 'online')
EUA_STEPS = ('fixed', 'deviation')


def deviation_gram(glob: Any, stacked: Any) -> jax.Array:
  """[m, m] Gram matrix <theta_g - theta_k, theta_g - theta_l> of the participants' deviations.

  glob: pytree of [...] leaves; stacked: the same pytree with leaves [m, ...]. Accumulated leaf by
  leaf, so the only temporary is one leaf's [m, size] difference, never a second copy of m models.
  """
  def leaf_gram(g, s):
    d = (g[None] - s).reshape(s.shape[0], -1)
    return d @ d.T
  grams = jax.tree_util.tree_leaves(jax.tree_util.tree_map(leaf_gram, glob, stacked))
  return sum(grams)


def direction_scales(sq_dev: jax.Array, direction: str) -> jax.Array:
  """[m] s_k with g_k = s_k Delta_k: 2 / ||Delta_k|| ('code') or 2 / ||Delta_k||^2 ('paper').

  A participant that did not move (Delta_k = 0, log u_k undefined) gets s_k = 0: g_k = 0 then makes
  p* = e_k and d = 0, i.e. the global model stays where that client already is.
  """
  norm = jnp.sqrt(sq_dev)
  denom = norm if direction == 'code' else sq_dev
  return jnp.where(norm > 0, 2.0 / jnp.where(norm > 0, denom, 1.0), 0.0)


def eua_coefficients(gram_dev: jax.Array, weights: jax.Array, *, direction: str, solver: str,
                     solver_iters: int, server_lr: float, step: str, admm_c: float,
                     admm_rho: float) -> Dict[str, jax.Array]:
  """EUA's update as coefficients on the deviations: theta_g <- theta_g - sum_k coef_k Delta_k.

  Args:
    gram_dev: [m, m] deviation Gram matrix (`deviation_gram`). weights: [m] data weights; an
      absent participant (weight 0, core/faults.py) is left out of the min-norm solve (coef 0).
  Returns:
    {'coef' [m], 'p' [m] min-norm weights, 'deviation' [m] ||Delta_k||, 'step_norm' scalar}.
  """
  sq_dev = jnp.maximum(jnp.diagonal(gram_dev), 0.0)
  s = direction_scales(sq_dev, direction)
  gram = gram_dev * s[:, None] * s[None, :]
  solve = lambda mask: min_norm.simplex_min_norm(gram, solver, num_iters=solver_iters or None,
                                                 c=admm_c, rho=admm_rho, mask=mask)
  here = present(weights)
  # With everyone present, the unmasked solve: the same arithmetic as before absences existed.
  # Both are computed (an [m, m] problem: milliseconds beside a round of seconds) and one
  # selected: under a `lax.cond` XLA compiles the ADMM loop differently, and its weights, which the
  # objective pins down only loosely, move by 1e-3 (measured: docs/notes/engine.md#eng-62).
  p = jnp.where(jnp.all(here), solve(None), solve(here))
  d_norm = jnp.sqrt(jnp.maximum(p @ gram @ p, 0.0))
  lr = server_lr
  if step == 'deviation':
    target = server_lr * jnp.sum(weights * jnp.sqrt(sq_dev))
    lr = jnp.where(d_norm > 0, target / jnp.where(d_norm > 0, d_norm, 1.0), 0.0)
  return {'coef': lr * p * s, 'p': p, 'deviation': jnp.where(here, jnp.sqrt(sq_dev), 0.0),
          'step_norm': lr * d_norm}


def apply_coefficients(glob: Any, stacked: Any, coef: jax.Array) -> Any:
  """theta_g - sum_k coef_k (theta_g - theta_k) = (1 - sum coef) theta_g + sum_k coef_k theta_k."""
  keep = 1.0 - jnp.sum(coef)
  def one(g, s):
    c = coef.reshape((-1,) + (1,) * g.ndim).astype(s.dtype)
    return (keep.astype(g.dtype) * g + jnp.sum(c * s, axis=0)).astype(g.dtype)
  return jax.tree_util.tree_map(one, glob, stacked)


def _eua_params(model: Dict[str, Any]) -> Dict[str, Any]:
  """The trainable tensors EUA moves: online params (+ the BYOL target's under 'whole_model')."""
  out = {'params': model['params']}
  if 'target' in model:
    out['target'] = model['target']['params']
  return out


def _stats(model: Dict[str, Any]) -> Dict[str, Any]:
  out = {'batch_stats': model['batch_stats']}
  if 'target' in model:
    out['target'] = model['target']['batch_stats']
  return out


def _set_eua_params(server: Dict[str, Any], params: Dict[str, Any]) -> Dict[str, Any]:
  """`server` with the tensors EUA moves replaced by `params` (the inverse of `_eua_params`)."""
  out = dict(server, params=params['params'])
  if 'target' in params:
    out['target'] = dict(server['target'], params=params['target'])
  return out


def _assemble(params: Dict[str, Any], stats: Dict[str, Any]) -> Dict[str, Any]:
  model = {'params': params['params'], 'batch_stats': stats['batch_stats']}
  if 'target' in params:
    model['target'] = {'params': params['target'], 'batch_stats': stats['target']}
  return model


def make(spec: ssl_client.ClientSpec, *, clients_per_round: int, eua: bool = True,
         eua_direction: str = 'code', eua_solver: str = 'exact', eua_solver_iters: int = 0,
         eua_scope: str = 'whole_model', eua_step: str = 'fixed', server_lr: float = 8.0,
         admm_c: float = 10.0, admm_rho: float = 1.0, byol_target_sync: str = 'keep',
         name: str = 'fedu2') -> Algorithm:
  """FedU2 over `spec` (whose feature_regularizer carries FUR, or None for the ablation).

  The server state is the global model {'params', 'batch_stats'[, 'target']} plus 'eua', the last
  round's diagnostics {'p', 'deviation' [clients_per_round], 'step_norm'}.
  """
  if spec.objective.classifier:
    raise ValueError(f'FedU2 regularises a projector: ssl_method = {spec.method!r} has none')
  for key, value, allowed in (('eua_direction', eua_direction, EUA_DIRECTIONS),
                              ('eua_solver', eua_solver, min_norm.METHODS),
                              ('eua_scope', eua_scope, EUA_SCOPES),
                              ('eua_step', eua_step, EUA_STEPS),
                              ('byol_target_sync', byol_target_sync, fedavg.BYOL_TARGET_SYNC)):
    if value not in allowed:
      raise ValueError(f'fedu2.{key} = {value!r} is invalid: must be one of {allowed}')
  names = spec.shared
  global_target = eua_scope == 'whole_model' and spec.objective.target
  m = clients_per_round

  def upload(client):
    out = fedavg.shared_subset(spec, client)
    if global_target:
      out['target'] = client['target']
    return out

  def init(key, num_clients):
    clients, _ = fedavg.init_shared(spec, key, num_clients)
    server = upload(jax.tree_util.tree_map(lambda a: a[0], clients))
    server['eua'] = {'p': jnp.full((m,), 1.0 / m, jnp.float32),
                     'deviation': jnp.zeros((m,), jnp.float32),
                     'step_norm': jnp.zeros((), jnp.float32)}
    return clients, server

  def begin(client, msg, key):
    del key
    first = client['extras']['participated'] == 0
    client = fedavg.adopt_global(spec, ssl_client.begin_round(spec, client), msg, names)
    if global_target:
      client = dict(client, target=msg['target'])
    else:
      client = fedavg.sync_target(spec, client, first | (byol_target_sync == 'reset'))
    return fedavg.mark_participated(client)

  def aggregate(server, payloads, weights, ids):
    glob = {k: v for k, v in server.items() if k != 'eua'}
    stats = weighted_mean(_stats(payloads), weights)
    if not eua:
      params = weighted_mean(_eua_params(payloads), weights)
      diag = dict(server['eua'], p=weights.astype(server['eua']['p'].dtype))
    else:
      g_params, k_params = _eua_params(glob), _eua_params(payloads)
      res = eua_coefficients(deviation_gram(g_params, k_params), weights,
                             direction=eua_direction, solver=eua_solver,
                             solver_iters=eua_solver_iters, server_lr=server_lr, step=eua_step,
                             admm_c=admm_c, admm_rho=admm_rho)
      params = apply_coefficients(g_params, k_params, res['coef'])
      # The diagnostics keep the dtype they were created with (float64 under an x64 state).
      diag = {k: res[k].astype(server['eua'][k].dtype) for k in ('p', 'deviation', 'step_norm')}
    return dict(_assemble(params, stats), eua=diag)

  return Algorithm(
      name=name, init=init, broadcast=lambda server: server, begin=begin,
      local_step=lambda c, b, k, msg, lr: ssl_client.local_step(spec, c, b, k, msg, lr),
      upload=lambda client, msg, local: upload(client),
      aggregate=aggregate,
      eval_variables=lambda state: (state.server, False),
      encoder_apply=lambda v, x: spec.model.encoder.apply(ssl_client.encoder_variables(v), x,
                                                          train=False),
      # A server optimizer steps what EUA moves (the BYOL target's parameters too, under
      # 'whole_model'), from EUA's result as the proposal.
      global_model=GlobalModel(get=_eua_params, set=_set_eua_params),
  )


def config_block() -> ml_collections.ConfigDict:
  """FedU2's keys, `config.fedu2`; defaults follow the decisions in docs/notes/fedu2.md."""
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


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  """Ranges and choices of `config.fedu2` (ConfigError naming the key)."""
  del dataset_info
  f = config.fedu2
  cv.check_choice('fedu2.fur', f.fur, uot.FUR_KINDS + ('none',))
  cv.check_choice('fedu2.cost', f.cost, uot.COSTS)
  cv.check_choice('fedu2.direction', f.direction, EUA_DIRECTIONS)
  cv.check_choice('fedu2.solver', f.solver, min_norm.METHODS)
  cv.check_choice('fedu2.scope', f.scope, EUA_SCOPES)
  cv.check_choice('fedu2.step', f.step, EUA_STEPS)
  for key in ('lambda_u', 'tau_a', 'tau_b', 'mass', 'eta_g', 'phi', 'rho', 'server_lr'):
    cv.check_float_range(f'fedu2.{key}', f[key], 0.0, None, inclusive=(key == 'lambda_u', True))
  cv.check_int_range('fedu2.uot_iters', f.uot_iters, 1, 1_000_000)
  cv.check_int_range('fedu2.swd_projections', f.swd_projections, 1, 1_000_000)
  cv.check_int_range('fedu2.solver_iters', f.solver_iters, 0, 10_000_000)


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


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  """FedU2 over the configured SSL client, FUR added to its loss."""
  f = config.fedu2
  spec = dataclasses.replace(ssl_client.spec_from_config(config, info),
                             feature_regularizer=fur_regularizer(f))
  return make(spec, clients_per_round=config.clients_per_round, eua=f.eua,
              eua_direction=f.direction, eua_solver=f.solver, eua_solver_iters=f.solver_iters,
              eua_scope=f.scope, eua_step=f.step, server_lr=f.server_lr,
              admm_c=f.eta_g ** 2 / f.phi, admm_rho=f.rho,
              byol_target_sync=config.byol_target_sync)


# Why config.dp (DP-FedAvg, ops/dp_fedavg.py) is refused.
_DP_REFUSAL = ('its server update (EUA) is not a weighted mean of the uploads, so a '
               'clipped-noised mean would not bound what it releases')
registry.register('fedu2', build, dp_refusal=_DP_REFUSAL,
                  defaults=config_block, validate=validate, needs=('projector',),
                  doc='FUR on the clients, EUA on the server (Liao et al., CVPR 2024)')
