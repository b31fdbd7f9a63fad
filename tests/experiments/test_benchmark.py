"""The benchmark on tiny settings, in-process: every variant runs the same round (equal losses), the
reported ratios are the measured times' ratios, and bad settings are refused before compute. One
test starts the binary, for its command line (flags -> settings -> the JSON file)."""
import dataclasses
import importlib
import json
import pathlib
import subprocess
import sys

from absl import flags
import jax
import numpy as np
import pytest

from experiments.benchmark import round_speed, scale, settings
from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment
from fedjax_ssl.core import round as rd
from tests import subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[2]
cli = importlib.import_module('experiments.benchmark.__main__')

# The smallest round: small_cnn on the model-compute preset, no PyTorch.
TINY = dict(models=['small_cnn'], clients=[2], local_steps=1, batch_size=8, repeats=1,
            augmentations=['flip'], torch=False)


def _tiny(**overrides) -> settings.Settings:
  return settings.make(**{**TINY, **overrides})


@pytest.mark.slow
def test_benchmark_variants_agree_and_ratios_are_consistent():
  # The session's fast compile (tests/subprocess_env.py): equal losses and ratios of the measured
  # times hold at any optimisation level.
  info, row = round_speed.run(_tiny(clients=[3], local_steps=2,
                                    variants=['stepwise', 'sequential', 'map']))
  assert info['default_strategy'] == 'map'
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


@pytest.mark.slow
def test_scale_device_program_of_a_host_round_is_smaller_than_the_whole_round():
  """The scale setting's `device_program_mb`: the whole donated round under client_state='device',
  the participants' part under 'host' (2 of 4 clients' stored states instead of all 4), on the
  setting's own config (FedEMA-BYOL, small_cnn) over synthetic Fashion-MNIST-shaped clients."""
  fed, ds = round_speed._data((28, 28, 1), 4, 32)
  mb = {}
  for placement in ('device', 'host'):
    config = scale._scale_config(4, 2.0, placement)
    config.clients_per_round = 2
    algo = experiment.build_algorithm(config, ds)
    step = rd.make_round_step(algo, experiment.round_config(config), 4)
    state = rd.init_state(algo, jax.random.PRNGKey(0), 4, client_state=placement)
    mb[placement] = scale._device_program_mb(step, state, fed, jax.random.PRNGKey(1), 2)
  # The stored states are FedEMA's per-client models: at least one client's fewer on the device.
  one_client = round_speed.tree_mb(jax.tree_util.tree_map(lambda a: a[0], state.clients))
  assert 0 < mb['host'] < mb['device'] - one_client, (mb, one_client)


def test_flops_per_step_counts_both_views_with_flip_and_one_without_augmentation():
  """'none' gives two identical views, which XLA computes once: the reason the benchmark's
  model-compute rows use 'flip' (views that differ, as PyTorch's two input tensors do)."""
  s = _tiny()
  flip = round_speed.flops_per_client_step(s, 'small_cnn', 'flip')
  none = round_speed.flops_per_client_step(s, 'small_cnn', 'none')
  # The step's flops are dominated by the two views' forward and backward passes (~0.2 GFLOP at
  # batch 8); one shared view leaves about half.
  assert 0.15e9 < flip < 0.3e9, flip
  np.testing.assert_allclose(none / flip, 0.5, atol=0.03)


def test_pytorch_variants_keep_their_name_whatever_the_precisions():
  """`targets` finds the references by name: on the H200 (PERF-52) a bf16-only run reported the
  TF32 loop as 'torch/bfloat16' and printed no ratio."""
  s = settings.make(precisions=['bfloat16', 'float32'])
  assert round_speed.variant_precisions(s, ['vmap', 'map/float32', 'torch', 'torch_union']) == [
      ('vmap/bfloat16', 'vmap', 'bfloat16'), ('map/float32', 'map', 'float32'),
      ('torch', 'torch', 'bfloat16'), ('torch_union', 'torch_union', 'bfloat16'),
      ('vmap', 'vmap', 'float32')]


@pytest.mark.slow
def test_benchmark_times_each_variant_at_each_precision_with_mfu():
  _, row = round_speed.run(_tiny(variants=['map'], precisions=['float32', 'bfloat16'],
                                 peak_tflops=['0.5']))
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
  # bound u failed there), 1.05 u at the suite's fast level (this test's, in-process). Bound 2 u.
  np.testing.assert_allclose(bf16['loss'], f32['loss'], rtol=2 ** -7)


@pytest.mark.slow
def test_benchmark_conv_impl_reaches_the_round_and_the_record():
  # The GPU check's `conv` part times the round with im2col convolutions (PERF-50): the setting must
  # reach the model (a different program) yet train the same function, so the round's loss (the
  # first local step's, before its update, from the same initial model) agrees to float32 rounding
  # of sums over a few hundred products (rtol 1e-5).
  losses = {}
  for impl in ('xla', 'im2col'):
    info, row = round_speed.run(_tiny(variants=['vmap'], conv_impl=impl))
    assert info['conv_impl'] == impl
    losses[impl] = row['results']['vmap']['loss']
  np.testing.assert_allclose(losses['im2col'], losses['xla'], rtol=1e-5)


