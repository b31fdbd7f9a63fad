"""Tests for fedjax_ssl.runs.checkpoint (orbax-based Checkpointer)."""

import gc
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.path import atomicity_types

from fedjax_ssl.runs.checkpoint import Checkpointer, UnreadableCheckpoint

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@flax.struct.dataclass
class _State:
  params: dict
  round: jnp.ndarray
  key: jnp.ndarray


def _nested_state(seed):
  """A state whose every leaf depends on `seed` (so rounds are distinguishable)."""
  rng = np.random.default_rng(seed)
  params = {'w': jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
            'b': jnp.asarray(rng.standard_normal(4), jnp.float32)}
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
  opt_state = tx.init(params)  # namedtuples, EmptyState, int32 count
  _, opt_state = tx.update(params, opt_state, params)  # non-zero moments
  return {
      'cohort': {
          'params': params,
          'opt_state': opt_state,
          'opt_count': jnp.asarray(rng.integers(0, 100, (2,)), jnp.int32),
      },
      'round': jnp.int32(seed),
      'key': jax.random.PRNGKey(seed),  # uint32[2]
      'client_keys': jax.random.split(jax.random.PRNGKey(seed + 1), 3),  # uint32[3, 2]
      'typed_key': jax.random.key(seed),  # new-style typed key array
  }


