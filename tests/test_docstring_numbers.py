"""No measured number in a docstring or comment of `fedjax_ssl/` or `experiments/` (issue 66 item 3).

A measured number (a time, a speed-up, an accuracy or a percentage that some run produced) belongs
in ONE note, `docs/notes/<topic>.md`, beside the command and the machine that produced it; code
links to that note (`docs/notes/performance.md#perf-47`) instead of quoting it, so that a re-run
changes one file and a reader finds the conditions with the number.

The rule, as the patterns below apply it to every docstring (`ast`) and every comment block
(`tokenize`; consecutive comment lines are read as one text, as are a docstring's lines):
* a time: a number with a unit of time (`16.7 s`, `52 ms`, `20-130 s`, `3 min`, `2 h`);
* a speed-up: a factor `N×` / `Nx` stated as a comparison (`1.75x slower`, `4-12x faster`,
  `4.6x longer`, `cut ... ~7x`), a range of factors (`1.4-3.4x`) or an approximate one (`~50x`);
* a percentage measured: one with decimals (`62.04 %`), one stated as a comparison (`15 % slower`,
  `10 % more`) or an approximate one (`~15 %`);
* an accuracy: a score (`0.705`, `73.14`) within a sentence after an accuracy word (accuracy,
  probe, kNN, top-1, fine-tune, score).
Not measured, so allowed: a bound or a target after a comparison (`<= 1.0x`, `>= 10x`, `< 60 s`),
products and shapes (`2 x [B, H, W, C]`, `784 x 784`, `conv3x3`), a defined factor (`4x` the
bottleneck's width, `2x the paper's loss`), a fraction that is a setting (`1 %` of the labels,
`tau = 0.5`, `default 0.5`), counts (`2 cores`), versions and equation numbers. A number a
pattern mistakes for a measurement is rewritten (`0.8·s`: colour strength s), not exempted.
"""
import ast
import io
import pathlib
import re
import tokenize
from typing import Iterator, List, Tuple

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOTS = ('fedjax_ssl', 'experiments')

_NUM = r'(?<![\w.·])\d+(?:[.,]\d+)?'
_RANGE = _NUM + r'(?:\s?[-–]\s?\d+(?:\.\d+)?)?'
# Not after a comparison (a bound or a target); an arrow `->` is no comparison.
_NOT_BOUND = r'(?<![<≤≥=]\s)(?<![<≤≥=])(?<![^-]>\s)(?<![^-]>)(?<![<>≤≥=]\s~)(?<![<>≤≥=]~)'
_COMPARATIVE = (r'(?:faster|slower|longer|shorter|quicker|cheaper|more|less|fewer|larger|smaller|'
                r'the time|of its time|speed-?up)')
PATTERNS = {
    'time': re.compile(_NOT_BOUND + _RANGE + r'\s?(?:s|ms|µs|us|ns|secs?|seconds?|mins?|minutes?|'
                       r'h|hours?)(?![\w/])'),
    'speed-up': re.compile(
        _NOT_BOUND + r'(?:~\s?' + _RANGE + r'\s?[x×](?![\w\[(])'                   # ~50x
        r'|' + _NUM + r'\s?[-–]\s?\d+(?:\.\d+)?\s?[x×](?![\w\[(])'                 # 1.4-3.4x
        r'|' + _NUM + r'\s?[x×]\s' + r'(?:\w+\s){0,2}' + _COMPARATIVE + r'\b'      # 1.75x slower
        r'|\b(?:cut|cuts|saves?|by)\b[^.;]{0,40}?' + _NUM + r'\s?[x×](?![\w\[(]))'),  # cut ... 7x
    'percent': re.compile(
        _NOT_BOUND + r'(?:~\s?' + _RANGE + r'\s?%'                                  # ~15 %
        r'|' + r'(?<![\w.])\d+\.\d+\s?%'                                            # 62.04 %
        r'|' + _RANGE + r'\s?%\s(?:\w+\s){0,2}' + _COMPARATIVE + r'\b)'),           # 15 % slower
    'accuracy': re.compile(
        r'(?i)\b(?:acc|accuracy|accuracies|probe|knn|top-1|fine-tune|scores?|scored)\b'
        r'(?:(?!\.\s)[^;]){0,60}?(?<![\w.])(?:0\.\d{2,}|\d{2}\.\d{1,2})(?![\w.])'),
}


