r"""FedU2's costs: the UOT solve (FUR) and the EUA server step, and their share of a round.

  python -m experiments.fedu2.timing --out fedu2_timing.json
  python -m experiments.fedu2.timing --out t.json --batch_sizes=128 --clients=10 --round_images=256

Measured, each after a compiling call, median of --repeats:
  * uot: `ops.uot.solve_l2_uot` (100 iterations) and FUR's value + gradient for B = 128/256/512 at
    d = 512 (the paper's projector output);
  * eua: the FedU2 server step (deviation Gram matrix, min-norm weights, update, BatchNorm means)
    for K = 10/100 participants uploading ResNet-18 BYOL models with the 512-2048-512 heads and
    the target network (the code's whole-model scope, 28.6M parameters per client);
  * round: one whole FedU2-BYOL round (ResNet-18, K clients of --round_images images each, batch
    128, 1 local epoch) with FUR on and off, and a FedAvg round of the same work: FUR's share is
    (on - off) / on, EUA's share is eua / on. K = 100 ResNet-18 BYOL clients do not fit one H100
    under 'vmap' (XLA asks for 172 GiB): time them with --strategy=map --map_chunk_size=10.
Synthetic images: the timings do not depend on the pixels.
"""
from __future__ import annotations

import json
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl import experiment
from fedjax_ssl.core import rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.data.types import Dataset, FedData
from fedjax_ssl.ops import uot
from fedjax_ssl.ssl.losses import l2_normalize


