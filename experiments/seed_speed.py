r"""The seed systems' rounds at GPU speed (issue 65 item 5): each of FedU2 (cross-silo, cross-device),
FedSC (DP shares on), Hetero-SSFL (two architectures) and FedEMA timed as our stacked round beside
the eager PyTorch loop of the same round and the union-batch bound, in one process.

  python -m experiments.seed_speed --out seeds.json                       # paper scale (a GPU)
  python -m experiments.seed_speed --scale=reduced --out seeds_cpu.json   # the CPU size
  python -m experiments.seed_speed --settings=fedsc,fedema --batches=2 --out s.json

Rows (--settings; experiments/torch_seeds.py `paper_settings` gives each one's model, image size,
batch, local epochs and optimiser, and `reduced_settings` the CPU size): every client trains E local
epochs of --batches batches of B images (the papers' clients hold more: each row reports the
factor `paper_batches / batches` by which a paper round's local work is larger, and the estimate
`paper_round_seconds` = measured seconds x that factor, which also scales the round's fixed server
costs and so errs high; docs/notes/performance.md#perf-73); the reduced scale reports no estimate.

Variants (--variants), timed interleaved after one warm-up round each, median of --repeats:
  * `ours` / `ours_bf16`: the method's round step (fedjax_ssl.core.round) at config.precision
    float32 / bfloat16, strategy 'vmap' ('map' with chunks of --map_chunk for fedu2_cross_device,
    whose 100 ResNet-18 participants do not fit side by side: configs/fedu2/paper_cross_device.py),
    `flip` views (the model-compute preset of experiments.benchmark, as PyTorch's pre-made views);
  * `torch` / `torch_bf16`: the official codes' eager per-client loop (TF32 on a GPU; bf16
    autocast), experiments/torch_seeds.py mode 'loop';
  * `torch_union`: one model per architecture on the union batch, the method's terms per client
    block, bf16 autocast, channels_last (mode 'union'): the bound stacking should approach;
    `torch_union_fp32` the same in float32 (the CPU's, where bf16 autocast is no speed-up).
Synthetic data (the timing does not depend on pixel values). Each row's `ratios` holds our fastest
variant against the fastest eager loop (speed-up) and against `torch_union` (time ratio).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Dict, List

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import torch_seeds
from fedjax_ssl import experiment
from fedjax_ssl.core import rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.data.types import Dataset, FedData

FLAGS = flags.FLAGS

VARIANTS = ('ours', 'ours_bf16', 'torch', 'torch_bf16', 'torch_union', 'torch_union_fp32')
TORCH_VARIANTS = {'torch': dict(mode='loop', precision='float32'),
                  'torch_bf16': dict(mode='loop', precision='bfloat16'),
                  'torch_union': dict(mode='union', precision='bfloat16', channels_last=True),
                  'torch_union_fp32': dict(mode='union', precision='float32')}
SCALES = ('paper', 'reduced')
# Batches of B per client and epoch in the papers' splits (50,000 CIFAR-10 training images; Hetero-
# SSFL's 45,000 after its 5,000-image RAD): 5,000 / 128, 500 / 128, 5,000 / 512 (the ragged last
# batch kept), 9,000 / 200, 10,000 / 128.
PAPER_BATCHES = {'fedu2_cross_silo': 39, 'fedu2_cross_device': 3.9, 'fedsc': 10,
                 'hetero_ssfl': 45, 'fedema': 78}
PAPER_ROUNDS = {'fedu2_cross_silo': 100, 'fedu2_cross_device': 100, 'fedsc': 200,
                'hetero_ssfl': 200, 'fedema': 100}
_HEAD_PRESET = {v: k for k, v in torch_seeds.HEADS.items()}


def jax_config(s: torch_seeds.Setting, precision: str, map_chunk: int):
  """Our config of setting `s` (the same model, heads, batch, epochs, optimiser and method keys)."""
  c = experiment.default_config()
  c.algorithm = s.method
  c.ssl_method = 'sc' if s.method == 'fedsc' else 'byol'
  c.encoder = s.cohorts[0][0]
  if s.heads in _HEAD_PRESET:
    c.heads = _HEAD_PRESET[s.heads]
  else:  # sizes of no preset (the tests' tiny heads): the custom heads, one BatchNorm choice
    (c.proj_hidden, c.proj_out, c.head_bn), pred = s.heads
    c.heads = 'custom'
    if pred:
      c.pred_hidden, c.pred_out = pred[:2]
  c.num_clients = c.clients_per_round = s.clients
  c.partition = 'iid'
  c.local_epochs, c.batch_size = s.local_epochs, s.batch
  c.optimizer, c.lr, c.momentum, c.weight_decay = 'sgd', s.lr, s.momentum, s.weight_decay
  c.grad_clip_norm = s.grad_clip
  c.lr_schedule = 'constant'
  c.reset_optimizer = True
  c.augmentation = 'flip'
  c.precision = precision
  c.strategy, c.map_chunk_size = ('map', map_chunk) if s.name == 'fedu2_cross_device' else ('vmap', 1)
  if s.ema:
    c.byol.ema_tau = s.ema
  if s.method == 'fedu2':
    c.fedu2.lambda_u, c.fedu2.tau_a, c.fedu2.tau_b = s.get('lambda_u'), s.get('tau'), s.get('tau')
    c.fedu2.uot_iters, c.fedu2.server_lr = s.get('uot_iters'), s.get('server_lr')
  if s.method == 'fedsc':
    c.sc_mu = s.get('sc_mu')
    c.drop_last = False
    c.fedsc.calr_views = s.get('calr_views')
    c.fedsc.calr_batch = s.batch
    c.fedsc.dp, c.fedsc.sigma = True, s.get('sigma')
  if s.method == 'hetero_ssfl':
    c.hetero_ssfl.mix = ','.join(f'{e}:{n}' for e, n in s.cohorts)
    c.public_size = s.get('rad_size')
    c.hetero_ssfl.rad_batch = s.get('rad_batch')
    c.hetero_ssfl.mu = s.get('mu')
  if s.method == 'fedema':
    c.fedema.autoscaler_tau = s.get('autoscaler_tau')
  return c


def synthetic_fed(s: torch_seeds.Setting):
  """(FedData, Dataset) of uniform random images: every client --batches x B images, and the RAD."""
  per = s.batches * s.batch
  rows = per * s.clients
  shape = (s.image, s.image, 3)
  x = jax.random.bits(jax.random.PRNGKey(0), (rows,) + shape, jnp.uint8)
  public = (jax.random.bits(jax.random.PRNGKey(2), (s.get('rad_size'),) + shape, jnp.uint8)
            if s.method == 'hetero_ssfl' else None)
  fed = FedData(x=x, y=jnp.zeros((rows,), jnp.int32), n=jnp.full((s.clients,), per, jnp.int32),
                offsets=jnp.arange(s.clients, dtype=jnp.int32) * per, n_max=per,
                public_x=public, n_min=per)
  x0 = np.asarray(x[:per])
  ds = Dataset(name='seed_speed', train_x=x0, train_y=np.zeros(per, np.int32), test_x=x0,
               test_y=np.zeros(per, np.int32), num_classes=10, mean=(0.5,) * 3, std=(0.25,) * 3)
  return fed, ds


def prepare_ours(s: torch_seeds.Setting, precision: str, map_chunk: int) -> Dict[str, Any]:
  """Our round of `s`, compiled and run once (round 0); {'run': r -> None, 'first': seconds}."""
  config = jax_config(s, precision, map_chunk)
  fed, ds = synthetic_fed(s)
  algo = experiment.build_algorithm(config, ds, np.asarray(fed.n))
  step = rd.make_round_step(algo, experiment.round_config(config), s.clients)
  p = dict(state=rd.init_state(algo, jax.random.PRNGKey(0), s.clients), times=[])
  root = jax.random.PRNGKey(1)

  def run(r):
    p['state'], p['metrics'] = step(p['state'], fed, rng.round_key(root, r))
    jax.block_until_ready(p['state'])
  t0 = time.perf_counter()
  run(0)
  p.update(run=run, first=time.perf_counter() - t0)
  return p


def prepare_torch(s: torch_seeds.Setting, variant: str) -> Dict[str, Any]:
  one_round = torch_seeds.build_round(s, **TORCH_VARIANTS[variant])
  p = dict(times=[])

  def run(r):
    del r
    p['loss'] = one_round()
  t0 = time.perf_counter()
  run(0)
  p.update(run=run, first=time.perf_counter() - t0)
  return p


def time_setting(s: torch_seeds.Setting, variants: List[str], repeats: int, map_chunk: int,
                 estimate: bool = True) -> Dict[str, Any]:
  """Every variant of `s` prepared, then their timed rounds interleaved (round r of each); with
  `estimate` (paper scale) each variant's paper-round seconds and GPU hours (module docstring)."""
  prepared = {}
  for v in variants:
    if v.startswith('torch'):
      prepared[v] = prepare_torch(s, v)
    else:
      prepared[v] = prepare_ours(s, 'bfloat16' if v.endswith('bf16') else 'float32', map_chunk)
    print(f'prepared {s.name} {v}: first round {prepared[v]["first"]:.1f} s', flush=True)
  for r in range(1, repeats + 1):
    for p in prepared.values():
      t0 = time.perf_counter()
      p['run'](r)
      p['times'].append(time.perf_counter() - t0)
  factor = PAPER_BATCHES[s.name] / s.batches
  out = {}
  for v, p in prepared.items():
    sec = statistics.median(p['times'])
    loss = p['loss'] if 'loss' in p else float(p['metrics']['loss'])
    out[v] = {'seconds_per_round': sec, 'first_round_seconds': p['first'],
              'all_seconds': p['times'], 'loss': loss}
    if estimate:
      out[v].update(paper_round_seconds=sec * factor,
                    paper_gpu_hours=sec * factor * PAPER_ROUNDS[s.name] / 3600)
  return out


