"""tfds' real download-and-prepare path, end to end without a network (issue 64).

A small builder of our own is served over a loopback HTTP server: tfds downloads its two files
(requests, its retrying session), encodes the images (PNG; PIL without TensorFlow), writes the
array_record files, and `sources.prepare_tfds` / `read_tfds` (what `load_dataset` uses for the
catalog) read them back. A dependency that path needs and the install lacks fails here. (tfds'
archive extraction and its catalog builders read files with tf.io.gfile, so they need TensorFlow:
the builder downloads raw files, and the catalog is refused in one line without TensorFlow.)
"""
import functools
import http.server
import importlib.util
import io
import tarfile
import threading

import numpy as np
import pytest
import tensorflow_datasets as tfds

from fedjax_ssl.data import sources

_URL = {'value': None}  # the served folder's URL, set by the server fixture (the builder reads it)
_SHAPE = (4, 5, 3)


def _records(n, offset):
  """n images [n, 4, 5, 3] and labels [n]: pixel values that identify each image."""
  x = (np.arange(n * 60, dtype=np.int64).reshape((n,) + _SHAPE) * 7 + offset) % 256
  return x.astype(np.uint8), (np.arange(n) % 3).astype(np.uint8)


class FedjaxSslOfflineTest(tfds.core.GeneratorBasedBuilder):
  """A cifar-like builder: train.bin / test.bin of records (label byte, 60 pixel bytes)."""
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'image': tfds.features.Image(shape=_SHAPE),
        'label': tfds.features.ClassLabel(num_classes=3)}))

  def _split_generators(self, dl_manager):
    paths = dl_manager.download({s: f"{_URL['value']}/{s}.bin" for s in ('train', 'test')})
    return {s: self._generate_examples(paths[s]) for s in ('train', 'test')}

  def _generate_examples(self, path):
    raw = np.fromfile(path, np.uint8).reshape(-1, 1 + 60)
    for i, row in enumerate(raw):
      yield i, {'image': row[1:].reshape(_SHAPE), 'label': int(row[0])}


def _write_bin(path, x, y):
  path.write_bytes(np.concatenate([y[:, None], x.reshape(len(x), -1)], axis=1).tobytes())


@pytest.fixture
def served(tmp_path):
  """Serves tmp_path/www on 127.0.0.1; yields that folder."""
  www = tmp_path / 'www'
  www.mkdir()
  handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(www))
  handler.log_message = lambda *a: None
  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  _URL['value'] = f'http://127.0.0.1:{server.server_address[1]}'
  yield www
  server.shutdown()
  server.server_close()


def test_download_and_prepare_end_to_end(served, tmp_path):
  train, test = _records(7, 0), _records(4, 100)
  _write_bin(served / 'train.bin', *train)
  _write_bin(served / 'test.bin', *test)
  data_dir = tmp_path / 'tfds'
  builder = sources.prepare_tfds('fedjax_ssl_offline_test', data_dir, download=True)
  assert builder.is_prepared()
  files = sorted(p.name for p in (data_dir / 'fedjax_ssl_offline_test' / '1.0.0').iterdir())
  assert [f for f in files if 'array_record' in f] == [
      'fedjax_ssl_offline_test-test.array_record-00000-of-00001',
      'fedjax_ssl_offline_test-train.array_record-00000-of-00001']
  ds = sources.read_tfds(builder, 'offline')
  assert ds.train_x.shape == (7,) + _SHAPE and ds.test_x.shape == (4,) + _SHAPE
  assert ds.num_classes == 3
  # tfds shuffles the records: compare as sets of (label, pixels), exactly (PNG is lossless).
  for (x, y), got_x, got_y in ((train, ds.train_x, ds.train_y), (test, ds.test_x, ds.test_y)):
    want = sorted((int(l), im.tobytes()) for im, l in zip(x, y))
    assert sorted((int(l), im.tobytes()) for im, l in zip(got_x, got_y)) == want
  # Prepared: a second call reads the files without the server.
  (served / 'train.bin').unlink()
  again = sources.read_tfds(sources.prepare_tfds('fedjax_ssl_offline_test', data_dir), 'offline')
  np.testing.assert_array_equal(again.train_x, ds.train_x)


