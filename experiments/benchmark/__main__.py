r"""Times the stacked round step against per-client loops (and eager PyTorch) on the same work.

  python -m experiments.benchmark --out results.json --models=small_cnn --clients=10,100
  python -m experiments.benchmark --setting=scale --clients=100 --out scale100.json
  python -m experiments.benchmark --setting=conv_layers --out conv_layers.json

The settings, variants and what each output row holds: docs/notes/harness.md#benchmark.
"""
from __future__ import annotations

import json
import os

from absl import flags

# First thing, before anything runs on JAX: glibc's malloc keeps freed memory from here on, so that
# repeated XLA:CPU executions reuse their temporaries instead of page-faulting fresh ones every call
# (fedjax_ssl/core/host_memory.py; FEDJAX_SSL_MALLOC=system keeps glibc's defaults). mallopt governs
# later allocations only; importing jax (which fedjax_ssl.core does) creates none of XLA's buffers.
# Only as a program: importing this module (tests) changes nothing.
from fedjax_ssl.core import host_memory

if __name__ == '__main__':
  host_memory.keep_freed_memory()

from experiments.benchmark import layers, round_speed, scale, settings  # noqa: E402
from fedjax_ssl import config_validation as cv  # noqa: E402
from fedjax_ssl.core import compilation, conv_choice  # noqa: E402

FLAGS = flags.FLAGS

