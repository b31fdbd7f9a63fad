"""Server optimizers (Reddi et al., "Adaptive Federated Optimization", ICLR 2021): FedAvgM, FedAdam,
FedYogi, FedAdagrad, for any algorithm whose server keeps a global model (`Algorithm.global_model`).

The algorithm's own `aggregate` proposes the next global parameters x̄ (FedAvg: the weighted mean of
the participants' models); the server optimizer treats g = x - x̄ (minus the mean client delta) as a
gradient and steps the previous global parameters x with it:

  sgd        x <- x - η g
  momentum   m <- μ m + g;  x <- x - η m                      (FedAvgM, heavy ball as optax.sgd)
  adam       m <- β1 m + (1-β1) g;  v <- β2 v + (1-β2) g²     x <- x - η m / (sqrt(v) + τ)
  yogi       m as adam;  v <- v - (1-β2) g² sign(v - g²)
  adagrad    m as adam;  v <- v + g²

with m = 0 and v = τ² at the start (Reddi et al., Algorithm 2: v_{-1} >= τ²; no bias correction),
τ = `eps`. `sgd` and `momentum` are optax's own; optax's adam / yogi / adagrad differ from these
forms (bias correction, eps inside the root, no first moment), so the three adaptive rules are
`scale_by_fedopt`. Only the parameters move through the optimizer: what else `aggregate` returns
(BatchNorm running statistics, diagnostics) is taken as it is, since an adaptive step on a running
variance could make it negative.

`wrap(algo, tx)` is the algorithm with the optimizer on its server: the server state becomes
{'algorithm': the algorithm's server, 'server_opt': the optax state}, so checkpoints hold the
optimizer's moments and a resumed run continues exactly; every function that reads the server sees
the algorithm's own. `sgd` at η = 1 is the proposal itself and is never wrapped, so FedAvg stays
bit for bit what it was. docs/notes/engine.md#server-optimizers.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_ssl.core.algorithm import Algorithm, GlobalModel, Prepare

OPTIMIZERS = ('sgd', 'momentum', 'adam', 'yogi', 'adagrad')
ADAPTIVE = ('adam', 'yogi', 'adagrad')


class FedOptState(NamedTuple):
  """First and second moments of an adaptive server optimizer (each a pytree like the params)."""
  m: Any
  v: Any


def _second_moment(rule: str, v, g2, b2):
  if rule == 'adam':
    return b2 * v + (1 - b2) * g2
  if rule == 'yogi':
    return v - (1 - b2) * g2 * jnp.sign(v - g2)
  return v + g2  # adagrad


def scale_by_fedopt(rule: str, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
  """m / (sqrt(v) + eps) of Reddi et al.'s FedAdam / FedYogi / FedAdagrad (module docstring)."""
  if rule not in ADAPTIVE:
    raise ValueError(f'rule = {rule!r} is invalid: must be one of {ADAPTIVE}')

  def init(params):
    return FedOptState(m=jax.tree_util.tree_map(jnp.zeros_like, params),
                       v=jax.tree_util.tree_map(lambda p: jnp.full_like(p, eps * eps), params))

  def update(grads, state, params=None):
    del params
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state.m, grads)
    v = jax.tree_util.tree_map(lambda v, g: _second_moment(rule, v, g * g, b2), state.v, grads)
    return jax.tree_util.tree_map(lambda m, v: m / (jnp.sqrt(v) + eps), m, v), FedOptState(m, v)

  return optax.GradientTransformation(init, update)


def make(name: str, lr: float = 1.0, *, momentum: float = 0.9, b1: float = 0.9, b2: float = 0.99,
         eps: float = 1e-3) -> Optional[optax.GradientTransformation]:
  """The server optimizer `name` (one of OPTIMIZERS) at server learning rate `lr`; None for plain
  aggregation (sgd at lr 1, whose step is the proposal itself)."""
  if name not in OPTIMIZERS:
    raise ValueError(f'server_optimizer = {name!r} is invalid: must be one of {OPTIMIZERS}')
  if name == 'sgd':
    return None if lr == 1.0 else optax.sgd(lr)
  if name == 'momentum':
    return optax.sgd(lr, momentum=momentum)
  return optax.chain(scale_by_fedopt(name, b1, b2, eps), optax.scale_by_learning_rate(lr))


def step(tx: optax.GradientTransformation, params: Any, proposed: Any, opt_state: Any):
  """(new params, new optimizer state): one server step from `params` towards `proposed` (same
  pytrees), along the pseudo-gradient params - proposed."""
  grads = jax.tree_util.tree_map(jnp.subtract, params, proposed)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def wrap(algo: Algorithm, tx: optax.GradientTransformation) -> Algorithm:
  """`algo` with the server optimizer `tx` on its global model (module docstring)."""
  if algo.global_model is None:
    raise ValueError(f'algorithm {algo.name!r} declares no global model (Algorithm.global_model): '
                     'a server optimizer has nothing to step')
  gm = algo.global_model

  def inner(state):
    """The FedState as the algorithm knows it (its own server)."""
    return state.replace(server=state.server['algorithm'])

  def init(key, num_clients):
    clients, server = algo.init(key, num_clients)
    return clients, {'algorithm': server, 'server_opt': tx.init(gm.get(server))}

  def aggregate(server, *args):
    before = server['algorithm']
    proposed = algo.aggregate(before, *args)
    params, opt_state = step(tx, gm.get(before), gm.get(proposed), server['server_opt'])
    return {'algorithm': gm.set(proposed, params), 'server_opt': opt_state}

  prepare = None
  if algo.prepare is not None:
    p = algo.prepare
    prepare = Prepare(
        fn=lambda state, *a: dict(state.server, algorithm=p.fn(inner(state), *a)),
        upload_bytes=(None if p.upload_bytes is None else
                      lambda state, after: p.upload_bytes(inner(state), after['algorithm'])),
        reads_clients=p.reads_clients, reads_data=p.reads_data,
        summarize=(None if p.summarize is None else
                   lambda server, *a: p.summarize(server['algorithm'], *a)),
        summarize_reads_data=p.summarize_reads_data, summarize_when=p.summarize_when,
        absorb=(None if p.absorb is None else
                lambda server, rows: dict(server, algorithm=p.absorb(server['algorithm'], rows))))
  return dataclasses.replace(
      algo, init=init, broadcast=lambda server: algo.broadcast(server['algorithm']),
      aggregate=aggregate, eval_variables=lambda state: algo.eval_variables(inner(state)),
      prepare=prepare,
      host_metrics=(None if algo.host_metrics is None else
                    lambda state: algo.host_metrics(inner(state))),
      update_reference=(None if algo.update_reference is None else
                        lambda server: algo.update_reference(server['algorithm'])),
      global_model=GlobalModel(lambda s: gm.get(s['algorithm']),
                               lambda s, p: dict(s, algorithm=gm.set(s['algorithm'], p))))
