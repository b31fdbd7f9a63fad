r"""Stacked round step vs a sequential per-client loop, on the same work, in one process.

  python -m experiments.benchmark --out results.json
  python -m experiments.benchmark --out results.json --models=small_cnn --clients=10,100

For every (model, client count) the same FedBYOL round (E local steps of batch B per client, SGD with
momentum, on-device augmentation included) runs
  * `stepwise`: the FedJAX `for_each_client` (jit backend) way, which is also how the official
    PyTorch codes run: Python loops over clients and over local steps, each batch gathered on the
    host, one jitted step call per batch;
  * `sequential`: the strongest per-client loop: one jitted call per client that runs its whole local
    training as a scan, then a jitted aggregation;
  * the stacked `round_step` under each execution strategy (vmap, map with chunk 1 and chunk 10, shard).
All variants compute the same numbers (tests/test_round_equivalence.py). Reported: seconds per round
(median of --repeats after a warm-up call that compiles), client-steps per second, the ratio to the
sequential and stepwise loops, compile time, and memory (XLA's compiled-buffer estimate; peak device bytes where
the backend reports them; the process's peak RSS).
"""
from __future__ import annotations

import json
import resource
import statistics
import time
from typing import Dict, List

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl import experiment
from fedjax_ssl.core import rng, strategies
from fedjax_ssl.core import round as rd
from fedjax_ssl.data.types import Dataset, FedData

_OUT = flags.DEFINE_string('out', 'results.json', 'Where to write the JSON results.')
_MODELS = flags.DEFINE_list('models', ['small_cnn', 'resnet18'], 'Encoders to benchmark.')
_CLIENTS = flags.DEFINE_list('clients', ['10', '100'], 'Client counts (all participate).')
_STEPS = flags.DEFINE_integer('local_steps', 5, 'Local steps per client per round.')
_BATCH = flags.DEFINE_integer('batch_size', 64, 'Local batch size.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed rounds per variant (after one warm-up).')
_VARIANTS = flags.DEFINE_list('variants', ['stepwise', 'sequential', 'vmap', 'map', 'map10', 'shard'],
                              'Which execution variants to time.')
_AUGMENTATION = flags.DEFINE_string(
    'augmentation', 'byol_easyfl',
    "Augmentation preset of the views ('none' = model compute only, to compare with "
    'experiments/torch_reference.py).')
_MAX_SECONDS = flags.DEFINE_float(
    'max_variant_seconds', 600.0,
    'Skip the remaining variants of a setting once one timed round exceeds this (CPU ResNet-18).')

# Native input of each benchmark model, and its heads: BYOL projector/predictor sized to the encoder.
_SETTINGS = {
    'small_cnn': dict(shape=(28, 28, 1), heads='custom'),
    'resnet18': dict(shape=(32, 32, 3), heads='fedu2'),
}


def _config(model: str, num_clients: int, strategy: str, chunk: int):
  c = experiment.default_config()
  c.encoder = model
  c.heads = _SETTINGS[model]['heads']
  c.num_clients = c.clients_per_round = num_clients
  c.local_epochs = 1
  c.batch_size = _BATCH.value
  c.lr = 0.05
  c.strategy = strategy
  c.map_chunk_size = chunk
  c.augmentation = _AUGMENTATION.value
  return c


def _data(shape, num_clients: int, per_client: int):
  """Synthetic uint8 data: the timing does not depend on pixel values."""
  h, w, ch = shape
  rs = np.random.RandomState(0)
  x = rs.randint(0, 256, (num_clients, per_client, h, w, ch)).astype(np.uint8)
  y = rs.randint(0, 10, (num_clients, per_client)).astype(np.int32)
  fed = FedData(x=jnp.asarray(x), y=jnp.asarray(y),
                n=jnp.full((num_clients,), per_client, jnp.int32))
  ds = Dataset(name='bench', train_x=x[0], train_y=y[0], test_x=x[0], test_y=y[0], num_classes=10,
               mean=(0.5,) * ch, std=(0.25,) * ch)
  return fed, ds


