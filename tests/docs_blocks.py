"""The code blocks of the project's docs, as the docs test reads them (tests/test_docs_blocks.py).

Every ```python and ```bash block of README.md, docs/**/*.md and configs/*/README.md carries a mark
on the line before it, an HTML comment a reader does not see rendered:

  <!-- docs-test: run -->                 run as printed; the block states its time
  <!-- docs-test: smoke 60 s -->          run with $FEDJAX_SSL_SMOKE=1 (the one switch that shrinks
                                          every training command: configuration.smoke), within
                                          twice the budget given; the block states its full time
  <!-- docs-test: names (WHY) -->         syntax and names only, for blocks that need a GPU, the
                                          network or several machines, or run this suite (WHY)
  <!-- docs-test: validate (WHY) -->      the names checks, and each training command's runs built
                                          without training: every config validated, its algorithm
                                          built and its initial state traced, the first run's round
                                          program traced, a table's outputs rendered; for commands
                                          whose code path a run or smoke block already runs (WHY);
                                          the block states its time
  <!-- docs-test: excerpt PATH -->        a fragment of PATH: each of its lines is in that file

A block states its time as a comment, `# <number> s|min|h on 2 CPU cores ...`; several commands of
one block state one each. docs/notes/harness.md#harn-24 has the rules and why; #harn-32 the
validate mark.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import List, Optional, Tuple

REPO = pathlib.Path(__file__).resolve().parents[1]
LANGUAGES = {'python': 'python', 'bash': 'bash', 'sh': 'bash', 'shell': 'bash'}
MODES = ('run', 'smoke', 'names', 'validate', 'excerpt')

_FENCE = re.compile(r'^(\s*)```([A-Za-z]*)\s*$')
_MARK = re.compile(r'^\s*<!-- docs-test: (\w+)(.*?) -->\s*$')
_TIME = re.compile(r'#.*?(\d+(?:\.\d+)?)\s*(s|min|h)\b[^\n]*?on 2 CPU cores')
_BUDGET = re.compile(r'^\s*(\d+(?:\.\d+)?)\s*(s|min|h)\s*$')
_UNIT = {'s': 1.0, 'min': 60.0, 'h': 3600.0}


@dataclasses.dataclass(frozen=True)
class Block:
  path: pathlib.Path        # the markdown file
  line: int                 # 1-based line of the opening fence
  language: str             # 'python' | 'bash'
  code: str                 # dedented to the fence's indent
  mode: Optional[str]       # one of MODES; None: unmarked
  argument: str             # the mark's text after the mode

  @property
  def name(self) -> str:
    return f'{self.path.relative_to(REPO)}:{self.line}'

  def stated_seconds(self) -> List[float]:
    """The times the block states, one per command that states one, in seconds."""
    return [float(v) * _UNIT[u] for v, u in _TIME.findall(self.code)]

  def budget_seconds(self) -> Optional[float]:
    """A smoke mark's budget ('smoke 60 s') in seconds; None when it gives none or garbles it."""
    found = _BUDGET.match(self.argument)
    return float(found.group(1)) * _UNIT[found.group(2)] if found else None


def doc_files() -> List[pathlib.Path]:
  return ([REPO / 'README.md'] + sorted((REPO / 'docs').rglob('*.md')) +
          sorted((REPO / 'configs').glob('*/README.md')))


def parse(path: pathlib.Path) -> List[Block]:
  """The python and shell blocks of one markdown file, with their marks."""
  lines = path.read_text().splitlines()
  blocks, i = [], 0
  while i < len(lines):
    opened = _FENCE.match(lines[i])
    if not opened or not opened.group(2):
      i += 1
      continue
    indent, language = opened.group(1), opened.group(2)
    end = i + 1
    while end < len(lines) and lines[end].strip() != '```':
      end += 1
    if language in LANGUAGES:
      body = [l[len(indent):] if l.startswith(indent) else l.lstrip() for l in lines[i + 1:end]]
      previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), '')
      mark = _MARK.match(previous)
      blocks.append(Block(path=path, line=i + 1, language=LANGUAGES[language],
                          code='\n'.join(body) + '\n', mode=mark.group(1) if mark else None,
                          argument=mark.group(2).strip() if mark else ''))
    i = end + 1
  return blocks


def all_blocks() -> List[Block]:
  return [b for path in doc_files() for b in parse(path)]


def commands(script: str) -> List[List[str]]:
  """The shell commands of a block as word lists: continuation lines joined, comments dropped, split
  at ';', '&&', '||', '|' and '&'; leading VAR=value assignments removed."""
  import shlex
  text = re.sub(r'\\\n', ' ', script)
  out = []
  for line in text.splitlines():
    try:
      words = shlex.split(line, comments=True)
    except ValueError:
      continue
    current: List[str] = []
    for w in words + [';']:
      # shlex keeps a ';' or '&' attached to the word before it ('done;'): it ends the command too
      ends = w in (';', '&&', '||', '|', '&') or w.endswith((';', '&'))
      if w not in (';', '&&', '||', '|', '&'):
        current.append(w.rstrip(';&'))
      if ends:
        while current and re.match(r'^[A-Za-z_][A-Za-z0-9_]*=', current[0]):
          current.pop(0)
        if current:
          out.append(current)
        current = []
  return out


def flag_words(words: List[str]) -> List[Tuple[str, Optional[str]]]:
  """(flag name, value or None) of each --flag of a command."""
  out = []
  for w in words:
    if w.startswith('--') and len(w) > 2:
      name, _, value = w[2:].partition('=')
      out.append((name, value if _ else None))
  return out
