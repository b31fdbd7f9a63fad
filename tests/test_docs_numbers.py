"""One home per number: a result the READMEs and the user pages under docs/ quote ("mean ± std")
is a number of a committed results file under docs/results/ (a table.md, geometry.md, ...), so a
table that is re-run and changes makes this test fail until the page quoting it follows."""
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
_MEAN_STD = re.compile(r'-?\d+\.\d+ ± \d+\.\d+')
# The README, the user pages under docs/ (its detail moved there, issue 66) and the papers' READMEs.
READMES = (['README.md'] + sorted(str(p.relative_to(REPO)) for p in (REPO / 'docs').glob('*.md')) +
           sorted(str(p.relative_to(REPO)) for p in (REPO / 'configs').glob('*/README.md')))


def _results_text() -> str:
  return '\n'.join(p.read_text(encoding='utf-8') for p in (REPO / 'docs' / 'results').rglob('*.md'))


@pytest.mark.parametrize('readme', READMES)
def test_every_quoted_mean_and_std_is_a_committed_result(readme):
  quoted = _MEAN_STD.findall((REPO / readme).read_text(encoding='utf-8'))
  results = _results_text()
  missing = sorted({q for q in quoted if q not in results})
  assert not missing, (f'{readme} quotes {missing}, which no results file under docs/results/ '
                       'holds: the table changed, or the number has no home')


def test_the_pattern_finds_the_numbers_it_checks():
  assert _MEAN_STD.findall('| FedSimCLR | 84.61 ± 0.18 | -1.5 ± 0.2 | 3 |') == ['84.61 ± 0.18',
                                                                            '-1.5 ± 0.2']
