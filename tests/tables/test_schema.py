"""fedjax_ssl.tables.schema: a table's cells planned into runs (identical configs share one), bad
tables refused with the reason, a scale a table does not define refused."""
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import tables
from tests.tables import TINY_TABLE, make_table


def test_plan_shares_runs_between_identical_configs_and_validates_each_cell():
  table = make_table(rows={'A': dict(ssl_method='simclr'),
                           'CL': dict(algorithm='centralized', num_clients=1, clients_per_round=1,
                                  partition='iid'),
                           'Bad': dict(algorithm='fedu', ssl_method='simclr')})
  runs = tables.plan_runs(table, seeds=[0, 1])
  by_name = {r.name: r for r in runs}
  # Centralized ignores the partition column (alpha is unused under 'iid'): one run per seed.
  assert by_name['cl.iid/seed0'].cells == [('CL', 'IID'), ('CL', 'Dir')]
  assert 'cl.dir/seed0' not in by_name
  assert by_name['a.dir/seed1'].config.alpha == 0.1 and by_name['a.dir/seed1'].config.seed == 1
  assert "'fedu'" in by_name['bad.iid/seed0'].config_error and by_name['bad.iid/seed0'].config is None
  assert len(runs) == 2 * (2 + 1 + 2)
  assert [r.name for r in tables.plan_runs(table, [0], only=['a.*'])] == ['a.iid/seed0',
                                                                          'a.dir/seed0']


def test_bad_tables_raise_with_the_reason(tmp_path):
  with pytest.raises(cv.ConfigError, match="metric 'top5'"):
    tables.check_table(make_table(metrics=('top5',)))
  with pytest.raises(cv.ConfigError, match='collide'):
    tables.check_table(make_table(rows={'A b': {}, 'a-b': {}}))
  with pytest.raises(cv.ConfigError, match='names no cell'):
    tables.check_table(make_table(paper={('A', 'Nope', 'probe_acc'): 1.0}))
  # A cell with a bad override is recorded as failed (the other cells still run).
  bad = tables.plan_runs(make_table(rows={'A': dict(lr_max=1.0), 'B': dict(seed='x')}), [0])
  assert [r.config for r in bad] == [None] * 4
  assert "config key 'lr_max' does not exist" in bad[0].config_error
  assert "seed = 'x' is invalid" in bad[2].config_error
  with pytest.raises(cv.ConfigError, match=r"--only \['z\*'\] matches no cell"):
    tables.plan_runs(make_table(), [0], only=['z*'])
  with pytest.raises(cv.ConfigError, match="--scale = 'huge'"):
    tables.load_table(str(tmp_path / 'x.py'), 'huge')
  with pytest.raises(cv.ConfigError, match='no such file'):
    tables.load_table(str(tmp_path / 'x.py'), 'quick')


def test_a_table_refuses_a_scale_it_does_not_define(tmp_path):
  path = tmp_path / 'two_scales.py'
  path.write_text(TINY_TABLE)
  with pytest.raises(cv.ConfigError, match="--scale = 'evidence' is not defined by .*: it defines "
                     r"\('quick', 'paper'\)"):
    tables.load_table(str(path), 'evidence')
  path.write_text("SCALES = ('quick', 'evidence')\n" + TINY_TABLE)
  assert tables.load_table(str(path), 'evidence').scale == 'evidence'
