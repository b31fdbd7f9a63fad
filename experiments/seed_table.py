r"""The table of one config over seeds: mean ± sample std of the trained encoder, its random-init
encoder and raw pixels, from the runs' results.json (the quickstart's table is this one).

  python -m experiments.seed_table docs/results/quickstart/seed0.results.json \
      docs/results/quickstart/seed1.results.json docs/results/quickstart/seed2.results.json

prints the markdown grid that `docs/results/quickstart/table.md` and the README hold;
`tests/experiments/test_seed_table.py` fails when either drifts from the committed results.
"""
import json
import pathlib
import sys
from typing import Dict, List, Sequence, Tuple

import numpy as np

# (results key, row label) of the grid, in order.
ROWS = (('probe_acc', 'linear probe'), ('probe_acc_1pct', 'linear probe, 1 % labels'),
        ('knn_acc', 'kNN (k = 200)'), ('knn_acc_1pct', 'kNN, 1 % labels (k = 200)'),
        ('knn_acc_1pct_k20', 'kNN, 1 % labels (k = 20)'))


def _cell(values: Sequence[float]) -> str:
  """'mean ± std' in percent (sample std; no ± for one value or none that differ)."""
  v = 100.0 * np.asarray(values, np.float64)
  if len(v) > 1 and np.ptp(v) > 0:
    return f'{v.mean():.2f} ± {v.std(ddof=1):.2f}'
  return f'{v.mean():.2f}'


def _gaps(a: Sequence[float], b: Sequence[float]) -> str:
  """'+1.00 / -0.50 / ...': a − b per seed, in points."""
  return ' / '.join(f'{100 * (x - y):+.2f}' for x, y in zip(a, b))


def grid(results: Sequence[Dict]) -> List[Tuple[str, ...]]:
  """[(row label, trained, random init, raw pixels, per-seed trained − random init, per-seed
  trained − pixels)] over the runs."""
  out = []
  for key, label in ROWS:
    trained = [r['final'][key] for r in results]
    init = [r['random_init'][key] for r in results]
    pixels = [r['raw_pixels'][key] for r in results]
    out.append((label, _cell(trained), _cell(init), _cell(pixels), _gaps(trained, init),
                _gaps(trained, pixels)))
  return out


def markdown(results: Sequence[Dict]) -> str:
  lines = ['| | trained | random init | raw pixels | trained − random init, per seed | '
           'trained − pixels, per seed |', '|---|---|---|---|---|---|']
  lines += [f'| {" | ".join(row)} |' for row in grid(results)]
  return '\n'.join(lines) + '\n'


def main(paths: Sequence[str]) -> None:
  if not paths:
    raise SystemExit('usage: python -m experiments.seed_table RESULTS.json [RESULTS.json ...]')
  sys.stdout.write(markdown([json.loads(pathlib.Path(p).read_text()) for p in paths]))


if __name__ == '__main__':
  main(sys.argv[1:])
