r"""Stacked round step vs a sequential per-client loop, on the same work, in one process.

  python -m experiments.benchmark --out results.json
  python -m experiments.benchmark --out results.json --models=small_cnn --clients=10,100
  python -m experiments.benchmark --setting=cross_device --clients=1000 --out cd1000.json
  python -m experiments.benchmark --setting=conv_layers --out conv_layers.json

Settings (--setting):
  * `byol` (default): a FedBYOL round, every client participating, SGD with momentum; the models,
    augmentations and client counts of the flags below.
  * `cross_device`: the standard cross-device round of the FL-simulator literature. Supervised
    FedAvg of `cross_device_cnn` (conv3x3 32 -> pool -> conv3x3 64 -> pool -> dense 128 -> dense 10,
    545,098 parameters) on synthetic CIFAR-10-shaped data, 50 examples per client, --participants
    (default 50) sampled per round from --clients (default 1000,10000), 1 local epoch of batch 10,
    plain SGD at lr 0.1 (no momentum, no weight decay), no augmentation: 250 local steps and 87.5
    GFLOP per round. Clients are stateless (nothing is stored per client), so memory is the data
    plus the server and the round's participants; each row reports the process's peak RSS (run one
    client count per process to read it per count). Variant `map_whole_state` is the same round
    with every client's whole state stored (FedAvg's stateful twin, what the engine did before
    stateless clients), for the memory comparison; run it in a process of its own. Variant
    `vmap_dropout` is the vmap round with each participant's upload lost with probability 0.1
    (config.dropout_rate, core/faults.py): what simulating dropouts costs (its row counts the last
    timed round's drops).
  * `scale`: skewed federations. Fashion-MNIST (the full training split) over --clients (default
    10,100,1000), IID and Dirichlet alpha = 0.1, 10 participants per round, FedEMA-BYOL (real
    per-client state) on small_cnn, batch 32, one local epoch, strategy vmap. Variants: `vmap_before`
    (vmap_shrink = 0: every participant runs the longest one's steps, the engine before phases),
    `vmap` (the default phases) and `vmap_host` (client_state = 'host'). Reported per row: the data's
    device MB against the real rows' and the padded layout's; per variant the median over --repeats
    rounds (default 5) of seconds per round and of milliseconds per real local step (round time /
    the participants' real steps), MB resident on the device between rounds (data + the state's
    device arrays) and XLA's buffer estimate of the round's device program. Needs the Fashion-MNIST
    IDX files (config.dataset = 'fashion_mnist'). Dirichlet alpha = 0.1 cannot give each of 1000
    clients an example (no draw in 1000 succeeds): --alpha=0.5 there.

  python -m experiments.benchmark --setting=scale --clients=100 --out scale100.json
  python -m experiments.benchmark --setting=scale --clients=1000 --alpha=0.5 --out scale1000.json

  * `conv_layers`: each convolution layer of the CPU benchmark models (cross_device_cnn at batch 10,
    small_cnn at batch 128), forward and both gradients inside a `lax.scan`, under the candidate
    implementations of experiments/conv_layers.py (--variants; default all, `pallas` only on a GPU),
    beside the layer's three GEMMs alone on cache-warm operands; GFLOP/s and the ratio to the GEMMs
    per layer, and the implementation conv_impl='auto' picks on this backend. --repeats timed scans
    per variant.

For every (model, augmentation, client count) the same FedBYOL round (E local steps of batch B per
client, SGD with momentum) runs
  * `stepwise`: the FedJAX `for_each_client` (jit backend) way, which is also how the official
    PyTorch codes run: Python loops over clients and over local steps, each batch gathered on the
    host, one jitted step call per batch;
  * `sequential`: the strongest per-client loop: one jitted call per client that runs its whole local
    training as a loop, then a jitted aggregation;
  * the stacked `round_step` under each execution strategy (vmap; map with chunk 1, 2, 5, 10: that
    many clients vmapped inside a lax.map; shard);
  * the PyTorch references (--torch_variants; experiments/torch_round.py), with the model-compute
    preset on small_cnn and resnet18, when torch is importable, timed in the same interleaved loop:
    `torch` and `torch_bf16`, the official codes' eager per-client loop (TF32 on a GPU; bf16
    autocast), and `torch_union` / `torch_union_fp32`, ONE model trained on the union batch C x B
    for the same steps (channels_last; bf16 autocast / float32), the bound that stacking should
    approach. Each row's `targets` holds issue 46's ratios: our fastest variant (any precision)
    against the faster eager loop (>= 10x) and against `torch_union` (time <= 1.0x).
A --variants entry '<variant>/<precision>' times that variant at that precision only. --profile_dir
traces one more round of the JAX variants under jax.profiler and adds the device-time summary of
experiments/profile_summary.py (busy time, gaps, kernels by class) to their records. --cache_dir
points JAX's persistent compilation cache at a folder: a second benchmark process with the same
folder shows in its `compile` records (trace, lowering, XLA, cache hits) what a second run pays.
Augmentations (--augmentations): `byol_easyfl` (on-device SimCLR-style augmentation, the papers'
setting) and `flip` = model compute: the views differ only by a random horizontal flip, as PyTorch's
two pre-made tensors differ. Not 'none': with identical views XLA computes the model once for both
views (docs/notes/performance.md#scan-vs-step), half the work PyTorch does.
With --precisions=float32,bfloat16 every JAX variant is also timed at config.precision = bfloat16
(docs/notes/engine.md#eng-58), reported as '<variant>/bfloat16' beside the float32 '<variant>', in the
same interleaved loop, with `speedup_vs_float32` (its float32 twin's time / its time; the other
speed-ups are against the float32 loops); GFLOP/s count the same model FLOPs at every precision
(XLA's count of the float32 step). --peak_tflops adds `mfu` = achieved
FLOP/s / peak per variant: one value for every precision or one per --precisions entry, e.g. on an
H100 SXM `--precisions=float32,bfloat16 --peak_tflops=67,989` (dense peaks: ~67 TFLOP/s float32
without tensor cores, ~989 bf16 on tensor cores; XLA's default precision may run float32 matmuls as
TF32, ~495 dense, which bounds float32 better than 67). Unset, no `mfu` is reported.
All JAX variants compute the same numbers (tests/core/test_round_equivalence.py). Every variant first runs
one warm-up round; then the timed rounds are interleaved across variants (round r of each variant,
then round r + 1), so a drift in machine speed hits all alike. Reported: seconds per round (median of
--repeats), client-steps per second, achieved GFLOP/s (XLA's flop count of one jitted local step
times the round's steps), the ratios to the stepwise and sequential loops and to PyTorch, compile
time, XLA's compiled-buffer estimate per stacked variant and the process's peak RSS per setting. All
variants of a setting are resident at once; `--nointerleave` times them one at a time instead, for
settings that do not fit in memory together (ResNet-18 on a 24 GB CPU box).
"""
from __future__ import annotations

