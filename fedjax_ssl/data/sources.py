"""Dataset sources: the tensorflow-datasets catalog, local IDX files, image folders, a synthetic set
and the shipped subset.

Every source returns a `types.Dataset` in the project's conventions: uint8 NHWC images, int32 labels,
per-channel mean/std of the clients' images / 255.

Sources (`load_dataset(name, source=...)`):
  'tfds'  tfds' array_record data sources (read without TensorFlow) for cifar10, cifar100, mnist,
          fashion_mnist, svhn (tfds 'svhn_cropped': the 32x32 digits, train / test splits, without
          'extra'), stl10 and stl10_unlabelled (the clients train on STL-10's unlabelled split).
          A dataset not in data_dir is downloaded and prepared (`prepare_tfds`; tfds needs
          TensorFlow for that step); what cannot be had is one `DataUnavailable` line.
  'idx'   the original MNIST / Fashion-MNIST IDX files in a directory (gzipped or not). Debian's
          `dataset-fashion-mnist` package installs them in /usr/share/datasets/fashion-mnist, the
          project's real offline default.
  'auto'  mnist / fashion_mnist: 'idx' when the IDX files are found (in data_dir, else in the Debian
          directory), otherwise 'tfds'. Other catalog names: 'tfds'. 'synthetic',
          'fashion_mnist_subset', 'folder' and 'tiny_imagenet' (image folders, folders.py) have a
          single source each, which 'auto' selects.
"""
from __future__ import annotations

import contextlib
import gzip
import importlib.util
import io
import logging
import os
import pathlib
from typing import Optional, Sequence, Tuple

import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl.data.types import Dataset, Rows

CATALOG_NAMES = ('cifar10', 'cifar100', 'mnist', 'fashion_mnist', 'svhn', 'stl10',
                 'stl10_unlabelled')
# Our name -> the tfds catalog's, where they differ.
TFDS_NAMES = {'svhn': 'svhn_cropped', 'stl10_unlabelled': 'stl10'}
# Catalog datasets whose clients train on the split named here (no labels) instead of 'train'; the
# labelled train and test splits serve the evaluation.
UNLABELLED_SPLITS = {'stl10_unlabelled': 'unlabelled'}
FOLDER_NAMES = ('folder', 'tiny_imagenet')  # fedjax_ssl/data/folders.py; data_dir is required
# Datasets with one source each, which source='auto' selects.
SINGLE_SOURCE_NAMES = ('synthetic', 'fashion_mnist_subset') + FOLDER_NAMES
NAMES = CATALOG_NAMES + SINGLE_SOURCE_NAMES
SOURCES = ('auto', 'tfds', 'idx')
IDX_NAMES = ('mnist', 'fashion_mnist')

# Where Debian's `dataset-fashion-mnist` package installs the original IDX files.
DEBIAN_FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'
_DEFAULT_IDX_DIRS = {'fashion_mnist': DEBIAN_FASHION_MNIST_DIR}
# File stems of the original distributions (the same for MNIST and Fashion-MNIST); '.gz' is optional.
IDX_FILES = {
    'train_x': 'train-images-idx3-ubyte',
    'train_y': 'train-labels-idx1-ubyte',
    'test_x': 't10k-images-idx3-ubyte',
    'test_y': 't10k-labels-idx1-ubyte',
}

SUBSET_ENV_VAR = 'FEDJAX_SSL_SUBSET'
# sources.py lives in <repo>/fedjax_ssl/data/, the subset in <repo>/tests/data/.
_DEFAULT_SUBSET_PATH = (pathlib.Path(__file__).resolve().parents[2] / 'tests' / 'data' /
                        'fashion_mnist_subset.npz')

# IDX type byte -> big-endian numpy dtype (the IDX format stores every multi-byte value big-endian).
_IDX_DTYPES = {0x08: np.dtype('u1'), 0x09: np.dtype('i1'), 0x0B: np.dtype('>i2'),
               0x0C: np.dtype('>i4'), 0x0D: np.dtype('>f4'), 0x0E: np.dtype('>f8')}
_GZIP_MAGIC = b'\x1f\x8b'
_TFDS_READ_CHUNK = 1024
_IDX_READ_BYTES = 1 << 20  # an IDX file is read (decompressed) by blocks of about this size
_DOWNLOAD_RETRIES = 2  # tfds' MAX_RETRIES during a prepare (_tfds_prepare_settings)
_PIL_MODES = {1: 'L', 3: 'RGB', 4: 'RGBA'}
_STATS_CHUNK = 1 << 20  # pixels per np.bincount call in channel_stats