def _host_copy(tree):
  """Independent reference: numpy copies (typed keys -> their uint32 data)."""
  def leaf(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return np.array(jax.random.key_data(x))
    return np.array(x)
  return jax.tree.map(leaf, tree)


def _assert_tree_exact(restored, expected_host):
  restored_host = _host_copy(restored)
  assert jax.tree.structure(restored_host) == jax.tree.structure(expected_host)
  for got, want in zip(jax.tree.leaves(restored_host), jax.tree.leaves(expected_host)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_roundtrip_nested_state_abstract_template(tmp_path):
  state = _nested_state(5)
  expected = _host_copy(state)
  meta = {'config': {'alpha': 0.5, 'method': 'byol', 'sizes': [1, 2]}, 'git': 'abc123'}
  with Checkpointer(tmp_path / 'ckpt', save_every=1) as ckpt:
    assert ckpt.latest_round() is None
    assert ckpt.maybe_save(3, state, metadata=meta)
  with Checkpointer(tmp_path / 'ckpt', save_every=1) as ckpt:  # a resumed process
    assert ckpt.latest_round() == 3
    template = jax.eval_shape(lambda: _nested_state(0))
    r, restored, restored_meta = ckpt.restore(template)
  assert r == 3
  assert restored_meta == meta
  _assert_tree_exact(restored, expected)
  assert restored['key'].dtype == np.uint32 and restored['round'].dtype == np.int32
  assert jnp.issubdtype(restored['typed_key'].dtype, jax.dtypes.prng_key)
  assert isinstance(restored['cohort']['params']['w'], jax.Array)


def test_struct_dataclass_roundtrip_real_template(tmp_path):
  state = _State(params={'w': (jnp.arange(6, dtype=jnp.float32) * 0.5 - 1.0).reshape(2, 3)},
                 round=jnp.int32(7), key=jax.random.PRNGKey(42))
  expected = _host_copy(state)
  template = _State(params={'w': jnp.zeros((2, 3), jnp.float32)},
                    round=jnp.int32(0), key=jax.random.PRNGKey(0))
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.maybe_save(7, state)
    r, restored, meta = ckpt.restore(template)
  assert (r, meta) == (7, {})
  assert isinstance(restored, _State)
  _assert_tree_exact(restored, expected)
  # Hand-derived values: arange(6) * 0.5 - 1 (exact in float32); PRNGKey(42) == [0, 42].
  np.testing.assert_array_equal(np.asarray(restored.params['w']).ravel(),
                                np.array([-1.0, -0.5, 0.0, 0.5, 1.0, 1.5], np.float32))
  np.testing.assert_array_equal(np.asarray(restored.key), np.array([0, 42], np.uint32))
  assert restored.round.sharding == template.round.sharding


def test_save_schedule_max_to_keep_and_specific_round(tmp_path):
  with Checkpointer(tmp_path, save_every=2, max_to_keep=2) as ckpt:
    written = [r for r in range(8) if ckpt.maybe_save(r, _nested_state(r))]
    assert written == [0, 2, 4, 6]
    assert ckpt.all_rounds() == [4, 6] and ckpt.latest_round() == 6
    assert sorted(os.listdir(tmp_path)) == ['4', '6']
    assert ckpt.maybe_save(7, _nested_state(7), force=True)
    # Synchronous: committed (renamed, commit file written) when the call returns.
    assert (tmp_path / '7' / 'commit_success.txt').is_file()
    assert not any(atomicity_types.TMP_DIR_SUFFIX in n for n in os.listdir(tmp_path))
    assert not ckpt.maybe_save(7, _nested_state(7), force=True)  # already saved: no-op
    assert ckpt.all_rounds() == [6, 7] and ckpt.latest_round() == 7
    template = jax.eval_shape(lambda: _nested_state(0))
    r, restored, _ = ckpt.restore(template, round_idx=6)
    assert r == 6
    _assert_tree_exact(restored, _host_copy(_nested_state(6)))
    r, restored, _ = ckpt.restore(template)
    assert r == 7
    _assert_tree_exact(restored, _host_copy(_nested_state(7)))


def test_save_every_zero_only_forced(tmp_path):
  with Checkpointer(tmp_path, save_every=0) as ckpt:
    assert not ckpt.maybe_save(0, _nested_state(0))
    assert not ckpt.maybe_save(4, _nested_state(4))
    assert ckpt.maybe_save(5, _nested_state(5), force=True)
    assert ckpt.all_rounds() == [5]


def test_tmp_named_directory_is_ignored(tmp_path):
  """A directory carrying orbax's in-progress suffix is never a checkpoint."""
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.maybe_save(1, _nested_state(1))
  # Even a byte-complete copy is ignored while it still has the tmp name.
  shutil.copytree(tmp_path / '1', tmp_path / f'9{atomicity_types.TMP_DIR_SUFFIX}')
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    assert ckpt.latest_round() == 1 and ckpt.all_rounds() == [1]
    r, restored, _ = ckpt.restore(jax.eval_shape(lambda: _nested_state(0)))
  assert r == 1
  _assert_tree_exact(restored, _host_copy(_nested_state(1)))


_KILLED_SAVE_SCRIPT = textwrap.dedent('''
    import os, sys
    import jax, jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    from fedjax_ssl.runs.checkpoint import Checkpointer

    ckpt = Checkpointer(sys.argv[1], save_every=1)
    ckpt.maybe_save(1, {'w': jnp.full((4,), 1.0), 'key': jax.random.PRNGKey(1)})

    item_finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def killed_before_step_rename(self):
      # Items ('state', 'metadata') are committed inside `2.orbax-checkpoint-tmp`;
      # the process dies right before that step directory is renamed to `2`,
      # the latest possible moment. os._exit runs no cleanup, like SIGKILL.
      if self.get_final().name == '2':
        os._exit(17)
      await item_finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = killed_before_step_rename
    ckpt.maybe_save(2, {'w': jnp.full((4,), 2.0), 'key': jax.random.PRNGKey(2)})
    ''')


def test_save_killed_mid_write_is_ignored(tmp_path):
  directory = tmp_path / 'ckpt'
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  proc = subprocess.run([sys.executable, '-c', _KILLED_SAVE_SCRIPT, str(directory)],
                        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 17, proc.stderr[-2000:]
  tmp_dir = directory / f'2{atomicity_types.TMP_DIR_SUFFIX}'
  # Round 2 is fully written but not committed.
  assert (tmp_dir / 'state' / 'commit_success.txt').is_file()
  assert (tmp_dir / 'metadata' / 'commit_success.txt').is_file()
  assert not (directory / '2').exists()

  template = {'w': jnp.zeros((4,)), 'key': jax.random.PRNGKey(0)}
  with Checkpointer(directory, save_every=1) as ckpt:
    assert ckpt.latest_round() == 1
    r, restored, _ = ckpt.restore(template)
    assert r == 1
    np.testing.assert_array_equal(np.asarray(restored['w']), np.ones(4, np.float32))
    np.testing.assert_array_equal(np.asarray(restored['key']), np.array([0, 1], np.uint32))
    # The resumed run re-saves round 2 over the leftover tmp directory.
    assert ckpt.maybe_save(2, {'w': jnp.full((4,), 2.0), 'key': jax.random.PRNGKey(2)})
    r, restored, _ = ckpt.restore(template)
  assert r == 2
  np.testing.assert_array_equal(np.asarray(restored['w']), np.full(4, 2.0, np.float32))
  assert not tmp_dir.exists()


def test_errors(tmp_path):
  with pytest.raises(ValueError, match='save_every'):
    Checkpointer(tmp_path, save_every=-1)
  with pytest.raises(ValueError, match='max_to_keep'):
    Checkpointer(tmp_path, save_every=1, max_to_keep=0)
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    template = {'w': jnp.zeros((3,), jnp.float32)}
    with pytest.raises(FileNotFoundError, match='no complete checkpoint'):
      ckpt.restore(template)
    with pytest.raises(ValueError, match='not JSON-serialisable'):
      ckpt.maybe_save(1, template, metadata={'x': np.float32(1.0)})
    assert ckpt.all_rounds() == []  # nothing written by the failed call
    with pytest.raises(ValueError, match='round_idx'):
      ckpt.maybe_save(-1, template)
    ckpt.maybe_save(1, template)
    with pytest.raises(ValueError, match=r'available rounds: \[1\]'):
      ckpt.restore(template, round_idx=5)
    with pytest.raises(ValueError, match='does not match the template'):
      ckpt.restore({'w': jnp.zeros((4,), jnp.float32)})
    with pytest.raises(ValueError, match='does not match the template'):
      ckpt.restore({'v': jnp.zeros((3,), jnp.float32)})


def test_read_only_reader_beside_a_writer(tmp_path):
  writer = Checkpointer(tmp_path, save_every=1)
  writer.maybe_save(1, _nested_state(1))
  in_progress = tmp_path / f'2{atomicity_types.TMP_DIR_SUFFIX}'  # the writer's save of round 2
  in_progress.mkdir()
  with Checkpointer(tmp_path, save_every=1, read_only=True) as reader:
    assert reader.latest_round() == 1
    r, _, _ = reader.restore(jax.eval_shape(lambda: _nested_state(0)))
    assert r == 1
    # A reader never cleans up another job's save (a writer's cleanup would have
    # removed it in the background by now).
    assert in_progress.is_dir()
    with pytest.raises(ValueError, match='read_only=True'):
      reader.maybe_save(3, _nested_state(3), force=True)
    in_progress.rmdir()
    writer.maybe_save(2, _nested_state(2))
    assert reader.latest_round() == 2  # sees rounds saved after it was opened
    r, restored, _ = reader.restore(jax.eval_shape(lambda: _nested_state(0)))
  writer.close()
  assert r == 2
  _assert_tree_exact(restored, _host_copy(_nested_state(2)))


def test_a_failed_restore_prints_no_traceback(tmp_path, caplog):
  """A damaged manifest fails every array's read task; orbax raises the first and asyncio logs each
  other one ("Task exception was never retrieved", with a traceback) when the task is collected,
  which a user would read as a crash. The restore's own error is what they see."""
  state = {f'layer{i}': {'w': jnp.ones((8, 8)), 'b': jnp.zeros(8)} for i in range(8)}
  rng = np.random.default_rng(0)
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.maybe_save(1, state)
    (tmp_path / '1' / 'state' / 'manifest.ocdbt').write_bytes(rng.bytes(64))
    with caplog.at_level(logging.ERROR, logger='asyncio'):
      for _ in range(3):  # each restore starts 16 reads, all failing
        with pytest.raises(UnreadableCheckpoint, match=r'round 1 .*manifest\.ocdbt'):
          ckpt.restore(state, 1)
        gc.collect()
  assert [r.getMessage()[:40] for r in caplog.records if r.name == 'asyncio'] == []


@pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning')
def test_a_failed_restore_stays_quiet_after_close(tmp_path, caplog):
  """Damaged data files leave futures whose errors asyncio logs when they are collected, which can
  be after the checkpointer is closed (CI saw the dumps then: a filter that `close` removed let
  them through), and TensorStore's reads that complete after orbax closed its loop raise in a
  callback ('Event loop is closed': pytest reports these unraisable errors as a warning, here an
  error). Both stay off the console for the rest of the process."""
  state = {f'layer{i}': {'w': jnp.full((64, 32), i, jnp.float32)} for i in range(16)}
  with Checkpointer(tmp_path, save_every=1) as ckpt:
    ckpt.maybe_save(1, state)
  for data in (tmp_path / '1' / 'state').glob('**/d/*'):
    data.write_bytes(bytes(min(data.stat().st_size, 8192)))
  with caplog.at_level(logging.ERROR, logger='asyncio'):
    with Checkpointer(tmp_path, save_every=1) as ckpt:
      with pytest.raises(UnreadableCheckpoint, match='round 1'):
        ckpt.restore(state, 1)
    gc.collect()
  assert [r.getMessage()[:40] for r in caplog.records if r.name == 'asyncio'] == []
