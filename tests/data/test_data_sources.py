"""Tests of fedjax_ssl.data.sources: IDX parsing, tfds loading (mock data), synthetic, subset."""
import gzip
import os
import struct

import numpy as np
import pytest
import tensorflow_datasets as tfds

from fedjax_ssl.data import sources

DEBIAN_DIR = sources.DEBIAN_FASHION_MNIST_DIR
HAVE_DEBIAN = all(os.path.isfile(os.path.join(DEBIAN_DIR, f + '.gz'))
                  for f in sources.IDX_FILES.values())


def _idx_bytes(array, type_byte, big_endian_dtype):
  """Independent IDX writer: header per the format description, then big-endian values."""
  header = struct.pack('>BBBB', 0, 0, type_byte, array.ndim)
  header += struct.pack('>' + 'I' * array.ndim, *array.shape)
  return header + np.ascontiguousarray(array, dtype=big_endian_dtype).tobytes()


def _write(path, data, compress):
  path.write_bytes(gzip.compress(data) if compress else data)
  return path


# ---------------------------------------------------------------------------------------------
# IDX
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('compress', [False, True])
def test_read_idx_uint8(tmp_path, compress):
  a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4) * 10
  path = _write(tmp_path / 'a', _idx_bytes(a, 0x08, '>u1'), compress)
  out = sources.read_idx(path)
  assert out.dtype == np.uint8 and out.shape == (2, 3, 4)
  np.testing.assert_array_equal(out, a)


def test_read_idx_big_endian_types(tmp_path):
  a = np.array([[1, -2, 300], [-32768, 32767, 0]], np.int16)
  out = sources.read_idx(_write(tmp_path / 'b', _idx_bytes(a, 0x0B, '>i2'), False))
  assert out.dtype == np.int16
  np.testing.assert_array_equal(out, a)
  f = np.array([1.5, -2.25, 1e30], np.float32)
  out = sources.read_idx(_write(tmp_path / 'c', _idx_bytes(f, 0x0D, '>f4'), False))
  np.testing.assert_array_equal(out, f)


def test_read_idx_rejects_bad_files(tmp_path):
  good = _idx_bytes(np.zeros((2, 2), np.uint8), 0x08, '>u1')
  with pytest.raises(ValueError, match='not an IDX file'):
    sources.read_idx(_write(tmp_path / 'm', b'\x01' + good[1:], False))
  with pytest.raises(ValueError, match='type byte 0x07'):
    sources.read_idx(_write(tmp_path / 't', good[:2] + b'\x07' + good[3:], False))
  with pytest.raises(ValueError, match='needs 4 data bytes, file has 3'):
    sources.read_idx(_write(tmp_path / 'x', good[:-1], True))
  with pytest.raises(ValueError, match='empty'):
    sources.read_idx(_write(tmp_path / 'e', b'', False))


def _write_idx_dir(directory, rng, n_train=12, n_test=5):
  arrays = dict(train_x=rng.integers(0, 256, (n_train, 4, 3), dtype=np.uint8),
                train_y=np.arange(n_train, dtype=np.uint8) % 10,
                test_x=rng.integers(0, 256, (n_test, 4, 3), dtype=np.uint8),
                test_y=np.arange(n_test, dtype=np.uint8) % 10)
  for key, stem in sources.IDX_FILES.items():
    compress = key.startswith('train')  # mixed on purpose: '.gz' is optional per file
    name = stem + ('.gz' if compress else '')
    _write(directory / name, _idx_bytes(arrays[key], 0x08, '>u1'), compress)
  return arrays


def test_load_idx_directory_and_auto_source(tmp_path):
  arrays = _write_idx_dir(tmp_path, np.random.default_rng(0))
  ds = sources.load_dataset('mnist', source='auto', data_dir=str(tmp_path))
  assert ds.name == 'mnist' and ds.num_classes == 10
  assert ds.train_x.shape == (12, 4, 3, 1) and ds.train_x.dtype == np.uint8
  assert ds.train_y.dtype == np.int32 and ds.test_x.shape == (5, 4, 3, 1)
  np.testing.assert_array_equal(ds.train_x[..., 0], arrays['train_x'])
  np.testing.assert_array_equal(ds.test_y, arrays['test_y'])
  ref = arrays['train_x'].astype(np.float64) / 255.0
  np.testing.assert_allclose(ds.mean, [ref.mean()], rtol=1e-12)
  np.testing.assert_allclose(ds.std, [ref.std()], rtol=1e-12)


def test_load_idx_missing_file(tmp_path):
  _write_idx_dir(tmp_path, np.random.default_rng(0))
  os.remove(tmp_path / 't10k-labels-idx1-ubyte')
  with pytest.raises(FileNotFoundError, match='t10k-labels-idx1-ubyte'):
    sources.load_dataset('fashion_mnist', source='idx', data_dir=str(tmp_path))