import functools
import gc
import json
import os
import resource
import statistics
import time
from typing import Any, Dict, List, Tuple

from absl import flags

# First thing, before anything runs on JAX: glibc's malloc keeps freed memory from here on, so that
# repeated XLA:CPU executions reuse their temporaries instead of page-faulting fresh ones every call
# (fedjax_ssl/core/host_memory.py; FEDJAX_SSL_MALLOC=system keeps glibc's defaults). mallopt governs
# later allocations only; importing jax (which fedjax_ssl.core does) creates none of XLA's buffers.
# Only as a program: importing this module (tests) changes nothing.
from fedjax_ssl.core import host_memory

if __name__ == '__main__':
  host_memory.keep_freed_memory()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import conv_layers  # noqa: E402
from fedjax_ssl import config_validation as cv  # noqa: E402
from fedjax_ssl import experiment  # noqa: E402
from fedjax_ssl import models  # noqa: E402
from fedjax_ssl.algorithms import fedavg, ssl_client  # noqa: E402
from fedjax_ssl.core.algorithm import restore_client  # noqa: E402
from experiments import baselines  # noqa: E402
from fedjax_ssl.core import compilation, conv_choice, rng, strategies  # noqa: E402
from fedjax_ssl.data import augment, partition  # noqa: E402
from fedjax_ssl.data.types import DataInfo  # noqa: E402
from fedjax_ssl.core import round as rd  # noqa: E402
from fedjax_ssl.data.types import Dataset, FedData  # noqa: E402

FLAGS = flags.FLAGS


# Native input of each benchmark model, and its heads: BYOL projector/predictor sized to the encoder.
_SETTINGS = {
    'small_cnn': dict(shape=(28, 28, 1), heads='custom'),
    'resnet18': dict(shape=(32, 32, 3), heads='fedu2'),
    'cross_device_cnn': dict(shape=(32, 32, 3), heads='custom'),
}

# Flag defaults of the cross-device setting (an explicitly given flag wins).
CROSS_DEVICE_DEFAULTS = dict(models=['cross_device_cnn'], clients=['1000', '10000'], local_steps=5,
                             batch_size=10, augmentations=['none'], participants=50,
                             variants=['stepwise', 'sequential', 'vmap', 'map', 'vmap_dropout'])


MODEL_COMPUTE = 'flip'  # the preset whose rows compare with eager PyTorch


def participants(num_clients: int) -> int:
  """m of a setting with `num_clients` clients: --participants (capped at C), 0 = every client."""
  return min(FLAGS.participants, num_clients) if FLAGS.participants else num_clients


