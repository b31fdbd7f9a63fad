"""Training images left in their source and read by row (types.Rows): indexing against the array,
the IDX and tfds readers against the whole-split loaders, the memory a rows-on-demand load holds,
and placement 'divided' built from the rows a process reads (placement.divide_rows)."""
import gc
import gzip
import tracemalloc

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from fedjax_ssl.core import placement
from fedjax_ssl.core import round as rd
from fedjax_ssl.data import partition, sources
from fedjax_ssl.data.types import Rows
from tests.core import test_round_equivalence as eq
from tests.data.test_data_sources import _idx_bytes, _write, _write_idx_dir


def _array_rows(a, reads=None):
  """Rows over an in-memory array; `reads` (a list) records every read's rows."""
  def read(rows):
    assert np.all(np.diff(rows) > 0), 'Rows must ask for sorted unique rows'
    if reads is not None:
      reads.append(rows)
    for j in range(0, len(rows), 4):
      yield j, a[rows[j:j + 4]]
  return Rows(a.shape, read, lambda n: (a[i:i + n] for i in range(0, len(a), n)))


def test_rows_index_like_the_array_and_read_each_row_once():
  a = np.random.default_rng(0).integers(0, 256, (50, 3, 2, 1), dtype=np.uint8)
  reads = []
  rows = _array_rows(a, reads)
  assert (rows.shape, rows.dtype, rows.ndim, len(rows)) == (a.shape, np.uint8, 4, 50)
  idx = np.array([7, 3, 7, -1, 49, 0])
  np.testing.assert_array_equal(rows[idx], a[idx])
  np.testing.assert_array_equal(reads[-1], [0, 3, 7, 49])   # sorted, unique, non-negative
  np.testing.assert_array_equal(rows[np.array([[1, 2], [2, 1]])], a[[[1, 2], [2, 1]]])
  assert rows[np.array([], np.int64)].shape == (0, 3, 2, 1)
  view = rows[10:40][5:]               # slices read nothing
  assert isinstance(view, Rows) and view.shape == (25, 3, 2, 1) and len(reads) == 2
  np.testing.assert_array_equal(view[np.array([0, 24])], a[[15, 39]])
  np.testing.assert_array_equal(np.asarray(view), a[15:40])
  np.testing.assert_array_equal(np.concatenate(list(view.chunks(7))), a[15:40])
  assert [len(c) for c in view.chunks(7)] == [6, 7, 7, 5]   # the source's chunks, cut
  np.testing.assert_array_equal(rows[::3], a[::3])
  assert np.asarray(rows, np.float32).dtype == np.float32
  assert sources.channel_stats(view) == sources.channel_stats(a[15:40])
  with pytest.raises(IndexError, match='row 50 is out of range for 50 rows'):
    rows[np.array([1, 50])]
  with pytest.raises(TypeError, match='Rows are indexed by integers or a slice, got float64'):
    rows[np.array([1.0])]


@pytest.mark.parametrize('compress', [False, True])
def test_idx_rows_on_demand_equal_the_loaded_split(tmp_path, compress):
  arrays = _write_idx_dir(tmp_path, np.random.default_rng(1), n_train=9000, n_test=20)
  train = tmp_path / sources.IDX_FILES['train_x']
  if not compress:   # the helper gzips the training files; this case reads the raw file
    (tmp_path / (train.name + '.gz')).unlink()
    _write(train, _idx_bytes(arrays['train_x'], 0x08, '>u1'), False)
  whole = sources.load_dataset('mnist', source='idx', data_dir=str(tmp_path))
  lazy = sources.load_dataset('mnist', source='idx', data_dir=str(tmp_path), rows_on_demand=True)
  assert isinstance(lazy.train_x, Rows) and lazy.train_x.shape == whole.train_x.shape
  assert (lazy.mean, lazy.std) == (whole.mean, whole.std)
  np.testing.assert_array_equal(lazy.train_y, whole.train_y)
  np.testing.assert_array_equal(lazy.test_x, whole.test_x)
  idx = np.random.default_rng(2).integers(0, 9000, 700)   # spans several decompressed chunks
  np.testing.assert_array_equal(lazy.train_x[idx], whole.train_x[idx])
  np.testing.assert_array_equal(lazy.train_x[np.array([8999])], whole.train_x[[8999]])


def test_a_truncated_gzipped_idx_file_is_refused_at_load(tmp_path):
  arrays = _write_idx_dir(tmp_path, np.random.default_rng(1), n_train=100)
  path = tmp_path / (sources.IDX_FILES['train_x'] + '.gz')
  path.write_bytes(gzip.compress(_idx_bytes(arrays['train_x'], 0x08, '>u1')[:-12]))
  with pytest.raises(ValueError, match=r'IDX shape \(100, 4, 3\) of uint8 needs 1200 data bytes, '
                                       r'the file ends after 1188'):
    sources.load_dataset('mnist', source='idx', data_dir=str(tmp_path), rows_on_demand=True)


