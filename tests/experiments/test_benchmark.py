"""The benchmark binary on a tiny setting: every variant runs the same round (equal losses), and the
reported ratios are the measured times' ratios."""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests import subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_benchmark_variants_agree_and_ratios_are_consistent(tmp_path):
  out = tmp_path / 'bench.json'
  # XLA's fast compile (tests/subprocess_env.py): equal losses and ratios of the measured times hold
  # at any optimisation level; 66 -> 31 s of this test (docs/notes/testing.md#test-16).
  env = subprocess_env.binary_env()
  subprocess.run(
      [sys.executable, '-m', 'experiments.benchmark', f'--out={out}', '--models=small_cnn',
       '--clients=3', '--local_steps=2', '--batch_size=8', '--repeats=1', '--augmentations=flip',
       '--variants=stepwise,sequential,map', '--notorch'],
      cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
  report = json.loads(out.read_text())
  assert report['info']['default_strategy'] == 'map'
  (row,) = report['rows']
  assert row['augmentation'] == 'flip'
  res = row['results']
  assert set(res) == {'stepwise', 'sequential', 'map'}
  losses = [r['loss'] for r in res.values()]
  np.testing.assert_allclose(losses, losses[0], rtol=1e-4)
  for name, r in res.items():
    assert r['seconds_per_round'] > 0
    np.testing.assert_allclose(r['client_steps_per_second'] * r['seconds_per_round'], 3 * 2)
    # Same work in every variant: GFLOP/s x seconds is the round's flop count for all of them.
    np.testing.assert_allclose(r['gflops'] * r['seconds_per_round'],
                               res['map']['gflops'] * res['map']['seconds_per_round'], rtol=1e-9)
    for base in ('stepwise', 'sequential'):
      np.testing.assert_allclose(r[f'speedup_vs_{base}'],
                                 res[base]['seconds_per_round'] / r['seconds_per_round'])
  assert 'compiled_mb' in res['map'] and 'compiled_mb' not in res['stepwise']


def test_flops_per_step_counts_both_views_with_flip_and_one_without_augmentation():
  """'none' gives two identical views, which XLA computes once: the reason the benchmark's
  model-compute rows use 'flip' (views that differ, as PyTorch's two input tensors do)."""
  probe = ('from absl import flags\n'
           'from experiments import benchmark\n'
           'benchmark.define_flags()\n'
           "flags.FLAGS(['benchmark', '--batch_size=8'])\n"
           "print(benchmark.flops_per_client_step('small_cnn', 'flip'), "
           "benchmark.flops_per_client_step('small_cnn', 'none'))\n")
  env = subprocess_env.binary_env(optimized=True)  # it measures compiled code
  out = subprocess.run([sys.executable, '-c', probe], cwd=REPO, env=env, check=True,
                       capture_output=True, text=True, timeout=600)
  flip, none = map(float, out.stdout.split())
  # The step's flops are dominated by the two views' forward and backward passes (~0.2 GFLOP at
  # batch 8); one shared view leaves about half.
  assert 0.15e9 < flip < 0.3e9, flip
  np.testing.assert_allclose(none / flip, 0.5, atol=0.03)


def test_pytorch_variants_keep_their_name_whatever_the_precisions():
  """`targets` finds the references by name: on the H200 (PERF-52) a bf16-only run reported the
  TF32 loop as 'torch/bfloat16' and printed no ratio."""
  probe = ('from absl import flags\n'
           'from experiments import benchmark\n'
           'benchmark.define_flags()\n'
           "flags.FLAGS(['benchmark', '--precisions=bfloat16,float32'])\n"
           "print(benchmark.variant_precisions(['vmap', 'map/float32', 'torch', 'torch_union']))\n")
  out = subprocess.run([sys.executable, '-c', probe], cwd=REPO, env=subprocess_env.binary_env(),
                       check=True, capture_output=True, text=True, timeout=600)
  assert out.stdout.strip() == str([
      ('vmap/bfloat16', 'vmap', 'bfloat16'), ('map/float32', 'map', 'float32'),
      ('torch', 'torch', 'bfloat16'), ('torch_union', 'torch_union', 'bfloat16'),
      ('vmap', 'vmap', 'float32')])


@pytest.mark.slow
def test_benchmark_times_each_variant_at_each_precision_with_mfu(tmp_path):
  out = tmp_path / 'bench.json'
  # Compiled as a user's run: the bf16 loss bound below assumes XLA's default fusion (at the fast
  # level each bf16 op rounds on its own and the loss moves by 4.1e-3 relative, measured).
  env = subprocess_env.binary_env(optimized=True)
  subprocess.run(
      [sys.executable, '-m', 'experiments.benchmark', f'--out={out}', '--models=small_cnn',
       '--clients=2', '--local_steps=1', '--batch_size=8', '--repeats=1', '--augmentations=flip',
       '--variants=map', '--notorch', '--precisions=float32,bfloat16', '--peak_tflops=0.5'],
      cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
  (row,) = json.loads(out.read_text())['rows']
  res = row['results']
  assert set(res) == {'map', 'map/bfloat16'}
  assert (res['map']['precision'], res['map/bfloat16']['precision']) == ('float32', 'bfloat16')
  for r in res.values():
    np.testing.assert_allclose(r['mfu'], r['gflops'] / 500.0)  # one peak for both precisions
  # The same model FLOPs at both precisions (counted in float32).
  f32, bf16 = res['map'], res['map/bfloat16']
  np.testing.assert_allclose(bf16['gflops'] * bf16['seconds_per_round'],
                             f32['gflops'] * f32['seconds_per_round'], rtol=1e-9)
  np.testing.assert_allclose(bf16['speedup_vs_float32'],
                             f32['seconds_per_round'] / bf16['seconds_per_round'])
  # One local step from the same initial model: the round's loss is that step's, before its update,
  # so it differs by the bf16 forward's rounding alone. Each layer's bf16 output carries a relative
  # rounding of at most u / 2 (u = 2^-8); through the ~8 layers of the online and target paths
  # (encoder, projector, predictor) these add as a random walk, ~sqrt(8) u / 2 = 1.4 u. Measured:
  # 0.99 u with XLA's default codegen on the 2-core box, 1.25 u under --xla_cpu_max_isa=SSE4_2 (the
  # bound u failed there), 1.05 u at the suite's fast level. Bound 2 u.
  np.testing.assert_allclose(bf16['loss'], f32['loss'], rtol=2 ** -7)


@pytest.mark.slow
def test_benchmark_conv_impl_reaches_the_round_and_the_record(tmp_path):
  # The GPU check's `conv` part times the round with im2col convolutions (PERF-50): the flag must
  # reach the model (a different program) yet train the same function, so the round's loss (the
  # first local step's, before its update, from the same initial model) agrees to float32 rounding
  # of sums over a few hundred products (rtol 1e-5).
  env = subprocess_env.binary_env()  # fast compile, as in the variants test above
  losses = {}
  for impl in ('xla', 'im2col'):
    out = tmp_path / f'{impl}.json'
    subprocess.run(
        [sys.executable, '-m', 'experiments.benchmark', f'--out={out}', '--models=small_cnn',
         '--clients=2', '--local_steps=1', '--batch_size=8', '--repeats=1', '--augmentations=flip',
         '--variants=vmap', '--notorch', f'--conv_impl={impl}'],
        cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    record = json.loads(out.read_text())
    assert record['info']['conv_impl'] == impl
    losses[impl] = record['rows'][0]['results']['vmap']['loss']
  np.testing.assert_allclose(losses['im2col'], losses['xla'], rtol=1e-5)


@pytest.mark.parametrize('args, message', [
    (['--precisions=float16'], "--precisions = 'float16' is invalid: 'float16' is not one of "
                               "['float32', 'bfloat16']"),
    (['--precisions=float32,bfloat16', '--peak_tflops=67,989,1'],
     "--peak_tflops = '67,989,1' is invalid: give one value, or one per --precisions entry (2)"),
    (['--peak_tflops=0'], "--peak_tflops = '0' is invalid: must be numbers > 0 (TFLOP/s)"),
], ids=['precision', 'peak_count', 'peak_zero'])
def test_benchmark_refuses_bad_precision_flags_before_compute(args, message, tmp_path):
  env = subprocess_env.binary_env(optimized=True)  # it measures compiled code
  proc = subprocess.run([sys.executable, '-m', 'experiments.benchmark', f'--out={tmp_path}/b.json',
                         *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == f'error: {message}'
  assert not (tmp_path / 'b.json').exists()
