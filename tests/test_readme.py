"""The README is a front door a newcomer reads in ten minutes (issue 66 item 6): at most
MAX_README_LINES lines, and everything it no longer holds is one link away. The user pages are the
markdown files directly under docs/ (the notes and results have their own tests); every one is
linked from the README, and every relative link of the README and of those pages lands on a file
that exists, and on an anchor of it when the link names one."""
import pathlib
import re

import pytest

from tests import test_notes_index

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / 'README.md'
MAX_README_LINES = 250
PAGES = sorted((REPO / 'docs').glob('*.md'))
# [text](target): a markdown link; targets with a scheme (https:) or only an anchor are skipped.
_LINK = re.compile(r'\]\(([^)\s]+)\)')


def relative_links(text: str):
  """(path, anchor or '') of each link in `text` to a file of the repository."""
  out = []
  for target in _LINK.findall(text):
    if re.match(r'^[a-z]+:', target) or target.startswith('#'):
      continue
    path, _, anchor = target.partition('#')
    out.append((path, anchor))
  return out


def link_problems(page: pathlib.Path) -> list:
  """The links of `page` that land on no file, or on no anchor of their markdown file."""
  problems = []
  for path, anchor in relative_links(page.read_text(encoding='utf-8')):
    target = (page.parent / path).resolve()
    if not target.exists():
      problems.append(f'{path}: no such file')
    elif anchor and target.suffix == '.md' and anchor not in test_notes_index._anchors(
        target.read_text(encoding='utf-8')):
      problems.append(f'{path}#{anchor}: no such anchor')
  return problems


def test_readme_is_short():
  lines = len(README.read_text(encoding='utf-8').splitlines())
  assert lines <= MAX_README_LINES, (
      f'README.md has {lines} lines, over {MAX_README_LINES}: move the detail to a page under '
      'docs/ and link it')


def test_every_user_page_is_linked_from_the_readme():
  assert len(PAGES) >= 8  # DESIGN, datasets and the pages the README's detail moved to
  linked = {(REPO / p).resolve() for p, _ in relative_links(README.read_text(encoding='utf-8'))}
  orphans = [p.name for p in PAGES if p.resolve() not in linked]
  assert not orphans, f'docs/ pages the README does not link: {orphans}'


@pytest.mark.parametrize('page', [README] + PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_lands(page):
  problems = link_problems(page)
  assert not problems, f'{page.relative_to(REPO)}: {problems}'


def test_a_broken_link_is_found(tmp_path):
  page = tmp_path / 'p.md'
  (tmp_path / 'q.md').write_text('# Some Heading\n\n<a id="x-1"></a>text\n')
  page.write_text('[a](q.md#some-heading) [b](q.md#x-1) [c](https://e.org) [d](#local) '
                  '[e](missing.md) [f](q.md#nowhere)\n')
  assert link_problems(page) == ['missing.md: no such file', 'q.md#nowhere: no such anchor']