@pytest.mark.parametrize('given, message', [
    (dict(precisions=['float16']), "--precisions = 'float16' is invalid: 'float16' is not one of "
                                   "['float32', 'bfloat16']"),
    (dict(precisions=['float32', 'bfloat16'], peak_tflops=['67', '989', '1']),
     "--peak_tflops = '67,989,1' is invalid: give one value, or one per --precisions entry (2)"),
    (dict(peak_tflops=['0']), "--peak_tflops = '0' is invalid: must be numbers > 0 (TFLOP/s)"),
    (dict(setting='scale', precisions=['bfloat16']),
     "--precisions = 'bfloat16', --peak_tflops = '' are invalid with --setting=scale: it times "
     'float32 only and reports no mfu'),
    (dict(clients=['10', 'x']), "--clients = '10,x' is invalid: must be comma-separated integers "
                                '>= 1'),
    (dict(variants=['vmap/float16']), "--variants = 'vmap/float16' is invalid: 'vmap/float16' "
                                      "names a precision not in ['float32', 'bfloat16']"),
    (dict(batch_size=1), '--batch_size = 1 is invalid: must be an integer >= 2'),
    (dict(setting='gpu'), "--setting = 'gpu' is invalid: must be one of ['byol', 'cross_device', "
                          "'scale', 'conv_layers']"),
    (dict(setting='scale', processes=['2', '0']), "--processes = '2,0' is invalid: must be "
                                                  'comma-separated integers >= 1'),
    (dict(processes=['2']), "--processes = '2' is invalid with --setting = 'byol': only the "
                            'scale setting measures placements'),
], ids=['precision', 'peak_count', 'peak_zero', 'scale_precision', 'clients', 'variant_precision',
        'batch_size', 'setting', 'processes', 'processes_setting'])
def test_bad_settings_are_refused_when_built(given, message):
  with pytest.raises(cv.ConfigError) as e:
    settings.make(**given)
  assert str(e.value) == message


def test_the_settings_are_frozen_and_checked_again_when_replaced():
  s = settings.make()
  with pytest.raises(AttributeError):
    s.repeats = 5  # pytype: disable=not-writable
  with pytest.raises(cv.ConfigError, match='--repeats = 0 is invalid'):
    dataclasses.replace(s, repeats=0)


def _parse(*argv) -> settings.Settings:
  fv = flags.FlagValues()
  cli.define_flags(fv)
  fv(['benchmark', *argv])
  return cli.settings_from_flags(fv)


def test_flags_become_the_settings_over_the_setting_defaults():
  assert _parse() == settings.Settings()
  assert _parse('--models=small_cnn', '--nointerleave', '--peak_tflops=67,989',
                '--precisions=float32,bfloat16') == settings.Settings(
                    models=('small_cnn',), interleave=False, peak_tflops=('67', '989'),
                    precisions=('float32', 'bfloat16'))
  cd = _parse('--setting=cross_device', '--clients=20', '--batch_size=64')
  # The setting's defaults fill what was not given; a given flag wins, even at its plain default.
  assert (cd.models, cd.clients, cd.participants, cd.batch_size, cd.augmentations) == (
      ('cross_device_cnn',), ('20',), 50, 64, ('none',))
  scale = _parse('--setting=scale')
  assert (scale.clients, scale.variants, scale.repeats) == (
      ('10', '100', '1000'), ('vmap_before', 'vmap', 'vmap_host'), 5)
  with pytest.raises(cv.ConfigError, match="--precisions = 'float16' is invalid"):
    _parse('--precisions=float16')


def test_every_settings_field_is_a_flag_with_the_same_default():
  fv = flags.FlagValues()
  cli.define_flags(fv)
  for name, default in settings.DEFAULTS.items():
    value = fv[name].value
    assert (tuple(value) if isinstance(value, list) else value) == default, name


@pytest.mark.slow
def test_the_command_line_writes_the_results_file(tmp_path):
  """The binary itself, once: flags parsed, the setting run, {'info', 'rows'} written to --out."""
  out = tmp_path / 'bench.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'experiments.benchmark', f'--out={out}', '--models=small_cnn',
       '--clients=2', '--local_steps=1', '--batch_size=8', '--repeats=1', '--augmentations=flip',
       '--variants=vmap', '--notorch', '--conv_impl=xla'],
      cwd=REPO, env=subprocess_env.binary_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip().splitlines()[-1] == f'wrote {out}'
  report = json.loads(out.read_text())
  assert (report['info']['setting'], report['info']['conv_impl']) == ('byol', 'xla')
  (row,) = report['rows']
  assert (row['model'], row['clients'], set(row['results'])) == ('small_cnn', 2, {'vmap'})
