"""The round-speed settings (`byol`, `cross_device`): the stacked round step beside the per-client
loops and the eager-PyTorch references, on the same work, timed in one interleaved loop.

What each variant is and what a row reports: docs/notes/harness.md#benchmark.
"""
from __future__ import annotations

import functools
import gc
import json
import os
import resource
import statistics
import time
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments import baselines
from fedjax_ssl import experiment
from fedjax_ssl.algorithms import fedavg, ssl_client
from fedjax_ssl.core import compilation, rng, strategies
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import restore_client
from fedjax_ssl.data.types import DataInfo, Dataset, FedData

if TYPE_CHECKING:  # settings imports this module for its tables
  from experiments.benchmark.settings import Settings


# Native input of each benchmark model, and its heads (BYOL projector/predictor sized to the
# encoder).
MODELS = {
    'small_cnn': dict(shape=(28, 28, 1), heads='custom'),
    'resnet18': dict(shape=(32, 32, 3), heads='fedu2'),
    'cross_device_cnn': dict(shape=(32, 32, 3), heads='custom'),
}

# The cross-device setting's defaults (settings.make: an explicitly given value wins).
CROSS_DEVICE_DEFAULTS = dict(models=['cross_device_cnn'], clients=['1000', '10000'], local_steps=5,
                             batch_size=10, augmentations=['none'], participants=50,
                             variants=['stepwise', 'sequential', 'vmap', 'map', 'vmap_dropout'])


MODEL_COMPUTE = 'flip'  # the preset whose rows compare with eager PyTorch


def participants(s: Settings, num_clients: int) -> int:
  """m of a setting with `num_clients` clients: --participants (capped at C), 0 = every client."""
  return min(s.participants, num_clients) if s.participants else num_clients


def _config(s: Settings, model: str, num_clients: int, strategy: str, chunk: int,
            augmentation: str, precision: str = 'float32'):
  """The experiment config of one variant's round (the setting's algorithm, model and knobs)."""
  c = experiment.default_config()
  c.encoder = model
  c.precision = precision
  c.heads = MODELS[model]['heads']
  c.num_clients = num_clients
  c.clients_per_round = participants(s, num_clients)
  c.local_epochs = 1
  c.batch_size = s.batch_size
  c.lr = 0.05
  c.strategy = strategy
  c.map_chunk_size = chunk
  c.augmentation = augmentation
  c.conv_impl = s.conv_impl
  if s.setting == 'cross_device':
    c.algorithm, c.ssl_method = 'fedavg', 'supervised'
    c.optimizer, c.momentum, c.weight_decay = 'sgd', 0.0, 0.0
    c.lr, c.lr_schedule = 0.1, 'constant'
  return c


def synthetic_images(key: jax.Array, shape: Tuple[int, ...], chunk: int = 256) -> jax.Array:
  """Uniform random uint8 array of `shape`, generated on the device `chunk` rows (clients) at a
  time into one donated buffer, so that the peak memory is the data plus one chunk (no host copy
  and no second device copy of 1.5 GB at 10,000 CIFAR-shaped clients)."""
  @functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
  def fill(buf, start, k, rows):
    block = jax.random.bits(k, (rows,) + tuple(shape[1:]), jnp.uint8)
    return jax.lax.dynamic_update_slice_in_dim(buf, block, start, 0)

  buf = jnp.zeros(shape, jnp.uint8)
  for i, start in enumerate(range(0, shape[0], chunk)):
    buf = fill(buf, start, jax.random.fold_in(key, i), min(chunk, shape[0] - start))
  return buf


@functools.lru_cache(maxsize=1)
def _data(shape, num_clients: int, per_client: int):
  """Synthetic data: the timing does not depend on pixel values. One copy on the device, shared by
  the variants of a setting."""
  h, w, ch = shape
  rows = num_clients * per_client
  x = synthetic_images(jax.random.PRNGKey(0), (rows, h, w, ch))
  y = jax.random.randint(jax.random.PRNGKey(1), (rows,), 0, 10, jnp.int32)
  fed = FedData(x=x, y=y, n=jnp.full((num_clients,), per_client, jnp.int32),
                offsets=jnp.arange(num_clients, dtype=jnp.int32) * per_client, n_max=per_client,
                n_min=per_client)
  x0, y0 = np.asarray(x[:per_client]), np.asarray(y[:per_client])
  ds = Dataset(name='bench', train_x=x0, train_y=y0, test_x=x0, test_y=y0, num_classes=10,
               mean=(0.5,) * ch, std=(0.25,) * ch)
  return fed, ds