def test_a_rows_on_demand_load_holds_the_rows_read_not_the_split(tmp_path):
  """60,000 images of 28 x 28 (47 MB, gzipped): loading them on demand and reading a quarter of
  the rows peaks below the quarter plus 25 % of the split (measured: the quarter plus 11 %, the
  decompression's blocks and the statistics' counting buffer, sizes that do not grow with the
  split); the whole-split load holds the split and more."""
  n = 60000
  image = np.random.default_rng(3).integers(0, 256, (28, 28), dtype=np.uint8)
  train_x = np.broadcast_to(image, (n, 28, 28))   # compresses fast; values do not matter here
  arrays = dict(train_x=train_x, train_y=(np.arange(n) % 10).astype(np.uint8),
                test_x=train_x[:10], test_y=np.arange(10, dtype=np.uint8))
  for key, stem in sources.IDX_FILES.items():
    (tmp_path / (stem + '.gz')).write_bytes(
        gzip.compress(_idx_bytes(arrays[key], 0x08, '>u1'), compresslevel=1))
  split_bytes = n * 28 * 28
  quarter = np.arange(0, n, 4)

  def peak(fn):
    gc.collect()
    tracemalloc.start()
    try:
      fn()
      return tracemalloc.get_traced_memory()[1]
    finally:
      tracemalloc.stop()

  def lazy():
    ds = sources.load_dataset('mnist', source='idx', data_dir=str(tmp_path), rows_on_demand=True)
    assert ds.train_x[quarter].shape == (n // 4, 28, 28, 1)

  assert peak(lazy) < split_bytes / 4 + 0.25 * split_bytes
  assert peak(lambda: sources.load_dataset('mnist', source='idx', data_dir=str(tmp_path))
              ) > split_bytes


@pytest.mark.parametrize('name', ['cifar10', 'fashion_mnist'])
def test_tfds_rows_on_demand_equal_the_loaded_split(name):
  with tfds.testing.mock_data(num_examples=9):
    whole = sources.load_dataset(name, source='tfds', download=False)
    lazy = sources.load_dataset(name, source='tfds', download=False, rows_on_demand=True)
    assert isinstance(lazy.train_x, Rows)
    np.testing.assert_array_equal(lazy.train_x[np.array([8, 0, 4, 4])],
                                  whole.train_x[[8, 0, 4, 4]])
    np.testing.assert_array_equal(np.asarray(lazy.train_x), whole.train_x)
  assert (lazy.mean, lazy.std) == (whole.mean, whole.std)
  np.testing.assert_array_equal(lazy.train_y, whole.train_y)
  np.testing.assert_array_equal(lazy.test_x, whole.test_x)


@pytest.mark.parametrize('processes', [1, 2, 3])
def test_divided_rows_equal_the_cut_of_the_whole_federation(processes):
  dataset = sources.make_synthetic(num_train=120, num_test=10, image_shape=(4, 4, 1))
  fed, info = partition.build_fed_data(dataset, 7, 'dirichlet', seed=4, alpha=0.3,
                                       public_size=9, on_host=True)
  drawn = partition.draw_rows(dataset, 7, 'dirichlet', seed=4, alpha=0.3, public_size=9)
  for key in ('histogram', 'public_idx'):
    np.testing.assert_array_equal(drawn[key], info[key])
  assert all(np.array_equal(a, b) for a, b in zip(drawn['indices'], info['indices']))
  for p in range(processes):
    reads = []
    got = placement.divide_rows(_array_rows(dataset.train_x, reads), dataset.train_y,
                                drawn['indices'], drawn['public_idx'], p, processes)
    want = placement.divide(fed, p, processes)
    for field in ('lo', 'hi', 'n_max', 'n_min', 'process_count'):
      assert getattr(got, field) == getattr(want, field), field
    for field in ('x', 'y', 'offsets', 'n', 'public_x'):
      np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    held = np.concatenate(drawn['indices'][got.lo:got.hi] + [drawn['public_idx']])
    assert len(reads) == 1 and set(reads[0]) == set(held)   # one read, of its rows only


def test_federation_shapes_give_the_whole_federations_message_sizes():
  """message_bytes traced on the shapes equals message_bytes on the whole federation's rows."""
  algo, _ = eq._algo('fedema')
  fed = eq._data()
  cfg = eq._round_cfg('vmap', 3)
  state = rd.init_state(algo, jax.random.PRNGKey(0), eq.NUM_CLIENTS)
  shapes = placement.federation_shapes(placement.divide(jax.device_get(fed), 0, 2))
  assert shapes.x.shape == fed.x.shape and shapes.n_max == fed.n_max
  assert (rd.message_bytes(algo, cfg, eq.NUM_CLIENTS, state, shapes)
          == rd.message_bytes(algo, cfg, eq.NUM_CLIENTS, state, fed))