def _config(model: str, num_clients: int, strategy: str, chunk: int, augmentation: str,
            precision: str = 'float32'):
  c = experiment.default_config()
  c.encoder = model
  c.precision = precision
  c.heads = _SETTINGS[model]['heads']
  c.num_clients = num_clients
  c.clients_per_round = participants(num_clients)
  c.local_epochs = 1
  c.batch_size = FLAGS.batch_size
  c.lr = 0.05
  c.strategy = strategy
  c.map_chunk_size = chunk
  c.augmentation = augmentation
  c.conv_impl = FLAGS.conv_impl
  if FLAGS.setting == 'cross_device':
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
_VARIANT_STRATEGY = {'stepwise': ('vmap', 1), 'sequential': ('vmap', 1), 'vmap': ('vmap', 1),
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


def _tree_mb(tree) -> float:
  return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree)) / 2**20


def torch_available() -> bool:
  try:
    import torch  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


def flops_per_client_step(model: str, augmentation: str) -> float:
  """XLA:CPU's flop count of one jitted local step (batch B, augmentation included) of the
  benchmark, on any backend (`core.compilation.xla_flops`: XLA:GPU does not count cuDNN's convolutions)."""
  config = _config(model, 1, 'vmap', 1, augmentation)
  fed, ds = _data(_SETTINGS[model]['shape'], 1, FLAGS.batch_size)
  algo = experiment.build_algorithm(config, ds)
  state = rd.init_state(algo, jax.random.PRNGKey(0), 1)
  msg = algo.broadcast(state.server)
  client = restore_client(algo, jax.tree_util.tree_map(lambda a: a[0], state.clients), msg)
  batch = {'x': fed.x[:FLAGS.batch_size], 'y': fed.y[:FLAGS.batch_size]}
  return compilation.xla_flops(algo.local_step, client, batch, jax.random.PRNGKey(0), msg,
                        jnp.float32(0.05))


def prepare_variant(model: str, num_clients: int, variant: str, augmentation: str,
                    precision: str = 'float32') -> Dict[str, Any]:
  """Builds a variant and runs its first (compiling) round; {'skipped': why} if it cannot run.

  Returns a dict whose 'run'(r) runs (and waits for) timed round r."""
  if variant in TORCH_VARIANTS:
    from experiments import torch_round  # pylint: disable=g-import-not-at-top
    one_round = torch_round.build_round(participants(num_clients), FLAGS.local_steps,
                                        FLAGS.batch_size, model=model, **TORCH_VARIANTS[variant])
    t0 = time.perf_counter()
    loss = one_round()
    p = dict(times=[], first=time.perf_counter() - t0, loss=loss)
    p['run'] = lambda r: p.update(loss=one_round())
    return p
  strategy, chunk = _VARIANT_STRATEGY[variant]
  if strategy == 'shard' and num_clients % jax.device_count():
    return {'skipped': f'{num_clients} clients not divisible by {jax.device_count()} devices'}
  config = _config(model, num_clients, strategy, chunk, augmentation, precision)
  fed, ds = _data(_SETTINGS[model]['shape'], num_clients, FLAGS.local_steps * FLAGS.batch_size)
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


def _summary(p: Dict[str, Any], variant: str, num_clients: int, flops_per_step: float,
             precision: str = 'float32') -> Dict[str, Any]:
  """Timing record of a prepared and timed variant."""
  if 'skipped' in p:
    return p
  sec = statistics.median(p['times'])
  steps = participants(num_clients) * FLAGS.local_steps
  out = {'seconds_per_round': sec, 'rounds_timed': len(p['times']),
         'first_call_seconds': p['first'], 'compile_seconds_est': max(p['first'] - sec, 0.0),
         **({'compile': p['compile']} if 'compile' in p else {}),
         'client_steps_per_second': steps / sec, 'gflops': flops_per_step * steps / sec / 1e9,
         'precision': precision}
  peak = peak_tflops(precision)
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
  out['state_mb'] = _tree_mb(p['state'])
  out['client_state_mb'] = _tree_mb(p['state'].clients)
  if variant not in BASELINES:
    out.update(_compiled_mb(p['step'], p['state'], p['fed'], rng.round_key(p['root'], 99)))
  return out