def _compiled_mb(step, state, fed, key) -> Dict[str, float]:
  """XLA's compiled-buffer estimate of a jitted round step (arguments + outputs + temporaries)."""
  try:
    ma = step.lower(state, fed, key).compile().memory_analysis()
    return {'compiled_mb': (ma.argument_size_in_bytes + ma.output_size_in_bytes +
                            ma.temp_size_in_bytes - ma.alias_size_in_bytes) / 2**20}
  except Exception:  # no memory analysis on this backend
    return {}


BASELINES = ('stepwise', 'sequential')
VARIANT_STRATEGY = {'stepwise': ('vmap', 1), 'sequential': ('vmap', 1), 'vmap': ('vmap', 1),
                     'map': ('map', 1), 'map2': ('map', 2), 'map5': ('map', 5),
                     'map10': ('map', 10), 'shard': ('shard', 1), 'map_whole_state': ('map', 1),
                     'vmap_dropout': ('vmap', 1)}
# The `vmap_dropout` variant: the vmap round with each participant's upload lost at this rate
# (config.dropout_rate, core/faults.py), the cross-device simulators' dropout knob.
DROPOUT_RATE = 0.1
# The eager-PyTorch references (experiments/torch_round.py), timed beside the 'flip' rows of the
# models torch_round has: the official codes' per-client loop at PyTorch's fastest float32 (TF32 on
# a GPU) and with bf16 autocast, and ONE model on the union batch C x B (bf16, channels_last; and
# float32), the bound for stacking.
TORCH_VARIANTS = {
    'torch': dict(mode='loop', precision='float32'),
    'torch_bf16': dict(mode='loop', precision='bfloat16'),
    'torch_union': dict(mode='union', precision='bfloat16', channels_last=True),
    'torch_union_fp32': dict(mode='union', precision='float32', channels_last=True),
}
EAGER_LOOPS = ('torch', 'torch_bf16')


def current_rss_mb() -> float:
  """The process's resident memory now (after the timed rounds): the steady state of a run, which
  the peak exceeds by the transients (compilation, the host copy of the synthetic data)."""
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmRSS:'):
        return int(line.split()[1]) / 1024
  return float('nan')


def tree_mb(tree) -> float:
  """MB of every array leaf of `tree`."""
  return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree)) / 2**20


def torch_available() -> bool:
  try:
    import torch  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


def flops_per_client_step(s: Settings, model: str, augmentation: str) -> float:
  """XLA:CPU's flop count of one jitted local step (batch B, augmentation included) of the
  benchmark, on any backend (`core.compilation.xla_flops`: XLA:GPU does not count cuDNN's
  convolutions)."""
  config = _config(s, model, 1, 'vmap', 1, augmentation)
  fed, ds = _data(MODELS[model]['shape'], 1, s.batch_size)
  algo = experiment.build_algorithm(config, ds)
  state = rd.init_state(algo, jax.random.PRNGKey(0), 1)
  msg = algo.broadcast(state.server)
  client = restore_client(algo, jax.tree_util.tree_map(lambda a: a[0], state.clients), msg)
  batch = {'x': fed.x[:s.batch_size], 'y': fed.y[:s.batch_size]}
  return compilation.xla_flops(algo.local_step, client, batch, jax.random.PRNGKey(0), msg,
                        jnp.float32(0.05))


