"""The quickstart's numbers have one home, its runs' results.json: the grid in
docs/results/quickstart/table.md and the README's expected table are `experiments.seed_table`'s
output over them, and this fails when either drifts."""
import json
import pathlib

import pytest

from experiments import seed_table

REPO = pathlib.Path(__file__).resolve().parents[2]
QUICKSTART = REPO / 'docs' / 'results' / 'quickstart'


def _results():
  return [json.loads((QUICKSTART / f'seed{s}.results.json').read_text()) for s in range(3)]


def test_grid_is_mean_and_sample_std_in_percent():
  runs = [{'final': {k: v}, 'random_init': {k: 0.5}, 'raw_pixels': {k: 0.6}}
          for v in (0.80, 0.82, 0.84) for k in ('probe_acc',)]
  for run in runs:
    for key, _ in seed_table.ROWS:
      for part in ('final', 'random_init', 'raw_pixels'):
        run[part].setdefault(key, run[part]['probe_acc'])
  label, trained, init, pixels, over_init, over_pixels = seed_table.grid(runs)[0]
  assert (label, trained, init, pixels) == ('linear probe', '82.00 ± 2.00', '50.00', '60.00')
  assert over_init == '+30.00 / +32.00 / +34.00' and over_pixels == '+20.00 / +22.00 / +24.00'


@pytest.mark.parametrize('doc', ['README.md', 'docs/results/quickstart/table.md'])
def test_the_quickstart_tables_are_the_committed_results(doc):
  text = (REPO / doc).read_text()
  for row in seed_table.markdown(_results()).splitlines()[2:]:
    assert row in text, f'{doc} lacks or changed the row {row!r}: regenerate it with ' \
                        '`python -m experiments.seed_table docs/results/quickstart/seed*.results.json`'
