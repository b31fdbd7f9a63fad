"""Quadratic-penalty unbalanced optimal transport and FedU2's flexible uniform regularizer (FUR).

FedU2 (Liao et al., CVPR 2024, Eqs. 3-6) regularises each view's batch of representations Z [B, d]
towards B fresh samples S of the uniform distribution on the unit sphere through the UOT problem

  min_{pi >= 0}  <C, pi> + tau_a/2 ||pi 1 - a||^2 + tau_b/2 ||pi^T 1 - b||^2,   C_ij = cost(z_i, s_j),

solved by projected steepest descent with an exact line search (Eq. 6). The quadratic form
Q = tau_a Phi_r^T Phi_r + tau_b Phi_c^T Phi_c of Eq. 5 is B^2 x B^2; it is never formed: its
products reduce to row and column sums (`_gradient`, `_curvature`), O(B^2) per iteration.

Two findings shape the defaults (docs/notes/fedu2.md):
  * at pi = 0 the gradient is C_ij - tau_a a_i - tau_b b_j, so pi* = 0 exactly (FUR has no gradient)
    whenever every cost exceeds tau_a a_i + tau_b b_j. With probability marginals a = b = 1/B and
    tau = 0.8 that holds for any batch on the sphere; the default marginals carry unit mass per
    sample (`mass=1`, a = b = 1) and the default cost is the non-squared distance;
  * the plan is a constant for the gradient (envelope theorem): the loss's gradient is
    sum_j pi*_ij dC_ij/dz_i, which pulls every z_i towards the prior points it is matched to.

`tangent_swd_loss` is the official code's FUR instead (a tangent-space sliced Wasserstein distance).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from fedjax_ssl.ops.numerics import l2_normalize

COSTS = ('l2', 'sq', 'sq_max')   # ||z - s||, ||z - s||^2, ||z - s||^2 / max_ij ||z - s||^2
FUR_KINDS = ('uot', 'swd')


def _gradient(plan, cost, a, b, tau_a, tau_b):
  """dL/dpi [N, M] = C + tau_a (pi 1 - a) 1^T + tau_b 1 (pi^T 1 - b)^T  (= Q vec(pi) + w)."""
  return (cost + tau_a * (jnp.sum(plan, 1) - a)[:, None]
          + tau_b * (jnp.sum(plan, 0) - b)[None, :])


def _curvature(g, tau_a, tau_b):
  """g^T Q g for g [N, M]: tau_a ||g 1||^2 + tau_b ||g^T 1||^2."""
  return tau_a * jnp.sum(jnp.sum(g, 1) ** 2) + tau_b * jnp.sum(jnp.sum(g, 0) ** 2)


def uot_objective(plan, cost, a, b, tau_a, tau_b):
  """Eq. 4: <C, pi> + tau_a/2 ||pi 1 - a||^2 + tau_b/2 ||pi^T 1 - b||^2 (scalar)."""
  return (jnp.sum(cost * plan) + 0.5 * tau_a * jnp.sum((jnp.sum(plan, 1) - a) ** 2)
          + 0.5 * tau_b * jnp.sum((jnp.sum(plan, 0) - b) ** 2))


def kkt_residual(plan, cost, a, b, tau_a, tau_b):
  """max_ij |min(pi_ij, dL/dpi_ij)|: zero exactly at the optimum of the bound-constrained QP
  (pi >= 0, gradient >= 0, complementary slackness)."""
  return jnp.max(jnp.abs(jnp.minimum(plan, _gradient(plan, cost, a, b, tau_a, tau_b))))


def solve_l2_uot(cost: jax.Array, a: jax.Array, b: jax.Array, tau_a: float, tau_b: float,
                 num_iters: int, init: Optional[jax.Array] = None
                 ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
  """Projected steepest descent with exact line search for the quadratic-penalty UOT (Eq. 6).

    pi <- max(0, pi - eta* g),  g = Q vec(pi) + w,  eta* = g^T g / g^T Q g

  (the step uses the unprojected gradient, as printed). Once pi* = 0 is reached with a
  non-negative gradient the iterate stays exactly 0.

  Args:
    cost: [N, M] transport cost C.
    a: [N] and b: [M] target marginals (any non-negative mass).
    tau_a, tau_b: marginal penalties (> 0).
    num_iters: static iteration count (`lax.fori_loop`).
    init: [N, M] starting plan; default the uniform plan sum(a) / (N M) per entry.
  Returns:
    plan [N, M] >= 0 and info {'objective', 'kkt_residual', 'iterations', 'mass'} (scalars).
  """
  if cost.ndim != 2 or a.shape != cost.shape[:1] or b.shape != cost.shape[1:]:
    raise ValueError(f'solve_l2_uot: cost {cost.shape}, a {a.shape}, b {b.shape} are invalid: '
                     'need cost [N, M], a [N], b [M]')
  n, m = cost.shape
  plan = (jnp.full((n, m), jnp.sum(a) / (n * m), cost.dtype) if init is None
          else init.astype(cost.dtype))
  tiny = jnp.finfo(cost.dtype).tiny

  def step(_, pi):
    g = _gradient(pi, cost, a, b, tau_a, tau_b)
    # A zero curvature (g has zero row and column sums) with g != 0 would make the quadratic
    # linear along g; the guard then takes a unit-free zero step rather than dividing by zero.
    curv = _curvature(g, tau_a, tau_b)
    eta = jnp.where(curv > tiny, jnp.sum(g * g) / jnp.maximum(curv, tiny), 0.0)
    return jnp.maximum(pi - eta * g, 0.0)

  plan = jax.lax.fori_loop(0, num_iters, step, plan)
  info = {'objective': uot_objective(plan, cost, a, b, tau_a, tau_b),
          'kkt_residual': kkt_residual(plan, cost, a, b, tau_a, tau_b),
          'iterations': jnp.asarray(num_iters, jnp.int32),
          'mass': jnp.sum(plan)}
  return plan, info


def sphere_prior(key: jax.Array, shape: Tuple[int, int], dtype=jnp.float32) -> jax.Array:
  """[B, d] samples of the uniform distribution on S^{d-1} (normalised Gaussians)."""
  return l2_normalize(jax.random.normal(key, shape, dtype))


def transport_cost(z: jax.Array, s: jax.Array, cost: str) -> jax.Array:
  """[B, M] cost between rows of z [B, d] and s [M, d]: 'l2' ||z-s||, 'sq' ||z-s||^2,
  'sq_max' ||z-s||^2 / max ||z-s||^2 (the max is a constant for the gradient)."""
  sq = jnp.maximum(jnp.sum(z * z, 1)[:, None] + jnp.sum(s * s, 1)[None, :] - 2.0 * z @ s.T, 0.0)
  if cost == 'l2':
    # The epsilon keeps the gradient of sqrt finite at a coincident pair.
    return jnp.sqrt(sq + 1e-12)
  if cost == 'sq':
    return sq
  if cost == 'sq_max':
    return sq / jax.lax.stop_gradient(jnp.maximum(jnp.max(sq), 1e-12))
  raise ValueError(f'fedu2.cost = {cost!r} is invalid: must be one of {COSTS}')


def fur_uot_loss(z: jax.Array, key: jax.Array, *, tau_a: float = 0.8, tau_b: float = 0.8,
                 num_iters: int = 100, cost: str = 'l2', mass: float = 1.0,
                 normalize: bool = True) -> Tuple[jax.Array, Dict[str, jax.Array]]:
  """FedU2's FUR, L_u(Z) = UOT(Z, S) with the plan held constant for the gradient (Eqs. 3-6).

  Args:
    z: [B, d] representations (the projector output); l2-normalised first when `normalize`.
    key: PRNG key of the B fresh prior samples S (uniform on the sphere).
    tau_a, tau_b: marginal penalties (paper 0.8). num_iters: solver iterations.
    cost: one of COSTS. mass: per-sample marginal mass, a = b = mass * 1 (1/B = probabilities).
  Returns:
    (loss scalar, info of the solve: objective, kkt_residual, iterations, mass, active = fraction
    of non-zero plan entries).
  """
  if normalize:
    z = l2_normalize(z)
  s = sphere_prior(key, z.shape, z.dtype)
  c = transport_cost(z, s, cost)
  bsz = z.shape[0]
  marg = jnp.full((bsz,), mass, z.dtype)
  plan, info = solve_l2_uot(jax.lax.stop_gradient(c), marg, marg, tau_a, tau_b, num_iters)
  plan = jax.lax.stop_gradient(plan)
  info = dict(info, active=jnp.mean((plan > 0).astype(jnp.float32)))
  return uot_objective(plan, c, marg, marg, tau_a, tau_b), info


def sphere_logmap(x: jax.Array, y: jax.Array) -> jax.Array:
  """Log map of the unit sphere at x [d] applied to rows of y [N, d] (geoopt's Sphere.logmap):
  proj_x(y - x) * arccos(<x, y>) / ||proj_x(y - x)||."""
  u = y - x[None, :]
  u = u - jnp.sum(u * x[None, :], 1, keepdims=True) * x[None, :]
  dist = jnp.arccos(jnp.clip(y @ x, -1.0 + 1e-7, 1.0 - 1e-7))
  norm = jnp.sqrt(jnp.sum(u * u, 1) + 1e-12)
  return u * (dist / norm)[:, None]


def tangent_swd_loss(z: jax.Array, key: jax.Array, *, num_projections: int = 6,
                     normalize: bool = False) -> jax.Array:
  """The official FedU2 code's FUR (`RepresentationTagentCollapse`): for B random base points X_m
  on the sphere, the sliced Wasserstein distance between the log maps at X_m of B prior samples and
  of z, with `num_projections` Gaussian directions; summed over the B base points and divided by
  num_projections (the code's scaling). z [B, d] is used as given unless `normalize` (the code
  normalises it for SimCLR only). Returns a scalar."""
  if normalize:
    z = l2_normalize(z)
  kx, ks, kt = jax.random.split(key, 3)
  bsz, dim = z.shape
  base = sphere_prior(kx, (bsz, dim), z.dtype)
  prior = sphere_prior(ks, (bsz, dim), z.dtype)
  theta = jax.random.normal(kt, (dim, num_projections), z.dtype)

  def swd_at(x):
    u = jnp.sort(sphere_logmap(x, prior) @ theta, axis=0)
    v = jnp.sort(sphere_logmap(x, z) @ theta, axis=0)
    return jnp.mean((u - v) ** 2)

  return jnp.sum(jax.vmap(swd_at)(base)) / num_projections
