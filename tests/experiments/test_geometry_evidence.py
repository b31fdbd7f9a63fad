"""experiments.fedu2.evidence's geometry.md: the per-cell summary and the verdicts of --claims."""
import numpy as np
import pytest

from experiments.fedu2 import evidence


def _run(uniformity, alignment, rank):
  metrics = {'uniformity': uniformity, 'alignment': alignment, 'effective_rank': rank}
  return {'trained': metrics, 'random_init': dict(metrics, effective_rank=1.0)}


def test_claims_are_signed_so_that_better_geometry_is_a_positive_effect():
  # Row a: 0.5 more uniform (lower), equally aligned, 2 more dimensions than b at every seed, with
  # seed std 0.1 (uniformity), 0 (alignment) and 1 (rank); b is one seed longer (not paired).
  results = {
      'a.col': {f'seed{s}': _run(-1.0 - 0.1 * (s - 1), 0.2, 8.0 + (s - 1)) for s in range(3)},
      'b.col': {f'seed{s}': _run(-0.5 - 0.1 * (s - 1), 0.2, 6.0 + (s - 1)) for s in range(4)},
      'a.other': {'seed0': _run(-1.0, 0.2, 8.0)},
  }
  rows = evidence.verdict_lines(results, [evidence.parse_claim('a>b')])[2:]
  got = [r.split(' | ') for r in rows]
  assert [g[1:3] for g in got] == [['col', m] for m in evidence.METRICS]   # 'other': b never ran
  effect = {g[2]: float(g[3]) for g in got}
  np.testing.assert_allclose([effect['uniformity'], effect['alignment'], effect['effective_rank']],
                             [0.5, 0.0, 2.0], atol=1e-3)
  spread = {g[2]: float(g[4]) for g in got}
  np.testing.assert_allclose([spread['uniformity'], spread['effective_rank']], [0.1, 1.0],
                             atol=1e-3)
  verdict = {g[2]: (int(g[5]), g[6].rstrip(' |')) for g in got}
  # 0.5 > 2 x 0.1: confirmed; 2.0 = 2 x 1.0 is not above the bar; 0 against 0: not confirmed.
  assert verdict == {'uniformity': (3, 'confirmed'), 'alignment': (3, 'not confirmed'),
                     'effective_rank': (3, 'not confirmed')}
  md = evidence.markdown(results, [('b', 'a')])
  assert '| b > a | col | uniformity | -0.500 | 0.100 | 3 | reversed |' in md
  assert '| random init (first run) | 1 |' in md
  assert '## Verdict' not in evidence.markdown(results)


@pytest.mark.parametrize('text', ['ab', '>b', 'a>', ' > '])
def test_a_claim_that_is_not_row_gt_row_is_refused_naming_it(text):
  with pytest.raises(ValueError, match=f'--claims entry {text!r} is invalid'):
    evidence.parse_claim(text)
