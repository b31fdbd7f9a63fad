"""The per-layer convolution benchmark's candidates compute `lax.conv_general_dilated` and its two
gradients (float64), and the benchmark setting reports what it measured."""
import functools
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import conv_layers
from experiments.benchmark import settings
from fedjax_ssl import config_validation as cv
from tests import subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[2]

# (batch, H, W, cin, cout, k, pads): the layers' 3x3 / padding 1, a 5x5 VALID one (LeNet,
# hetero_cnn), asymmetric padding, a 1x1 kernel and a non-square input; batch 16 for chunk16.
CASES = [
    (16, 8, 8, 3, 5, 3, ((1, 1), (1, 1))),
    (16, 9, 7, 4, 6, 5, ((0, 0), (0, 0))),
    (16, 6, 6, 2, 3, 3, ((2, 0), (0, 1))),
    (16, 5, 5, 3, 4, 1, ((0, 0), (0, 0))),
]


@pytest.fixture
def x64():
  jax.config.update('jax_enable_x64', True)
  yield
  jax.config.update('jax_enable_x64', False)


@pytest.mark.parametrize('name', sorted(set(conv_layers.CANDIDATES) - {'pallas'}))
def test_every_candidate_is_the_convolution_and_its_gradients(name, x64):
  del x64
  conv = conv_layers.CANDIDATES[name]
  for b, h, w, cin, cout, k, pads in CASES:
    keys = jax.random.split(jax.random.PRNGKey(b + h + k), 3)
    x = jax.random.normal(keys[0], (b, h, w, cin), np.float64)
    kernel = jax.random.normal(keys[1], (k, k, cin, cout), np.float64)
    y_ref, vjp_ref = jax.vjp(lambda x, kk: conv_layers.conv_xla(x, kk, pads), x, kernel)
    y, vjp = jax.vjp(lambda x, kk: conv(x, kk, pads), x, kernel)
    g = jax.random.normal(keys[2], y_ref.shape, np.float64)
    assert y.shape == y_ref.shape and y.dtype == np.float64
    # Sums of at most k*k*cin products of O(1) terms: float64 rounding is ~1e-15 relative.
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(vjp(g), vjp_ref(g)):
      np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-11)


def test_the_setting_reports_each_layer_against_its_gemms(tmp_path):
  rows = conv_layers.run(['im2col', 'rows', 'chunk16'], repeats=1,
                         layer_names=['cross_device_cnn/conv2'])
  (row,) = rows
  assert row['library_conv_impl'] == 'im2col'  # the CPU backend's conv_impl='auto'
  np.testing.assert_allclose(row['mflop_per_gemm'], 2 * 10 * 16 * 16 * 288 * 64 / 1e6)
  assert set(row['gflops']) == {'im2col', 'rows'}   # chunk16 needs a batch multiple of 16
  for v, rate in row['gflops'].items():
    assert rate > 0 and np.isclose(row['ratio_to_gemms'][v], rate / row['gemms_gflops'])


def test_an_unknown_candidate_is_refused_before_compute():
  with pytest.raises(cv.ConfigError, match=r"^--variants = 'im2col,winograd' is invalid: "
                                           r"'winograd' is not one of \['xla', 'im2col'"):
    settings.make(setting='conv_layers', variants=['im2col', 'winograd'])


def test_the_pallas_candidate_is_the_convolution_and_its_gradients():
  """float32 (the kernel has no float64), interpreted here: one 3x3 and the 1x1 case. Each value
  is a float32 sum of at most L = max(k*k*cin, k*k*cout, b*Ho*Wo) products on both sides, so
  |ours - XLA| <= 2 * L * 2**-24 * sum|a*b| (tests/ops/test_pallas_conv.py derives it), below
  1e-4 of the largest value for these sizes."""
  assert 'pallas' not in conv_layers.default_variants() or jax.default_backend() == 'gpu'
  for b, h, w, cin, cout, k, pads in (CASES[2], CASES[3]):
    keys = jax.random.split(jax.random.PRNGKey(b + h + k), 3)
    x = jax.random.normal(keys[0], (b, h, w, cin))
    kernel = jax.random.normal(keys[1], (k, k, cin, cout))
    g = jax.random.normal(keys[2], conv_layers.conv_xla(x, kernel, pads).shape)

    def all3(conv, x, kk, pads=pads):
      y, vjp = jax.vjp(lambda x, kk: conv(x, kk, pads), x, kk)
      return (y,) + vjp(g)
    got3 = jax.jit(functools.partial(all3, conv_layers.conv_pallas))(x, kernel)
    for got, want in zip(got3, all3(conv_layers.conv_xla, x, kernel)):
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.max(np.abs(want))))


@pytest.mark.slow
def test_the_grouped_layers_program_writes_each_impls_times(tmp_path):
  """python -m experiments.conv_layers --smoke: every impl of GROUPED_IMPLS per layer, in JSON
  (pallas interpreted here)."""
  env = subprocess_env.binary_env(optimized=True)
  out = tmp_path / 'g.json'
  proc = subprocess.run([sys.executable, '-m', 'experiments.conv_layers', '--smoke', '--clients=2',
                         '--batch=2', '--repeats=1', f'--out={out}'], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  info, *rows = json.loads(out.read_text())
  assert info['pallas_native'] is False and [r['layer'] for r in rows] == ['tiny', 'tiny.down']
  for r in rows:
    assert set(r['seconds']) == set(conv_layers.GROUPED_IMPLS) and min(r['seconds'].values()) > 0