_DEFAULTS = settings.DEFAULTS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The binary's flags (defaults: `settings.Settings`'s); defined only when it runs, so that any
  two binaries (whose flag names overlap) can be imported in one process, as the tests do."""
  d, fv = _DEFAULTS, dict(flag_values=flag_values)
  flags.DEFINE_enum('setting', d['setting'], list(settings.SETTINGS),
                    'Which round to time (docs/notes/harness.md#benchmark).', **fv)
  flags.DEFINE_integer(
      'participants', d['participants'],
      'Clients sampled per round; 0 = every client (byol) or 50 (cross_device).', **fv)
  flags.DEFINE_string('out', d['out'], 'Where to write the JSON results.', **fv)
  flags.DEFINE_float('alpha', d['alpha'], 'Dirichlet alpha of the skewed partition '
                     '(--setting=scale; alpha = 0.1 cannot give every one of 1000 '
                     'Fashion-MNIST clients an example, use 0.5 there).', **fv)
  flags.DEFINE_list('models', list(d['models']), 'Encoders to benchmark.', **fv)
  flags.DEFINE_list('clients', list(d['clients']), 'Client counts (all participate).', **fv)
  flags.DEFINE_integer('local_steps', d['local_steps'], 'Local steps per client per round.', **fv)
  flags.DEFINE_integer('batch_size', d['batch_size'], 'Local batch size.', **fv)
  flags.DEFINE_integer('repeats', d['repeats'], 'Timed rounds per variant (after one warm-up).',
                       **fv)
  flags.DEFINE_list('variants', list(d['variants']), 'Which execution variants to time.', **fv)
  flags.DEFINE_list(
      'augmentations', list(d['augmentations']),
      "Augmentation presets of the views, one row each ('flip' = model compute, beside PyTorch).",
      **fv)
  flags.DEFINE_bool(
      'torch', d['torch'], 'Time the PyTorch references (experiments/torch_round.py) beside the '
      "'flip' rows of small_cnn and resnet18 when torch is importable.", **fv)
  flags.DEFINE_list('torch_variants', list(d['torch_variants']),
                    'Which PyTorch references to time (TORCH_VARIANTS).', **fv)
  flags.DEFINE_string(
      'profile_dir', d['profile_dir'], 'After timing, trace one round of each JAX variant of '
      '--profile_variants with jax.profiler under this folder and add the device-time summary '
      '(experiments/profile_summary.py) to the row. Empty: no profile.', **fv)
  flags.DEFINE_list('profile_variants', list(d['profile_variants']),
                    'Variants to profile (default: every JAX variant).', **fv)
  flags.DEFINE_enum(
      'conv_impl', d['conv_impl'], ['auto', 'xla', 'im2col', 'packed', 'measured', 'pallas'],
      "config.conv_impl of the JAX variants: 'im2col' (slices + one matmul) turns a stacked round's "
      'per-client convolutions into batched matmuls instead of grouped convolutions '
      "(docs/notes/performance.md#perf-50); 'packed' keeps the stacked clients' activations "
      "[N, H, W, K*C] (core/packing.py); 'measured' times each convolution's implementations once "
      '(core/conv_choice.py; on a GPU the Pallas kernel is a candidate) and the output lists '
      "every convolution's candidate times (docs/notes/performance.md#perf-53); 'pallas' runs "
      'every convolution it can by the Pallas kernel of ops/pallas_conv.py (GPU only, '
      'PERF-68).', **fv)
  flags.DEFINE_string(
      'cache_dir', d['cache_dir'], 'JAX\'s persistent compilation cache for the timed programs '
      '(fedjax_ssl/core/compilation.py): a second benchmark process with the same folder loads '
      'them, and its `compile` entries show what a second run pays. Empty (default): none, every '
      'first round compiles from scratch.', **fv)
  flags.DEFINE_bool(
      'interleave', d['interleave'],
      'Keep every variant of a setting resident and interleave their timed rounds (robust ratios on '
      'a machine whose speed drifts). --nointerleave times one variant at a time and frees it before '
      'the next: for settings whose variants do not fit in memory together (ResNet-18 on CPU).',
      **fv)
  flags.DEFINE_list(
      'precisions', list(d['precisions']),
      "config.precision values to time every JAX variant at (float32 | bfloat16); a variant at a "
      "precision other than float32 is reported as '<variant>/<precision>'. PyTorch stays float32.",
      **fv)
  flags.DEFINE_list(
      'peak_tflops', list(d['peak_tflops']),
      'Peak TFLOP/s of the device, one value for every precision or one per --precisions entry, '
      'for mfu = achieved FLOP/s / peak (H100 SXM dense: ~67 float32 without tensor cores, ~495 '
      'TF32, ~989 bf16). Empty: no mfu.', **fv)
  flags.DEFINE_list(
      'processes', list(d['processes']),
      "scale: process counts P; measures placement 'divided' over P processes on 127.0.0.1 "
      "against 'replicated' on one (memory held per process) instead of the strategy variants.",
      **fv)
  flags.DEFINE_float(
      'max_variant_seconds', d['max_variant_seconds'],
      'Stop timing a variant once one of its rounds exceeds this many seconds (CPU ResNet-18).',
      **fv)


def settings_from_flags(flag_values: flags.FlagValues = FLAGS) -> settings.Settings:
  """The run's settings: the flags given on the command line over the setting's defaults."""
  return settings.make(**{name: flag_values[name].value for name in settings.FIELDS
                          if flag_values[name].present})


def run(s: settings.Settings) -> None:
  """Times the setting of `s` and writes {'info': ..., 'rows': [...]} to `s.out`."""
  try:
    compilation.enable_cache(s.cache_dir or 'none')
  except compilation.CacheError as e:
    raise cv.ConfigError(str(e).replace('cache_dir =', '--cache_dir =')) from None
  if s.setting == 'scale' and s.processes:
    rows = scale.placement_rows(s)
  else:
    rows = {'scale': scale.run, 'conv_layers': layers.run}.get(s.setting, round_speed.run)(s)
  if conv_choice.recorded():  # conv_impl='measured': each convolution's candidates and choice
    print('--- conv_impl=measured, per convolution (K clients, shapes | candidate ms -> choice):')
    print('\n'.join(conv_choice.text()))
    rows[0]['conv_choices'] = conv_choice.recorded()
  with open(s.out, 'w') as f:
    json.dump({'info': rows[0], 'rows': rows[1:]}, f, indent=2)
  print(f'wrote {s.out}')


def main(argv):
  del argv
  run(settings_from_flags())


if __name__ == '__main__':
  # JAX and torch share the device when the PyTorch references run: JAX allocates as it needs
  # instead of taking 75 % of the GPU's memory at its start.
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  define_flags()
  cv.run(main)