def prepare_variant(s: Settings, model: str, num_clients: int, variant: str, augmentation: str,
                    precision: str = 'float32') -> Dict[str, Any]:
  """Builds a variant and runs its first (compiling) round; {'skipped': why} if it cannot run.

  Returns a dict whose 'run'(r) runs (and waits for) timed round r."""
  if variant in TORCH_VARIANTS:
    from experiments import torch_round  # pylint: disable=g-import-not-at-top
    one_round = torch_round.build_round(participants(s, num_clients), s.local_steps,
                                        s.batch_size, model=model, **TORCH_VARIANTS[variant])
    t0 = time.perf_counter()
    loss = one_round()
    p = dict(times=[], first=time.perf_counter() - t0, loss=loss)
    p['run'] = lambda r: p.update(loss=one_round())
    return p
  strategy, chunk = VARIANT_STRATEGY[variant]
  if strategy == 'shard' and num_clients % jax.device_count():
    return {'skipped': f'{num_clients} clients not divisible by {jax.device_count()} devices'}
  config = _config(s, model, num_clients, strategy, chunk, augmentation, precision)
  fed, ds = _data(MODELS[model]['shape'], num_clients, s.local_steps * s.batch_size)
  algo = experiment.build_algorithm(config, ds)
  if variant == 'vmap_dropout':
    config.dropout_rate = DROPOUT_RATE
  rcfg = experiment.round_config(config)
  if variant == 'map_whole_state':
    # The stateful twin: every client's whole state stored, as before stateless clients.
    algo = fedavg.make(ssl_client.spec_from_config(config, DataInfo.of(ds)), stateless=False)
  if variant == 'stepwise':
    step = baselines.make_stepwise_round_step(algo, rcfg, num_clients)
  elif variant == 'sequential':
    step = baselines.make_sequential_round_step(algo, rcfg, num_clients)
  else:
    step = rd.make_round_step(algo, rcfg, num_clients)
  p = dict(step=step, state=rd.init_state(algo, jax.random.PRNGKey(0), num_clients), fed=fed,
           root=jax.random.PRNGKey(1), times=[])

  def run(r):
    p['state'], p['metrics'] = step(p['state'], fed, rng.round_key(p['root'], r))
    jax.block_until_ready(p['state'])
  t0 = time.perf_counter()
  with compilation.compile_timer() as times:
    run(0)
  p.update(run=run, first=time.perf_counter() - t0, compile=times.to_json())
  return p


def _time_round(p: Dict[str, Any], r: int) -> None:
  t0 = time.perf_counter()
  p['run'](r)
  p['times'].append(time.perf_counter() - t0)


def _summary(s: Settings, p: Dict[str, Any], variant: str, num_clients: int,
             flops_per_step: float, precision: str = 'float32') -> Dict[str, Any]:
  """Timing record of a prepared and timed variant."""
  if 'skipped' in p:
    return p
  sec = statistics.median(p['times'])
  steps = participants(s, num_clients) * s.local_steps
  out = {'seconds_per_round': sec, 'rounds_timed': len(p['times']),
         'first_call_seconds': p['first'], 'compile_seconds_est': max(p['first'] - sec, 0.0),
         **({'compile': p['compile']} if 'compile' in p else {}),
         'client_steps_per_second': steps / sec, 'gflops': flops_per_step * steps / sec / 1e9,
         'precision': precision}
  peak = peak_tflops(s, precision)
  if peak:
    out['mfu'] = out['gflops'] / (1e3 * peak)
  if variant in TORCH_VARIANTS:
    out.update(loss=p['loss'], precision=TORCH_VARIANTS[variant]['precision'])
    return out
  out['loss'] = float(p['metrics']['loss'])
  if 'dropped_clients' in p['metrics']:  # of the last timed round
    out['dropped_clients'] = float(p['metrics']['dropped_clients'])
  # What the run keeps between rounds: the server and the per-client stored states (none for
  # stateless clients); the data is counted apart, in the row.
  out['state_mb'] = tree_mb(p['state'])
  out['client_state_mb'] = tree_mb(p['state'].clients)
  if variant not in BASELINES:
    out.update(_compiled_mb(p['step'], p['state'], p['fed'], rng.round_key(p['root'], 99)))
  return out


def time_setting(s: Settings, model: str, num_clients: int, variants: List[str],
                 augmentation: str) -> Dict[str, Dict]:
  """Times every variant on the same work. With --interleave (default) all variants are prepared
  first and their timed rounds interleaved (round r of every variant, then round r + 1), so drift in
  the machine's speed (shared or throttled CPUs) hits all variants alike and the ratios stay
  meaningful; otherwise one variant at a time, each freed before the next."""
  jobs = variant_precisions(s, variants)
  # The model's work, counted once in float32 for every precision: a bf16 program's own count
  # also counts its casts, which are no model FLOPs (docs/notes/performance.md#perf-63).
  flops = flops_per_client_step(s, model, augmentation)
  if not s.interleave:
    results = {}
    for name, v, q in jobs:
      p = prepare_variant(s, model, num_clients, v, augmentation, q)
      if 'skipped' not in p:
        for r in range(1, s.repeats + 1):
          _time_round(p, r)
          if p['times'][-1] > s.max_variant_seconds:
            break
      results[name] = _summary(s, p, v, num_clients, flops, q)
      _maybe_profile(s, p, name, v, f'{model}_{augmentation}_c{num_clients}', results[name])
      del p  # this variant's state and executables go before the next one is built
      gc.collect()
    return results
  prepared = {}
  for name, v, q in jobs:
    prepared[name] = prepare_variant(s, model, num_clients, v, augmentation, q)
    p = prepared[name]
    print(f'prepared {model} C={num_clients} {name}: ' + (
        f'skipped ({p["skipped"]})' if 'skipped' in p else
        f'first round {p["first"]:.1f} s' + (f', {p["compile"]["compile_seconds"]:.1f} s '
                                             'compiling' if 'compile' in p else '')), flush=True)
  live = [name for name, _, _ in jobs if 'skipped' not in prepared[name]]
  for r in range(s.repeats):
    for name in list(live):
      _time_round(prepared[name], r + 1)
      if prepared[name]['times'][-1] > s.max_variant_seconds:
        live.remove(name)
  results = {name: _summary(s, prepared[name], v, num_clients, flops, q) for name, v, q in jobs}
  for name, v, _ in jobs:
    _maybe_profile(s, prepared[name], name, v, f'{model}_{augmentation}_c{num_clients}',
                   results[name])
  return results


