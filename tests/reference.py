"""A slow, obviously-correct federated round: Python loops over participants and over local steps,
no scan, no masking, no vmap, no scatter; the server average is computed in numpy float64.

It shares with the engine only the algorithm's per-client pure functions (begin / local_step / end /
upload) and the key-derivation rules, so that both consume identical random numbers.
"""
from __future__ import annotations

import jax
import numpy as np

from fedjax_ssl.core import rng
from fedjax_ssl.core.round import sample_participants


def _take(tree, i):
  return jax.tree_util.tree_map(lambda a: np.asarray(a)[i], tree)


def numpy_weighted_mean(payloads, weights):
  """float64 weighted mean over a Python list of pytrees."""
  def avg(*leaves):
    acc = sum(w * np.asarray(l, np.float64) for w, l in zip(weights, leaves))
    return acc.astype(np.asarray(leaves[0]).dtype)
  return jax.tree_util.tree_map(avg, *payloads)


def reference_round(algo, local_step, clients, server, data, key, round_idx, *, clients_per_round,
                    batch_size, local_epochs, lr_fn, aggregates=True):
  """Returns (clients, server, mean loss) after one round.

  Args:
    algo: the Algorithm (its per-client functions are used as they are).
    local_step: jitted algo.local_step (only to keep the reference fast).
    clients: stacked client state (numpy or jax leaves, leading axis C).
    server: server state.
    data: FedData.
    aggregates: False for algorithms whose server keeps nothing (independent).
  """
  x, y, n_all = np.asarray(data.x), np.asarray(data.y), np.asarray(data.n)
  num_clients, n_max = x.shape[0], x.shape[1]
  ids = [int(i) for i in np.asarray(sample_participants(key, num_clients, clients_per_round))]
  msg = algo.broadcast(server)
  lr = lr_fn(round_idx)
  new = {}
  payloads, losses = [], []
  for cid in ids:
    ckey = rng.client_key(key, cid)
    n = int(n_all[cid])
    spe = max(n // batch_size, 1)
    client = algo.begin(_take(clients, cid), msg, rng.begin_key(ckey))
    start = client
    step_losses = []
    for s in range(local_epochs * spe):
      epoch, j = divmod(s, spe)
      u = np.asarray(jax.random.uniform(rng.epoch_permutation_key(ckey, epoch), (n_max,)))
      order = np.argsort(np.where(np.arange(n_max) < n, u, 2.0), kind='stable')
      assert set(order[:n]) == set(range(n))
      idx = order[(j * batch_size + np.arange(batch_size)) % n]
      client, loss = local_step(client, {'x': x[cid][idx], 'y': y[cid][idx]},
                                rng.step_key(ckey, s), msg, lr)
      step_losses.append(float(loss))
    client = algo.end(start, client, msg)
    new[cid] = client
    payloads.append(algo.upload(client))
    losses.append(np.mean(step_losses))
  weights = n_all[ids] / n_all[ids].sum()
  server = numpy_weighted_mean(payloads, weights) if aggregates else server

  def scatter(stacked, *per_client):
    out = np.array(stacked)
    for cid, leaf in zip(ids, per_client):
      out[cid] = leaf
    return out
  clients = jax.tree_util.tree_map(scatter, clients, *[new[c] for c in ids])
  return clients, server, float(np.mean(losses))