def _docstrings(tree: ast.AST) -> Iterator[Tuple[int, str]]:
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      doc = node.body[0] if node.body else None
      if (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and
          isinstance(doc.value.value, str)):
        yield doc.value.lineno, doc.value.value


def _comment_blocks(source: str) -> Iterator[Tuple[int, str]]:
  """(first line, text) of each run of comments on consecutive lines."""
  block: List[Tuple[int, str]] = []
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type != tokenize.COMMENT:
      continue
    if block and tok.start[0] != block[-1][0] + 1:
      yield block[0][0], '\n'.join(t for _, t in block)
      block = []
    block.append((tok.start[0], tok.string.lstrip('#')))
  if block:
    yield block[0][0], '\n'.join(t for _, t in block)


def measured_numbers(source: str) -> List[Tuple[int, str, str]]:
  """(line, kind, matched text) of every measured number in `source`'s docstrings and comments."""
  hits = []
  texts = list(_docstrings(ast.parse(source))) + list(_comment_blocks(source))
  for first_line, text in texts:
    flat = text.replace('\n', ' ')  # a pattern may span a line break; offsets stay the same
    for kind, pattern in PATTERNS.items():
      for m in pattern.finditer(flat):
        hits.append((first_line + text.count('\n', 0, m.start()), kind, m.group(0).strip()))
  return sorted(hits)


def _files() -> List[pathlib.Path]:
  return sorted(p for root in ROOTS for p in (REPO / root).rglob('*.py'))


@pytest.mark.parametrize('path', _files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_measured_number_in_docstrings_or_comments(path):
  hits = measured_numbers(path.read_text(encoding='utf-8'))
  where = [f'{path.relative_to(REPO)}:{line}: {kind} {text!r}' for line, kind, text in hits]
  assert not where, ('measured numbers belong in docs/notes/<topic>.md with their command and '
                     'machine; link the note instead:\n' + '\n'.join(where))


@pytest.mark.parametrize('text', [
    'the quickstart round: 16.7 s against 9.7 s', 'compiled for 20-130 s', 'about 20 ms of its 52 ms',
    '`vmap` was 1.75x slower than `map`', 'this was 4-12x faster than', 'ran ~5x slower',
    'compiled 4.6x longer', 'It cut the iterations ~7x on those features', '1.4-3.4x on every CPU',
    'ran ~15 % slower in our tests', 'its casts (~10 % more on small_cnn)', '(73.14 -> 62.04 %)',
    'probe 13.88, kNN 13.59', 'for the kNN (20k bank, k = 200: 0.705 standardised',
    'the committed runs score 10.00 to 10.02', 'took 3 min on 2 cores', 'a 2 h run',
])
def test_the_patterns_catch_measured_numbers(text):
  assert measured_numbers(f'"""{text}"""\n'), text
  assert measured_numbers(f'# {text}\n'), text


@pytest.mark.parametrize('text', [
    'tau=0.5', 'default 0.5', 'x [B, H, W, C] -> 2 x [B, H/s, W/s, planes]', 'a 784 x 784 eigh',
    'conv3x3 32 -> pool', 'bottleneck output is 4x', "2x the paper's loss", 'target >= 10x',
    'our time <= 1.0x its time', 'FedU2 FT 1% / 10%', 'at 1 % of the labels', 'on 2 cores',
    'jax 0.10.2', 'Eq. 5 of the paper', 'colour strength s = 0.5: jitter 0.8·s, 0.2·s',
    'lr 0.05, batch 512 (10%) or 256 (1%), 100 epochs', 'held-out 10% of the training split',
    'taking 75 % of the GPU memory', 'runs in < 60 s', 'fraction tag for 100%, 0.1 or 0.01',
    'within 0.05 points of the stored means', 'an accuracy of the chance level 1 / classes',
])
def test_the_patterns_leave_constants_alone(text):
  assert not measured_numbers(f'"""{text}"""\n'), (text, measured_numbers(f'"""{text}"""\n'))