def time_setting(model: str, num_clients: int, variants: List[str], augmentation: str
                 ) -> Dict[str, Dict]:
  """Times every variant on the same work. With --interleave (default) all variants are prepared
  first and their timed rounds interleaved (round r of every variant, then round r + 1), so drift in
  the machine's speed (shared or throttled CPUs) hits all variants alike and the ratios stay
  meaningful; otherwise one variant at a time, each freed before the next."""
  jobs = variant_precisions(variants)
  # The model's work, counted once in float32 for every precision: a bf16 program's own count
  # also counts its casts (~10 % more on small_cnn), which are no model FLOPs.
  flops = flops_per_client_step(model, augmentation)
  if not FLAGS.interleave:
    results = {}
    for name, v, q in jobs:
      p = prepare_variant(model, num_clients, v, augmentation, q)
      if 'skipped' not in p:
        for r in range(1, FLAGS.repeats + 1):
          _time_round(p, r)
          if p['times'][-1] > FLAGS.max_variant_seconds:
            break
      results[name] = _summary(p, v, num_clients, flops, q)
      _maybe_profile(p, name, v, f'{model}_{augmentation}_c{num_clients}', results[name])
      del p  # this variant's state and executables go before the next one is built
      gc.collect()
    return results
  prepared = {}
  for name, v, q in jobs:
    prepared[name] = prepare_variant(model, num_clients, v, augmentation, q)
    p = prepared[name]
    print(f'prepared {model} C={num_clients} {name}: ' + (
        f'skipped ({p["skipped"]})' if 'skipped' in p else
        f'first round {p["first"]:.1f} s' + (f', {p["compile"]["compile_seconds"]:.1f} s '
                                             'compiling' if 'compile' in p else '')), flush=True)
  live = [name for name, _, _ in jobs if 'skipped' not in prepared[name]]
  for r in range(FLAGS.repeats):
    for name in list(live):
      _time_round(prepared[name], r + 1)
      if prepared[name]['times'][-1] > FLAGS.max_variant_seconds:
        live.remove(name)
  results = {name: _summary(prepared[name], v, num_clients, flops, q) for name, v, q in jobs}
  for name, v, _ in jobs:
    _maybe_profile(prepared[name], name, v, f'{model}_{augmentation}_c{num_clients}',
                   results[name])
  return results


def _maybe_profile(p: Dict[str, Any], name: str, variant: str, setting: str,
                   record: Dict[str, Any]) -> None:
  """With --profile_dir: one more round of a prepared JAX variant under jax.profiler, its device
  time summary in record['profile'] (experiments/profile_summary.py) and printed."""
  wanted = FLAGS.profile_variants or None
  if (not FLAGS.profile_dir or 'skipped' in p or variant in TORCH_VARIANTS or
      (wanted and name not in wanted)):
    return
  from experiments import profile_summary  # pylint: disable=g-import-not-at-top
  log_dir = os.path.join(FLAGS.profile_dir, f'{setting}_{name.replace("/", "_")}')
  path = profile_summary.trace(lambda: p['run'](FLAGS.repeats + 1), log_dir)
  record['profile'] = dict(profile_summary.summarize(path), trace=path)
  print(f'--- profile of {setting} {name} ({path}):\n' +
        profile_summary.format_summary(record['profile']), flush=True)


def variant_precisions(variants: List[str]) -> List[Tuple[str, str, str]]:
  """(reported name, variant, precision) of every timed job: each variant at each of --precisions,
  named '<variant>' at float32 and '<variant>/<precision>' otherwise; a --variants entry
  '<variant>/<precision>' at that precision only; the PyTorch variants once, under their own name
  whatever --precisions is (their precision is their own, and `targets` looks them up by name)."""
  jobs = []
  for q in FLAGS.precisions:
    for v in variants:
      if '/' in v:  # '<variant>/<precision>': that precision only
        if q == FLAGS.precisions[0]:
          jobs.append((v, *v.split('/')))
      elif v in TORCH_VARIANTS:
        if q == FLAGS.precisions[0]:
          jobs.append((v, v, q))
      else:
        jobs.append((v if q == 'float32' else f'{v}/{q}', v, q))
  return jobs


def peak_tflops(precision: str) -> float:
  """--peak_tflops for `precision` (0 = not given: no mfu)."""
  peaks = [float(p) for p in FLAGS.peak_tflops]
  if not peaks:
    return 0.0
  return peaks[0] if len(peaks) == 1 else peaks[list(FLAGS.precisions).index(precision)]


def setting_variants(model: str, augmentation: str) -> List[str]:
  """--variants, plus --torch_variants for the model-compute rows of the models
  experiments/torch_round.py has, when torch is importable."""
  from experiments import torch_round  # pylint: disable=g-import-not-at-top
  variants = list(FLAGS.variants)
  if (FLAGS.torch and model in torch_round.MODELS and augmentation == MODEL_COMPUTE and
      torch_available()):
    variants += list(FLAGS.torch_variants)
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


