"""core/host_memory: once `keep_freed_memory()` has run (the binaries call it at their start;
importing fedjax_ssl does not), repeated XLA:CPU executions reuse freed temporaries instead of
page-faulting fresh ones: mostly with the default 'keep', fully with 'one_arena';
FEDJAX_SSL_MALLOC=system keeps glibc's behaviour (every call faults its temporaries in again)."""
import ast
import os
import pathlib
import platform
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

# A supervised FedAvg small-CNN step of batch 128 (its temporaries are ~53 MiB, above glibc's
# largest mmap threshold of 32 MiB; a small program, so it compiles fast), jitted at top level; prints its temporary bytes and the minor page faults
# per call after three warm-up calls (the least over 4 blocks of 5 calls: another process on the
# cores can delay a free past the next call's allocation).
_PROBE = r'''
import resource
import numpy as np
from fedjax_ssl.core import host_memory
host_memory.keep_freed_memory()  # as the binaries do at their start
import jax, jax.numpy as jnp
from fedjax_ssl import experiment
from fedjax_ssl.core.algorithm import restore_client
from fedjax_ssl.core import round as rd
from fedjax_ssl.data.types import Dataset
c = experiment.default_config()
c.algorithm, c.ssl_method = 'fedavg', 'supervised'
c.encoder, c.heads, c.augmentation = 'small_cnn', 'custom', 'none'
c.num_clients = c.clients_per_round = 1
x = np.random.RandomState(0).randint(0, 256, (128, 28, 28, 1)).astype(np.uint8)
y = np.zeros(128, np.int32)
ds = Dataset(name='probe', train_x=x, train_y=y, test_x=x, test_y=y, num_classes=10,
             mean=(0.5,), std=(0.25,))
algo = experiment.build_algorithm(c, ds)
state = rd.init_state(algo, jax.random.PRNGKey(0), 1)
msg = algo.broadcast(state.server)
client = restore_client(algo, jax.tree_util.tree_map(lambda a: a[0], state.clients), msg)
step = jax.jit(algo.local_step)
args = (client, {'x': jnp.asarray(x), 'y': jnp.asarray(y)}, jax.random.PRNGKey(1), msg,
        jnp.float32(0.05))
temp = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
for _ in range(3):
  jax.block_until_ready(step(*args))
blocks = []
for _ in range(4):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(5):
    jax.block_until_ready(step(*args))
  blocks.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
print(temp, min(blocks))
'''


def _temp_pages_and_faults_per_call(malloc: str):
  env = dict(os.environ, PYTHONPATH=str(REPO), FEDJAX_SSL_MALLOC=malloc, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  out = subprocess.run([sys.executable, '-c', _PROBE], env=env, check=True, capture_output=True,
                       text=True, timeout=300)
  temp, faults = out.stdout.strip().splitlines()[-1].split()
  return int(temp) // os.sysconf('SC_PAGE_SIZE'), float(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='the settings are glibc mallopt')
def test_executions_reuse_freed_temporaries_unless_opted_out():
  pages, system = _temp_pages_and_faults_per_call('system')
  _, kept = _temp_pages_and_faults_per_call('keep')
  _, one_arena = _temp_pages_and_faults_per_call('one_arena')
  assert pages > (32 << 20) // os.sysconf('SC_PAGE_SIZE')
  # Measured: ~100 % of the pages per call with glibc's defaults; with 'keep' 0-60 % over 11
  # processes (median < 1 %: it depends on which worker thread's arena, unmapped once empty, serves
  # the block); 0 with one arena on a quiet machine (single blocks up to ~10 % under load).
  assert system > 0.8 * pages, (system, pages)
  assert kept < 0.8 * pages, (kept, pages)
  assert one_arena < 0.05 * pages, (one_arena, pages)


def test_unknown_mode_is_a_clear_error(monkeypatch):
  from fedjax_ssl.core import host_memory  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv(host_memory.ENV_VAR, 'jemalloc')
  with pytest.raises(ValueError, match=r"FEDJAX_SSL_MALLOC = 'jemalloc' is invalid: must be one "
                                       r"of \('keep', 'one_arena', 'system'\)"):
    host_memory.keep_freed_memory()


# Whether glibc serves a 64 MiB malloc with mmap (its default: the block is above the largest mmap
# threshold, 32 MiB) or from the heap (M_MMAP_MAX = 0), read from mallinfo2's mmapped bytes; before
# and after `keep_freed_memory()`, with fedjax_ssl (and with it jax) imported first.
_MMAP_PROBE = r'''
import ctypes
import fedjax_ssl
libc = ctypes.CDLL(None)
class MallInfo2(ctypes.Structure):
  _fields_ = [(f, ctypes.c_size_t) for f in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd',
              'usmblks', 'fsmblks', 'uordblks', 'fordblks', 'keepcost')]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def mmapped():
  before = libc.mallinfo2().hblkhd
  block = libc.malloc(64 << 20)
  grew = libc.mallinfo2().hblkhd - before >= 64 << 20
  libc.free(block)
  return grew
print(mmapped(), fedjax_ssl.core.host_memory.keep_freed_memory(), mmapped())
'''


@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='the settings are glibc mallopt')
def test_importing_fedjax_ssl_leaves_malloc_alone():
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS='cpu')
  env.pop('FEDJAX_SSL_MALLOC', None)  # the default, 'keep'
  out = subprocess.run([sys.executable, '-c', _MMAP_PROBE], env=env, check=True,
                       capture_output=True, text=True, timeout=300)
  # mmapped after the import (glibc's defaults), then glibc accepted 'keep': no mmap any more.
  assert out.stdout.split() == ['True', 'True', 'False'], out.stdout


def _top_level_calls_and_imports(path: pathlib.Path):
  """The binary's top-level statements, in order: ('import', module) for every import and
  ('call', source) for every call statement under `if __name__ == '__main__':`."""
  events = []
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.Import):
      events += [('import', alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      events.append(('import', node.module))
    elif isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
      events += [('call', ast.unparse(s)) for s in node.body if isinstance(s, ast.Expr)]
  return events


@pytest.mark.parametrize('binary', ['train.py', 'benchmark/__main__.py', 'reproduce.py'])
def test_binaries_keep_freed_memory_at_process_start(binary):
  events = _top_level_calls_and_imports(REPO / 'experiments' / binary)
  call = events.index(('call', 'host_memory.keep_freed_memory()'))
  # Before it: only the standard library, absl and host_memory itself; jax and the rest after it.
  before = [module for kind, module in events[:call] if kind == 'import']
  assert 'fedjax_ssl.core' in before, before
  assert not [m for m in before
              if m != 'fedjax_ssl.core' and m.split('.')[0] not in sys.stdlib_module_names
              and m.split('.')[0] not in ('__future__', 'absl')], before
  after = [module for kind, module in events[call:] if kind == 'import']
  # jax, or the binary's own modules that import it (the benchmark's settings), after it.
  assert [m for m in after if m == 'jax' or m.startswith('experiments.')], after
  # The packages Python imports before running the binary (`python -m experiments.benchmark` runs
  # experiments/__init__.py and experiments/benchmark/__init__.py first) import nothing at all.
  for package in pathlib.Path(binary).parents:
    assert not [e for e in _top_level_calls_and_imports(REPO / 'experiments' / package /
                                                        '__init__.py') if e[0] == 'import']
