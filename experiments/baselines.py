"""The same round as `core.round.make_round_step`, run as Python loops over clients: the baselines
of the benchmark (the same numbers, `tests/core/test_round_equivalence.py`).

  * `make_stepwise_round_step` runs clients the way FedJAX's `for_each_client` (jit backend) and the
    official PyTorch codes do: a Python loop over participants and, inside, over local steps, with
    each batch gathered on the host and one jitted step call per batch;
  * `make_sequential_round_step` is the strongest per-client loop: one jitted call per participant
    that runs that client's whole local training as a while-loop.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl.core import local, rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import (Algorithm, CohortSlots, LocalData, persist_client,
                                        restore_client)
from fedjax_ssl.core.round import RoundConfig
from fedjax_ssl.core.state import FedState
from fedjax_ssl.data.types import FedData


def _check_plain(algo: Algorithm, what: str) -> None:
  if algo.cohorts:
    raise ValueError(f'{what} runs single-architecture algorithms; {algo.name!r} has '
                     f'{len(algo.cohorts)} cohorts (use make_round_step)')


def _loop_prepare_finish(algo: Algorithm, cfg: RoundConfig) -> Tuple[Callable, Callable]:
  """The jitted round start (participants, broadcast, lr) and end (aggregate, scatter) shared by the
  two Python-loop baselines."""
  @jax.jit
  def prepare(state, data, key):
    ids = rd.sample_participants(key, data.num_clients, cfg.clients_per_round)
    server = rd.prepare_server(algo, state, data, ids, key)
    return ids, server, rd.round_message(algo, server, data), cfg.lr_fn(state.round)

  @jax.jit
  def finish(state, server, ids, n_sel, new_sel, payloads, losses, lr, msg, key):
    # The same fault screen as the vectorised round (core/faults.py), so both give the same state.
    slots = (CohortSlots(ids, ids, jnp.ones(ids.shape, bool)),)
    old = jax.tree_util.tree_map(lambda a: a[ids], state.clients)
    (new_sel,), (payloads,), screened = rd.screen(cfg, state.round, key, slots, (old,), (new_sel,),
                                                  (payloads,), (losses,))
    server, metrics = rd.aggregate_round(algo, state, server, ids, n_sel, payloads,
                                         screened.present[0], screened.loss, lr, msg,
                                         dp=cfg.dp, key=key)
    metrics = dict(metrics, **rd.fault_metrics(cfg, slots, screened))
    clients = jax.tree_util.tree_map(lambda a, b: a.at[ids].set(b), state.clients, new_sel)
    return FedState(clients=clients, server=server, round=state.round + 1), metrics

  return prepare, finish


def make_sequential_round_step(algo: Algorithm, cfg: RoundConfig, num_clients: int) -> Callable:
  """Same round, clients one at a time from Python: one jitted call per participant, then a jitted
  aggregation. Used as the benchmark baseline (the FedJAX `for_each_client` / PyTorch-loop way)."""
  _check_plain(algo, 'make_sequential_round_step')
  rd.validate(dataclasses.replace(cfg, strategy='vmap'), num_clients, algo)
  per_client = jax.jit(rd.client_round_fn(algo, cfg))
  prepare, finish = _loop_prepare_finish(algo, cfg)

  def round_step(state: FedState, data: FedData, key: jax.Array):
    ids, server, msg, lr = prepare(state, data, key)
    outs = []
    for cid in [int(i) for i in ids]:
      client = jax.tree_util.tree_map(lambda a: a[cid], state.clients)
      outs.append(per_client(client, rng.client_key(key, cid), jnp.int32(cid), data, msg, lr))
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
    return finish(state, server, ids, data.n[ids], *stacked, lr, msg, key)

  return round_step


def make_stepwise_round_step(algo: Algorithm, cfg: RoundConfig, num_clients: int) -> Callable:
  """Same round, the FedJAX `for_each_client` way: for each participant a jitted `begin`, then a
  Python loop over its real local steps (E * steps_per_epoch(n)), each batch gathered from host memory
  with numpy and passed to one jitted step call, then a jitted `end`/`upload`; a jitted aggregation
  last. Batches and keys are those of `local.train_client`, so the numbers are the same."""
  _check_plain(algo, 'make_stepwise_round_step')
  rd.validate(dataclasses.replace(cfg, strategy='vmap'), num_clients, algo)
  bsz, epochs = cfg.batch_size, cfg.local_epochs
  prepare, finish = _loop_prepare_finish(algo, cfg)
  personalize = jax.jit(algo.personalize or (lambda msg, cid: msg))

  @functools.partial(jax.jit, static_argnames='n_max')
  def begin(stored, msg, ckey, n, n_max):
    perms = local.epoch_permutations(ckey, n, n_max, epochs)
    return algo.begin(restore_client(algo, stored, msg), msg, rng.begin_key(ckey)), perms

  @jax.jit
  def step(client, batch, ckey, s, msg, lr):
    return algo.local_step(client, batch, rng.step_key(ckey, s), msg, lr)

  @jax.jit
  def end(start, trained, msg, data, cid, ckey):
    trained = algo.end(start, trained, msg)
    payload = algo.upload(trained, msg, LocalData(*data.client(cid), rng.upload_key(ckey)))
    return persist_client(algo, trained), payload

  def round_step(state: FedState, data: FedData, key: jax.Array):
    ids, server, msg_all, lr = prepare(state, data, key)
    x_host, y_host, n_host = np.asarray(data.x), np.asarray(data.y), np.asarray(data.n)
    off_host = np.asarray(data.offsets)
    outs = []
    for cid in [int(i) for i in ids]:
      msg = personalize(msg_all, jnp.int32(cid))
      client = jax.tree_util.tree_map(lambda a: a[cid], state.clients)
      ckey, n = rng.client_key(key, cid), int(n_host[cid])
      start, perms = begin(client, msg, ckey, n_host[cid], n_max=data.n_max)
      perms = np.asarray(perms)
      spe = int(local.steps_per_epoch(n, bsz, cfg.drop_last))
      trained, losses = start, []
      for s in range(epochs * spe):
        pos = (s % spe) * bsz + np.arange(bsz)
        idx = off_host[cid] + perms[s // spe, pos % n]
        batch = {'x': x_host[idx], 'y': y_host[idx]}
        if not cfg.drop_last:
          batch['mask'] = pos < n
        trained, loss = step(trained, batch, ckey, s, msg, lr)
        losses.append(loss)
      trained, payload = end(start, trained, msg, data, jnp.int32(cid), ckey)
      outs.append((trained, payload, jnp.mean(jnp.stack(losses))))
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
    return finish(state, server, ids, data.n[ids], *stacked, lr, msg_all, key)

  return round_step
