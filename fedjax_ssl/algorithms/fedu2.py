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

from typing import Any, Dict

import jax
import jax.numpy as jnp

from fedjax_ssl.algorithms import fedavg, ssl_client
from fedjax_ssl.algorithms.base import Algorithm, weighted_mean
from fedjax_ssl.ops import min_norm

METHODS = ('byol', 'simsiam', 'simclr')
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
    gram_dev: [m, m] deviation Gram matrix (`deviation_gram`). weights: [m] data weights.
  Returns:
    {'coef' [m], 'p' [m] min-norm weights, 'deviation' [m] ||Delta_k||, 'step_norm' scalar}.
  """
  sq_dev = jnp.maximum(jnp.diagonal(gram_dev), 0.0)
  s = direction_scales(sq_dev, direction)
  gram = gram_dev * s[:, None] * s[None, :]
  p = min_norm.simplex_min_norm(gram, solver, num_iters=solver_iters or None, c=admm_c,
                                rho=admm_rho)
  d_norm = jnp.sqrt(jnp.maximum(p @ gram @ p, 0.0))
  lr = server_lr
  if step == 'deviation':
    target = server_lr * jnp.sum(weights * jnp.sqrt(sq_dev))
    lr = jnp.where(d_norm > 0, target / jnp.where(d_norm > 0, d_norm, 1.0), 0.0)
  return {'coef': lr * p * s, 'p': p, 'deviation': jnp.sqrt(sq_dev), 'step_norm': lr * d_norm}


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
  for key, value, allowed in (('method', spec.method, METHODS),
                              ('eua_direction', eua_direction, EUA_DIRECTIONS),
                              ('eua_solver', eua_solver, min_norm.METHODS),
                              ('eua_scope', eua_scope, EUA_SCOPES),
                              ('eua_step', eua_step, EUA_STEPS),
                              ('byol_target_sync', byol_target_sync, fedavg.BYOL_TARGET_SYNC)):
    if value not in allowed:
      raise ValueError(f'fedu2.{key} = {value!r} is invalid: must be one of {allowed}')
  names = ssl_client.SHARED_MODULES[spec.method]
  global_target = eua_scope == 'whole_model' and spec.method == 'byol'
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
      end=lambda start, client, msg: client, upload=lambda client, msg, local: upload(client),
      aggregate=aggregate,
      eval_variables=lambda state: (state.server, False),
      encoder_apply=lambda v, x: spec.model.encoder.apply(ssl_client.encoder_variables(v), x,
                                                          train=False),
  )