@pytest.mark.skipif(not HAVE_DEBIAN, reason='Debian dataset-fashion-mnist files not installed')
def test_debian_fashion_mnist_is_the_auto_default():
  ds = sources.load_dataset('fashion_mnist')  # 'auto': the Debian IDX files
  assert ds.train_x.shape == (60000, 28, 28, 1) and ds.test_x.shape == (10000, 28, 28, 1)
  assert ds.train_x.dtype == np.uint8 and ds.train_y.dtype == np.int32
  np.testing.assert_array_equal(np.bincount(ds.train_y), [6000] * 10)
  np.testing.assert_array_equal(np.bincount(ds.test_y), [1000] * 10)
  # Published Fashion-MNIST training statistics: mean 0.2860, std 0.3530.
  np.testing.assert_allclose(ds.mean, [0.2860], atol=5e-5)
  np.testing.assert_allclose(ds.std, [0.3530], atol=5e-5)


# ---------------------------------------------------------------------------------------------
# tfds (mock data: no download, no TensorFlow)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name,shape,num_classes', [
    ('cifar10', (32, 32, 3), 10), ('cifar100', (32, 32, 3), 100),
    ('mnist', (28, 28, 1), 10), ('fashion_mnist', (28, 28, 1), 10), ('svhn', (32, 32, 3), 10)])
def test_tfds_mock_loading(name, shape, num_classes):
  with tfds.testing.mock_data(num_examples=6):
    ds = sources.load_dataset(name, source='tfds', download=False)
    tfds_name = sources.TFDS_NAMES.get(name, name)   # svhn is tfds' 'svhn_cropped'
    reference = {split: tfds.data_source(tfds_name, split=split, download=False)
                 for split in ('train', 'test')}
    ref = {split: [reference[split][i] for i in range(6)] for split in reference}
  assert ds.name == name and ds.num_classes == num_classes
  for split, x, y in (('train', ds.train_x, ds.train_y), ('test', ds.test_x, ds.test_y)):
    assert x.shape == (6,) + shape and x.dtype == np.uint8
    assert y.shape == (6,) and y.dtype == np.int32
    np.testing.assert_array_equal(x, np.stack([e['image'] for e in ref[split]]))
    # cifar100: the fine 'label', not 'coarse_label'.
    np.testing.assert_array_equal(y, [int(e['label']) for e in ref[split]])
  assert len(ds.mean) == shape[-1] and len(ds.std) == shape[-1]
  scaled = ds.train_x.astype(np.float64) / 255.0
  np.testing.assert_allclose(ds.mean, scaled.mean(axis=(0, 1, 2)), rtol=1e-12)
  np.testing.assert_allclose(ds.std, scaled.std(axis=(0, 1, 2)), rtol=1e-12)


def test_tfds_auto_for_cifar():
  with tfds.testing.mock_data(num_examples=3):
    ds = sources.load_dataset('cifar10', download=False)
  assert ds.train_x.shape == (3, 32, 32, 3)


class _BatchedSource:
  """A data source with a working __getitems__, as tfds' real array_record sources have."""

  def __init__(self, n):
    self.n, self.batched_calls, self.single_calls = n, 0, 0

  def __len__(self):
    return self.n

  def _example(self, i):
    return {'image': np.full((2, 2, 1), i, np.uint8), 'label': np.int64(i % 3)}

  def __getitem__(self, i):
    self.single_calls += 1
    return self._example(i)

  def __getitems__(self, keys):
    self.batched_calls += 1
    return [self._example(i) for i in keys]


def test_read_split_uses_batched_reads(monkeypatch):
  monkeypatch.setattr(sources, '_TFDS_READ_CHUNK', 4)
  src = _BatchedSource(10)
  x, y = sources._read_split(src, (2, 2, 1))
  assert src.batched_calls == 3 and src.single_calls == 0  # chunks of 4, 4, 2
  np.testing.assert_array_equal(x[:, 0, 0, 0], np.arange(10))
  np.testing.assert_array_equal(y, np.arange(10) % 3)


# ---------------------------------------------------------------------------------------------
# synthetic
# ---------------------------------------------------------------------------------------------
def test_synthetic_deterministic_balanced_and_linearly_learnable():
  kw = dict(num_train=600, num_test=200, image_shape=(8, 8, 3), num_classes=6)
  a = sources.load_dataset('synthetic', seed=3, **kw)
  b = sources.load_dataset('synthetic', seed=3, **kw)
  c = sources.load_dataset('synthetic', seed=4, **kw)
  np.testing.assert_array_equal(a.train_x, b.train_x)
  np.testing.assert_array_equal(a.test_y, b.test_y)
  assert not np.array_equal(a.train_x, c.train_x)
  assert a.train_x.shape == (600, 8, 8, 3) and a.train_x.dtype == np.uint8
  assert a.num_classes == 6 and a.train_y.dtype == np.int32
  np.testing.assert_array_equal(np.bincount(a.train_y), [100] * 6)
  # The nearest-class-mean rule, a linear classifier, separates the classes on raw pixels.
  train = a.train_x.reshape(600, -1).astype(np.float64)
  test = a.test_x.reshape(200, -1).astype(np.float64)
  centroids = np.stack([train[a.train_y == k].mean(0) for k in range(6)])
  dist = ((test[:, None, :] - centroids[None]) ** 2).sum(-1)
  assert (dist.argmin(1) == a.test_y).mean() > 0.9


