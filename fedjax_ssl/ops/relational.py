"""FedX's relational (similarity-distribution) loss (Han et al., "FedX: Unsupervised Federated
Learning with Cross Knowledge Distillation", ECCV 2022; the authors' `js_loss`).

Two views of a batch are compared through their similarity distributions over a set of anchors (a
different batch of the same client, encoded by the local or the frozen global model): each view's
distribution at temperature tau is pulled towards the mean of both views' distributions at the
sharper temperature tau_target, a Jensen-Shannon-like agreement of the two views' relations.
docs/notes/fedu2.md#fedu2-fedx.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_ssl.ops.numerics import l2_normalize


def relation_logits(x: jax.Array, anchors: jax.Array) -> jax.Array:
  """Cosine similarities [B, K] of the rows of x [B, d] with the rows of anchors [K, d]."""
  return l2_normalize(x) @ l2_normalize(anchors).T


def relational_js(x1: jax.Array, x2: jax.Array, anchors: jax.Array, tau: float = 0.1,
                  tau_target: float = 0.01) -> jax.Array:
  """FedX's relational loss of two views against a set of anchors.

  With s_v = normalize(x_v) normalize(anchors)^T [B, K] (cosine similarities, v = 1, 2),
    q_v = softmax(s_v / tau)                                  (row-wise, [B, K])
    m   = (softmax(s_1 / tau_target) + softmax(s_2 / tau_target)) / 2
    L   = 1/2 * sum_v (1/B) sum_i KL(m_i || q_v,i)
        = 1/2 * sum_v (1/B) sum_{i,k} m_ik (log m_ik - log q_v,ik)
  (PyTorch's `kl_div(log q_v, m, reduction='batchmean')`, averaged over the two views, as the
  authors' code). The target m is not detached: the gradient flows through both sides, as in the
  authors' code (their `kl_div` target is a function of the trained network).

  Args:
    x1, x2: float [B, d], the two views' representations (B >= 1).
    anchors: float [K, d], the anchor representations (K >= 1); stop their gradient yourself where
      they come from a frozen model.
    tau: temperature of the views' distributions q_v (the code's `t`, 0.1), > 0.
    tau_target: temperature of the target m (the code's `t2`: `--tt` global, `--ts` local, 0.01).
  Returns:
    scalar loss (>= 0 up to rounding).
  """
  if x1.ndim != 2 or x1.shape != x2.shape or anchors.ndim != 2 or anchors.shape[1] != x1.shape[1]:
    raise ValueError(f'relational_js: x1 {x1.shape}, x2 {x2.shape} must be the same [B, d] and '
                     f'anchors {anchors.shape} [K, d]')
  if not (tau > 0 and tau_target > 0):
    raise ValueError(f'relational_js: tau = {tau}, tau_target = {tau_target} must be > 0')
  s1, s2 = relation_logits(x1, anchors), relation_logits(x2, anchors)
  # log m from the two log-softmaxes (finite where a float32 softmax at 0.01 underflows to 0).
  log_m = jnp.logaddexp(jax.nn.log_softmax(s1 / tau_target, axis=-1),
                        jax.nn.log_softmax(s2 / tau_target, axis=-1)) - jnp.log(2.0)
  m = jnp.exp(log_m)
  b = x1.shape[0]
  kl = lambda s: jnp.sum(m * (log_m - jax.nn.log_softmax(s / tau, axis=-1))) / b
  return 0.5 * (kl(s1) + kl(s2))