def _maybe_profile(s: Settings, p: Dict[str, Any], name: str, variant: str, setting: str,
                   record: Dict[str, Any]) -> None:
  """With --profile_dir: one more round of a prepared JAX variant under jax.profiler, its device
  time summary in record['profile'] (experiments/profile_summary.py) and printed."""
  wanted = s.profile_variants or None
  if (not s.profile_dir or 'skipped' in p or variant in TORCH_VARIANTS or
      (wanted and name not in wanted)):
    return
  from experiments import profile_summary  # pylint: disable=g-import-not-at-top
  log_dir = os.path.join(s.profile_dir, f'{setting}_{name.replace("/", "_")}')
  path = profile_summary.trace(lambda: p['run'](s.repeats + 1), log_dir)
  record['profile'] = dict(profile_summary.summarize(path), trace=path)
  print(f'--- profile of {setting} {name} ({path}):\n' +
        profile_summary.format_summary(record['profile']), flush=True)


def variant_precisions(s: Settings, variants: List[str]) -> List[Tuple[str, str, str]]:
  """(reported name, variant, precision) of every timed job: each variant at each of --precisions,
  named '<variant>' at float32 and '<variant>/<precision>' otherwise; a --variants entry
  '<variant>/<precision>' at that precision only; the PyTorch variants once, under their own name
  whatever --precisions is (their precision is their own, and `targets` looks them up by name)."""
  jobs = []
  for q in s.precisions:
    for v in variants:
      if '/' in v:  # '<variant>/<precision>': that precision only
        if q == s.precisions[0]:
          jobs.append((v, *v.split('/')))
      elif v in TORCH_VARIANTS:
        if q == s.precisions[0]:
          jobs.append((v, v, q))
      else:
        jobs.append((v if q == 'float32' else f'{v}/{q}', v, q))
  return jobs


def peak_tflops(s: Settings, precision: str) -> float:
  """--peak_tflops for `precision` (0 = not given: no mfu)."""
  peaks = [float(p) for p in s.peak_tflops]
  if not peaks:
    return 0.0
  return peaks[0] if len(peaks) == 1 else peaks[list(s.precisions).index(precision)]


def setting_variants(s: Settings, model: str, augmentation: str) -> List[str]:
  """--variants, plus --torch_variants for the model-compute rows of the models
  experiments/torch_round.py has, when torch is importable."""
  from experiments import torch_round  # pylint: disable=g-import-not-at-top
  variants = list(s.variants)
  if (s.torch and model in torch_round.MODELS and augmentation == MODEL_COMPUTE and
      torch_available()):
    variants += list(s.torch_variants)
  return variants


def targets(results: Dict[str, Dict]) -> Dict[str, Any]:
  """Issue 46's ratios of a row: the fastest JAX variant (any precision) against the faster
  eager-PyTorch loop (target >= 10x) and against one PyTorch model on the union batch (target:
  our time <= 1.0x its time); {} without the references."""
  def sec(name):
    return results.get(name, {}).get('seconds_per_round')
  ours = {n: r['seconds_per_round'] for n, r in results.items()
          if 'seconds_per_round' in r and n.split('/')[0] not in tuple(TORCH_VARIANTS) + BASELINES}
  if not ours:
    return {}
  best = min(ours, key=ours.get)
  out: Dict[str, Any] = {'fastest_jax': best, 'fastest_jax_seconds': ours[best]}
  loops = [n for n in EAGER_LOOPS if sec(n)]
  if loops:
    loop = min(loops, key=sec)
    out.update(faster_eager_loop=loop, speedup_vs_faster_eager_loop=sec(loop) / ours[best],
               target_speedup_vs_eager_loop=10.0)
    out['meets_eager_target'] = out['speedup_vs_faster_eager_loop'] >= 10.0
  if sec('torch_union'):
    out.update(time_vs_union_batch=ours[best] / sec('torch_union'), target_time_vs_union_batch=1.0)
    out['meets_union_target'] = out['time_vs_union_batch'] <= 1.0
  return out


