"""FedCA's primitives (Zhang et al., "Federated unsupervised representation learning", FITEE 2023,
arXiv:2010.08982): the dictionary of shared representations, the two dictionary-contrastive losses
and the alignment loss. docs/notes/fedsc.md#fedsc-fedca.

Dictionary module. After local training a client encodes every local example x_i with two
augmented views in inference mode and uploads the mean of the two projector outputs; the server
keeps one entry per example, an EMA across the client's participations, L2-normalised (the FedSC
authors' `Client_CA.comp_dict`):

  m_i = (z(x_i⁰) + z(x_i¹)) / 2                                   `dictionary_entries`
  D_i ← normalize(m_i)                             first upload   `update_dictionary`
  D_i ← normalize(β D_i + (1 − β) m_i)             later ones (β = 0.5; D_i the stored unit row)

The other clients' entries are the negatives of a client's local contrastive loss, in one of two
forms (ẑ = normalize(z), τ the temperature, D_k the valid negatives, rows unit-norm):

  'negatives' (the FedCA paper: the dictionary as extra negatives), `dictionary_nt_xent`: SimCLR's
    NT-Xent over the 2B anchors [ẑ⁰; ẑ¹] with the dictionary added to every denominator,
      ℓ_a = −ẑ_a·ẑ_pos(a)/τ + log( Σ_{b≠a} exp(ẑ_a·ẑ_b/τ) + Σ_k exp(ẑ_a·D_k/τ) ),  L = mean_a ℓ_a;
  'code' (`Client_CA.loss`), `code_dictionary_loss`:
      L = (1 − w) · InfoNCE(ẑ⁰, ẑ¹) + w · (1/R) Σ_{i<R} CE(ẑ⁰_i Dᵀ / τ, target i),   w = 0.2,
    InfoNCE(ẑ⁰, ẑ¹) = (1/B) Σ_i CE(ẑ⁰_i ẑ¹ᵀ / τ, target i) (one direction, the other view's batch as
    the only negatives), "target i" in the dictionary term = its i-th valid row (the code's
    `labels = arange(B)` over `neg_logits`), R = min(B, #valid); without any valid row, L = InfoNCE.

Alignment module, `alignment_loss`: (1/b) Σ_i ‖n(z_i) − n(z̄_i)‖² between the client's and a
reference model's projector outputs on the same public images (n = L2 normalisation, or the
identity).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedjax_ssl.ops.numerics import as_float, check_positive
from fedjax_ssl.ops.numerics import l2_normalize


def _check_pair(name: str, z0: jax.Array, z1: jax.Array) -> None:
  if z0.ndim != 2 or z0.shape != z1.shape or z0.shape[0] < 1:
    raise ValueError(f'{name}: z0 {z0.shape} and z1 {z1.shape} must be the same [B, d], B >= 1')


def _check_dictionary(name: str, z0: jax.Array, dictionary: jax.Array, valid: jax.Array) -> None:
  if (dictionary.ndim != 2 or dictionary.shape[1] != z0.shape[1]
      or valid.shape != (dictionary.shape[0],)):
    raise ValueError(f'{name}: dictionary {dictionary.shape} must be [K, d] with d = {z0.shape[1]} '
                     f'and valid {valid.shape} [K]')


def dictionary_entries(z0: jax.Array, z1: jax.Array) -> jax.Array:
  """m = (z0 + z1) / 2: the new (unnormalised) entries of n examples from their two views' projector
  outputs z0, z1 [n, d]; returns [n, d] in at least float32."""
  _check_pair('dictionary_entries', z0, z1)
  return (as_float(z0) + as_float(z1)) / 2


def update_dictionary(old: jax.Array, entries: jax.Array, seen: jax.Array,
                      momentum: float = 0.5) -> jax.Array:
  """One client's dictionary rows after an upload.

  Args:
    old: [n, d] the stored rows (unit vectors, or anything when not `seen`).
    entries: [n, d] the uploaded means m (`dictionary_entries`).
    seen: bool scalar, whether the client uploaded before (its rows hold an earlier upload).
    momentum: β, the weight of the stored row (the code: 0.5); 0 replaces it.
  Returns:
    [n, d] normalize(β·old + (1 − β)·m) if seen else normalize(m) (zero rows stay zero).
  """
  if old.shape != entries.shape or old.ndim != 2:
    raise ValueError(f'update_dictionary: old {old.shape} and entries {entries.shape} must be the '
                     'same [n, d]')
  if not 0.0 <= momentum < 1.0:
    raise ValueError(f'update_dictionary: momentum = {momentum} must be in [0, 1)')
  entries = as_float(entries)
  mixed = momentum * old.astype(entries.dtype) + (1.0 - momentum) * entries
  return l2_normalize(jnp.where(seen, mixed, entries))


def select_negatives(key: jax.Array, dictionary: jax.Array, valid: jax.Array, size: int,
                     ordered: bool) -> tuple[jax.Array, jax.Array]:
  """At most `size` rows of a dictionary as the negatives of one step.

  Args:
    key: PRNG key of the draw (unused when ordered or when size >= P).
    dictionary: [P, d] rows; valid: bool [P], which rows may be used.
    size: K >= 1, the number of rows returned (static).
    ordered: True: the first K valid rows in row order (the code's dictionary, which keeps the
      clients' order); False: K valid rows uniformly without replacement.
  Returns:
    (rows [min(K, P), d], their validity [min(K, P)]). With K >= P the dictionary itself (every
    valid row, in order); with fewer than K valid rows the tail is invalid rows (valid False).
  """
  if size < 1:
    raise ValueError(f'select_negatives: size = {size} must be >= 1')
  p = dictionary.shape[0]
  if size >= p:
    return dictionary, valid
  score = (-jnp.arange(p, dtype=jnp.float32) if ordered
           else jax.random.uniform(key, (p,), jnp.float32))
  _, idx = jax.lax.top_k(jnp.where(valid, score, -jnp.inf), size)
  return dictionary[idx], valid[idx]


def dictionary_nt_xent(z0: jax.Array, z1: jax.Array, dictionary: jax.Array, valid: jax.Array,
                       temperature: float) -> jax.Array:
  """NT-Xent over the 2B anchors [z0; z1] with the valid dictionary rows as extra negatives in every
  denominator (module docstring, 'negatives'). Without valid rows it is `losses.nt_xent`.

  Args:
    z0, z1: [B, d] projector outputs of the two views (normalised here).
    dictionary: [K, d] unit-norm rows (a constant: no gradient is taken through it).
    valid: bool [K].
    temperature: τ > 0.
  Returns:
    scalar, the mean over the 2B anchors.
  """
  _check_pair('dictionary_nt_xent', z0, z1)
  _check_dictionary('dictionary_nt_xent', z0, dictionary, valid)
  check_positive('temperature', temperature)
  b = z0.shape[0]
  z = l2_normalize(jnp.concatenate([as_float(z0), as_float(z1)], axis=0))
  dictionary = jax.lax.stop_gradient(dictionary).astype(z.dtype)
  batch = jnp.where(jnp.eye(2 * b, dtype=bool), -jnp.inf, z @ z.T / temperature)
  extra = jnp.where(valid[None, :], z @ dictionary.T / temperature, -jnp.inf)
  positive = (jnp.arange(2 * b) + b) % (2 * b)
  logits = jnp.concatenate([batch, extra], axis=1)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, positive))


def info_nce(z0: jax.Array, z1: jax.Array, temperature: float) -> jax.Array:
  """The FedSC code's SimCLR loss (`InfoNCE` without explicit negatives):
  (1/B) Σ_i CE(ẑ0_i ẑ1ᵀ/τ, i), one direction, z0 [B, d] the queries, z1 [B, d] the keys; scalar."""
  _check_pair('info_nce', z0, z1)
  check_positive('temperature', temperature)
  logits = l2_normalize(as_float(z0)) @ l2_normalize(as_float(z1)).T / temperature
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits,
                                                                  jnp.arange(z0.shape[0])))


def code_dictionary_loss(z0: jax.Array, z1: jax.Array, dictionary: jax.Array, valid: jax.Array,
                         temperature: float, dict_weight: float = 0.2) -> jax.Array:
  """`Client_CA.loss` (module docstring, 'code').

  Args:
    z0, z1: [B, d] projector outputs of the two views (normalised here).
    dictionary: [K, d] unit-norm rows, in the order whose i-th valid row is query i's target.
    valid: bool [K].
    temperature: τ > 0.
    dict_weight: w, the dictionary term's weight (the code: 0.2; the InfoNCE term gets 1 − w).
  Returns:
    scalar: (1 − w)·InfoNCE + w·(mean over the queries i < min(B, #valid) of their dictionary
    cross-entropy), or InfoNCE alone without any valid row.
  """
  _check_pair('code_dictionary_loss', z0, z1)
  _check_dictionary('code_dictionary_loss', z0, dictionary, valid)
  check_positive('temperature', temperature)
  b = z0.shape[0]
  base = info_nce(z0, z1, temperature)
  q = l2_normalize(as_float(z0))
  dictionary = jax.lax.stop_gradient(dictionary).astype(q.dtype)
  # A finite fill (not -inf): a query row with no valid entry stays finite, and so does its gradient.
  fill = jnp.finfo(q.dtype).min / 4
  logits = jnp.where(valid[None, :], q @ dictionary.T / temperature, fill)
  rank = jnp.cumsum(valid.astype(jnp.int32)) - 1                     # [K]: i at the i-th valid row
  target = valid[None, :] & (rank[None, :] == jnp.arange(b)[:, None])  # [B, K] one-hot or empty
  count = jnp.sum(valid.astype(jnp.int32))
  has = jnp.arange(b) < count                                          # [B] queries with a target
  ce = jax.nn.logsumexp(logits, axis=1) - jnp.sum(jnp.where(target, logits, 0.0), axis=1)
  term = jnp.sum(jnp.where(has, ce, 0.0)) / jnp.maximum(jnp.sum(has), 1)
  return jnp.where(count > 0, (1.0 - dict_weight) * base + dict_weight * term, base)


def alignment_loss(z: jax.Array, reference: jax.Array, normalize: bool = True) -> jax.Array:
  """(1/b) Σ_i ‖n(z_i) − n(ref_i)‖² over b rows [b, d] (n = L2 normalisation when `normalize`, else
  the identity; the reference gets no gradient); scalar."""
  _check_pair('alignment_loss', z, reference)
  z, reference = as_float(z), jax.lax.stop_gradient(as_float(reference))
  if normalize:
    z, reference = l2_normalize(z), l2_normalize(reference)
  return jnp.mean(jnp.sum((z - reference.astype(z.dtype)) ** 2, axis=1))
