"""Every table file under configs/ loads at each scale it defines, and every cell's config validates
(no data loaded, nothing compiled): a table that would fail at run time fails here."""
import importlib.util
import pathlib

import pytest

from fedjax_ssl import tables

REPO = pathlib.Path(__file__).resolve().parents[2]
# Table files define get_table; the train configs beside them (configs/fedu2/paper_cross_*.py) are
# checked by tests/experiments/test_paper_configs.py.
TABLES = sorted(p for p in REPO.glob('configs/*/*.py')
                if p.name not in ('__init__.py', 'common.py') and p.parent.name != 'examples'
                and 'def get_table(' in p.read_text())


def _scales(path):
  spec = importlib.util.spec_from_file_location(f'_scan_{path.parent.name}_{path.stem}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return getattr(module, 'SCALES', tables.DEFAULT_TABLE_SCALES)


def test_the_tables_are_found():
  assert {p.parent.name for p in TABLES} == {'fedssl', 'fedu2', 'fedsc', 'hetero_ssfl', 'repshare',
                                             'ssd', 'dp', 'fedbuff'}


@pytest.mark.parametrize('path', TABLES, ids=lambda p: f'{p.parent.name}/{p.stem}')
def test_every_cell_of_every_scale_validates(path):
  for scale in _scales(path):
    table = tables.load_table(str(path), scale)
    runs = tables.plan_runs(table, seeds=[0])
    errors = [f'{r.name}: {r.config_error}' for r in runs if r.config_error]
    assert not errors, f'{path.name} at scale {scale!r}: {errors[:3]}'