def run(s: Settings) -> List[Dict]:
  """The `byol` and `cross_device` settings: the info row, then one row per (model, augmentation,
  client count) with every variant's timing record, the speed-ups and the `targets`."""
  rows = []
  info = {'backend': jax.default_backend(), 'devices': [str(d) for d in jax.devices()],
          'setting': s.setting, 'participants': s.participants,
          'cpu_affinity': sorted(os.sched_getaffinity(0)),
          'default_strategy': strategies.default_strategy(), 'local_steps': s.local_steps,
          'batch_size': s.batch_size, 'augmentations': list(s.augmentations),
          'jax': jax.__version__, 'malloc': os.environ.get('FEDJAX_SSL_MALLOC'),
          'conv_impl': s.conv_impl, 'xla_flags': os.environ.get('XLA_FLAGS', '')}
  if torch_available():
    import torch  # pylint: disable=g-import-not-at-top
    info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
  print(json.dumps(info))
  comparisons = BASELINES + tuple(TORCH_VARIANTS)
  for model in s.models:
    for augmentation in s.augmentations:
      for num_clients in [int(c) for c in s.clients]:
        variants = setting_variants(s, model, augmentation)
        results = time_setting(s, model, num_clients, variants, augmentation)
        for variant, r in results.items():
          print(f'{model:10s} {augmentation:11s} C={num_clients:4d} {variant:10s} {json.dumps(r)}',
                flush=True)
        for baseline in comparisons:
          base = results.get(baseline, {}).get('seconds_per_round')
          for r in results.values():
            if base and 'seconds_per_round' in r:
              r[f'speedup_vs_{baseline}'] = base / r['seconds_per_round']
        for name, r in results.items():  # '<variant>/<precision>' against '<variant>' (float32)
          base = results.get(name.split('/')[0], {}).get('seconds_per_round')
          if '/' in name and base and 'seconds_per_round' in r:
            r['speedup_vs_float32'] = base / r['seconds_per_round']
        fed, _ = _data(MODELS[model]['shape'], num_clients, s.local_steps * s.batch_size)
        row = {'model': model, 'augmentation': augmentation, 'clients': num_clients,
               'participants': participants(s, num_clients), 'results': results,
               'data_mb': tree_mb(fed),
               'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               'rss_mb': current_rss_mb()}
        row['targets'] = targets(results)
        stats = jax.devices()[0].memory_stats() or {}
        if 'peak_bytes_in_use' in stats:  # accelerators; cumulative over the process
          row['device_peak_mb'] = stats['peak_bytes_in_use'] / 2**20
        rows.append(row)
        for baseline in comparisons:
          summary = ', '.join(f'{v}: {r[f"speedup_vs_{baseline}"]:.2f}x'
                              for v, r in results.items() if f'speedup_vs_{baseline}' in r)
          if summary:
            print(f'==> {model} {augmentation} C={num_clients}: speed-up vs {baseline}: {summary}',
                  flush=True)
        t = row['targets']
        if 'speedup_vs_faster_eager_loop' in t:
          print(f'==> {model} {augmentation} C={num_clients}: targets: fastest ours '
                f'{t["fastest_jax"]} {t["fastest_jax_seconds"]:.4f} s = '
                f'{t["speedup_vs_faster_eager_loop"]:.2f}x the faster eager loop '
                f'({t["faster_eager_loop"]}; target >= 10x)' +
                (f', {t["time_vs_union_batch"]:.2f}x the union-batch model\'s time (target <= 1.0x)'
                 if 'time_vs_union_batch' in t else ''), flush=True)
        print(f'==> {model} {augmentation} C={num_clients}: GFLOP/s: ' + ', '.join(
            f'{v}: {r["gflops"]:.1f}' for v, r in results.items() if 'gflops' in r), flush=True)
        if s.peak_tflops:
          print(f'==> {model} {augmentation} C={num_clients}: MFU: ' + ', '.join(
              f'{v}: {100 * r["mfu"]:.2f}%' for v, r in results.items() if 'mfu' in r), flush=True)
  return [info] + rows