def ratios(results: Dict[str, Any]) -> Dict[str, float]:
  """Our fastest variant against the fastest eager loop (speed-up) and the union bound (time)."""
  t = {v: r['seconds_per_round'] for v, r in results.items()}
  ours = [t[v] for v in t if v.startswith('ours')]
  loops = [t[v] for v in ('torch', 'torch_bf16') if v in t]
  out = {}
  if ours and loops:
    out['speedup_vs_eager_loop'] = min(loops) / min(ours)
  unions = [t[v] for v in ('torch_union', 'torch_union_fp32') if v in t]
  if ours and unions:
    out['time_vs_union'] = min(ours) / min(unions)
  return out


def check_flags() -> None:
  """ValueError naming the flag and what is allowed, before any compute."""
  known = list(torch_seeds.paper_settings())
  for name, values, allowed in (('settings', FLAGS.settings, known),
                                ('variants', FLAGS.variants, list(VARIANTS))):
    for v in values:
      if v not in allowed:
        raise ValueError(f'--{name} = {",".join(values)!r} is invalid: {v!r} is not one of '
                         f'{allowed}')
  for name in ('batches', 'repeats', 'map_chunk'):
    if FLAGS[name].value < 1:
      raise ValueError(f'--{name} = {FLAGS[name].value} is invalid: must be an integer >= 1')


