"""The benchmark's helpers for the GPU check: the device-time summary of a profiler trace
(experiments/profile_summary.py) on a trace whose numbers are known, the issue-46 target ratios of a
row, and the PyTorch references (experiments/torch_round.py; skipped where torch is not installed,
as in CI: it is a benchmark-only extra)."""
import gzip
import json

import numpy as np
import pytest

from experiments import profile_summary
from experiments.benchmark import round_speed


def _trace(path):
  """A Perfetto trace as XLA:GPU writes it: a host process, a device process with two kernel
  streams and an 'XLA Ops' row that overlaps them (not kernels: left out)."""
  meta = [
      {'ph': 'M', 'pid': 1, 'name': 'process_name', 'args': {'name': '/host:CPU'}},
      {'ph': 'M', 'pid': 2, 'name': 'process_name', 'args': {'name': '/device:GPU:0'}},
      {'ph': 'M', 'pid': 2, 'tid': 10, 'name': 'thread_name', 'args': {'name': 'Stream #13(Compute)'}},
      {'ph': 'M', 'pid': 2, 'tid': 11, 'name': 'thread_name', 'args': {'name': 'Stream #14(MemcpyD2D)'}},
      {'ph': 'M', 'pid': 2, 'tid': 12, 'name': 'thread_name', 'args': {'name': 'XLA Ops'}},
  ]
  def x(pid, tid, ts, dur, name):
    return {'ph': 'X', 'pid': pid, 'tid': tid, 'ts': ts, 'dur': dur, 'name': name}
  events = meta + [
      x(1, 1, 0, 500, 'python'),
      x(2, 10, 100, 50, 'sm90_xmma_fprop_implicit_gemm_bf16'),   # 100-150
      x(2, 10, 160, 40, 'loop_add_fusion'),                      # 160-200
      x(2, 11, 180, 40, 'memcpy32_post'),                        # 180-220 (overlaps 20)
      x(2, 10, 300, 50, 'sm90_xmma_fprop_implicit_gemm_bf16'),   # 300-350
      x(2, 12, 100, 250, 'fusion.1'),                            # an op row: not a kernel
  ]
  with gzip.open(path, 'wt') as f:
    json.dump({'displayTimeUnit': 'ns', 'traceEvents': events}, f)


def test_summary_of_a_known_trace(tmp_path):
  path = tmp_path / 'perfetto_trace.json.gz'
  _trace(path)
  s = profile_summary.summarize(str(tmp_path))
  (gpu,) = s['devices'].values()
  # Kernels cover [100,150) + [160,220) + [300,350) = 160 us of the 250 us window.
  np.testing.assert_allclose([gpu['window_ms'], gpu['busy_ms'], gpu['idle_ms']],
                             [0.250, 0.160, 0.090])
  assert gpu['kernels'] == 4 and gpu['mean_kernel_us'] == pytest.approx(180 / 4)
  assert gpu['ms_by_class'] == pytest.approx({'library_gemm_conv': 0.1, 'copy': 0.04,
                                              'xla_fusion_other': 0.04})
  assert gpu['top_kernels'][0] == {'name': 'sm90_xmma_fprop_implicit_gemm_bf16', 'ms': 0.1,
                                   'count': 2, 'class': 'library_gemm_conv'}
  assert s['host_threads'] == 1
  assert 'busy 0.2 of 0.2 ms (64 %)' in profile_summary.format_summary(s)


def test_union_length_counts_overlaps_once():
  assert profile_summary.union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0
  assert profile_summary.union_length([]) == 0.0


def test_targets_of_a_row():
  res = {'map': {'seconds_per_round': 0.45}, 'vmap/bfloat16': {'seconds_per_round': 0.28},
         'sequential': {'seconds_per_round': 0.1},  # a JAX baseline loop is not "ours"
         'torch': {'seconds_per_round': 2.07}, 'torch_bf16': {'seconds_per_round': 2.32},
         'torch_union': {'seconds_per_round': 0.18}, 'shard': {'skipped': 'one device'}}
  t = round_speed.targets(res)
  assert (t['fastest_jax'], t['faster_eager_loop']) == ('vmap/bfloat16', 'torch')
  np.testing.assert_allclose(t['speedup_vs_faster_eager_loop'], 2.07 / 0.28)
  np.testing.assert_allclose(t['time_vs_union_batch'], 0.28 / 0.18)
  assert not t['meets_eager_target'] and not t['meets_union_target']
  assert round_speed.targets({'torch': {'seconds_per_round': 1.0}}) == {}


def test_torch_resnet18_is_the_library_resnet18_and_both_modes_train():
  torch = pytest.importorskip('torch')
  from experiments import torch_round  # pylint: disable=g-import-not-at-top
  from fedjax_ssl import models  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  online, _ = torch_round._networks('resnet18')  # pylint: disable=protected-access
  ours = models.get_encoder('resnet18').init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)),
                                             train=False)
  assert (sum(p.numel() for p in online().encoder.parameters()) ==
          models.count_params(ours['params']) == 11_168_832)
  torch.manual_seed(0)
  for mode, precision in (('loop', 'float32'), ('union', 'bfloat16')):
    one_round = torch_round.build_round(2, 1, 2, model='resnet18', mode=mode, precision=precision,
                                        channels_last=mode == 'union', device='cpu')
    losses = [one_round() for _ in range(2)]
    assert all(np.isfinite(losses)) and 0 < losses[0] <= 8  # BYOL's symmetric loss is in [0, 8]
  with pytest.raises(ValueError, match="mode = 'batch' is invalid"):
    torch_round.build_round(2, 1, 4, mode='batch')
