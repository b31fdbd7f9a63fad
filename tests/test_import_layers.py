"""The package's layers, read from its import statements: a module imports only from its own layer
and the layers below it. The order is written once, here and in docs/DESIGN.md §2."""
import ast
import pathlib

import fedjax_ssl

PACKAGE = pathlib.Path(fedjax_ssl.__file__).parent

# Lowest first. A sub-package is one layer; the top-level modules are the runner's API (below the
# runs and tables that use it), except the helpers every layer may use.
LAYERS = (
    ('config_validation', 'files'),   # helpers: import nothing of fedjax_ssl
    ('ops',),                         # federation-agnostic primitives
    ('data',),                        # datasets, partitions, augmentation, the FedData layout
    ('core',),                        # the engine: contract, round step, strategies, caches
    ('models',),
    ('ssl',),                         # SSL losses
    ('algorithms',),                  # the registry and one module per method
    ('eval',),                        # evaluation primitives (features, probes, kNN, protocol)
    ('run_identity', 'configuration', 'evaluation', 'experiment', '__init__'),  # the runner's API
    ('runs',),                        # one run: the loop, its directory, guard, checkpoints, logs
    ('tables',),                      # tables of runs: schema, statistics, rendering
)
_LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _unit(path: pathlib.Path) -> str:
  """The layer unit of a module file: its sub-package, or its own name at the top level."""
  rel = path.relative_to(PACKAGE)
  return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_units(path: pathlib.Path):
  """(line, unit) of every fedjax_ssl import in the file, at any depth (function-level too)."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      parts = node.module.split('.')
      if parts[0] != 'fedjax_ssl':
        continue
      if len(parts) > 1:
        yield node.lineno, parts[1]
      else:  # from fedjax_ssl import a, b
        for alias in node.names:
          yield node.lineno, alias.name
    elif isinstance(node, ast.Import):
      for alias in node.names:
        parts = alias.name.split('.')
        if parts[0] == 'fedjax_ssl' and len(parts) > 1:
          yield node.lineno, parts[1]


def test_every_module_is_in_a_layer():
  units = {_unit(p) for p in PACKAGE.rglob('*.py')}
  assert units <= set(_LAYER), f'modules in no layer: {sorted(units - set(_LAYER))}'


def _upward(path: pathlib.Path, unit: str) -> list:
  """'file:line (unit, layer i) imports X (layer j)' for each import of `path` (a module of `unit`)
  from a higher layer."""
  return [f'{path}:{line} ({unit}, layer {_LAYER[unit]}) imports {imported} '
          f'(layer {_LAYER[imported]})'
          for line, imported in _imported_units(path)
          if imported in _LAYER and _LAYER[imported] > _LAYER[unit]]


def test_no_module_imports_from_a_higher_layer():
  upward = [line for path in sorted(PACKAGE.rglob('*.py')) for line in _upward(path, _unit(path))]
  assert not upward, 'imports from a higher layer:\n' + '\n'.join(upward)


def test_an_upward_import_is_caught(tmp_path):
  """The check itself: a runs module importing the tables, or the runner importing a run's module,
  in any of the import forms, is reported; imports of its own layer and below are not."""
  module = tmp_path / 'm.py'
  module.write_text('from fedjax_ssl import tables\n'
                    'import fedjax_ssl.tables.stats\n'
                    'def f():\n  from fedjax_ssl.tables.schema import Table\n'
                    'from fedjax_ssl.runs import checkpoint\n'
                    'from fedjax_ssl import experiment, files\n')
  assert [line.split(' imports ')[1].split()[0] for line in _upward(module, 'runs')] == [
      'tables'] * 3
  assert len(_upward(module, 'experiment')) == 4
  assert _upward(module, 'tables') == []


def test_the_helpers_import_nothing_of_the_package():
  for name in LAYERS[0]:
    assert not list(_imported_units(PACKAGE / f'{name}.py')), name


def test_the_run_guard_does_not_reach_up_to_the_tables():
  """What a run survives needs the run's identity, not the tables (a layer below them)."""
  guard = ('run_guard', 'lock', 'resuming', 'divergence', 'signals')
  imported = {u for m in guard for _, u in _imported_units(PACKAGE / 'runs' / f'{m}.py')}
  assert 'tables' not in imported and 'run_identity' in imported
