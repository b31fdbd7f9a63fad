"""conv_impl='measured' (core/conv_choice.py): each packable convolution of a vmapped local step is
timed once under every candidate, the choice is stored beside strategy.json, read back by a later
trace without timing, recorded for the run, and computes what the packed program computes; a
damaged choice file is one error line, an unreadable one a warning."""
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import models
from fedjax_ssl.core import conv_choice, packing

K = 2


def _run(conv_impl):
  enc = models.get_encoder('small_cnn', conv_features=(3, 4), dense_features=(6,),
                           conv_impl=conv_impl)
  x = jax.random.normal(jax.random.PRNGKey(0), (K, 2, 8, 8, 1))
  variables = jax.vmap(lambda k, xx: enc.init(k, xx, train=True))(
      jax.random.split(jax.random.PRNGKey(1), K), x)

  def step(v, xx):
    return jax.grad(lambda p: jnp.sum(jnp.sin(enc.apply({**v, 'params': p}, xx, train=True))))(
        v['params'])
  return jax.jit(packing.vmap(step))(variables, x)


@pytest.fixture
def folder(tmp_path, monkeypatch):
  monkeypatch.setattr(conv_choice, 'cache_dir', lambda: tmp_path)
  monkeypatch.setattr(conv_choice, 'REPEATS', 1)
  conv_choice.reset()
  yield tmp_path
  conv_choice.reset()


def test_measured_once_stored_reused_recorded(folder, monkeypatch):
  got = _run('measured')
  first = conv_choice.recorded()
  # small_cnn's two convolutions: forward and kernel gradient each, and conv2's input gradient.
  assert len(first) == 5
  for entry in first.values():
    # On this CPU the Pallas kernel would run interpreted: never a candidate (PERF-68).
    assert entry['source'] == 'measured' and set(entry['seconds']) == {'grouped', 'loop', 'vmap'}
    assert entry['impl'] == min(entry['seconds'], key=entry['seconds'].get)
  stored = json.loads((folder / conv_choice.FILE).read_text())
  assert {k: v['impl'] for k, v in stored.items()} == {k: v['impl'] for k, v in first.items()}
  assert all(k.startswith(f'{jax.devices()[0].device_kind}|jax {jax.__version__}|K={K}|')
             for k in stored)
  # float32, a few dozen terms per output: the implementations differ by summation order only.
  want = _run('packed')
  for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(a))))
  # A new process (this one's record forgotten) reads the file and times nothing.
  conv_choice.reset()
  monkeypatch.setattr(conv_choice, 'time_candidates', lambda *a, **k: pytest.fail('timed again'))
  _run('measured')
  again = conv_choice.recorded()
  assert {k: (v['impl'], v['source']) for k, v in again.items()} == {
      k: (v['impl'], 'cache') for k, v in first.items()}
  assert len(conv_choice.text()) == 5


def test_candidates_are_timed_running_not_staged(folder, monkeypatch):
  # Timing happens while the round is traced; a call staged into that trace instead of run would
  # return a tracer (and time the staging).
  seen = []
  original = conv_choice.jax.block_until_ready

  def spy(x):
    seen.append(all(isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
                    for leaf in jax.tree_util.tree_leaves(x)))
    return original(x)
  monkeypatch.setattr(conv_choice.jax, 'block_until_ready', spy)
  _run('measured')
  assert seen and all(seen)


def test_a_damaged_file_is_one_line_before_compute(folder):
  # Raised at trace time (jax appends its traceback note on lines of their own).
  path = folder / conv_choice.FILE
  path.write_text('{"a": ')
  with pytest.raises(ValueError, match=rf'(?m)\A{path} is not JSON \(.*\); delete it to measure again$'):
    _run('measured')
  path.write_text(json.dumps({'some conv': {'impl': 'winograd'}}))
  with pytest.raises(ValueError, match=rf"\A{path}: entry 'some conv' has impl='winograd'; allowed: "
                                       r"\('grouped', 'loop', 'vmap', 'pallas'\) \(delete the file"):
    _run('measured')
  path.write_text('[1]')
  with pytest.raises(ValueError, match=r'holds list, not an object of choices'):
    _run('measured')


def test_an_unreadable_file_is_a_warning(folder, caplog):
  (folder / conv_choice.FILE).mkdir()  # reading a folder fails with an OSError
  with caplog.at_level(logging.WARNING):
    _run('measured')
  assert 'cannot be read' in caplog.text and 'cannot be written' in caplog.text
  assert {v['source'] for v in conv_choice.recorded().values()} == {'measured'}


def test_pallas_is_a_candidate_only_where_it_compiles(monkeypatch):
  """'pallas' is timed only on a GPU backend (pallas_conv.available) and for equations the kernel
  computes; on this CPU it is never a candidate."""
  enc = models.get_encoder('small_cnn', conv_features=(3, 4), dense_features=(6,), conv_impl='packed')
  x = jnp.zeros((K, 2, 8, 8, 1))
  variables = jax.vmap(lambda xx: enc.init(jax.random.PRNGKey(1), xx, train=True))(x)
  seen = []

  def spy(eqn, vals, k, case):
    seen.append((eqn, vals, case))
    return 'grouped'
  step = lambda v, xx: jax.grad(lambda p: jnp.sum(enc.apply({**v, 'params': p}, xx, train=True)))(  # noqa: E731
      v['params'])
  jax.make_jaxpr(packing.vmap(step, choose=spy))(variables, x)
  assert len(seen) == 5
  assert {packing.candidates(*s) for s in seen} == {('grouped', 'loop', 'vmap')}
  monkeypatch.setattr(packing.pallas_conv, 'available', lambda: True)
  assert {packing.candidates(*s) for s in seen} == {packing.IMPLS}
  eqn, vals, case = seen[0]
  f64 = [packing.Value(np.zeros(v.array.shape, np.float64), v.form, v.shape) for v in vals]
  assert 'pallas' not in packing.candidates(eqn, f64, case)  # float64: not a kernel dtype


def test_a_stored_pallas_choice_is_measured_again_where_it_cannot_run(folder, caplog):
  _run('measured')
  path = folder / conv_choice.FILE
  stored = json.loads(path.read_text())
  path.write_text(json.dumps({k: {**v, 'impl': 'pallas'} for k, v in stored.items()}))
  conv_choice.reset()
  with caplog.at_level(logging.WARNING):
    _run('measured')
  assert caplog.text.count("'pallas' for ") == 5 and 'cannot run here' in caplog.text
  assert {(v['source'], v['impl'] != 'pallas') for v in conv_choice.recorded().values()} == {
      ('measured', True)}
