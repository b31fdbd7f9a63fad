"""Every python and shell block a user copies from the docs runs (tests/docs_blocks.py: the marks).

`run` blocks run as printed (paths under /tmp/ and the placeholder DIR moved into the test's folder)
and must take between half and twice the time they state; `smoke` blocks run with
$FEDJAX_SSL_SMOKE=1 within twice their budget; every training command's --workdir must then hold a
completed results.json. `names` blocks are parsed, and the modules, flags, config keys, files,
extras and table scales they name must exist; `validate` blocks pass the names checks and build
each training command's runs without training (test_block_validates); `excerpt` blocks must be lines
of their file. docs/notes/harness.md#harn-24, #harn-32.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import tomllib

import pytest

from tests import docs_blocks, subprocess_env

BLOCKS = docs_blocks.all_blocks()
RUNNABLE = [b for b in BLOCKS if b.mode in ('run', 'smoke')]
CHECKED = [b for b in BLOCKS if b.mode in ('names', 'validate', 'excerpt')]
VALIDATED = [b for b in BLOCKS if b.mode == 'validate']
_PYTHONS = ('python', 'python3', '.venv/bin/python')


def _trainings(block) -> int:
  """How many commands of the block train: a python block is one, a shell block counts its
  train / reproduce / quickstart commands."""
  if block.language == 'python':
    return 1
  return sum(map(_trainings_of, docs_blocks.commands(block.code)))


def _trainings_of(words) -> bool:
  """Whether one shell command (its words) trains."""
  return any(w in ('experiments.train', 'experiments.reproduce', 'scripts/quickstart.sh')
             for w in words)


def test_every_block_is_marked_and_states_its_time():
  assert len(BLOCKS) >= 19, [b.name for b in BLOCKS]  # README, DESIGN and the papers' READMEs
  problems = []
  for b in BLOCKS:
    if b.mode not in docs_blocks.MODES:
      problems.append(f'{b.name}: mark it <!-- docs-test: {"|".join(docs_blocks.MODES)} ... -->')
    elif b.mode in ('run', 'smoke', 'validate') and len(b.stated_seconds()) < _trainings(b):
      problems.append(f'{b.name}: each command that trains states its time ("# 40 s on 2 CPU '
                      f'cores" before it): {_trainings(b)} commands, {len(b.stated_seconds())} times')
    elif b.mode == 'smoke' and b.budget_seconds() is None:
      problems.append(f'{b.name}: a smoke mark gives its budget, e.g. "smoke 60 s"')
    elif b.mode in ('names', 'validate') and not b.argument.startswith('('):
      problems.append(f'{b.name}: a {b.mode} mark says why the block is not run: "{b.mode} (GPU)"')
    elif b.mode == 'excerpt' and not (docs_blocks.REPO / b.argument).is_file():
      problems.append(f'{b.name}: excerpt of a file that does not exist: {b.argument}')
  assert not problems, '\n'.join(problems)


def test_marks_are_read():
  """The parser sees the marks, the times and the budgets of a made-up file."""
  text = ('intro\n\n<!-- docs-test: smoke 90 s -->\n```bash\n'
          'python -m experiments.train --config c.py --workdir /tmp/w   # 8.5 min on 2 CPU cores\n'
          'python -m x   # 2 h on 2 CPU cores, first run\n```\n\n```python\nprint(1)\n```\n'
          '<!-- docs-test: names (GPU) -->\n  ```sh\n  nvidia-smi\n  ```\n```text\nno\n```\n')
  path = docs_blocks.REPO / 'tests' / '_docs_blocks_probe.md'
  try:
    path.write_text(text)
    smoke, unmarked, names = docs_blocks.parse(path)
  finally:
    path.unlink()
  assert (smoke.mode, smoke.budget_seconds(), smoke.stated_seconds()) == ('smoke', 90.0, [510.0, 7200.0])
  assert (unmarked.mode, unmarked.language) == (None, 'python')
  assert (names.mode, names.argument, names.code, names.language) == ('names', '(GPU)', 'nvidia-smi\n', 'bash')
  assert docs_blocks.commands('for i in 0 1; do\n  A=1 python -m m --x=$i &\ndone; wait\n') == [
      ['for', 'i', 'in', '0', '1'], ['do'], ['python', '-m', 'm', '--x=$i'], ['done'], ['wait']]


@functools.lru_cache(maxsize=None)
def _help(module: str) -> str:
  """`python -m module --helpfull`: every flag the binary defines."""
  done = subprocess.run([sys.executable, '-m', module, '--helpfull'], cwd=docs_blocks.REPO,
                        env=subprocess_env.binary_env(), capture_output=True, text=True, timeout=120)
  return done.stdout + done.stderr


def _config_key_exists(key: str) -> bool:
  from fedjax_ssl import experiment
  node = experiment.default_config()
  for part in key.split('.'):
    if part not in node:
      return False
    node = node[part]
  return True


def _flags(words) -> dict:
  """{name: value} of a command's --flags, written --flag=value or --flag value (the docs'
  reproduce commands write `--table PATH`); None for a flag without a value."""
  out = {}
  for i, w in enumerate(words):
    for name, value in docs_blocks.flag_words([w]):
      if value is None and i + 1 < len(words) and not words[i + 1].startswith('--'):
        value = words[i + 1]
      out[name] = value
  return out


def _check_command(words, problems, where):
  for w in words:
    path = re.match(r'^((?:configs|scripts|experiments|fedjax_ssl|tests|docs)/[\w./-]+)', w)
    if path and not (docs_blocks.REPO / path.group(1)).exists():
      problems.append(f'{where}: {path.group(1)} does not exist')
  if words[0] == 'bash' and len(words) > 1 and not (docs_blocks.REPO / words[1]).is_file():
    problems.append(f'{where}: {words[1]} does not exist')
  if 'pip' in words[0] or words[:3] == ['python', '-m', 'pip']:
    extras = tomllib.loads((docs_blocks.REPO / 'pyproject.toml').read_text())['project'][
        'optional-dependencies']
    for w in words:
      for extra in re.findall(r"^\.\[(\w+)\]$", w.strip("'\"")):
        if extra not in extras:
          problems.append(f'{where}: pyproject.toml has no extra {extra!r}')
    return
  if not (words[0] in _PYTHONS or words[0].endswith('/python')) or words[1:2] != ['-m']:
    return
  module = words[2]
  if importlib.util.find_spec(module) is None:
    problems.append(f'{where}: no module {module}')
    return
  flags = _flags(words[3:])
  for name in flags:
    if name.startswith(('config.', 'noconfig.')):
      if not _config_key_exists(name.split('.', 1)[1]):
        problems.append(f'{where}: no config key {name}')
    elif module.startswith('experiments.') and not re.search(
        rf'--(\[no\])?{re.escape(name)}\b', _help(module)):
      problems.append(f'{where}: {module} has no flag --{name}')
  if module == 'experiments.reproduce' and flags.get('table'):
    from fedjax_ssl import tables
    try:
      tables.load_table(flags['table'], flags.get('scale') or 'quick')
    except Exception as e:  # pylint: disable=broad-except
      problems.append(f'{where}: {flags["table"]} at scale {flags.get("scale") or "quick"}: {e}')


def _train_config(words):
  """The config an `experiments.train` command builds: its --config file and --config.KEY=VALUE
  flags, parsed by ml_collections as the binary parses them."""
  from absl import flags
  from ml_collections import config_flags
  argv, rest = ['train'], iter(words[3:])
  for w in rest:
    if w == '--config':
      argv += [w, next(rest)]
    elif w.startswith(('--config=', '--config.', '--noconfig.')):
      argv.append(w)
  values = flags.FlagValues()
  # The override flags (--config.KEY) are defined from the argv given here, as from sys.argv.
  config_flags.DEFINE_config_file('config', None, 'config file', flag_values=values,
                                  lock_config=True, sys_argv=argv)
  values(argv)
  return values.config


def _trace_round(setup):
  """Traces the round program of an abstract `plan.setup` (shapes only: nothing is lowered,
  compiled or run), as `plan.compile_round` would hand it to XLA."""
  from experiments import plan
  from fedjax_ssl import experiment
  from fedjax_ssl.core import round as rd
  config, algo = setup.config, setup.algo
  step = rd.make_round_step(algo, experiment.round_config(config), config.num_clients)
  if config.client_state == 'device':
    step.trace(setup.state, setup.data, plan._key())
    return
  sel = tuple(plan._rows(stack, min(config.clients_per_round, len(c.members))) for stack, c in
              zip(rd.cohort_stacks(algo, setup.state.clients), rd.cohorts(algo, config.num_clients)))
  step.device_program.trace(setup.state.replace(clients=None), sel, setup.data, plan._key())


def validate_problems(words, out: pathlib.Path) -> list:
  """What a `validate` block proves of one training command, without training: `experiments.train`
  builds its config as the binary does; `experiments.reproduce` loads its table at its scale and
  plans the runs of its first seed, each config valid. Every config then validates, its algorithm
  builds from the registry on the dataset's catalog shapes and its initial state traces
  (`plan.setup`, no data loaded); the first run's round program traces (the program a smoke run
  would compile first); a table's outputs (table.csv, .md, .png) render under `out` with no run
  finished. Returns the problems, one line each."""
  from experiments import plan
  from fedjax_ssl import tables as reproduce
  module = words[2] if len(words) > 2 and words[1] == '-m' else ' '.join(words[:2])
  flags = _flags(words[3:])
  if module == 'experiments.train':
    configs = [_train_config(words)]
  elif module == 'experiments.reproduce':
    table = reproduce.load_table(flags['table'], flags.get('scale') or 'quick')
    seed = int((flags.get('seeds') or '0').split(',')[0])
    runs = reproduce.plan_runs(table, [seed])
    invalid = [f'{r.name}: {r.config_error}' for r in runs if r.config is None]
    if invalid:
      return [f'{flags["table"]}: invalid runs {invalid}']
    configs = [r.config for r in runs]
    out.mkdir(parents=True, exist_ok=True)
    reproduce.write_outputs(table, reproduce.summarize(table, [], out), out, [seed], 'validate')
    rendered = sorted(p.name for p in out.iterdir())
    if rendered != ['table.csv', 'table.md', 'table.png']:
      return [f'{flags["table"]}: rendered {rendered}']
  else:
    return [f'{module}: a validate block holds experiments.train and experiments.reproduce '
            'commands (run or smoke the others)']
  setups = [plan.setup(c, 'cpu') for c in configs]
  _trace_round(setups[0])
  return []


@pytest.mark.parametrize('block', CHECKED, ids=[b.name for b in CHECKED])
def test_block_names(block):
  problems = []
  if block.language == 'python':
    compile(block.code, block.name, 'exec')
  else:
    done = subprocess.run(['bash', '-n', '-c', block.code], capture_output=True, text=True)
    assert done.returncode == 0, f'{block.name}: {done.stderr}'
  if block.mode == 'excerpt':
    # A trailing comment may be the doc's own note on a line.
    bare = lambda line: line.split('  # ')[0].strip()
    source = {bare(l) for l in (docs_blocks.REPO / block.argument).read_text().splitlines()}
    missing = [l for l in block.code.splitlines() if bare(l) and bare(l) not in source]
    assert not missing, f'{block.name}: not lines of {block.argument}: {missing}'
  elif block.language == 'bash':
    for words in docs_blocks.commands(block.code):
      _check_command(words, problems, block.name)
  assert not problems, '\n'.join(problems)


@pytest.mark.slow
@pytest.mark.parametrize('block', VALIDATED, ids=[b.name for b in VALIDATED])
def test_block_validates(block, tmp_path):
  trains = [w for w in docs_blocks.commands(block.code) if _trainings_of(w)]
  assert trains, f'{block.name}: a validate block holds training commands'
  problems = []
  for i, words in enumerate(trains):
    problems += [f'{block.name}: {p}' for p in validate_problems(words, tmp_path / f'out{i}')]
  assert not problems, '\n'.join(problems)


def _workdirs(script: str):
  return [pathlib.Path(v) for words in docs_blocks.commands(script)
          for name, v in docs_blocks.flag_words(words) if name == 'workdir' and v]


@pytest.mark.slow
@pytest.mark.parametrize('block', RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_block_runs(block, tmp_path):
  # A run block compiles as a user's run does (its time is compared with the stated one) and starts
  # from an empty cache folder, like a first run; a smoke block keeps the session's fast compile and
  # cache folder (its references and programs shared with the other smoke blocks).
  env = subprocess_env.binary_env(optimized=block.mode == 'run')
  env['PATH'] = f'{pathlib.Path(sys.executable).parent}{os.pathsep}{env["PATH"]}'
  env['WORKDIR'] = str(tmp_path / 'workdir')
  if block.mode == 'run':
    env['FEDJAX_SSL_CACHE_DIR'] = str(tmp_path / 'cache')
    limit = sum(block.stated_seconds())
  else:
    env['FEDJAX_SSL_SMOKE'] = '1'
    limit = block.budget_seconds()
  code = block.code.replace('/tmp/', f'{tmp_path}/')
  if block.language == 'python':
    (tmp_path / 'block.py').write_text(code)
    argv, cwd = [sys.executable, str(tmp_path / 'block.py')], tmp_path
  else:
    # Each command gets its own output folder, as a user running two tables would.
    lines = code.split('\n')
    code = '\n'.join(re.sub(r'(?<![\w/$])DIR\b', str(tmp_path / f'DIR{i}'), l)
                     for i, l in enumerate(lines))
    argv, cwd = ['bash', '-euo', 'pipefail', '-c', code], docs_blocks.REPO
  start = time.monotonic()
  done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=max(3 * limit, 120), stdin=subprocess.DEVNULL)
  seconds = time.monotonic() - start
  assert done.returncode == 0, f'{block.name} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}'
  for workdir in _workdirs(code):
    results = json.loads((workdir / 'results.json').read_text())
    assert results['status'] == 'completed', (block.name, workdir, results['status'])
  assert seconds <= 2 * limit, f'{block.name}: {seconds:.0f} s, more than twice the {limit:.0f} s stated'
  if block.mode == 'run':
    assert seconds >= limit / 2, f'{block.name}: {seconds:.0f} s, under half the {limit:.0f} s stated'


@pytest.mark.slow
def test_validate_refuses_what_the_binary_would_refuse(tmp_path):
  """A validate block fails where the command would fail before training: an objective under an
  algorithm it does not fit (FedEMA needs a predictor), a table at a scale it does not define."""
  from fedjax_ssl import config_validation as cv
  train = ('python -m experiments.train --config configs/examples/custom_objective.py '
           '--config.dataset=synthetic --config.algorithm=fedema --workdir W').split()
  with pytest.raises(cv.ConfigError, match='predictor'):
    validate_problems(train, tmp_path / 'a')
  reproduce = 'python -m experiments.reproduce --table configs/fedu2/table2.py --scale evidence'
  with pytest.raises(cv.ConfigError, match='not defined'):
    validate_problems(reproduce.split(), tmp_path / 'b')
