"""The notes stay an index someone reads (issue 47 item 2): BUILD_NOTES.md is a short overview
(<= 30,000 bytes), every entry of a topic file under docs/notes/ has one line in that file's
`## Index`, every index line and every BUILD_NOTES link lands on an anchor, and every known gap is
named in BUILD_NOTES."""
import collections
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTES = sorted((REPO / 'docs' / 'notes').glob('*.md'))
BUILD_NOTES = REPO / 'BUILD_NOTES.md'
MAX_BUILD_NOTES_BYTES = 30_000

_ANCHOR = re.compile(r'<a id="([^"]+)"></a>')
# An entry starts a line with its anchor (a paragraph or a list item); later anchors on the same
# line are aliases (`FEDU2-A16 / FEDU2-A12`), reachable but listed under the first.
_ENTRY = re.compile(r'^(?:[*-] )?<a id="([^"]+)"></a>', re.M)
_INDEX_LINE = re.compile(r'^- \[[^\]]+\]\(#([^)]+)\)', re.M)
_NOTES_LINK = re.compile(r'\]\(docs/notes/([\w.]+)#([^)]+)\)')


def _heading_slug(heading: str) -> str:
  """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
  return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def _anchors(text: str) -> set:
  headings = re.findall(r'^#+ (.+)$', text, re.M)
  return set(_ANCHOR.findall(text)) | {_heading_slug(h) for h in headings}


def _index_section(text: str) -> str:
  """The `## Index` section: up to the next level-2 heading."""
  start = text.index('\n## Index')
  end = re.search(r'\n## (?!Index)', text[start + 1:])
  return text[start:] if end is None else text[start:start + 1 + end.start()]


def index_problems(text: str) -> list:
  """What is wrong with one topic file's index: entries listed other than once, index lines with
  no anchor. Empty when the index is true."""
  if '\n## Index' not in text:
    return ['no `## Index` section']
  listed = collections.Counter(_INDEX_LINE.findall(_index_section(text)))
  anchors = _anchors(text)
  return ([f'entry #{a} is listed {listed[a]} times' for a in _ENTRY.findall(text)
           if listed[a] != 1] +
          [f'index line #{a} has no anchor' for a in listed if a not in anchors])


def test_build_notes_is_a_short_index():
  size = len(BUILD_NOTES.read_bytes())
  assert size <= MAX_BUILD_NOTES_BYTES, (
      f'BUILD_NOTES.md is {size:,} bytes, over {MAX_BUILD_NOTES_BYTES:,}: move detail into its '
      'topic file under docs/notes/ and keep one line here')


@pytest.mark.parametrize('path', NOTES, ids=lambda p: p.name)
def test_every_entry_has_one_line_in_its_topic_index(path):
  problems = index_problems(path.read_text(encoding='utf-8'))
  assert not problems, problems


def test_every_build_notes_link_lands_on_an_anchor():
  anchors = {p.name: _anchors(p.read_text(encoding='utf-8')) for p in NOTES}
  links = _NOTES_LINK.findall(BUILD_NOTES.read_text(encoding='utf-8'))
  assert len(links) > 100  # the index is read, not an empty match
  dangling = [f'{f}#{a}' for f, a in links if a not in anchors.get(f, ())]
  assert not dangling, f'BUILD_NOTES.md links to missing anchors: {dangling}'


def test_every_known_gap_is_named_in_build_notes():
  gaps = _ENTRY.findall((REPO / 'docs' / 'notes' / 'known_gaps.md').read_text(encoding='utf-8'))
  assert len(gaps) >= 20
  text = BUILD_NOTES.read_text(encoding='utf-8')
  missing = [g for g in gaps if f'known_gaps.md#{g})' not in text]
  assert not missing, f'known gaps missing from BUILD_NOTES.md: {missing}'


def test_the_index_check_finds_what_it_checks():
  good = ('# T\n\n## Index\n\n- [T-1](#t-1) — one\n- [T-2](#t-2) — two\n\n## Notes\n\n'
          '<a id="t-1"></a>**T-1.** one\n* <a id="t-2"></a><a id="t-3"></a>**T-2 / T-3.** two\n')
  assert index_problems(good) == []
  unlisted = good.replace('- [T-2](#t-2) — two\n', '')
  assert index_problems(unlisted) == ['entry #t-2 is listed 0 times']
  dangling = good.replace('(#t-1)', '(#t-9)')
  assert index_problems(dangling) == ['entry #t-1 is listed 0 times',
                                      'index line #t-9 has no anchor']