def define_flags() -> None:
  flags.DEFINE_list('settings', list(torch_seeds.paper_settings()), 'Rows to time.')
  flags.DEFINE_enum('scale', 'paper', list(SCALES),
                    "paper: the papers' sizes (a GPU); reduced: the CPU size (torch_seeds).")
  flags.DEFINE_list('variants', ['ours_bf16', 'torch', 'torch_union'], 'Variants to time.')
  flags.DEFINE_integer('batches', 1, 'Batches of B per client and epoch (paper scale).')
  flags.DEFINE_integer('repeats', 2, 'Timed rounds per variant after the warm-up.')
  flags.DEFINE_integer('map_chunk', 10, "fedu2_cross_device: participants per vmapped chunk "
                       "of strategy 'map'.")
  flags.DEFINE_string('out', 'seeds.json', 'Where to write the JSON results.')


def main(argv):
  del argv
  check_flags()
  settings = (torch_seeds.paper_settings(FLAGS.batches) if FLAGS.scale == 'paper'
              else torch_seeds.reduced_settings())
  import torch  # pylint: disable=g-import-not-at-top
  info = {'backend': jax.default_backend(), 'devices': [str(d) for d in jax.devices()],
          'jax': jax.__version__, 'torch': torch.__version__, 'scale': FLAGS.scale,
          'repeats': FLAGS.repeats, 'torch_threads': torch.get_num_threads(),
          'cpu_affinity': sorted(os.sched_getaffinity(0))}
  print(json.dumps(info), flush=True)
  rows = []
  for name in FLAGS.settings:
    s = settings[name]
    results = time_setting(s, list(FLAGS.variants), FLAGS.repeats,
                           min(FLAGS.map_chunk, s.clients), estimate=FLAGS.scale == 'paper')
    row = {'setting': name, 'spec': {k: v for k, v in vars(s).items() if k != 'extra'},
           'extra': dict(s.extra), 'paper_batches': PAPER_BATCHES[name],
           'paper_rounds': PAPER_ROUNDS[name], 'results': results, 'ratios': ratios(results)}
    rows.append(row)
    print(f'{name}: ' + ', '.join(f'{v} {r["seconds_per_round"]:.3f} s' for v, r in
                                  results.items()) + f' | {json.dumps(row["ratios"])}', flush=True)
    with open(FLAGS.out, 'w') as f:  # after every row: a stage cut short keeps what it timed
      json.dump({'info': info, 'rows': rows}, f, indent=1)
  print(f'wrote {FLAGS.out}')


if __name__ == '__main__':
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  define_flags()
  app.run(main)
