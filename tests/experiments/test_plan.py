"""experiments.plan on tiny configs: the round's memory adds up, FLOPs per round = FLOPs per step x
real steps, host-placed client state leaves the C - m stored states off the device, the --json
object's keys, exit status 2 for a round that does not fit (one line with the numbers), the refusal
of a device memory <= 0 (exit status 1), a table's estimate, the FLOP count (XLA:CPU's, exact for a
convolution and a matmul), --measure_rounds (the planned round trained on synthetic images of
the planned client sizes) and --hosts / --devices_per_host (per device and per host, today and once
clients are placed, against a hand count; bad counts refused in one line)."""
import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from experiments import plan
from fedjax_ssl.core import compilation
from configs import quickstart
from fedjax_ssl import configuration, experiment, tables
from fedjax_ssl import config_validation as cv
from fedjax_ssl.data import partition
from tests import subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[2]
# A tiny FedU on synthetic 32x32x3 images (sizes known without loading): a stateful algorithm, so
# the stored states are real arrays, 6 clients of which 2 train, 4 steps of batch 8 each.
TINY = dict(dataset='synthetic', train_size=192, num_clients=6, clients_per_round=2,
            partition='iid', algorithm='fedu', ssl_method='byol', encoder='small_cnn',
            heads='custom', proj_hidden=16, proj_out=8, pred_hidden=16, pred_out=8,
            augmentation='flip', batch_size=8, local_epochs=1, rounds=3, strategy='map', knn_k=8,
            probe='adam')


def _config(**overrides):
  """configs/quickstart.py with TINY, as the binary's command line below builds it."""
  c = quickstart.get_config()
  c.update(dict(TINY, **overrides))
  return c


def _run(*flags):
  env = subprocess_env.binary_env(optimized=True)  # plan reports compiled memory
  cmd = [sys.executable, '-m', 'experiments.plan', '--config=configs/quickstart.py']
  cmd += [f'--config.{k}={v}' for k, v in TINY.items()] + list(flags)
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope='module')
def too_small():
  """The binary on TINY with --json and a device of 1 MiB: the round does not fit."""
  return _run('--json', '--device_memory_gb=0.001')


@pytest.fixture(scope='module')
def device_plan(too_small):
  return json.loads(too_small.stdout)