_SYNTHETIC_DEFAULTS = dict(num_train=2000, num_test=500, image_shape=(32, 32, 3), num_classes=10,
                           pattern_size=4, amplitude=60.0, noise=40.0)


class DataUnavailable(cv.ConfigError):
  """A dataset that is neither in its data folder nor obtainable here. A ConfigError, so that the
  binaries print its message as one line (config_validation.run); the message names the dataset,
  the folder searched and the command that prepares it."""


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------
def channel_stats(x) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
  """Per-channel mean and (population) std of uint8 images [N, H, W, C] scaled to [0, 1].

  Computed exactly from a 256-bin histogram per channel, so no float copy of the data is made;
  `Rows` are streamed in chunks (every row read once, none kept).
  """
  if not isinstance(x, Rows):
    x = np.asarray(x)
  if x.dtype != np.uint8 or x.ndim != 4:
    raise ValueError(f'channel_stats expects uint8 [N, H, W, C] images, got {x.dtype} {x.shape}')
  if x.shape[0] == 0:
    raise ValueError('channel_stats needs at least one image, got N=0')
  hist = np.zeros((x.shape[-1], 256), np.int64)
  rows_per_chunk = max(1, _STATS_CHUNK // int(np.prod(x.shape[1:3])))
  for chunk in (x.chunks(rows_per_chunk) if isinstance(x, Rows) else (x,)):
    _add_histogram(hist, chunk)
  return _stats(hist)


def _add_histogram(hist: np.ndarray, x: np.ndarray) -> None:
  """Adds the pixel counts of uint8 [n, H, W, C] to hist int64 [C, 256]."""
  pixels = x.reshape(-1, x.shape[-1])
  # Chunks bound the int64 temporary that np.bincount makes of its uint8 input.
  for start in range(0, pixels.shape[0], _STATS_CHUNK):
    chunk = pixels[start:start + _STATS_CHUNK]
    for c in range(x.shape[-1]):
      hist[c] += np.bincount(chunk[:, c], minlength=256)


def _stats(hist: np.ndarray) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
  """(mean, std) per channel of the pixel values / 255 counted in hist int64 [C, 256]."""
  values = np.arange(256, dtype=np.float64) / 255.0
  means, stds = [], []
  for counts in hist.astype(np.float64):
    total = counts.sum()
    mean = float(np.dot(counts, values) / total)
    var = float(np.dot(counts, (values - mean) ** 2) / total)
    means.append(mean)
    stds.append(float(np.sqrt(var)))
  return tuple(means), tuple(stds)


def _make_dataset(name, train_x, train_y, test_x, test_y, num_classes, unlabeled_x=None,
                  stats=None) -> Dataset:
  """Checks dtypes/shapes/label range and attaches the statistics of the clients' images (train_x,
  or unlabeled_x when given; `stats` (mean, std) when the source counted them as it read)."""
  if not isinstance(train_x, Rows):
    train_x = np.asarray(train_x)
  test_x = np.asarray(test_x)
  train_y, test_y = np.asarray(train_y, np.int32), np.asarray(test_y, np.int32)
  for split, x, y in (('train', train_x, train_y), ('test', test_x, test_y)):
    if x.dtype != np.uint8 or x.ndim != 4:
      raise ValueError(f'{name} {split} images must be uint8 [N, H, W, C], got {x.dtype} {x.shape}')
    if y.shape != (x.shape[0],):
      raise ValueError(f'{name} {split}: {x.shape[0]} images but labels of shape {y.shape}')
    if y.size and (y.min() < 0 or y.max() >= num_classes):
      raise ValueError(f'{name} {split} labels must lie in [0, {num_classes}), '
                       f'got range [{y.min()}, {y.max()}]')
  if train_x.shape[1:] != test_x.shape[1:]:
    raise ValueError(f'{name}: train images {train_x.shape[1:]} and test images '
                     f'{test_x.shape[1:]} differ in shape')
  if unlabeled_x is not None:
    unlabeled_x = np.asarray(unlabeled_x)
    if unlabeled_x.dtype != np.uint8 or unlabeled_x.shape[1:] != train_x.shape[1:]:
      raise ValueError(f'{name} unlabelled images must be uint8 [N, {", ".join(map(str, train_x.shape[1:]))}], '
                       f'got {unlabeled_x.dtype} {unlabeled_x.shape}')
  mean, std = stats or channel_stats(train_x if unlabeled_x is None else unlabeled_x)
  return Dataset(name=name, train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y,
                 num_classes=int(num_classes), mean=mean, std=std, unlabeled_x=unlabeled_x)


# ----------------------------------------------------------------------------------------------
# IDX files
# ----------------------------------------------------------------------------------------------
def _check_idx_magic(path, head: bytes) -> Tuple[int, int]:
  """(type byte, number of dimensions) from an IDX file's first 4 bytes; ValueError if malformed."""
  if len(head) < 4 or head[0] != 0 or head[1] != 0:
    raise ValueError(f'{path}: not an IDX file (magic number must start with two zero bytes, '
                     f'got {head[:4].hex() or "an empty file"})')
  type_code, ndim = head[2], head[3]
  if type_code not in _IDX_DTYPES:
    raise ValueError(f'{path}: unknown IDX type byte 0x{type_code:02x}; allowed: '
                     f'{", ".join(f"0x{c:02x}" for c in _IDX_DTYPES)}')
  return type_code, ndim


def _idx_header(path) -> Tuple[int, Tuple[int, ...], bool]:
  """(type byte, stored shape, gzipped) of an IDX file, reading only its header."""
  path = pathlib.Path(path)
  with open(path, 'rb') as f:
    gzipped = f.read(2) == _GZIP_MAGIC
  with (gzip.open(path, 'rb') if gzipped else open(path, 'rb')) as f:
    type_code, ndim = _check_idx_magic(path, f.read(4))
    dims = f.read(4 * ndim)
  if len(dims) != 4 * ndim:
    raise ValueError(f'{path}: IDX header announces {ndim} dimensions but the file ends early')
  return type_code, tuple(int(d) for d in np.frombuffer(dims, '>u4')), gzipped


def read_idx_shape(path) -> Tuple[int, ...]:
  """The stored shape of an IDX file (gzip-compressed or raw), reading only its header: lets config
  validation know a dataset's sizes without loading it."""
  return _idx_header(path)[1]


def idx_rows(path) -> Rows:
  """The uint8 images [N, H, W] of an IDX file as `Rows` [N, H, W, 1], read on demand: a raw file
  is memory-mapped (a read touches its rows' pages only); a gzipped one is decompressed as a
  stream, keeping only the rows asked for (the bytes before the last of them are decompressed,
  not kept).

  Raises:
    ValueError: the file does not hold uint8 [N, H, W] (bad header, wrong type or rank); a read
      that reaches the end of a file shorter than its header announces.
  """
  path = pathlib.Path(path)
  type_code, shape, gzipped = _idx_header(path)
  if _IDX_DTYPES[type_code] != np.uint8 or len(shape) != 3:
    raise ValueError(f'{path}: must hold uint8 [N, H, W] images, got '
                     f'{_IDX_DTYPES[type_code]} {shape}')
  header_len, row_bytes = 4 + 4 * len(shape), shape[1] * shape[2]
  block = max(1, _IDX_READ_BYTES // row_bytes)
  if not gzipped and path.stat().st_size != header_len + shape[0] * row_bytes:
    raise ValueError(f'{path}: IDX shape {shape} of uint8 needs {shape[0] * row_bytes} data bytes, '
                     f'file has {path.stat().st_size - header_len}')

  def chunks(size):
    with (gzip.open(path, 'rb') if gzipped else open(path, 'rb')) as f:
      f.read(header_len)
      for start in range(0, shape[0], size):
        k = min(size, shape[0] - start)
        buf = f.read(k * row_bytes)
        if len(buf) != k * row_bytes:
          raise ValueError(f'{path}: IDX shape {shape} of uint8 needs {shape[0] * row_bytes} data '
                           f'bytes, the file ends after {start * row_bytes + len(buf)}')
        yield np.frombuffer(buf, np.uint8).reshape(k, shape[1], shape[2], 1)

  def read(rows):
    if not gzipped:
      mapped = np.memmap(path, np.uint8, 'r', offset=header_len, shape=shape)
      for j in range(0, len(rows), block):
        yield j, np.array(mapped[rows[j:j + block]])[..., None]
      return
    at = 0
    for chunk in chunks(block):
      lo, hi = np.searchsorted(rows, [at, at + len(chunk)])
      yield int(lo), chunk[rows[lo:hi] - at]
      at += len(chunk)
      if hi == len(rows):
        return

  return Rows(shape + (1,), read, chunks)


def read_idx(path) -> np.ndarray:
  """Reads one IDX file (gzip-compressed or raw) into a numpy array of its stored shape.

  IDX layout: two zero bytes, a type byte (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
  0x0D float32, 0x0E float64), a byte with the number of dimensions d, d big-endian uint32 sizes,
  then the values in C order, big-endian. Returns native-endian values.

  Raises:
    ValueError: the file is not a well-formed IDX file (bad magic, unknown type, wrong length).
  """
  path = pathlib.Path(path)
  raw = path.read_bytes()
  if raw[:2] == _GZIP_MAGIC:
    raw = gzip.decompress(raw)
  type_code, ndim = _check_idx_magic(path, raw[:4])
  header_len = 4 + 4 * ndim
  if len(raw) < header_len:
    raise ValueError(f'{path}: IDX header announces {ndim} dimensions but the file has only '
                     f'{len(raw)} bytes')
  shape = tuple(int(s) for s in np.frombuffer(raw, dtype='>u4', count=ndim, offset=4))
  dtype = _IDX_DTYPES[type_code]
  expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if len(raw) - header_len != expected:
    raise ValueError(f'{path}: IDX shape {shape} of {dtype} needs {expected} data bytes, '
                     f'file has {len(raw) - header_len}')
  data = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(shape)
  return data.astype(dtype.newbyteorder('='))


def _find_idx_file(directory: pathlib.Path, stem: str) -> Optional[pathlib.Path]:
  for candidate in (directory / stem, directory / (stem + '.gz')):
    if candidate.is_file():
      return candidate
  return None


def _has_idx_files(directory) -> bool:
  if directory is None or not pathlib.Path(directory).is_dir():
    return False
  return all(_find_idx_file(pathlib.Path(directory), s) for s in IDX_FILES.values())


def load_idx(directory, name: str = 'fashion_mnist', rows_on_demand: bool = False) -> Dataset:
  """Loads MNIST-style IDX files from `directory` (train/t10k images and labels, optionally .gz).

  Images [N, 28, 28] become uint8 [N, 28, 28, 1]; labels int32 in [0, 10). With `rows_on_demand`
  the training images stay in their file (`idx_rows`): the statistics stream over them.
  """
  directory = pathlib.Path(directory)
  arrays = {}
  for key, stem in IDX_FILES.items():
    path = _find_idx_file(directory, stem)
    if path is None:
      raise FileNotFoundError(f'{directory}: missing IDX file {stem}[.gz]; expected '
                              f'{", ".join(IDX_FILES.values())} (each optionally .gz)')
    arrays[key] = idx_rows(path) if key == 'train_x' and rows_on_demand else read_idx(path)
  for key in ('train_x', 'test_x'):
    if isinstance(arrays[key], Rows):
      continue
    if arrays[key].dtype != np.uint8 or arrays[key].ndim != 3:
      raise ValueError(f'{directory}: {IDX_FILES[key]} must hold uint8 [N, H, W] images, got '
                       f'{arrays[key].dtype} {arrays[key].shape}')
    arrays[key] = arrays[key][..., None]
  for key in ('train_y', 'test_y'):
    if arrays[key].ndim != 1:
      raise ValueError(f'{directory}: {IDX_FILES[key]} must hold 1-D labels, got shape '
                       f'{arrays[key].shape}')
  return _make_dataset(name, arrays['train_x'], arrays['train_y'], arrays['test_x'],
                       arrays['test_y'], num_classes=10)


# ----------------------------------------------------------------------------------------------
# tensorflow-datasets catalog
# ----------------------------------------------------------------------------------------------
def _read_examples(ds, keys: Sequence[int]):
  """Reads examples `keys` from a tfds data source, batched where the source supports it.

  Batched reads (`__getitems__`) let array_record fetch records in parallel. The mock installed by
  `tfds.testing.mock_data` (tfds 4.9.10) defines a `__getitems__` that cannot be called (it is
  bound without `self` and raises TypeError), so a TypeError falls back to item-by-item reads; a
  genuine read/decode error is raised again by the item-by-item path.
  """
  getitems = getattr(ds, '__getitems__', None)
  if getitems is not None:
    try:
      return getitems(list(keys))
    except TypeError:
      pass
  return [ds[k] for k in keys]


def _read_split(ds, image_shape, labels: bool = True) -> Tuple[np.ndarray, np.ndarray]:
  """All examples of a tfds data source as (uint8 [N, H, W, C], int32 [N]); 'label' is the target
  (labels=False: -1 for every example, for a split without labels)."""
  n = len(ds)
  x = np.empty((n,) + tuple(image_shape), np.uint8)
  y = np.empty((n,), np.int32)
  for start in range(0, n, _TFDS_READ_CHUNK):
    keys = range(start, min(n, start + _TFDS_READ_CHUNK))
    for i, example in zip(keys, _read_examples(ds, keys)):
      x[i] = example['image']
      y[i] = example['label'] if labels else -1
  return x, y


def _split_on_demand(ds, image_shape) -> Tuple[Rows, np.ndarray, np.ndarray]:
  """A tfds data source's split as (`Rows` reading its images by key, int32 labels [N], the pixel
  histogram int64 [C, 256] of its images): one pass over the records keeps the labels and counts
  the pixels, holding one chunk of images at a time."""
  n = len(ds)
  y = np.empty((n,), np.int32)
  hist = np.zeros((image_shape[-1], 256), np.int64)

  images = lambda examples: np.asarray(np.stack([e['image'] for e in examples]), np.uint8)

  def chunks(size):
    for start in range(0, n, size):
      yield images(_read_examples(ds, range(start, min(n, start + size))))

  def read(rows):
    for j in range(0, len(rows), _TFDS_READ_CHUNK):
      yield j, images(_read_examples(ds, rows[j:j + _TFDS_READ_CHUNK].tolist()))

  for start in range(0, n, _TFDS_READ_CHUNK):
    keys = range(start, min(n, start + _TFDS_READ_CHUNK))
    examples = _read_examples(ds, keys)
    y[start:keys.stop] = [e['label'] for e in examples]
    _add_histogram(hist, images(examples))

  return Rows((n,) + tuple(image_shape), read, chunks), y, hist


def default_tfds_dir() -> str:
  """The folder tfds reads and writes when no data_dir is given: $TFDS_DATA_DIR, else
  ~/tensorflow_datasets (tfds' own default)."""
  return os.environ.get('TFDS_DATA_DIR') or os.path.expanduser('~/tensorflow_datasets')


def prepare_command(name: str, data_dir) -> str:
  """The command that prepares dataset `name` into `data_dir` on a machine with internet."""
  return f'python -m experiments.prepare_data --dataset {name} --data_dir {data_dir}'


def _tensorflow_missing() -> bool:
  return importlib.util.find_spec('tensorflow') is None


def _encode_png_with_pil(encoder, np_image: np.ndarray) -> bytes:
  """PNG bytes of uint8 [H, W, C] (C in 1, 3, 4) with PIL: tfds' `_ImageEncoder._encode_image`
  without TensorFlow. PNG is lossless, so the decoded pixels are those TensorFlow's encoder keeps."""
  if encoder.encoding_format != 'png':
    raise ValueError(f'image encoding {encoder.encoding_format!r} needs TensorFlow when preparing a '
                     "tfds dataset; without it only 'png' is supported")
  from tensorflow_datasets.core.features import image_feature  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  image_feature._validate_np_array(np_image, shape=encoder.shape,  # pylint: disable=protected-access
                                   dtype=encoder.np_dtype)
  if np_image.dtype != np.uint8 or np_image.shape[-1] not in _PIL_MODES:
    raise ValueError(f'PNG encoding without TensorFlow takes uint8 images with 1, 3 or 4 channels, '
                     f'got {np_image.dtype} {np_image.shape}')
  buffer = io.BytesIO()
  image = np_image[..., 0] if np_image.shape[-1] == 1 else np_image
  Image.fromarray(image, _PIL_MODES[np_image.shape[-1]]).save(buffer, format='PNG')
  return buffer.getvalue()


@contextlib.contextmanager
def _tfds_prepare_settings():
  """What tfds 4.9.10's download-and-prepare path needs changed, for the duration of one prepare.

  * Without TensorFlow, images are PNG-encoded with PIL (tfds calls tf.image.encode_png).
  * Download retries: tfds retries a failed request 10 times with exponential back-off (minutes
    on an offline machine before the error); _DOWNLOAD_RETRIES keeps a transient failure covered
    and makes an offline machine fail within seconds (docs/notes/data.md#data-10), and urllib3's
    warning per retry stays off the console.
  """
  from tensorflow_datasets.core.download import downloader  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.core.features import image_feature  # pylint: disable=g-import-not-at-top
  encoder_cls = image_feature._ImageEncoder  # pylint: disable=protected-access
  saved_retries, saved_encode = downloader.MAX_RETRIES, encoder_cls._encode_image
  urllib3_logger = logging.getLogger('urllib3')
  saved_level = urllib3_logger.level
  downloader.MAX_RETRIES = _DOWNLOAD_RETRIES
  # One warning per retry ("Retrying ... after connection broken"): the final error says it once.
  urllib3_logger.setLevel(logging.ERROR)
  if _tensorflow_missing():
    encoder_cls._encode_image = _encode_png_with_pil
  try:
    yield
  finally:
    downloader.MAX_RETRIES, encoder_cls._encode_image = saved_retries, saved_encode
    urllib3_logger.setLevel(saved_level)


def _import_error(error: BaseException) -> Optional[ImportError]:
  """The ImportError of `error`'s chain (tfds wraps errors of its threads in its own), or None."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, ImportError):
      return error
    error = error.__cause__ or error.__context__
  return None


def _not_prepared(name: str, data_dir) -> Tuple[str, str]:
  """The two halves of a DataUnavailable message: what is missing where, and what to run."""
  return (f'dataset {name!r} is not prepared in {data_dir}',
          f'on a machine with internet run `{prepare_command(name, data_dir)}` and copy that folder '
          'here (--config.data_dir=FOLDER)')


def prepare_tfds(tfds_name: str, data_dir=None, download: bool = True, *, name: Optional[str] = None,
                 needs_tensorflow: bool = False):
  """The tfds builder of `tfds_name` with its array_record files in `data_dir`, downloaded and
  prepared first when they are not there and `download` is True.

  The files are array_record (what `tfds.data_source` reads without TensorFlow): `tfds.data_source`
  itself prepares TFRecord files whenever a data_dir is given (tfds 4.9.10), which it cannot read.
  The download comes from the dataset's own URL, never from tfds' GCS mirror (TFRecord files).

  Args:
    tfds_name: a registered tfds builder name.
    data_dir: the tfds data folder; None = default_tfds_dir().
    download: whether a dataset that is not prepared may be downloaded and prepared.
    name: the dataset's name in this project (messages), default tfds_name.
    needs_tensorflow: the builder reads its archives with TensorFlow (tf.io.gfile), as tfds' catalog
      builders of cifar10/100, svhn, mnist and stl10 do: without TensorFlow it is refused before
      any download.

  Raises:
    DataUnavailable: (one line) the dataset is not prepared in data_dir and cannot be prepared
      here; the message names the dataset, the folder and the command to run.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (slow import)
  name = name or tfds_name
  data_dir = os.fspath(data_dir) if data_dir else default_tfds_dir()
  # tfds warns (absl) that a folder not yet prepared has no dataset_info.json: the message below
  # says it better, so the warning is kept off the console.
  absl_logger = logging.getLogger('absl')
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)
  try:
    builder = tfds.builder(tfds_name, data_dir=data_dir, file_format='array_record')
    prepared = builder.is_prepared()
  finally:
    absl_logger.setLevel(level)
  # Without download, reading reports a missing dataset (read_tfds); tfds.testing.mock_data
  # serves reads of builders that are not prepared.
  if not download or prepared:
    return builder
  where, carry = _not_prepared(name, data_dir)
  if needs_tensorflow and _tensorflow_missing():
    raise DataUnavailable(
        f"{where}, and tensorflow-datasets' {tfds_name} builder needs TensorFlow to prepare it "
        f"(pip install -e '.[prepare]' where you prepare it); {carry}")
  try:
    with _tfds_prepare_settings():
      builder.download_and_prepare(
          download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  except Exception as e:  # pylint: disable=broad-except  (network, disk, archive: all one line)
    if _import_error(e) is not None:  # the install lacks a module: a bug to see, not a data problem
      raise
    reason = str(e).strip().splitlines()[0] if str(e).strip() else ''
    raise DataUnavailable(f'{where} and could not be downloaded and prepared here '
                          f'({type(e).__name__}: {reason[:300]}); {carry}') from e
  return builder


def load_tfds(name: str, data_dir=None, download: bool = True,
              rows_on_demand: bool = False) -> Dataset:
  """Loads a catalog dataset through tfds' array_record data sources (no TensorFlow needed to read).

  For cifar100 the target is the fine 'label' (100 classes), not 'coarse_label'.
  `download=True` lets tfds fetch and prepare the dataset into `data_dir` (prepare_tfds) when it
  is not there yet.
  """
  if name not in CATALOG_NAMES:
    raise ValueError(f'unknown tfds dataset {name!r}; allowed: {CATALOG_NAMES}')
  builder = prepare_tfds(TFDS_NAMES.get(name, name), data_dir, download, name=name,
                         needs_tensorflow=True)
  return read_tfds(builder, name, rows_on_demand)


def read_tfds(builder, name: str, rows_on_demand: bool = False) -> Dataset:
  """The train and test splits of a prepared tfds builder as a Dataset ('image', 'label'); with
  `rows_on_demand` the training images of a labelled dataset stay in their files
  (`_split_on_demand`).

  Raises:
    DataUnavailable: (one line) the builder's files cannot be opened (not prepared, downloading off).
  """
  splits = {}
  for split in ('train', 'test'):
    try:
      ds = builder.as_data_source(split=split)
    except Exception as e:  # pylint: disable=broad-except  (tfds raises several kinds: all one line)
      where, carry = _not_prepared(name, builder.data_dir_root)
      raise DataUnavailable(f'{where} ({type(e).__name__} opening split {split!r}: '
                            f'{str(e).strip().splitlines()[0][:200] if str(e).strip() else ""}); '
                            f'{carry}') from e
    image_shape = builder.info.features['image'].shape
    if split == 'train' and rows_on_demand and name not in UNLABELLED_SPLITS:
      rows, labels, hist = _split_on_demand(ds, image_shape)
      splits[split] = (rows, labels)
      stats = _stats(hist)
    else:
      splits[split] = _read_split(ds, image_shape)
  num_classes = builder.info.features['label'].num_classes
  if isinstance(splits['train'][0], Rows):
    return _make_dataset(name, *splits['train'], *splits['test'], num_classes=num_classes,
                         stats=stats)
  unlabelled = None
  if name in UNLABELLED_SPLITS:
    ds = builder.as_data_source(split=UNLABELLED_SPLITS[name])
    unlabelled = _read_split(ds, builder.info.features['image'].shape, labels=False)[0]
  return _make_dataset(name, *splits['train'], *splits['test'], num_classes=num_classes,
                       unlabeled_x=unlabelled)


# ----------------------------------------------------------------------------------------------
# Synthetic data and the shipped subset
# ----------------------------------------------------------------------------------------------
def make_synthetic(seed: int = 0, *, num_train: int = 2000, num_test: int = 500,
                   image_shape=(32, 32, 3), num_classes: int = 10, pattern_size: int = 4,
                   amplitude: float = 60.0, noise: float = 40.0) -> Dataset:
  """A deterministic labelled image set for unit tests.

  Each class owns a smooth random pattern (a pattern_size x pattern_size x C Gaussian grid, upsampled
  to H x W by pixel repetition). An image is clip(128 + amplitude * pattern[y] + noise * N(0, 1))
  in uint8, so classes differ in their mean image and a linear probe separates them. Labels are
  balanced (i % num_classes) and shuffled. Train and test share the patterns, not the noise.
  """
  image_shape = tuple(int(s) for s in image_shape)
  if len(image_shape) != 3 or min(image_shape) < 1:
    raise ValueError(f'image_shape must be (H, W, C) with positive sizes, got {image_shape}')
  for arg, value, low in (('num_train', num_train, 1), ('num_test', num_test, 1),
                          ('num_classes', num_classes, 2), ('pattern_size', pattern_size, 1)):
    if int(value) != value or value < low:
      raise ValueError(f'{arg} must be an integer >= {low}, got {value}')
  if amplitude < 0 or noise < 0:
    raise ValueError(f'amplitude and noise must be >= 0, got {amplitude}, {noise}')
  h, w, c = image_shape
  rng = np.random.default_rng(seed)
  grid = rng.standard_normal((num_classes, pattern_size, pattern_size, c))
  reps_h, reps_w = -(-h // pattern_size), -(-w // pattern_size)
  patterns = np.repeat(np.repeat(grid, reps_h, axis=1), reps_w, axis=2)[:, :h, :w, :]

  def draw(n):
    y = rng.permutation(np.arange(n) % num_classes).astype(np.int32)
    x = 128.0 + amplitude * patterns[y] + noise * rng.standard_normal((n, h, w, c))
    return np.clip(np.rint(x), 0, 255).astype(np.uint8), y

  train_x, train_y = draw(num_train)
  test_x, test_y = draw(num_test)
  return _make_dataset('synthetic', train_x, train_y, test_x, test_y, num_classes)


def subset_path() -> pathlib.Path:
  """Path of the shipped Fashion-MNIST subset: $FEDJAX_SSL_SUBSET, else <repo>/tests/data/."""
  env = os.environ.get(SUBSET_ENV_VAR)
  return pathlib.Path(env) if env else _DEFAULT_SUBSET_PATH


def load_subset(path=None) -> Dataset:
  """The shipped stratified Fashion-MNIST subset (tests/data/make_subset.py): 3,000 train
  (300 per class) and 1,000 test (100 per class) images, uint8 [N, 28, 28, 1]."""
  path = pathlib.Path(path) if path is not None else subset_path()
  if not path.is_file():
    raise FileNotFoundError(f'Fashion-MNIST subset not found at {path}; it ships in the repository '
                            f'as tests/data/fashion_mnist_subset.npz, or set ${SUBSET_ENV_VAR}')
  with np.load(path) as f:
    arrays = {k: f[k] for k in ('train_x', 'train_y', 'test_x', 'test_y')}
  return _make_dataset('fashion_mnist_subset', arrays['train_x'], arrays['train_y'],
                       arrays['test_x'], arrays['test_y'], num_classes=10)


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------
def _check_kwargs(name, kw, allowed):
  unknown = sorted(set(kw) - set(allowed))
  if unknown:
    raise ValueError(f'load_dataset({name!r}) got unknown keyword(s) {unknown}; '
                     f'allowed: {sorted(allowed)}')


def _load_folder_dataset(name: str, data_dir, kw) -> Dataset:
  """'folder' or 'tiny_imagenet' from the image folder data_dir (fedjax_ssl/data/folders.py)."""
  from fedjax_ssl.data import folders  # pylint: disable=g-import-not-at-top  (PIL only here)
  if not data_dir:
    raise folders.ImageFolderError(f'dataset {name!r} needs data_dir: the image folder')
  if name == 'folder':
    _check_kwargs(name, kw, ('image_size', 'test_fraction'))
    arrays = folders.load_folder(data_dir, **kw)
  else:
    _check_kwargs(name, kw, ('image_size',))
    arrays = folders.load_tiny_imagenet(data_dir, **kw)
  return _make_dataset(name, *arrays[:4], num_classes=len(arrays[4]))


def load_dataset(name: str, source: str = 'auto', data_dir=None, seed: int = 0,
                 rows_on_demand: bool = False, **kw) -> Dataset:
  """Loads dataset `name` as a `Dataset` (uint8 NHWC images, int32 labels, train mean/std).

  Args:
    name: one of NAMES.
    source: one of SOURCES (see the module docstring); 'synthetic' and 'fashion_mnist_subset'
      accept only 'auto'.
    data_dir: tfds data directory ('tfds') or directory holding the IDX files ('idx'); for
      'fashion_mnist_subset', an optional path to the npz file; for 'folder' and 'tiny_imagenet'
      (required) the image folder (fedjax_ssl/data/folders.py).
    seed: seed of the synthetic data (other sources are fixed files and ignore it).
    rows_on_demand: the training images as `Rows`, left in their files and read by row ('idx';
      'tfds' for a labelled training split); the other sources (synthetic, the shipped subset,
      image folders) return arrays either way.
    **kw: 'tfds': download (bool). 'synthetic': num_train, num_test, image_shape, num_classes,
      pattern_size, amplitude, noise. 'folder': image_size, test_fraction. 'tiny_imagenet':
      image_size.
  """
  if name not in NAMES:
    raise ValueError(f'unknown dataset name {name!r}; allowed: {NAMES}')
  if source not in SOURCES:
    raise ValueError(f'unknown source {source!r}; allowed: {SOURCES}')
  if name in SINGLE_SOURCE_NAMES:
    if source != 'auto':
      raise ValueError(f'dataset {name!r} has a single source; use source="auto", got {source!r}')
    if name in FOLDER_NAMES:
      return _load_folder_dataset(name, data_dir, kw)
    if name == 'synthetic':
      _check_kwargs(name, kw, _SYNTHETIC_DEFAULTS)
      return make_synthetic(seed, **kw)
    _check_kwargs(name, kw, ())
    return load_subset(data_dir)

  if source == 'idx' and name not in IDX_NAMES:
    raise ValueError(f'source="idx" supports {IDX_NAMES}, not {name!r}')
  if source == 'auto':
    if name in IDX_NAMES and _has_idx_files(data_dir):
      source = 'idx'
    elif name in IDX_NAMES and data_dir is None and _has_idx_files(_DEFAULT_IDX_DIRS.get(name)):
      source, data_dir = 'idx', _DEFAULT_IDX_DIRS[name]
    else:
      source = 'tfds'
  if source == 'idx':
    _check_kwargs(name, kw, ())
    directory = data_dir if data_dir is not None else _DEFAULT_IDX_DIRS.get(name)
    if directory is None:
      raise ValueError(f'source="idx" for {name!r} needs data_dir (no default IDX directory)')
    return load_idx(directory, name, rows_on_demand)
  _check_kwargs(name, kw, ('download',))
  return load_tfds(name, data_dir=data_dir, download=kw.get('download', True),
                   rows_on_demand=rows_on_demand)