def _time(fn, *args):
  """(compile + first call seconds, median seconds of the next --repeats calls)."""
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t
  times = []
  for _ in range(flags.FLAGS.repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return first, statistics.median(times)


def time_uot(bsz: int) -> dict:
  z = jax.random.normal(jax.random.PRNGKey(0), (bsz, 512))
  s = uot.sphere_prior(jax.random.PRNGKey(1), (bsz, 512))
  cost = uot.transport_cost(l2_normalize(z), s, "l2")
  ones = jnp.ones((bsz,))
  solve = jax.jit(lambda c: uot.solve_l2_uot(c, ones, ones, 0.8, 0.8, 100)[0])
  fur = jax.jit(jax.value_and_grad(lambda z, k: uot.fur_uot_loss(z, k)[0]))
  _, t_solve = _time(solve, cost)
  _, t_fur = _time(fur, z, jax.random.PRNGKey(2))
  return {'B': bsz, 'solve_100_iters_s': t_solve, 'fur_value_and_grad_s': t_fur}


def _config(num_clients: int, fur: str, algorithm: str = 'fedu2'):
  c = experiment.default_config()
  c.dataset, c.encoder, c.heads, c.augmentation = 'synthetic', flags.FLAGS.encoder, 'fedu2', 'fedu2'
  c.algorithm, c.ssl_method = algorithm, 'byol'
  c.num_clients = c.clients_per_round = num_clients
  c.local_epochs, c.batch_size = 1, 128
  c.strategy, c.map_chunk_size = flags.FLAGS.strategy, flags.FLAGS.map_chunk_size
  c.fedu2.fur = fur
  return c


def _dataset(n_train: int) -> Dataset:
  rs = np.random.RandomState(0)
  x = rs.randint(0, 256, (n_train, 32, 32, 3)).astype(np.uint8)
  y = rs.randint(0, 10, n_train).astype(np.int32)
  return Dataset(name='synthetic', train_x=x, train_y=y, test_x=x[:10], test_y=y[:10],
                 num_classes=10, mean=(0.5,) * 3, std=(0.25,) * 3)


def time_eua(num_clients: int) -> dict:
  algo = experiment.build_algorithm(_config(num_clients, 'none'), _dataset(16))
  state = rd.init_state(algo, jax.random.PRNGKey(0), 1)
  server = state.server
  # K uploads = the global model plus independent noise (what matters is the shapes).
  keys = jax.random.split(jax.random.PRNGKey(1), num_clients)
  glob = {k: v for k, v in server.items() if k != 'eua'}
  payloads = jax.vmap(lambda k: jax.tree_util.tree_map(
      lambda a: a + 1e-3 * jax.random.normal(k, a.shape, a.dtype), glob))(keys)
  weights = jnp.full((num_clients,), 1.0 / num_clients)
  params = sum(a.size for a in jax.tree_util.tree_leaves(glob['params']))
  params += sum(a.size for a in jax.tree_util.tree_leaves(glob.get('target', {}).get('params', {})))
  ids = jnp.arange(num_clients)  # the participants' client ids
  first, t = _time(jax.jit(algo.aggregate), server, payloads, weights, ids)
  return {'K': num_clients, 'params_per_client': int(params), 'eua_s': t, 'compile_s': first}


def time_round(num_clients: int) -> dict:
  n = flags.FLAGS.round_images
  out = {'K': num_clients, 'images_per_client': n, 'local_steps': n // 128}
  ds = _dataset(16)
  rs = np.random.RandomState(0)
  data = FedData.from_padded(rs.randint(0, 256, (num_clients, n, 32, 32, 3)).astype(np.uint8),
                             np.zeros((num_clients, n), np.int32), np.full((num_clients,), n))
  for label, fur, algorithm in (('fedu2_round_s', 'uot', 'fedu2'),
                                ('fedu2_no_fur_round_s', 'none', 'fedu2'),
                                ('fedavg_round_s', 'none', 'fedavg')):
    cfg = _config(num_clients, fur, algorithm)
    algo = experiment.build_algorithm(cfg, ds)
    step = rd.make_round_step(algo, experiment.round_config(cfg), num_clients)
    state = rd.init_state(algo, jax.random.PRNGKey(0), num_clients)
    times = []
    for r in range(flags.FLAGS.repeats + 1):
      t = time.perf_counter()
      state, metrics = step(state, data, rng.round_key(jax.random.PRNGKey(1), r))
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t)
    out[label] = statistics.median(times[1:])
    del state, step
  return out


def define_flags() -> None:
  """The binary's flags; defined only when it runs, so that any two binaries (whose flag names
  overlap) can be imported in one process, as the tests do."""
  flags.DEFINE_string('out', 'fedu2_timing.json', 'Where to write the JSON results.')
  flags.DEFINE_list('batch_sizes', ['128', '256', '512'], 'UOT batch sizes B.')
  flags.DEFINE_list('clients', ['10', '100'], 'EUA participant counts K.')
  flags.DEFINE_list('round_clients', ['10'], 'K of the timed whole rounds.')
  flags.DEFINE_integer('round_images', 1280, 'Images per client in the timed rounds.')
  flags.DEFINE_string('encoder', 'resnet18', 'Encoder of the EUA / round timings.')
  flags.DEFINE_integer('repeats', 3, 'Timed calls per measurement (after one compiling).')
  flags.DEFINE_string('strategy', 'auto', 'Round strategy of the timed rounds.')
  flags.DEFINE_integer('map_chunk_size', 1, "Clients per chunk under strategy 'map'.")


def main(argv):
  del argv
  res = {'device': str(jax.devices()[0]), 'uot': [], 'eua': [], 'round': []}
  for b in flags.FLAGS.batch_sizes:
    res['uot'].append(time_uot(int(b)))
    print(res['uot'][-1], flush=True)
  for k in flags.FLAGS.clients:
    res['eua'].append(time_eua(int(k)))
    print(res['eua'][-1], flush=True)
  for k in flags.FLAGS.round_clients:
    r = time_round(int(k))
    eua = next((e['eua_s'] for e in res['eua'] if e['K'] == int(k)), None)
    r['fur_share'] = (r['fedu2_round_s'] - r['fedu2_no_fur_round_s']) / r['fedu2_round_s']
    if eua is not None:
      r['eua_share'] = eua / r['fedu2_round_s']
    res['round'].append(r)
    print(r, flush=True)
  with open(flags.FLAGS.out, 'w') as f:
    json.dump(res, f, indent=1)


if __name__ == '__main__':
  define_flags()
  app.run(main)