def test_synthetic_validation():
  with pytest.raises(ValueError, match='num_classes'):
    sources.load_dataset('synthetic', num_classes=1)
  with pytest.raises(ValueError, match='image_shape'):
    sources.load_dataset('synthetic', image_shape=(8, 8))
  with pytest.raises(ValueError, match='bogus'):
    sources.load_dataset('synthetic', bogus=3)


def test_channel_stats_matches_float64_reference():
  x = np.random.default_rng(0).integers(0, 256, (7, 5, 3, 2), dtype=np.uint8)
  mean, std = sources.channel_stats(x)
  ref = x.astype(np.float64) / 255.0
  np.testing.assert_allclose(mean, ref.mean(axis=(0, 1, 2)), rtol=1e-12)
  np.testing.assert_allclose(std, ref.std(axis=(0, 1, 2)), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# shipped subset
# ---------------------------------------------------------------------------------------------
def test_subset_is_stratified():
  ds = sources.load_dataset('fashion_mnist_subset')
  assert ds.train_x.shape == (3000, 28, 28, 1) and ds.test_x.shape == (1000, 28, 28, 1)
  assert ds.train_x.dtype == np.uint8 and ds.train_y.dtype == np.int32
  np.testing.assert_array_equal(np.bincount(ds.train_y, minlength=10), [300] * 10)
  np.testing.assert_array_equal(np.bincount(ds.test_y, minlength=10), [100] * 10)
  assert ds.num_classes == 10


@pytest.mark.skipif(not HAVE_DEBIAN, reason='Debian dataset-fashion-mnist files not installed')
def test_subset_matches_the_full_files():
  with np.load(sources.subset_path()) as f:
    train_idx, test_idx = f['train_idx'], f['test_idx']
  assert np.unique(train_idx).size == 3000 and np.unique(test_idx).size == 1000
  sub = sources.load_dataset('fashion_mnist_subset')
  full_x = sources.read_idx(os.path.join(DEBIAN_DIR, 'train-images-idx3-ubyte.gz'))
  full_y = sources.read_idx(os.path.join(DEBIAN_DIR, 't10k-labels-idx1-ubyte.gz'))
  np.testing.assert_array_equal(sub.train_x[..., 0], full_x[train_idx])
  np.testing.assert_array_equal(sub.test_y, full_y[test_idx])


def test_subset_env_override(tmp_path, monkeypatch):
  path = tmp_path / 'mine.npz'
  x = np.full((4, 3, 3, 1), 255, np.uint8)
  np.savez(path, train_x=x, train_y=np.arange(4, dtype=np.int32), test_x=x[:2],
           test_y=np.zeros(2, np.int32))
  monkeypatch.setenv(sources.SUBSET_ENV_VAR, str(path))
  ds = sources.load_dataset('fashion_mnist_subset')
  assert ds.train_x.shape == (4, 3, 3, 1) and ds.mean == (1.0,) and ds.std == (0.0,)
  monkeypatch.setenv(sources.SUBSET_ENV_VAR, str(tmp_path / 'missing.npz'))
  with pytest.raises(FileNotFoundError, match='FEDJAX_SSL_SUBSET'):
    sources.load_dataset('fashion_mnist_subset')


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize('args,kw,match', [
    (('imagenet',), {}, "'imagenet'.*allowed"),
    (('cifar10',), dict(source='web'), "'web'.*allowed"),
    (('cifar10',), dict(source='idx'), 'idx'),
    (('synthetic',), dict(source='tfds'), 'single source'),
    (('fashion_mnist_subset',), dict(source='idx'), 'single source'),
    (('cifar10',), dict(source='tfds', batch=3), 'batch'),
])
def test_load_dataset_validation(args, kw, match):
  with pytest.raises(ValueError, match=match):
    sources.load_dataset(*args, **kw)


def test_read_idx_shape_reads_the_header_only(tmp_path):
  arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
  raw = b'\0\0\x08\x03' + np.asarray(arr.shape, '>u4').tobytes() + arr.tobytes()
  (tmp_path / 'a').write_bytes(raw)
  (tmp_path / 'b.gz').write_bytes(gzip.compress(raw[:16]))   # header alone: no data needed
  assert sources.read_idx_shape(tmp_path / 'a') == (2, 3, 4) == sources.read_idx(tmp_path / 'a').shape
  assert sources.read_idx_shape(tmp_path / 'b.gz') == (2, 3, 4)
  (tmp_path / 'c').write_bytes(b'\x01\0\x08\x01')
  with pytest.raises(ValueError, match='not an IDX file'):
    sources.read_idx_shape(tmp_path / 'c')
  (tmp_path / 'd').write_bytes(b'\0\0\x08\x03\0\0')
  with pytest.raises(ValueError, match='ends early'):
    sources.read_idx_shape(tmp_path / 'd')