def test_memory_adds_up_and_flops_are_steps_times_step(device_plan):
  p = device_plan
  assert p['bytes_per_device'] == (p['input_bytes'] + p['output_bytes'] - p['alias_bytes'] +
                                   p['temp_bytes'] + p['generated_code_bytes'])
  assert p['input_bytes'] >= p['argument_bytes'] > 6 * p['stored_client_bytes'] > 0
  assert p['alias_bytes'] > 0  # the donated state
  assert p['steps_per_round'] == 2 * (192 // 6 // 8)   # m = 2 of 6 clients, 4 steps each
  assert p['flops_per_step'] > 0 and p['xla_round_flops'] > 0
  assert p['flops_per_round'] == pytest.approx(p['flops_per_step'] * p['steps_per_round'])
  assert p['strategy'] == 'map' and p['conv_impl'] == 'xla' and p['target'] == 'gpu'


def test_host_client_state_keeps_the_other_clients_off_the_device(device_plan):
  host = plan.plan(_config(client_state='host'), device_memory_gb=80)
  assert host['fits']
  # The device holds 2 participants' stored states instead of 6.
  assert host['input_bytes'] == pytest.approx(
      device_plan['input_bytes'] - 4 * device_plan['stored_client_bytes'], rel=1e-6)
  assert host['alias_bytes'] == 0 and host['flops_per_round'] == device_plan['flops_per_round']


# TINY's federated data by hand: 192 images of 32x32x3 uint8, 192 int32 labels, 6 int32 sizes and
# 6 int32 offsets (no public set).
TINY_DATA_BYTES = 192 * 32 * 32 * 3 + 192 * 4 + 6 * 4 * 2


# placement 'divided': the 4 participants' padded views (n_max 32 rows each: TINY's 192 images cut
# IID over 6 clients) of 32x32x3 uint8 and int32 labels, the 6 sizes and offsets.
TINY_ROUND_BYTES = 4 * 32 * (32 * 32 * 3 + 4) + 6 * 4 * 2


def _ceil_div(a, b):
  return -(-a // b)


def test_hosts_and_devices_divide_the_participants_and_divided_placement_the_data():
  # 2 hosts x 2 GPUs, 4 participants: each device trains 1; the data and the 6 stored states are
  # on every device whole, and every host loads the whole data.
  p = plan.plan(_config(clients_per_round=4), hosts=2, devices_per_host=2)
  one = plan.plan(_config(clients_per_round=1, strategy='vmap'))  # one device's program, by hand
  assert (p['devices'], p['participants_per_device'], p['strategy'], p['map_chunk_size']) == (
      4, 1, 'shard', 1)
  assert p['replicated_data_bytes'] == TINY_DATA_BYTES
  assert p['replicated_client_state_bytes'] == 6 * one['stored_client_bytes'] > 0
  assert p['bytes_per_device'] == one['total_bytes'] == p['total_bytes']
  assert p['input_bytes'] == one['input_bytes']  # the 6 stored states and the data, whole
  assert p['bytes_per_host'] == TINY_DATA_BYTES   # GPU target, device-resident states
  # placement 'divided': every device gets the 4 participants' padded rows in place of the data,
  # and the 4 participants' stored states in place of the 6; a host's first device holds its 3
  # clients' states too. Each host holds half the data and those rows.
  s = one['stored_client_bytes']
  assert p['round_data_bytes_divided'] == TINY_ROUND_BYTES
  assert p['bytes_per_device_divided'] == (one['total_bytes'] - TINY_DATA_BYTES + TINY_ROUND_BYTES
                                           + (3 + 4 - 6) * s)
  assert p['bytes_per_host_divided'] == _ceil_div(TINY_DATA_BYTES, 2) + TINY_ROUND_BYTES
  # FLOPs are the whole round's: 4 participants of 4 steps.
  assert p['steps_per_round'] == 4 * (192 // 6 // 8)
  assert p['fits'] and 'per host, replicated' in plan.text(p)
  assert 'with --config.placement=divided: per device' in plan.text(p)


def test_host_resident_states_are_in_every_process_and_on_a_cpu_target_so_are_its_devices():
  # 1 CPU host with 2 devices, client_state 'host', 4 participants: each device's program trains
  # 2, but all 4 participants' states arrive on every device (and leave it) replicated.
  p = plan.plan(_config(clients_per_round=4, client_state='host'), hosts=1, devices_per_host=2,
                target='cpu')
  one = plan.plan(_config(clients_per_round=2, client_state='host', strategy='map',
                          map_chunk_size=1), target='cpu')
  s = one['stored_client_bytes']
  assert p['participants_per_device'] == 2 and p['map_chunk_size'] == 1
  assert p['bytes_per_device'] == one['total_bytes'] + 2 * (4 - 2) * s
  assert p['bytes_per_device'] == (p['input_bytes'] + p['output_bytes'] - p['alias_bytes'] +
                                   p['temp_bytes'] + p['generated_code_bytes'])
  assert p['replicated_client_state_bytes'] == 4 * s
  assert p['host_client_state_bytes'] == 6 * s
  assert p['bytes_per_host'] == TINY_DATA_BYTES + 6 * s + 2 * p['bytes_per_device']
  divided = p['bytes_per_device'] - TINY_DATA_BYTES + TINY_ROUND_BYTES
  assert p['bytes_per_device_divided'] == divided
  assert p['bytes_per_host_divided'] == TINY_DATA_BYTES + 6 * s + TINY_ROUND_BYTES + 2 * divided


def test_divided_device_state_is_cut_per_cohort():
  """A mix (cohorts of 3 and 5 clients, a and b bytes each) on 2 hosts, 4 participants a round:
  each host's first device holds ⌈3/2⌉ + ⌈5/2⌉ states and every device min(4, C_c) participants
  of each cohort, in place of the 3a + 5b replicated states (ENG-95 counted ⌈8/2⌉ + 4 of one size)."""
  config = ml_collections.ConfigDict(dict(clients_per_round=4, num_clients=8,
                                          client_state='device'))
  a, b, data, rows = 1000, 3000, 10_000, 500
  mem = {'total_bytes': 100_000}
  topo = plan.topology(config, mem, data, rows, (3 * a + 5 * b) // 8, 2, 1, 'gpu',
                       cohort_states=[(3, a), (5, b)])
  assert topo['bytes_per_device_divided'] == (100_000 - data + rows + (2 * a + 3 * b)
                                              + (3 * a + 4 * b) - (3 * a + 5 * b))
  one = plan.topology(config, mem, data, rows, a, 2, 1, 'gpu')  # one cohort: C = 8 of a bytes
  assert one['bytes_per_device_divided'] == 100_000 - data + rows + (4 + 4 - 8) * a


@pytest.mark.parametrize('hosts, devices, m, message', [
    (0, 1, 4, '--hosts = 0 is invalid: must be an integer >= 1'),
    (1, -2, 4, '--devices_per_host = -2 is invalid: must be an integer >= 1'),
    (True, 1, 4, '--hosts = True is invalid: must be an integer >= 1'),
    (1, 3, 4, "clients_per_round = 4 is invalid with --hosts=1 x --devices_per_host=3 = 3 devices: "
              "strategy 'shard' gives every device the same number of participants, so it must be "
              "a multiple of 3 (e.g. 3 or 6)"),
    (2, 4, 4, 'a multiple of 8 (e.g. 8)'),
])
def test_bad_host_and_device_counts_are_refused(hosts, devices, m, message):
  with pytest.raises(cv.ConfigError, match=re.escape(message)):
    plan.check_topology(hosts, devices, m)


def test_participants_that_do_not_divide_are_one_line_from_the_binary():
  out = _run('--hosts=1', '--devices_per_host=4', '--config.clients_per_round=6')
  assert out.returncode == 1 and not out.stdout
  assert out.stderr.strip().splitlines()[-1] == (
      "error: clients_per_round = 6 is invalid with --hosts=1 x --devices_per_host=4 = 4 devices: "
      "strategy 'shard' gives every device the same number of participants, so it must be a "
      "multiple of 4 (e.g. 4 or 8)")
  assert 'Traceback' not in out.stderr


def test_client_sizes_are_those_of_the_partition():
  config = _config(partition='dirichlet', alpha=0.3, train_size=0)
  info = configuration.dataset_info(config)
  labels = plan.balanced_labels(info.num_train, info.num_classes)
  parts = partition.partition(labels, 6, 'dirichlet', seed=0, alpha=0.3, num_classes=10)
  np.testing.assert_array_equal(plan.client_sizes(config, info), [len(p) for p in parts])


def test_json_and_exit_status_2_when_the_round_does_not_fit(too_small):
  assert too_small.returncode == plan.EXIT_DOES_NOT_FIT, too_small.stderr[-2000:]
  p = json.loads(too_small.stdout)  # exactly one JSON object on stdout
  for key in ('bytes_per_device', 'flops_per_round', 'fits', 'flops_per_step', 'steps_per_round',
              'argument_bytes', 'output_bytes', 'temp_bytes', 'generated_code_bytes',
              'alias_bytes', 'input_bytes', 'usable_bytes'):
    assert key in p, key
  assert p['fits'] is False and p['usable_bytes'] < p['bytes_per_device']
  error = [line for line in too_small.stderr.splitlines() if line.startswith('error: ')]
  assert len(error) == 1 and 'does not fit' in error[0] and 'GiB' in error[0], error


@pytest.mark.parametrize('memory', ['0', '-8'])
def test_a_device_memory_of_zero_or_less_is_refused(memory):
  out = _run(f'--device_memory_gb={memory}')
  assert out.returncode == 1
  assert f'error: --device_memory_gb = {float(memory):g} is invalid: must be > 0' in out.stderr
  assert 'Traceback' not in out.stderr and not out.stdout


def test_table_estimate_is_the_sum_of_its_runs():
  path = str(REPO / 'configs/repshare/fig3.py')
  e = plan.table_estimate(path, 'quick', seeds=[0], tflops=10)
  # One step compiled per variant: lambda_kd and lambda_disc each zero (that term off) or not.
  assert e['runs'] == 25 and len(e['groups']) == 4
  assert sum(g['runs'] for g in e['groups'].values()) == 25
  config = tables.cell_config(tables.load_table(path, 'quick'), 'lambda_kd=0',
                              'lambda_disc=0', seed=0)
  sizes = plan.client_sizes(config, configuration.dataset_info(config))
  steps = config.rounds * plan.real_steps(sizes, config)  # the same clients in every run
  for g in e['groups'].values():
    assert g['flops'] == pytest.approx(g['runs'] * steps * g['flops_per_step'][0])
  assert e['flops_total'] == pytest.approx(sum(g['flops'] for g in e['groups'].values()))
  assert e['hours'] == pytest.approx(e['flops_total'] / 10e12 / 3600)


def test_xla_flops_counts_a_convolution_and_a_matmul_exactly():
  # VALID convolution: every output element is Cin * K * K multiply-adds (2 FLOPs each).
  x, w = np.ones((4, 3, 10, 10), np.float32), np.ones((5, 3, 3, 3), np.float32)
  conv = compilation.xla_flops(lambda x, w: jax.lax.conv(x, w, (1, 1), 'VALID'), x, w)
  assert conv == 2 * 4 * 5 * 8 * 8 * 3 * 3 * 3
  a, b = np.ones((7, 11), np.float32), np.ones((11, 13), np.float32)
  assert compilation.xla_flops(jnp.matmul, a, b) == 2 * 7 * 11 * 13


def test_xla_flops_without_a_cpu_backend_counts_on_the_default_one(monkeypatch):
  def no_cpu(backend=None):
    raise RuntimeError(f'Unknown backend {backend}')
  monkeypatch.setattr(jax, 'local_devices', no_cpu)
  a, b = np.ones((7, 11), np.float32), np.ones((11, 13), np.float32)
  assert compilation.xla_flops(jnp.matmul, a, b) == 2 * 7 * 11 * 13  # here the default is the CPU


def test_the_synthetic_stand_in_has_the_planned_client_sizes():
  # Dirichlet with a public set carved out: the partition draws depend on the class counts only.
  config = plan.resolve_for(_config(partition='dirichlet', alpha=0.3, public_size=16), 'cpu')
  info = configuration.dataset_info(config)
  fed, _ = experiment.build_fed_data(config, plan.synthetic_dataset(config, info))
  np.testing.assert_array_equal(np.asarray(fed.n), plan.client_sizes(config, info))


def test_measure_trains_the_planned_round_and_reports_its_time():
  p = plan.plan(_config(), target='cpu', measure_rounds=2)
  m = p['measured']
  assert m['rounds_timed'] == 2 and m['first_round_seconds'] > 0 and m['seconds_per_round'] > 0
  assert m['flops_per_second'] == pytest.approx(p['flops_per_round'] / m['seconds_per_round'])
  assert m['peak_device_bytes'] is None  # XLA:CPU keeps no memory statistics
  assert 'measured on cpu' in plan.text(p) and 'n/a' in plan.text(p)
  host = plan.plan(_config(client_state='host'), target='cpu', measure_rounds=1)['measured']
  assert host['rounds_timed'] == 1 and host['seconds_per_round'] > 0  # its own round_step
  tiny = plan.plan(_config(), device_memory_gb=0.001, measure_rounds=2)
  assert not tiny['fits'] and 'measured' not in tiny  # a round planned not to fit is not run
  with pytest.raises(plan.cv.ConfigError, match=r'--measure_rounds = -1 is invalid: must be >= 0'):
    plan.plan(_config(), measure_rounds=-1)
