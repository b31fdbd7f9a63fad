"""What is known of a dataset before loading it: sizes, image shape, number of classes.

The config checks (`configuration.validate_config`) use it to refuse a run whose sizes cannot work
before any data is read or compute is spent.
"""
from __future__ import annotations

import dataclasses
import pathlib
import zipfile
from typing import Dict, Optional, Tuple

import numpy as np

from fedjax_ssl.data import folders, sources
from fedjax_ssl.data.types import Dataset


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What the config checks need to know of a dataset: sizes, image shape, number of classes;
  num_unlabeled > 0: the clients train on that many unlabelled images (`Dataset.unlabeled_x`)."""
  name: str
  num_train: int
  num_test: int
  image_shape: Tuple[int, int, int]
  num_classes: int
  num_unlabeled: int = 0

  @classmethod
  def of(cls, dataset: Dataset) -> 'DatasetInfo':
    """The info of a loaded dataset (after load_data's train_size cut)."""
    unlabeled = 0 if dataset.unlabeled_x is None else len(dataset.unlabeled_x)
    return cls(dataset.name, len(dataset.train_y), len(dataset.test_y),
               tuple(int(s) for s in dataset.image_shape), int(dataset.num_classes), unlabeled)


# The tfds catalog splits (tfds.builder(name).info.splits / features; fixed by the datasets' own
# definitions). The original MNIST / Fashion-MNIST IDX files hold the same splits.


CATALOG_INFO = {
    'cifar10': DatasetInfo('cifar10', 50_000, 10_000, (32, 32, 3), 10),
    'cifar100': DatasetInfo('cifar100', 50_000, 10_000, (32, 32, 3), 100),
    'mnist': DatasetInfo('mnist', 60_000, 10_000, (28, 28, 1), 10),
    'fashion_mnist': DatasetInfo('fashion_mnist', 60_000, 10_000, (28, 28, 1), 10),
    'svhn': DatasetInfo('svhn', 73_257, 26_032, (32, 32, 3), 10),
    'stl10': DatasetInfo('stl10', 5_000, 8_000, (96, 96, 3), 10),
    'stl10_unlabelled': DatasetInfo('stl10_unlabelled', 5_000, 8_000, (96, 96, 3), 10, 100_000),
}


def _npz_shapes(path: pathlib.Path, keys) -> Dict[str, Tuple[int, ...]]:
  """The shapes of arrays `keys` of an .npz file, reading only their .npy headers."""
  shapes = {}
  with zipfile.ZipFile(path) as zf:
    for key in keys:
      with zf.open(f'{key}.npy') as f:
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                np.lib.format.read_array_header_2_0)
        shapes[key] = tuple(read(f)[0])
  return shapes


def dataset_info(name: str, source: str = 'auto', data_dir: Optional[str] = None,
                 image_size: int = 0) -> Optional[DatasetInfo]:
  """Sizes and image shape of dataset `name` as `sources.load_dataset(name, source, data_dir)`
  would load it (before a train_size cut), known without loading it: the tfds catalog's constants,
  the synthetic set's defaults, Tiny-ImageNet's release, and the headers of the shipped subset's
  .npz or of the IDX files. None where the files do not exist or cannot be read (loading then
  reports the problem) and for a user's image folder ('folder': known once decoded)."""
  data_dir = data_dir or None
  if name == 'folder':
    return None
  if name == 'tiny_imagenet':
    size = image_size or folders.TINY_IMAGENET_SIZE
    return DatasetInfo(name, *folders.TINY_IMAGENET_SPLITS, (size, size, 3),
                       folders.TINY_IMAGENET_CLASSES)
  try:
    if name == 'synthetic':  # load_data passes no overrides: the defaults of make_synthetic
      d = sources._SYNTHETIC_DEFAULTS  # pylint: disable=protected-access
      return DatasetInfo(name, d['num_train'], d['num_test'], tuple(d['image_shape']),
                         d['num_classes'])
    if name == 'fashion_mnist_subset':
      path = pathlib.Path(data_dir) if data_dir else sources.subset_path()
      shapes = _npz_shapes(path, ('train_x', 'test_x'))
      return DatasetInfo(name, shapes['train_x'][0], shapes['test_x'][0],
                         tuple(shapes['train_x'][1:]), 10)
    idx_dir = None  # the same resolution as sources.load_dataset
    default_dir = sources._DEFAULT_IDX_DIRS.get(name)  # pylint: disable=protected-access
    has_idx = sources._has_idx_files  # pylint: disable=protected-access
    if name in sources.IDX_NAMES and source == 'idx':
      idx_dir = data_dir or default_dir
    elif name in sources.IDX_NAMES and source == 'auto':
      if has_idx(data_dir):
        idx_dir = data_dir
      elif data_dir is None and has_idx(default_dir):
        idx_dir = default_dir
    if idx_dir is None:
      return CATALOG_INFO[name]
    find = sources._find_idx_file  # pylint: disable=protected-access
    train = sources.read_idx_shape(find(pathlib.Path(idx_dir), sources.IDX_FILES['train_x']))
    test = sources.read_idx_shape(find(pathlib.Path(idx_dir), sources.IDX_FILES['test_x']))
    return DatasetInfo(name, train[0], test[0], tuple(train[1:]) + (1,), 10)
  except (OSError, ValueError, KeyError, IndexError, TypeError, zipfile.BadZipFile):
    return None
