"""The benchmark binary on a tiny setting: every variant runs the same round (equal losses), and the
reported ratios are the measured times' ratios."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_benchmark_variants_agree_and_ratios_are_consistent(tmp_path):
  out = tmp_path / 'bench.json'
  env = dict(os.environ, PYTHONPATH=str(REPO))
  env.pop('XLA_FLAGS', None)
  subprocess.run(
      [sys.executable, '-m', 'experiments.benchmark', f'--out={out}', '--models=small_cnn',
       '--clients=3', '--local_steps=2', '--batch_size=8', '--repeats=1', '--augmentation=none',
       '--variants=stepwise,sequential,map'],
      cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
  report = json.loads(out.read_text())
  assert report['info']['default_strategy'] == 'map'
  (row,) = report['rows']
  res = row['results']
  assert set(res) == {'stepwise', 'sequential', 'map'}
  losses = [r['loss'] for r in res.values()]
  np.testing.assert_allclose(losses, losses[0], rtol=1e-4)
  for name, r in res.items():
    assert r['seconds_per_round'] > 0
    np.testing.assert_allclose(r['client_steps_per_second'] * r['seconds_per_round'], 3 * 2)
    for base in ('stepwise', 'sequential'):
      np.testing.assert_allclose(r[f'speedup_vs_{base}'],
                                 res[base]['seconds_per_round'] / r['seconds_per_round'])
  assert 'compiled_mb' in res['map'] and 'compiled_mb' not in res['stepwise']
