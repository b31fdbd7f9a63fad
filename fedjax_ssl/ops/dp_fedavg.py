"""User-level DP-FedAvg (McMahan et al., ICLR 2018): clipped updates, Gaussian noise on their sum, a
fixed denominator, and the epsilon of the round's sampling from dp-accounting.

Per round, each of the m sampled participants k (of C clients, fixed-size sampling without
replacement: core/round.py `sample_participants`) uploads u_k; its update is Δ_k = u_k - g, g the
global model in the upload's pytree form (`Algorithm.update_reference`). The server releases

  ū = g + (Σ_k clip(Δ_k) + N(0, (z S)² I)) / m

with S = clip_norm, z = noise_multiplier, uniform weights and the fixed denominator m (never the
n_k-weighted data mean, whose weights would depend on the data). clip is over the whole upload
flattened (||clip(Δ)||_2 <= S), or with `per_layer` each of the L leaves clipped to S / sqrt(L), so
the whole update still has norm <= S and the same accounting holds. A participant that failed or
dropped (core/faults.py) adds nothing but still counts in m.

Neighbouring relation: replace-one user (the client count C is public, as fixed-size sampling
needs). Replacing one user's data changes the clipped sum by at most 2 S, so each round is a
Gaussian mechanism of noise multiplier z / 2 relative to its sensitivity, subsampled without
replacement with q = m / C (`round_event`). Accountants (`ACCOUNTANTS`): 'rdp' (dp-accounting's
RdpAccountant with REPLACE_ONE, Wang et al. 2019 for the subsampling) and 'pld' (dp-accounting's
PLDAccountant, which cannot account sampling without replacement: only full participation, m = C,
where the round is a plain Gaussian). docs/notes/engine.md#dp-fedavg.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Dict

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl.ops import privacy

ACCOUNTANTS = ('rdp', 'pld')
# fold_in constant of the server's noise key: distinct from the streams of core/rng.py.
NOISE_STREAM = 0x44504641


@dataclasses.dataclass(frozen=True)
class DpAggregation:
  """The round's DP aggregation (core/round.py RoundConfig.dp).

  Attributes:
    clip_norm: S > 0, the L2 bound of one participant's update.
    noise_multiplier: z >= 0, the noise std on the sum is z S.
    per_layer: clip each leaf to S / sqrt(L) instead of the whole update to S.
  """
  clip_norm: float
  noise_multiplier: float
  per_layer: bool = False

  def __post_init__(self):
    check_clip_norm(self.clip_norm)
    check_noise_multiplier(self.noise_multiplier)


def check_clip_norm(value) -> float:
  return privacy._check_real('dp.clip_norm', value, 'a finite number > 0', lambda s: s > 0.0)


def check_noise_multiplier(value) -> float:
  return privacy._check_real('dp.noise_multiplier', value, 'a finite number >= 0',
                             lambda z: z >= 0.0)


def _float_leaves(tree):
  leaves = jax.tree_util.tree_leaves(tree)
  for leaf in leaves:
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise ValueError(f'DP aggregation: an upload leaf of dtype {leaf.dtype} is invalid: every '
                       'uploaded leaf must be floating to be clipped and noised')
  return leaves


def clip_update(delta: Any, clip_norm: float, per_layer: bool = False) -> Any:
  """One update scaled to L2 norm <= clip_norm (pytree of float leaves, shapes kept).

  Flat: Δ · min(1, S / ||Δ||) over all leaves together. Per layer: each leaf scaled by
  min(1, (S / sqrt(L)) / ||leaf||), L = number of leaves, so the whole norm is <= S too.
  S / max(norm, S) is the min without dividing by a zero norm.
  """
  leaves, treedef = jax.tree_util.tree_flatten(delta)
  _float_leaves(delta)
  if per_layer:
    bound = clip_norm / math.sqrt(len(leaves))
    out = [x * (bound / jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(x))), bound)).astype(x.dtype)
           for x in leaves]
  else:
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in leaves))
    scale = clip_norm / jnp.maximum(norm, clip_norm)
    out = [x * scale.astype(x.dtype) for x in leaves]
  return jax.tree_util.tree_unflatten(treedef, out)


def gaussian_noise(key: jax.Array, like: Any, std) -> Any:
  """std · N(0, I) shaped like the pytree `like`; leaf i uses fold_in(key, i), so the noise of a
  leaf depends only on the key and the leaf's position."""
  leaves, treedef = jax.tree_util.tree_flatten(like)
  out = [jnp.asarray(std, x.dtype) * jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
         for i, x in enumerate(leaves)]
  return jax.tree_util.tree_unflatten(treedef, out)