def run() -> List[Dict]:
  rows = []
  info = {'backend': jax.default_backend(), 'devices': [str(d) for d in jax.devices()],
          'setting': FLAGS.setting, 'participants': FLAGS.participants,
          'cpu_affinity': sorted(os.sched_getaffinity(0)),
          'default_strategy': strategies.default_strategy(), 'local_steps': FLAGS.local_steps,
          'batch_size': FLAGS.batch_size, 'augmentations': list(FLAGS.augmentations),
          'jax': jax.__version__, 'malloc': os.environ.get('FEDJAX_SSL_MALLOC'),
          'conv_impl': FLAGS.conv_impl, 'xla_flags': os.environ.get('XLA_FLAGS', '')}
  if torch_available():
    import torch  # pylint: disable=g-import-not-at-top
    info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
  print(json.dumps(info))
  comparisons = BASELINES + tuple(TORCH_VARIANTS)
  for model in FLAGS.models:
    for augmentation in FLAGS.augmentations:
      for num_clients in [int(c) for c in FLAGS.clients]:
        results = time_setting(model, num_clients, setting_variants(model, augmentation),
                               augmentation)
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
        fed, _ = _data(_SETTINGS[model]['shape'], num_clients, FLAGS.local_steps * FLAGS.batch_size)
        row = {'model': model, 'augmentation': augmentation, 'clients': num_clients,
               'participants': participants(num_clients), 'results': results,
               'data_mb': _tree_mb(fed),
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
        if FLAGS.peak_tflops:
          print(f'==> {model} {augmentation} C={num_clients}: MFU: ' + ', '.join(
              f'{v}: {100 * r["mfu"]:.2f}%' for v, r in results.items() if 'mfu' in r), flush=True)
  return [info] + rows


# The scale setting: Fashion-MNIST partitioned over C clients, IID or Dirichlet alpha = 0.1, m = 10
# participants, FedEMA-BYOL (real per-client state) on the small CNN, batch 32, one local epoch.
SCALE_VARIANTS = {  # name: (vmap_shrink, client_state)
    'vmap_before': (0.0, 'device'),   # every participant runs the longest one's step count
    'vmap': (2.0, 'device'),
    'vmap_host': (2.0, 'host'),
}
SCALE_DEFAULTS = dict(clients=['10', '100', '1000'], variants=list(SCALE_VARIANTS), repeats=5)


def _scale_config(num_clients: int, shrink: float, client_state: str):
  c = experiment.default_config()
  c.algorithm, c.ssl_method, c.encoder, c.heads = 'fedema', 'byol', 'small_cnn', 'custom'
  c.dataset, c.num_clients, c.clients_per_round = 'fashion_mnist', num_clients, 10
  c.batch_size, c.local_epochs, c.strategy = 32, 1, 'vmap'
  c.vmap_shrink, c.client_state = shrink, client_state
  return c


def _device_program_mb(step, state, fed, key, m: int) -> float:
  """XLA's buffer estimate (arguments + outputs + temporaries - aliased) of the round's device
  program: the whole jitted round ('device'), or the participants' part ('host')."""
  program = getattr(step, 'device_program', None)
  if program is None:
    compiled = step.lower(state, fed, key).compile()
  else:
    sel = (jax.tree_util.tree_map(lambda a: jnp.asarray(a[:m]), state.clients),)
    compiled = program.lower(state.replace(clients=None), sel, fed, key).compile()
  ma = compiled.memory_analysis()
  return (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes -
          ma.alias_size_in_bytes) / 2**20


def _device_tree_mb(tree) -> float:
  """MB of the device arrays of `tree` (numpy leaves, the host placement's clients, excluded)."""
  return sum(a.nbytes for a in jax.tree_util.tree_leaves(tree) if isinstance(a, jax.Array)) / 2**20


def run_scale() -> List[Dict]:
  """Per C and partition: the data's device bytes (flat layout vs the padded one it replaced), and
  per variant the median over rounds of seconds per round and per real local step (round time /
  the participants' real steps), resident device MB between rounds, the device program's MB."""
  dataset = experiment.load_data(_scale_config(10, 2.0, 'device'))
  info = {'backend': jax.default_backend(), 'devices': [str(d) for d in jax.devices()],
          'setting': 'scale', 'jax': jax.__version__, 'repeats': FLAGS.repeats,
          'alpha': FLAGS.alpha,
          'cpu_affinity': sorted(os.sched_getaffinity(0))}
  print(json.dumps(info))
  rows = []
  for num_clients in [int(c) for c in FLAGS.clients]:
    for scheme, kw in (('iid', {}), ('dirichlet', {'alpha': FLAGS.alpha})):
      fed, _ = partition.build_fed_data(dataset, num_clients, scheme, seed=0, **kw)
      n = np.asarray(fed.n)
      row_bytes = int(np.prod(fed.x.shape[1:])) + 4  # image + label
      label = scheme + (f'(alpha={kw["alpha"]})' if kw else '')
      row = {'clients': num_clients, 'participants': 10, 'partition': label,
             'real_rows': int(n.sum()), 'n_max': int(n.max()),
             'data_device_mb': _tree_mb((fed.x, fed.y, fed.n, fed.offsets)),
             'padded_data_mb': num_clients * int(n.max()) * row_bytes / 2**20,
             'real_data_mb': int(n.sum()) * row_bytes / 2**20, 'results': {}}
      prepared = {}
      for variant in FLAGS.variants:
        shrink, placement = SCALE_VARIANTS[variant]
        config = _scale_config(num_clients, shrink, placement)
        algo = experiment.build_algorithm(config, dataset)
        step = rd.make_round_step(algo, experiment.round_config(config), num_clients)
        state = rd.init_state(algo, jax.random.PRNGKey(0), num_clients, client_state=placement)
        root = jax.random.PRNGKey(1)
        program_mb = _device_program_mb(step, state, fed, rng.round_key(root, 99), 10)
        prepared[variant] = dict(step=step, state=state, root=root, times=[], per_step=[],
                                 program_mb=program_mb)
        state, _ = step(state, fed, rng.round_key(root, 0))  # compile and warm up
        jax.block_until_ready(state.server)
        prepared[variant]['state'] = state
        # Resident on the device between rounds: the data and the state's device arrays.
        prepared[variant]['resident_mb'] = _device_tree_mb((fed, state))
        del state
      for r in range(1, FLAGS.repeats + 1):  # interleaved: drift hits every variant alike
        key = rng.round_key(jax.random.PRNGKey(1), r)
        ids = np.asarray(rd.sample_participants(key, num_clients, 10))
        real_steps = int(np.maximum(n[ids] // 32, 1).sum())
        for p in prepared.values():
          t0 = time.perf_counter()
          p['state'], metrics = p['step'](p['state'], fed, key)
          jax.block_until_ready((p['state'].server, metrics))
          p['times'].append(time.perf_counter() - t0)
          p['per_step'].append(p['times'][-1] / real_steps)
      for variant, p in prepared.items():
        row['results'][variant] = {
            'seconds_per_round': statistics.median(p['times']),
            'ms_per_real_step': 1e3 * statistics.median(p['per_step']),
            'resident_device_mb': p['resident_mb'], 'device_program_mb': p['program_mb'],
            'client_state_mb': _tree_mb(p['state'].clients)}
        print(f'C={num_clients:5d} {label:20s} {variant:12s} {json.dumps(row["results"][variant])}',
              flush=True)
      prepared.clear()
      gc.collect()
      print(f'C={num_clients:5d} {label:20s} data {row["data_device_mb"]:.1f} MB on device for '
            f'{row["real_data_mb"]:.1f} MB of real rows (padded layout: {row["padded_data_mb"]:.1f}'
            ' MB)', flush=True)
      rows.append(row)
  for c in sorted({r['clients'] for r in rows}):
    iid = next(r for r in rows if r['clients'] == c and r['partition'] == 'iid')
    skew = next(r for r in rows if r['clients'] == c and r['partition'] != 'iid')
    ratio = lambda v: (skew['results'][v]['ms_per_real_step'] /
                       iid['results'][v]['ms_per_real_step'])
    print(f'==> C={c}: per real step, {skew["partition"]} / IID: ' + ', '.join(
        f'{v}: {ratio(v):.2f}x' for v in FLAGS.variants), flush=True)
  return [info] + rows


# variants: every candidate, less 'pallas' off a GPU (conv_layers.default_variants, resolved when the
# defaults are applied: it asks the backend).
CONV_LAYERS_DEFAULTS = dict(variants=conv_layers.default_variants, repeats=7)


def run_conv_layers() -> List[Dict]:
  """--setting=conv_layers (experiments/conv_layers.py): the info row, then one row per layer."""
  info = {'backend': jax.default_backend(), 'setting': 'conv_layers',
          'cpu_affinity': sorted(os.sched_getaffinity(0)), 'jax': jax.__version__,
          'steps_per_scan': conv_layers.STEPS, 'repeats': FLAGS.repeats}
  print(json.dumps(info))
  return [info] + conv_layers.run(FLAGS.variants, FLAGS.repeats)


def check_flags() -> None:
  """Raises cv.ConfigError naming the flag, its value and what is allowed (before any compute)."""
  variants = list({'scale': SCALE_VARIANTS, 'conv_layers': conv_layers.CANDIDATES}.get(
      FLAGS.setting, _VARIANT_STRATEGY))
  for name, values, allowed in (('models', FLAGS.models, list(_SETTINGS)),
                                ('variants', [v.split('/')[0] for v in FLAGS.variants],
                                 variants),
                                ('torch_variants', FLAGS.torch_variants, list(TORCH_VARIANTS)),
                                ('profile_variants', FLAGS.profile_variants,
                                 variants + [f'{v}/{q}' for v in variants
                                             for q in models.PRECISIONS])):
    for value in values:
      if value not in allowed:
        raise cv.ConfigError(f'--{name} = {",".join(values)!r} is invalid: {value!r} is not one of '
                             f'{allowed}')
  for value in FLAGS.variants:
    if '/' in value and value.split('/', 1)[1] not in models.PRECISIONS:
      raise cv.ConfigError(f'--variants = {",".join(FLAGS.variants)!r} is invalid: {value!r} names '
                           f'a precision not in {list(models.PRECISIONS)}')
  for value in FLAGS.clients:
    if not value.isdigit() or int(value) < 1:
      raise cv.ConfigError(f'--clients = {",".join(FLAGS.clients)!r} is invalid: must be '
                           'comma-separated integers >= 1')
  if FLAGS.participants < 0:
    raise cv.ConfigError(f'--participants = {FLAGS.participants} is invalid: must be >= 0 '
                         '(0 = every client)')
  for name, value in (('local_steps', FLAGS.local_steps), ('repeats', FLAGS.repeats)):
    if value < 1:
      raise cv.ConfigError(f'--{name} = {value} is invalid: must be an integer >= 1')
  if FLAGS.batch_size < 2:
    raise cv.ConfigError(f'--batch_size = {FLAGS.batch_size} is invalid: must be an integer >= 2')
  _check_precisions()
  for value in FLAGS.augmentations:
    if value not in augment.PRESETS:
      raise cv.ConfigError(f'--augmentations = {",".join(FLAGS.augmentations)!r} is invalid: '
                           f'{value!r} is not one of {sorted(augment.PRESETS)}')


def _check_precisions() -> None:
  """--precisions: distinct config.precision values (float32 only under --setting=scale, which has
  no precision variants and no mfu); --peak_tflops: numbers > 0, one for every precision or one per
  --precisions entry."""
  precisions, peaks = list(FLAGS.precisions), list(FLAGS.peak_tflops)
  text, peak_text = ','.join(precisions), ','.join(peaks)
  for value in precisions:
    if value not in models.PRECISIONS:
      raise cv.ConfigError(f'--precisions = {text!r} is invalid: {value!r} is not one of '
                           f'{list(models.PRECISIONS)}')
  if not precisions or len(set(precisions)) != len(precisions):
    raise cv.ConfigError(f'--precisions = {text!r} is invalid: must name distinct precisions, at '
                         'least one')
  if FLAGS.setting == 'scale' and (precisions != ['float32'] or peaks):
    raise cv.ConfigError(f'--precisions = {text!r}, --peak_tflops = {peak_text!r} are invalid with '
                         "--setting=scale: it times float32 only and reports no mfu")
  if not all(_positive_number(p) for p in peaks):
    raise cv.ConfigError(f'--peak_tflops = {peak_text!r} is invalid: must be numbers > 0 (TFLOP/s)')
  if len(peaks) > 1 and len(peaks) != len(precisions):
    raise cv.ConfigError(f'--peak_tflops = {peak_text!r} is invalid: give one value, or one per '
                         f'--precisions entry ({len(precisions)})')


def _positive_number(text: str) -> bool:
  try:
    return float(text) > 0
  except ValueError:
    return False


def apply_setting_defaults() -> None:
  """The cross-device and scale settings' flag defaults, for every flag not given on the command
  line."""
  defaults = {'cross_device': CROSS_DEVICE_DEFAULTS, 'scale': SCALE_DEFAULTS,
              'conv_layers': CONV_LAYERS_DEFAULTS}.get(FLAGS.setting, {})
  for name, value in defaults.items():
    if not flags.FLAGS[name].present:
      flags.FLAGS[name].value = value() if callable(value) else value


def define_flags() -> None:
  """The binary's flags; defined only when it runs, so that any two binaries (whose flag names
  overlap) can be imported in one process, as the tests do."""
  flags.DEFINE_enum('setting', 'byol', ['byol', 'cross_device', 'scale', 'conv_layers'],
                    'Which round to time (module docstring).')
  flags.DEFINE_integer(
      'participants', 0, 'Clients sampled per round; 0 = every client (byol) or 50 (cross_device).')
  flags.DEFINE_string('out', 'results.json', 'Where to write the JSON results.')
  flags.DEFINE_float('alpha', 0.1, 'Dirichlet alpha of the skewed partition (--setting=scale; '
                     'alpha = 0.1 cannot give every one of 1000 Fashion-MNIST clients an '
                     'example, use 0.5 there).')
  flags.DEFINE_list('models', ['small_cnn', 'resnet18'], 'Encoders to benchmark.')
  flags.DEFINE_list('clients', ['10', '100'], 'Client counts (all participate).')
  flags.DEFINE_integer('local_steps', 5, 'Local steps per client per round.')
  flags.DEFINE_integer('batch_size', 64, 'Local batch size.')
  flags.DEFINE_integer('repeats', 3, 'Timed rounds per variant (after one warm-up).')
  flags.DEFINE_list('variants', ['stepwise', 'sequential', 'vmap', 'map', 'map10', 'shard'],
                    'Which execution variants to time.')
  flags.DEFINE_list(
      'augmentations', ['byol_easyfl', 'flip'],
      "Augmentation presets of the views, one row each ('flip' = model compute, beside PyTorch).")
  flags.DEFINE_bool(
      'torch', True, 'Time the PyTorch references (experiments/torch_round.py) beside the '
      "'flip' rows of small_cnn and resnet18 when torch is importable.")
  flags.DEFINE_list('torch_variants', list(TORCH_VARIANTS),
                    'Which PyTorch references to time (TORCH_VARIANTS).')
  flags.DEFINE_string(
      'profile_dir', '', 'After timing, trace one round of each JAX variant of --profile_variants '
      'with jax.profiler under this folder and add the device-time summary '
      '(experiments/profile_summary.py) to the row. Empty: no profile.')
  flags.DEFINE_list('profile_variants', [], 'Variants to profile (default: every JAX variant).')
  flags.DEFINE_enum(
      'conv_impl', 'auto', ['auto', 'xla', 'im2col', 'packed', 'measured', 'pallas'],
      "config.conv_impl of the JAX variants: 'im2col' (slices + one matmul) turns a stacked round's "
      'per-client convolutions into batched matmuls instead of grouped convolutions '
      "(docs/notes/performance.md#perf-50); 'packed' keeps the stacked clients' activations "
      "[N, H, W, K*C] (core/packing.py); 'measured' times each convolution's implementations once "
      '(core/conv_choice.py; on a GPU the Pallas kernel is a candidate) and the output lists '
      "every convolution's candidate times (docs/notes/performance.md#perf-53); 'pallas' runs "
      'every convolution it can by the Pallas kernel of ops/pallas_conv.py (GPU only, PERF-68).')
  flags.DEFINE_string(
      'cache_dir', '', 'JAX\'s persistent compilation cache for the timed programs '
      '(fedjax_ssl/core/compilation.py): a second benchmark process with the same folder loads '
      'them, and its `compile` entries show what a second run pays. Empty (default): none, every '
      'first round compiles from scratch.')
  flags.DEFINE_bool(
      'interleave', True,
      'Keep every variant of a setting resident and interleave their timed rounds (robust ratios on '
      'a machine whose speed drifts). --nointerleave times one variant at a time and frees it before '
      'the next: for settings whose variants do not fit in memory together (ResNet-18 on CPU).')
  flags.DEFINE_list(
      'precisions', ['float32'],
      "config.precision values to time every JAX variant at (float32 | bfloat16); a variant at a "
      "precision other than float32 is reported as '<variant>/<precision>'. PyTorch stays float32.")
  flags.DEFINE_list(
      'peak_tflops', [],
      'Peak TFLOP/s of the device, one value for every precision or one per --precisions entry, '
      'for mfu = achieved FLOP/s / peak (H100 SXM dense: ~67 float32 without tensor cores, ~495 '
      'TF32, ~989 bf16). Empty: no mfu.')
  flags.DEFINE_float(
      'max_variant_seconds', 600.0,
      'Stop timing a variant once one of its rounds exceeds this many seconds (CPU ResNet-18).')


def main(argv):
  del argv
  apply_setting_defaults()
  check_flags()
  try:
    compilation.enable_cache(FLAGS.cache_dir or 'none')
  except compilation.CacheError as e:
    raise cv.ConfigError(str(e).replace('cache_dir =', '--cache_dir =')) from None
  rows = {'scale': run_scale, 'conv_layers': run_conv_layers}.get(FLAGS.setting, run)()
  if conv_choice.recorded():  # conv_impl='measured': each convolution's candidates and choice
    print('--- conv_impl=measured, per convolution (K clients, shapes | candidate ms -> choice):')
    print('\n'.join(conv_choice.text()))
    rows[0]['conv_choices'] = conv_choice.recorded()
  with open(FLAGS.out, 'w') as f:
    json.dump({'info': rows[0], 'rows': rows[1:]}, f, indent=2)
  print(f'wrote {FLAGS.out}')


if __name__ == '__main__':
  # JAX and torch share the device when the PyTorch references run: JAX allocates as it needs
  # instead of taking 75 % of the GPU's memory at its start.
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  define_flags()
  cv.run(main)