def _memory(step, state, fed, key) -> Dict[str, float]:
  out = {'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
  try:
    ma = step.lower(state, fed, key).compile().memory_analysis()
    out['compiled_mb'] = (ma.argument_size_in_bytes + ma.output_size_in_bytes +
                          ma.temp_size_in_bytes - ma.alias_size_in_bytes) / 2**20
  except Exception:  # sequential variant (not one jitted function) or no analysis on this backend
    pass
  stats = jax.devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:
    out['device_peak_mb'] = stats['peak_bytes_in_use'] / 2**20
  return out


BASELINES = ('stepwise', 'sequential')


def time_variant(model: str, num_clients: int, variant: str) -> Dict[str, float]:
  strategy, chunk = {'stepwise': ('vmap', 1), 'sequential': ('vmap', 1), 'vmap': ('vmap', 1),
                     'map': ('map', 1),
                     'map10': ('map', 10), 'shard': ('shard', 1)}[variant]
  if strategy == 'shard' and num_clients % jax.device_count():
    return {'skipped': f'{num_clients} clients not divisible by {jax.device_count()} devices'}
  config = _config(model, num_clients, strategy, chunk)
  fed, ds = _data(_SETTINGS[model]['shape'], num_clients, _STEPS.value * _BATCH.value)
  algo = experiment.build_algorithm(config, ds)
  rcfg = experiment.round_config(config)
  if variant == 'stepwise':
    step = rd.make_stepwise_round_step(algo, rcfg, num_clients)
  elif variant == 'sequential':
    step = rd.make_sequential_round_step(algo, rcfg, num_clients)
  else:
    step = rd.make_round_step(algo, rcfg, num_clients)
  state = rd.init_state(algo, jax.random.PRNGKey(0), num_clients)
  root = jax.random.PRNGKey(1)
  t0 = time.perf_counter()
  state, m = step(state, fed, rng.round_key(root, 0))
  jax.block_until_ready(state)
  first = time.perf_counter() - t0
  times = []
  for r in range(_REPEATS.value):
    t0 = time.perf_counter()
    state, m = step(state, fed, rng.round_key(root, r + 1))
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t0)
    if times[-1] > _MAX_SECONDS.value:
      break
  sec = statistics.median(times)
  out = {'seconds_per_round': sec, 'first_call_seconds': first,
         'compile_seconds_est': max(first - sec, 0.0),
         'client_steps_per_second': num_clients * _STEPS.value / sec,
         'loss': float(m['loss'])}
  if variant not in BASELINES:
    out.update(_memory(step, state, fed, rng.round_key(root, 99)))
  else:
    out.update(_memory(None, None, None, None))
  return out


def run() -> List[Dict]:
  rows = []
  info = {'backend': jax.default_backend(), 'devices': [str(d) for d in jax.devices()],
          'default_strategy': strategies.default_strategy(), 'local_steps': _STEPS.value,
          'batch_size': _BATCH.value, 'augmentation': _AUGMENTATION.value,
          'jax': jax.__version__}
  print(json.dumps(info))
  for model in _MODELS.value:
    for num_clients in [int(c) for c in _CLIENTS.value]:
      results = {}
      for variant in _VARIANTS.value:
        results[variant] = time_variant(model, num_clients, variant)
        print(f'{model:10s} C={num_clients:4d} {variant:10s} {json.dumps(results[variant])}',
              flush=True)
        if results[variant].get('seconds_per_round', 0) > _MAX_SECONDS.value:
          break
      for baseline in BASELINES:
        base = results.get(baseline, {}).get('seconds_per_round')
        for r in results.values():
          if base and 'seconds_per_round' in r:
            r[f'speedup_vs_{baseline}'] = base / r['seconds_per_round']
      rows.append({'model': model, 'clients': num_clients, 'results': results})
      for baseline in BASELINES:
        summary = ', '.join(f'{v}: {r[f"speedup_vs_{baseline}"]:.2f}x' for v, r in results.items()
                            if f'speedup_vs_{baseline}' in r)
        if summary:
          print(f'==> {model} C={num_clients}: speed-up vs the {baseline} loop: {summary}',
                flush=True)
  return [info] + rows


def main(argv):
  del argv
  rows = run()
  with open(_OUT.value, 'w') as f:
    json.dump({'info': rows[0], 'rows': rows[1:]}, f, indent=2)
  print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  app.run(main)