def noisy_mean(reference: Any, payloads: Any, present: jax.Array, key: jax.Array,
               dp: DpAggregation, denominator: int) -> Any:
  """g + (Σ_k present_k clip(u_k - g) + N(0, (z S)² I)) / denominator (module docstring).

  Args:
    reference: g, pytree of float leaves [...] (the global model in the upload's form).
    payloads: the same pytree with leaves [m, ...], one row per participant.
    present: bool [m]; an absent participant's row (zeroed, or non-finite) adds nothing.
    key: the noise key (the caller folds NOISE_STREAM into the round key).
    denominator: the fixed denominator (the participants sampled per round).
  Returns:
    pytree like `reference`.
  """
  _float_leaves(reference)
  deltas = jax.tree_util.tree_map(lambda u, g: u - g[None], payloads, reference)
  clipped = jax.vmap(lambda d: clip_update(d, dp.clip_norm, dp.per_layer))(deltas)

  def total(c):
    mask = present.reshape(present.shape + (1,) * (c.ndim - 1))
    return jnp.sum(jnp.where(mask, c, jnp.zeros((), c.dtype)), axis=0)

  summed = jax.tree_util.tree_map(total, clipped)
  noise = gaussian_noise(key, reference, dp.noise_multiplier * dp.clip_norm)
  return jax.tree_util.tree_map(
      lambda g, s, n: g + (s + n) / jnp.asarray(denominator, g.dtype), reference, summed, noise)


# --- Accounting -------------------------------------------------------------------------------


def _check_accounting(noise_multiplier, clients_per_round, num_clients, rounds, delta, accountant):
  z = check_noise_multiplier(noise_multiplier)
  c = privacy._check_count('num_clients', num_clients, 1)
  m = privacy._check_count('clients_per_round', clients_per_round, 1)
  if m > c:
    raise ValueError(f'clients_per_round = {m} is invalid: need <= num_clients = {c}')
  t = privacy._check_count('rounds', rounds, 0)
  d = privacy._check_real('dp.delta', delta, 'a number in (0, 1)', lambda x: 0.0 < x < 1.0)
  privacy._check_choice('dp.accountant', accountant, ACCOUNTANTS)
  if accountant == 'pld' and m < c:
    raise ValueError(f"dp.accountant = 'pld' is invalid with clients_per_round = {m} < "
                     f'num_clients = {c}: dp-accounting\'s PLD cannot account sampling without '
                     "replacement; use 'rdp' or full participation")
  return z, m, c, t, d


def round_event(noise_multiplier: float, clients_per_round: int, num_clients: int
                ) -> dp_accounting.DpEvent:
  """The DpEvent of one round: a Gaussian of multiplier z / 2 (replace-one sensitivity 2 S),
  sampled without replacement (m of C) unless m = C."""
  gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2.0)
  if clients_per_round == num_clients:
    return gaussian
  return dp_accounting.SampledWithoutReplacementDpEvent(num_clients, clients_per_round, gaussian)


def make_accountant(accountant: str) -> dp_accounting.PrivacyAccountant:
  """A fresh accountant: RDP under REPLACE_ONE, or PLD (full participation only)."""
  if accountant == 'rdp':
    return dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  # A Gaussian without sampling has the same privacy loss for replace-one as for add/remove at
  # the same sensitivity, which round_event's multiplier already expresses.
  return dp_accounting.pld.PLDAccountant()


