"""Every module under experiments/ imports beside every other in one process.

absl refuses a flag defined twice, and the binaries share flag names (--out, --workdir, --table):
a binary whose flags clash with another's defines them in `define_flags()`, called only when it
runs. pytest-xdist puts test files that import different binaries in one worker by chance, so a
clash shows up in CI only sometimes; this test makes it deterministic."""
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_every_experiments_module_imports_beside_every_other():
  modules = sorted('.'.join(p.relative_to(REPO).with_suffix('').parts)
                   for p in (REPO / 'experiments').rglob('*.py') if p.name != '__init__.py')
  assert 'experiments.reproduce' in modules and 'experiments.fedsc.evidence' in modules, modules
  probe = 'import importlib\n' + ''.join(f'importlib.import_module({m!r})\n' for m in modules)
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, '-c', probe], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
