"""A slow, obviously-correct federated round: Python loops over participants and over local steps,
no scan, no masking, no vmap, no scatter; the server average is computed in numpy float64.

It shares with the engine only the algorithm's per-client pure functions (begin / local_step / end /
upload) and the key-derivation rules, so that both consume identical random numbers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl.core.algorithm import LocalData
from fedjax_ssl.core import rng
from fedjax_ssl.core.round import sample_participants
from fedjax_ssl.ops import min_norm

# Deliberate one-place bugs, so a test can show the engine comparison fails on each kind:
#   batch  — the first participant's first batch is shifted by one row (B - 1 rows shared);
#   key    — the first participant's first step uses the key of step 1;
#   mask   — the smallest participant makes one surplus step that should be masked;
#   weight — server weights n_k + 1 instead of n_k (off by one example);
#   client — the first participant trains on the second participant's data.
PERTURBATIONS = ('batch', 'key', 'mask', 'weight', 'client')


def _take(tree, i):
  return jax.tree_util.tree_map(lambda a: np.asarray(a)[i], tree)


def numpy_weighted_mean(payloads, weights):
  """float64 weighted mean over a Python list of pytrees."""
  def avg(*leaves):
    acc = sum(w * np.asarray(l, np.float64) for w, l in zip(weights, leaves))
    return acc.astype(np.asarray(leaves[0]).dtype)
  return jax.tree_util.tree_map(avg, *payloads)


def reference_round(algo, local_step, clients, server, data, key, round_idx, *, clients_per_round,
                    batch_size, local_epochs, lr_fn, aggregates=True, aggregate=None,
                    prepare=None, personalize=None, drop_last=True, perturb=None):
  """Returns (clients, server, mean loss) after one round.

  Args:
    algo: the Algorithm (its per-client functions are used as they are).
    local_step: jitted algo.local_step (only to keep the reference fast).
    clients: stacked client state (numpy or jax leaves, leading axis C).
    server: server state.
    data: FedData.
    aggregates: False for algorithms whose server keeps nothing (independent).
    aggregate: the server step as (server, list of payloads, float64 weights) -> server; default
      the float64 data-weighted mean.
    prepare: the algorithm's pre-round server step as (server, data, ids list, round_idx, key) ->
      server, written independently (FedSC's uploads); needed when algo.prepare is set.
    personalize: (msg, client id int) -> msg, written independently; needed with algo.personalize.
    drop_last: False keeps the ragged last batch of each epoch, with batch['mask'].
    perturb: None, or one of PERTURBATIONS (a deliberate bug, for testing the comparison).
  """
  if perturb not in (None,) + PERTURBATIONS:
    raise ValueError(f'perturb = {perturb!r} is invalid: must be None or one of {PERTURBATIONS}')
  n_all = np.asarray(data.n)
  num_clients = n_all.shape[0]
  ids = [int(i) for i in np.asarray(sample_participants(key, num_clients, clients_per_round))]
  assert (prepare is None) == (algo.prepare is None), 'pass a reference prepare for this algorithm'
  assert (personalize is None) == (algo.personalize is None), 'pass a reference personalize'
  if prepare is not None:
    server = prepare(server, data, ids, round_idx, key)
  msg_all = algo.broadcast(server)
  lr = lr_fn(round_idx)
  new = {}
  payloads, losses = [], []
  smallest = min(ids, key=lambda c: (n_all[c], c))
  for pos, cid in enumerate(ids):
    msg = personalize(msg_all, cid) if personalize is not None else msg_all
    # The bug only touches the first participant's first step ('mask': the smallest participant).
    client, payload, loss = train_participant(
        algo, local_step, _take(clients, cid), data, key, cid, msg, lr, batch_size=batch_size,
        local_epochs=local_epochs, drop_last=drop_last,
        perturb=perturb if (cid == smallest if perturb == 'mask' else pos == 0) else None,
        other=ids[1] if len(ids) > 1 else cid)
    new[cid] = client
    payloads.append(payload)
    losses.append(loss)
  counts = n_all[ids] + (perturb == 'weight')
  weights = counts / counts.sum()
  if aggregates:
    server = (aggregate or (lambda _, p, w: numpy_weighted_mean(p, w)))(server, payloads, weights)

  def scatter(stacked, *per_client):
    out = np.array(stacked)
    for cid, leaf in zip(ids, per_client):
      out[cid] = leaf
    return out
  clients = jax.tree_util.tree_map(scatter, clients, *[new[c] for c in ids])
  return clients, server, float(np.mean(losses))


def train_participant(algo, local_step, client, data, key, cid, msg, lr, *, batch_size,
                      local_epochs, drop_last=True, perturb=None, other=None):
  """One participant's round written out: begin, every real local step from a Python loop with
  its batch gathered in numpy, end, upload. Returns (client, payload, mean step loss).

  perturb: None or a per-participant bug of PERTURBATIONS ('batch', 'key', 'mask', 'client'; the
  latter trains on client `other`'s data).
  """
  (x, y), n_all = data.padded(), np.asarray(data.n)
  n_max = x.shape[1]
  ckey = rng.client_key(key, cid)
  n = int(n_all[cid])
  spe = max(n // batch_size if drop_last else -(-n // batch_size), 1)
  client = algo.begin(client, msg, rng.begin_key(ckey))
  start = client
  step_losses = []
  data_cid = other if perturb == 'client' else cid
  num_steps = local_epochs * spe + (perturb == 'mask')
  for s in range(num_steps):
    epoch, j = divmod(s, spe)
    epoch = min(epoch, local_epochs - 1)
    u = np.asarray(jax.random.uniform(rng.epoch_permutation_key(ckey, epoch), (n_max,)))
    order = np.argsort(np.where(np.arange(n_max) < n, u, 2.0), kind='stable')
    assert set(order[:n]) == set(range(n))
    shift = int(perturb == 'batch' and s == 0)
    epoch_pos = j * batch_size + np.arange(batch_size) + shift
    idx = order[epoch_pos % n]
    step_key = rng.step_key(ckey, s + int(perturb == 'key' and s == 0))
    batch = {'x': x[data_cid][idx], 'y': y[data_cid][idx]}
    if not drop_last:
      batch['mask'] = epoch_pos < n
    client, loss = local_step(client, batch, step_key, msg, lr)
    step_losses.append(float(loss))
  client = algo.end(start, client, msg)
  local = LocalData(jnp.asarray(x[data_cid]), jnp.asarray(y[data_cid]), jnp.int32(n_all[data_cid]),
                    rng.upload_key(ckey))
  return client, algo.upload(client, msg, local), float(np.mean(step_losses))


def numpy_hetero_round(algo, local_steps, clients, server, data, key, round_idx, *,
                       clients_per_round, batch_size, local_epochs, lr_fn, mu, mu_schedule='constant',
                       average='kernels', kbar_clients='all', broadcast='kernel'):
  """One Hetero-SSFL round as Algorithm 1 reads, with Python loops and numpy float64 server maths.

  Who belongs to which architecture comes from `algo.cohorts`; each participant (in client-id
  order) is trained by its cohort's per-client functions (`train_participant`). The server:
  round 0 fills the cache with every client's upload of its initial model (A27); K̄ = Σ_j w_j A_j
  A_jᵀ with w_j = 1/N over all clients (or 1/m over this round's participants), built in float64 from the
  cached representations; the participants' uploads replace their cache entries.

  Returns (clients tuple, server, mean loss).
  """
  num_clients = sum(len(c.members) for c in algo.cohorts)
  where = {int(g): (k, j) for k, c in enumerate(algo.cohorts) for j, g in enumerate(c.members)}
  take = lambda cid: _take(clients[where[cid][0]], where[cid][1])
  ids = [int(i) for i in np.asarray(sample_participants(key, num_clients, clients_per_round))]
  reps = [np.array(r, np.float64) for r in server['reps']]
  rad = np.asarray(data.public_x)
  if round_idx == 0:
    for cid in range(num_clients):
      k, j = where[cid]
      reps[k][j] = np.asarray(algo.cohorts[k].client.upload(take(cid), {'public_x': rad}, None))
  mu_t = mu * (np.sqrt(round_idx) if mu_schedule == 'sqrt' else 1.0)
  in_kbar = np.ones(num_clients)
  if kbar_clients == 'participants':  # this round's participants, from their cached representation
    in_kbar = np.zeros(num_clients)
    in_kbar[ids] = 1.0
  w = in_kbar / in_kbar.sum()
  feats = [reps[where[cid][0]][where[cid][1]] for cid in range(num_clients)]
  if average == 'features':
    feats, w = [sum(wj * a for wj, a in zip(w, feats))], np.ones(1)
  dtype = np.asarray(server['mu']).dtype
  if broadcast == 'kernel':
    kbar = sum(wj * a @ a.T for wj, a in zip(w, feats))
    msg = {'kbar': kbar.astype(dtype)}
  else:
    msg = {'reps': tuple(np.stack([reps[k][j] for j in range(len(c.members))]).astype(dtype)
                         for k, c in enumerate(algo.cohorts)) if average == 'kernels' else
                   (np.stack(feats).astype(dtype),),
           'weights': tuple(np.array([w[g] for g in c.members], dtype) for c in algo.cohorts)
                      if average == 'kernels' else (np.ones(1, dtype),)}
  msg.update(mu=np.asarray(mu_t, dtype), public_x=rad)
  lr = lr_fn(round_idx)
  new, losses = {}, []
  for cid in ids:
    k, _ = where[cid]
    client, payload, loss = train_participant(
        algo.cohorts[k].client, local_steps[k], take(cid), data, key, cid, msg, lr,
        batch_size=batch_size, local_epochs=local_epochs)
    new[cid] = client
    reps[k][where[cid][1]] = np.asarray(payload, np.float64)
    losses.append(loss)
  out_clients = []
  for k, c in enumerate(algo.cohorts):
    def scatter(stacked, *per_client, members=c.members):
      out = np.array(stacked)
      for j, g in enumerate(members):
        if g in new:
          out[j] = per_client[j]
      return out
    out_clients.append(jax.tree_util.tree_map(
        scatter, clients[k], *[new.get(g, _take(clients[k], j)) for j, g in enumerate(c.members)]))
  server = dict(server, reps=tuple(r.astype(np.asarray(server['reps'][0]).dtype) for r in reps),
                in_kbar=in_kbar.astype(np.asarray(server['in_kbar']).dtype),
                mu=np.asarray(mu_t, dtype))
  return tuple(out_clients), server, float(np.mean(losses))


def _flat(trees):
  """float64 concatenation of the leaves of a list of pytrees (tree order)."""
  return np.concatenate([np.asarray(l, np.float64).ravel()
                         for t in trees for l in jax.tree_util.tree_leaves(t)])


def _unflat(vec, like):
  """Inverse of _flat for one list of pytrees shaped like `like`."""
  out, pos = [], 0
  for t in like:
    leaves, treedef = jax.tree_util.tree_flatten(t)
    new = []
    for l in leaves:
      size = np.asarray(l).size
      new.append(vec[pos:pos + size].reshape(np.shape(l)).astype(np.asarray(l).dtype))
      pos += size
    out.append(jax.tree_util.tree_unflatten(treedef, new))
  return out


def numpy_eua(server, payloads, weights, *, direction, solver, server_lr, step, admm_c=10.0,
              admm_rho=1.0):
  """FedU2's EUA server step written out on explicit flat float64 vectors: Delta_k, g_k, the Gram
  matrix, d = sum_k p_k g_k, theta_g - lr d, data-weighted BatchNorm statistics. The min-norm
  weights come from ops.min_norm.simplex_min_norm (tested on its own against scipy)."""
  def trainable(model):
    return [model['params']] + ([model['target']['params']] if 'target' in model else [])

  def stats(model):
    return {'batch_stats': model['batch_stats'],
            **({'target': model['target']['batch_stats']} if 'target' in model else {})}

  glob = {k: v for k, v in server.items() if k != 'eua'}
  flat_g = _flat(trainable(glob))
  deltas = np.stack([flat_g - _flat(trainable(p)) for p in payloads])
  norms = np.linalg.norm(deltas, axis=1)
  scales = 2.0 / (norms if direction == 'code' else norms ** 2)
  g = scales[:, None] * deltas
  with jax.enable_x64(True):
    p = np.asarray(min_norm.simplex_min_norm(jnp.asarray(g @ g.T), solver, c=admm_c, rho=admm_rho))
  d = p @ g
  lr = server_lr * (np.sum(weights * norms) / np.linalg.norm(d) if step == 'deviation' else 1.0)
  new_params = _unflat(flat_g - lr * d, trainable(glob))
  new_stats = numpy_weighted_mean([stats(p) for p in payloads], weights)
  out = {'params': new_params[0], 'batch_stats': new_stats['batch_stats']}
  if 'target' in glob:
    out['target'] = {'params': new_params[1], 'batch_stats': new_stats['target']}
  dtype = np.asarray(server['eua']['p']).dtype
  out['eua'] = {'p': p.astype(dtype), 'deviation': norms.astype(dtype),
                'step_norm': np.asarray(lr * np.linalg.norm(d), dtype)}
  return out


def numpy_calr(spec, apply_fn, augment_fn, variables, x, n, key, *, views, chunk, mu):
  """FedSC's DP-CalR matrix of one client (before noise), by loops: each view of each real row
  augmented with its own key fold_in(fold_in(key, v), row) (the engine's rule) and passed through
  `apply_fn` (-> z) in chunks, then NormClip and the mean of ž žᵀ in numpy float64.
  augment_fn(key, image) -> float image (jitted `augment.augment` with the spec's config)."""
  from fedjax_ssl.data import augment  # pylint: disable=g-import-not-at-top
  acc = 0.0
  for start in range(0, n, chunk):
    rows = range(start, min(n, start + chunk))
    for v in range(views):
      imgs = [augment_fn(jax.random.fold_in(jax.random.fold_in(key, v), r), jnp.asarray(x[r]))
              for r in rows]
      z = np.asarray(apply_fn(variables, augment.normalize(jnp.stack(imgs), spec.mean, spec.std)),
                     np.float64)
      for zb in z:
        if mu is not None and np.linalg.norm(zb) >= np.sqrt(mu):
          zb = np.sqrt(mu) * zb / np.linalg.norm(zb)
        acc = acc + np.outer(zb, zb)
  return acc / (views * n)


def numpy_fedsc_hooks(spec, *, num_rounds, sigma, views, chunk, mu, share_start=0, share_every=1,
                      matrix_weights='uniform', alpha_schedule='linear', alpha_start=1.0,
                      alpha_end=0.2):
  """(prepare, personalize) of FedSC written out with Python loops and numpy float64: who uploads
  in round t (everyone at the first share round, then the participants), each uploader's DP-CalR
  plus its noise (ops.privacy.add_noise with the engine's key rule, so the same keys give the same
  noise), the share counts, q, alpha_t, and R̃_{-j} as an explicit sum over the other clients."""
  from fedjax_ssl.algorithms import fedsc  # pylint: disable=g-import-not-at-top
  from fedjax_ssl.ops import privacy  # pylint: disable=g-import-not-at-top
  from fedjax_ssl.data import augment  # pylint: disable=g-import-not-at-top
  apply_fn = jax.jit(lambda v, img: spec.model.apply(v, img, train=False, with_predictor=False)['z'])
  augment_fn = jax.jit(lambda k, im: augment.augment(k, im, spec.aug))

  def prepare(server, data, ids, round_idx, key):
    t = round_idx + 1
    dtype = np.asarray(server['cov']).dtype
    cov = np.array(server['cov'], np.float64)
    shares = np.array(server['shares'])
    x, n = data.padded()[0], np.asarray(data.n)
    if t > share_start and t % share_every == 0:
      for c in (range(len(n)) if shares.sum() == 0 else ids):
        ckey = jax.random.fold_in(rng.client_key(key, c), fedsc.CALR_STREAM)
        r = numpy_calr(spec, apply_fn, augment_fn, server['model'], x[c], int(n[c]),
                       jax.random.fold_in(ckey, fedsc.VIEW_STREAM), views=views, chunk=chunk,
                       mu=mu)
        if sigma > 0:
          noise_key = jax.random.fold_in(ckey, fedsc.NOISE_STREAM)
          r = r + np.asarray(privacy.add_noise(noise_key, jnp.zeros(r.shape, dtype), sigma))
        cov[c] = r
        shares[c] += 1
    q = np.full(len(n), 1.0 / len(n)) if matrix_weights == 'uniform' else n / n.sum()
    alpha = alpha_start + (alpha_end - alpha_start) * (t - 1) / num_rounds
    return dict(server, cov=cov.astype(dtype), shares=shares,
                q=q.astype(np.asarray(server['q']).dtype),
                alpha=np.asarray(alpha, np.asarray(server['alpha']).dtype))

  def personalize(msg, cid):
    cov, q = np.asarray(msg['cov'], np.float64), np.asarray(msg['q'], np.float64)
    dtype = np.asarray(msg['cov']).dtype
    if np.asarray(msg['shares']).sum() == 0:
      return {'model': msg['model'], 'alpha': np.asarray(1.0, dtype),
              'r_other': np.zeros(cov.shape[1:], dtype)}
    r = sum(q[k] * cov[k] for k in range(len(q)) if k != cid) / (1.0 - q[cid])
    alpha = msg['alpha'] if alpha_schedule == 'linear' else q[cid]
    return {'model': msg['model'], 'alpha': np.asarray(alpha, dtype), 'r_other': r.astype(dtype)}

  return prepare, personalize