@functools.lru_cache(maxsize=256)
def _round_rdp(noise_multiplier: float, clients_per_round: int, num_clients: int):
  """(orders, RDP of ONE round): dp-accounting's RdpAccountant (REPLACE_ONE) composed with one
  `round_event`. Composing the same event T times adds T times its RDP to zeros (the accountant's
  `_rdp += count * rdp`), so T rounds are exactly T times this: the ledger's epsilon after round T
  costs one `compute_epsilon` instead of a fresh subsampled-RDP evaluation (about 0.2 CPU-s each,
  once per round; docs/notes/engine.md#eng-82)."""
  acc = make_accountant('rdp')
  acc.compose(round_event(noise_multiplier, clients_per_round, num_clients), 1)
  return np.array(acc._orders), np.array(acc._rdp)  # the accountant's own arrays, read once


@functools.lru_cache(maxsize=4096)
def epsilon(noise_multiplier: float, clients_per_round: int, num_clients: int, rounds: int,
            delta: float, accountant: str = 'rdp') -> float:
  """epsilon after `rounds` DP-FedAvg rounds (0.0 for none, inf without noise)."""
  z, m, c, t, d = _check_accounting(noise_multiplier, clients_per_round, num_clients, rounds,
                                    delta, accountant)
  if t == 0:
    return 0.0
  if z == 0.0:
    return math.inf
  if accountant == 'rdp':
    orders, rdp = _round_rdp(z, m, c)
    return float(dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon(orders, t * rdp, d)[0])
  acc = make_accountant(accountant)
  acc.compose(round_event(z, m, c), t)
  return float(acc.get_epsilon(d))


@functools.lru_cache(maxsize=64)
def calibrate_noise_multiplier(target_epsilon: float, delta: float, clients_per_round: int,
                               num_clients: int, rounds: int, accountant: str = 'rdp') -> float:
  """The noise multiplier z whose epsilon after `rounds` rounds is <= target_epsilon
  (dp_accounting.calibrate_dp_mechanism, then raised by 1e-6 relative steps until the accountant
  confirms the target: it is never exceeded)."""
  target = privacy._check_real('dp.target_epsilon', target_epsilon, 'a finite number > 0',
                               lambda e: e > 0.0)
  _, m, c, t, d = _check_accounting(1.0, clients_per_round, num_clients, rounds, delta,
                                    accountant)
  if t == 0:
    return 0.0
  # An explicit bracket: the default one starts at z = 0, where the subsampled RDP divides by 0.
  lo, hi = 0.5, 1.0
  while epsilon(lo, m, c, t, d, accountant) <= target:
    lo, hi = lo / 2.0, lo
  while epsilon(hi, m, c, t, d, accountant) > target:
    lo, hi = hi, hi * 2.0
  z = dp_accounting.calibrate_dp_mechanism(
      lambda: make_accountant(accountant),
      lambda z: dp_accounting.SelfComposedDpEvent(round_event(z, m, c), t), target, d,
      bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi), tol=1e-7)
  z = float(z)
  while epsilon(z, m, c, t, d, accountant) > target:
    z *= 1.0 + 1e-6
  return z


class DpLedger:
  """epsilon of a DP-FedAvg run after each round. Every round samples m of C with the same noise,
  so epsilon depends only on the rounds done (FedState.round, checkpointed with the state: a
  resumed run reports exactly what an unbroken one does)."""

  def __init__(self, noise_multiplier: float, clients_per_round: int, num_clients: int,
               delta: float, accountant: str = 'rdp'):
    _check_accounting(noise_multiplier, clients_per_round, num_clients, 0, delta, accountant)
    self.args = (float(noise_multiplier), int(clients_per_round), int(num_clients))
    self.delta, self.accountant = float(delta), accountant

  def epsilon(self, rounds: int) -> float:
    z, m, c = self.args
    return epsilon(z, m, c, int(rounds), self.delta, self.accountant)

  def host_metrics(self, state) -> Dict[str, float]:
    """{'epsilon': spent after state.round rounds} for every metrics row."""
    return {'epsilon': self.epsilon(int(jax.device_get(state.round)))}