def test_download_failure_is_one_line(served, tmp_path):
  data_dir = tmp_path / 'tfds'  # nothing is served: the download gets a 404
  with pytest.raises(sources.DataUnavailable) as e:
    sources.prepare_tfds('fedjax_ssl_offline_test', data_dir, download=True, name='offline')
  message = str(e.value)
  assert '\n' not in message
  assert f"dataset 'offline' is not prepared in {data_dir}" in message
  assert f'python -m experiments.prepare_data --dataset offline --data_dir {data_dir}' in message


def test_not_prepared_without_download_is_one_line(tmp_path):
  with pytest.raises(sources.DataUnavailable, match=r"dataset 'cifar10' is not prepared in .*"
                     r"experiments.prepare_data --dataset cifar10 --data_dir") as e:
    sources.load_dataset('cifar10', source='tfds', data_dir=str(tmp_path), download=False)
  assert '\n' not in str(e.value)


def test_catalog_without_tensorflow_refused_before_download(tmp_path, monkeypatch):
  """tfds' catalog builders read their archives with tf.io.gfile: without TensorFlow the run stops
  in one line before any byte is downloaded."""
  monkeypatch.setattr(sources, '_tensorflow_missing', lambda: True)

  def no_download(*args, **kwargs):
    raise AssertionError('download_and_prepare must not be reached')
  monkeypatch.setattr(tfds.core.DatasetBuilder, 'download_and_prepare', no_download)
  with pytest.raises(sources.DataUnavailable, match=r'needs TensorFlow .*prepare_data --dataset '
                     r'svhn') as e:
    sources.load_dataset('svhn', data_dir=str(tmp_path))
  assert '\n' not in str(e.value)


_HAVE_TENSORFLOW = importlib.util.find_spec('tensorflow') is not None


def _cifar10_local_builder():
  """tfds' real Cifar10 builder (its archive layout, tf.io.gfile reader and features) with the URL
  of the loopback server: its checksum is not registered, so a fake archive is accepted."""
  from tensorflow_datasets.image_classification import cifar  # pylint: disable=g-import-not-at-top

  class Cifar10LocalTest(cifar.Cifar10):
    @property
    def _cifar_info(self):
      return super()._cifar_info._replace(url=f"{_URL['value']}/cifar-10-binary.tar.gz")
  return Cifar10LocalTest


def _cifar_archive(splits) -> bytes:
  """A cifar-10-binary.tar.gz: batch files of (label, 3072 CHW bytes) records and the label names."""
  buffer = io.BytesIO()
  files = {'batches.meta.txt': '\n'.join(f'class{i}' for i in range(10)).encode()}
  for name, (x, y) in splits.items():
    chw = x.transpose(0, 3, 1, 2).reshape(len(x), -1)
    files[name] = np.concatenate([y[:, None], chw], axis=1).astype(np.uint8).tobytes()
  with tarfile.open(fileobj=buffer, mode='w:gz') as tar:
    for name, data in files.items():
      info = tarfile.TarInfo('cifar-10-batches-bin/' + name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  return buffer.getvalue()


@pytest.mark.skipif(not _HAVE_TENSORFLOW, reason="tfds' catalog builders and its archive "
                    'extraction need TensorFlow (DATA-10)')
def test_real_cifar10_builder_prepares_with_tensorflow(served, tmp_path):
  """With TensorFlow installed (where a user runs experiments.prepare_data), tfds' own cifar10
  builder code prepares through prepare_tfds: download, tar.gz extraction, its reader, array_record."""
  rng = np.random.default_rng(0)
  splits = {f'data_batch_{i}.bin': (rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8),
                                    np.array([i, 9 - i], np.uint8)) for i in range(1, 6)}
  splits['test_batch.bin'] = (rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8),
                              np.array([0, 1, 2], np.uint8))
  (served / 'cifar-10-binary.tar.gz').write_bytes(_cifar_archive(splits))
  _cifar10_local_builder()
  builder = sources.prepare_tfds('cifar10_local_test', tmp_path / 'tfds', needs_tensorflow=True)
  ds = sources.read_tfds(builder, 'cifar10')
  assert ds.train_x.shape == (10, 32, 32, 3) and ds.test_x.shape == (3, 32, 32, 3)
  train = [(x, y) for name, (xs, ys) in splits.items() if name != 'test_batch.bin'
           for x, y in zip(xs, ys)]
  assert (sorted((int(y), x.tobytes()) for x, y in train) ==
          sorted((int(y), x.tobytes()) for x, y in zip(ds.train_x, ds.train_y)))
