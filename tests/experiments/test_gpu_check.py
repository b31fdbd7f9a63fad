"""scripts/gpu_check.sh, the prepared GPU check, run on the CPU with SMOKE=1 (a tiny model and
round): its 'auto' part trains twice through the binary's caches and its 'export' part twice
through the exported round, each leaving the files a GPU lease brings back; a wrong part name is
one error line. (The 'core', 'conv' and 'extra' parts run the benchmark and
experiments.fedu2.timing, whose flags their own tests check.)"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests import subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_auto_part_measures_then_reads_the_caches(tmp_path):
  # A CPU has one candidate strategy: two, so that the first run measures as on a GPU.
  env = dict(subprocess_env.binary_env(), SMOKE='1', OUT=str(tmp_path), PYTHON=sys.executable,
             FEDJAX_SSL_AUTOTUNE='map1,vmap')
  out = subprocess.run(['bash', 'scripts/gpu_check.sh', 'auto'], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == [
      'check_auto.log', 'env_auto.json', 'strategy_cache.json', 'train_first_results.json',
      'train_second_results.json']
  first = json.loads((tmp_path / 'train_first_results.json').read_text())
  second = json.loads((tmp_path / 'train_second_results.json').read_text())
  assert (first['strategy']['source'], second['strategy']['source']) == ('measured', 'cache')
  assert second['first_round']['persistent_cache_hits'] >= 1
  log = (tmp_path / 'check_auto.log').read_text()
  assert '=== train_second: exit 0' in log and 'the fastest by measurement' in log
  assert json.loads((tmp_path / 'env_auto.json').read_text())['devices'] == ['cpu:cpu']


@pytest.mark.slow
def test_export_part_second_run_loads_its_round_untraced(tmp_path):
  """Issue 65 item 4 through the binary: the second run's results.json says the round was loaded
  from its export, traced in at most a quarter of the first run's time, to the same numbers."""
  env = dict(subprocess_env.binary_env(), SMOKE='1', OUT=str(tmp_path), PYTHON=sys.executable)
  out = subprocess.run(['bash', 'scripts/gpu_check.sh', 'export'], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == [
      'check_export.log', 'env_export.json', 'export_first_results.json',
      'export_second_results.json']
  first, second = (json.loads((tmp_path / f'export_{r}_results.json').read_text())
                   for r in ('first', 'second'))
  a, b = first['first_round'], second['first_round']
  assert (a['export'], b['export']) == ('written', 'loaded')
  assert b['trace_seconds'] <= 0.25 * a['trace_seconds'], (a, b)
  assert b['persistent_cache_hits'] >= 1 and b['process_seconds_at_start'] > 0
  total = lambda r: r['setup_compile_seconds'] + r['compile_seconds']  # noqa: E731
  assert total(b) < total(a), (a, b)
  assert second['final'] == first['final']
  log = (tmp_path / 'check_export.log').read_text()
  assert '=== export_second: exit 0' in log and '.jaxexport' in log


@pytest.mark.slow
def test_packed_part_times_packed_and_measured_and_brings_back_the_choices(tmp_path):
  env = dict(subprocess_env.binary_env(), SMOKE='1', OUT=str(tmp_path), PYTHON=sys.executable)
  out = subprocess.run(['bash', 'scripts/gpu_check.sh', 'packed'], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == [
      'check_packed.log', 'conv_impl_choices.json', 'conv_measured.json', 'conv_packed.json',
      'env_packed.json']
  measured = json.loads((tmp_path / 'conv_measured.json').read_text())
  choices = json.loads((tmp_path / 'conv_impl_choices.json').read_text())
  # small_cnn: two convolutions, their kernel gradients and conv2's input gradient.
  assert len(choices) == 5 and set(measured['info']['conv_choices']) == set(choices)
  assert json.loads((tmp_path / 'conv_packed.json').read_text())['info']['conv_impl'] == 'packed'
  log = (tmp_path / 'check_packed.log').read_text()
  assert '=== packed: exit 0' in log and '=== measured: exit 0' in log
  assert log.count(' -> ') >= 5  # every convolution's candidate times and choice


@pytest.mark.slow
def test_pallas_part_times_every_layer_under_every_impl(tmp_path):
  """SMOKE: two tiny layers, the Pallas kernel interpreted (the GPU runs ResNet-18's 11 shapes)."""
  env = dict(subprocess_env.binary_env(), SMOKE='1', OUT=str(tmp_path), PYTHON=sys.executable)
  out = subprocess.run(['bash', 'scripts/gpu_check.sh', 'pallas'], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == [
      'check_pallas.log', 'env_pallas.json', 'pallas_layers_bf16.json',
      'pallas_layers_bf16_t128.json']
  for name, impls, tiles in (('bf16', {'pallas', 'grouped', 'vmap'}, [64, 64, 32]),
                             ('bf16_t128', {'pallas'}, [128, 128, 32])):
    info, *rows = json.loads((tmp_path / f'pallas_layers_{name}.json').read_text())
    assert info['clients'] == 3 and len(rows) == 2
    assert [info['tiles'][t] for t in 'MNK'] == tiles
    assert all(set(r['seconds']) == impls for r in rows)
  log = (tmp_path / 'check_pallas.log').read_text()
  assert '=== layers_bf16: exit 0' in log and '=== layers_t128: exit 0' in log


def test_unknown_part_is_one_error_line(tmp_path):
  out = subprocess.run(['bash', 'scripts/gpu_check.sh', 'all'], cwd=REPO, capture_output=True,
                       text=True, env=dict(os.environ, OUT=str(tmp_path)), timeout=60)
  assert out.returncode == 1
  assert out.stderr.strip() == (
      "error: part = 'all' is invalid: must be core, conv, packed, pallas, extra, seeds, auto or export")


@pytest.mark.slow
def test_seeds_part_times_ours_beside_the_pytorch_rounds(tmp_path):
  """Issue 65 item 5's part at the reduced size, one method (FedEMA): our round, the eager loop
  and the union-batch model timed in one process, the paper-round estimate in the row."""
  pytest.importorskip('torch')
  env = dict(subprocess_env.binary_env(), SMOKE='1', OUT=str(tmp_path), PYTHON=sys.executable,
             SEEDS='fedema:600:1')
  out = subprocess.run(['bash', 'scripts/gpu_check.sh', 'seeds'], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == ['check_seeds.log', 'env_seeds.json',
                                          'seeds_fedema.json']
  row, = json.loads((tmp_path / 'seeds_fedema.json').read_text())['rows']
  assert set(row['results']) == {'ours', 'torch', 'torch_union_fp32'}
  assert set(row['ratios']) == {'speedup_vs_eager_loop', 'time_vs_union'}
  for r in row['results'].values():  # the reduced size gives no paper-round estimate
    assert r['seconds_per_round'] > 0 and 'paper_round_seconds' not in r
  assert '=== seeds_fedema: exit 0' in (tmp_path / 'check_seeds.log').read_text()
