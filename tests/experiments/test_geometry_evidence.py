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


def test_a_run_without_a_checkpoint_keeps_only_a_measurement_of_the_same_results(tmp_path):
  # Checkpoints are not committed: a clone re-measures the runs it has checkpoints for and keeps
  # the others' earlier entries only where results.json is byte-for-byte the one measured.
  for cell, seed in [('a.col', 'seed0'), ('a.col', 'seed1'), ('b.col', 'seed0')]:
    run = tmp_path / 'runs' / cell / seed
    run.mkdir(parents=True)
    (run / 'results.json').write_text(f'{{"run": "{cell}/{seed}"}}')
  runs = evidence.finished_runs(tmp_path)
  assert [f'{r.parent.name}/{r.name}' for r in runs] == ['a.col/seed0', 'a.col/seed1',
                                                          'b.col/seed0']
  assert evidence.measure_run(runs[0], {}, 10) is None        # no checkpoints directory
  stamp = lambda run: {'results_sha256': evidence.results_digest(run), 'num_images': 10}
  same = dict(_run(-1.0, 0.2, 8.0), **stamp(runs[0]))
  redone = dict(_run(-2.0, 0.2, 8.0), **stamp(runs[0]))
  unstamped = _run(-3.0, 0.2, 8.0)
  previous = {'a.col': {'seed0': same, 'seed1': redone}, 'b.col': {'seed0': unstamped}}
  assert evidence.kept_entry(previous, runs[0], 10) is same
  assert evidence.kept_entry(previous, runs[0], 20) is None   # another sample of test images
  assert evidence.kept_entry(previous, runs[1], 10) is None   # measured on another results.json
  assert evidence.kept_entry(previous, runs[2], 10) is None   # no digest: not known to match
  results = {'a.col': {'seed0': same}}
  missing = evidence.missing_runs(tmp_path, results)
  assert missing == ['a.col/seed1', 'b.col/seed0']
  assert ('Not measured (2 finished runs with no entry: no checkpoint where geometry.json was '
          'written and no earlier measurement of the same results.json): a.col/seed1, '
          'b.col/seed0.') in evidence.markdown(results, missing=missing)
  assert 'Not measured' not in evidence.markdown(results)
