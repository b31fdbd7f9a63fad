"""Image-folder sources (a user's folder, Tiny-ImageNet's release), STL-10's unlabelled split, and
the one-line refusals of bad data input (issue 64)."""
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from fedjax_ssl import config_validation as cv
from fedjax_ssl import configuration, experiment
from fedjax_ssl.data import folders, partition, sources
from fedjax_ssl.data.info import DatasetInfo


def _image(value, size=(6, 4), mode='RGB'):
  """A PIL image of `size` (width, height) whose pixels identify it: (value, value+1, value+2)."""
  w, h = size
  pixels = np.broadcast_to(np.array([value, value + 1, value + 2], np.uint8), (h, w, 3))
  return Image.fromarray(np.ascontiguousarray(pixels)).convert(mode)


def _write(path, value, size=(6, 4), fmt='PNG', mode='RGB'):
  path.parent.mkdir(parents=True, exist_ok=True)
  _image(value, size, mode).save(path, format=fmt)


def test_folder_with_train_and_test(tmp_path):
  for split, count in (('train', 3), ('test', 1)):
    for c, name in enumerate(('cat', 'dog')):
      for i in range(count):
        _write(tmp_path / split / name / f'{i}.png', 10 * c + i + (100 if split == 'test' else 0))
  ds = sources.load_dataset('folder', data_dir=str(tmp_path))
  assert ds.name == 'folder' and ds.num_classes == 2
  assert ds.train_x.shape == (6, 4, 6, 3) and ds.train_x.dtype == np.uint8
  assert ds.test_x.shape == (2, 4, 6, 3)
  np.testing.assert_array_equal(ds.train_y, [0, 0, 0, 1, 1, 1])   # sorted class names: cat, dog
  np.testing.assert_array_equal(ds.train_x[:, 0, 0, 0], [0, 1, 2, 10, 11, 12])
  np.testing.assert_array_equal(ds.test_x[:, 0, 0, 0], [100, 110])
  np.testing.assert_array_equal(ds.test_y, [0, 1])
  # Decoded once: the cache file sits beside the data, and a second load reads it.
  cache = list((tmp_path / folders.CACHE_DIR).glob('folder-*.npz'))
  assert len(cache) == 1
  again = sources.load_dataset('folder', data_dir=str(tmp_path))
  np.testing.assert_array_equal(again.train_x, ds.train_x)
  # A changed image (new size on disk) or another image_size makes a new cache entry.
  _write(tmp_path / 'train' / 'cat' / '0.png', 50)
  assert sources.load_dataset('folder', data_dir=str(tmp_path)).train_x[0, 0, 0, 0] == 50
  resized = sources.load_dataset('folder', data_dir=str(tmp_path), image_size=3)
  assert resized.train_x.shape == (6, 3, 3, 3)
  np.testing.assert_array_equal(resized.train_x[:, 1, 1, 0], [50, 1, 2, 10, 11, 12])  # constant
  assert len(list((tmp_path / folders.CACHE_DIR).glob('folder-*.npz'))) == 3


def test_folder_split_by_fraction_and_jpeg_gray(tmp_path):
  for c, name in enumerate(('a', 'b', 'c')):
    for i in range(5):  # JPEG and grayscale PNG mixed: every image becomes RGB
      if i % 2:
        _write(tmp_path / name / f'{i}.jpg', 40 * c, fmt='JPEG')
      else:
        _write(tmp_path / name / f'{i}.png', 40 * c, mode='L')
  ds = sources.load_dataset('folder', data_dir=str(tmp_path), test_fraction=0.4)
  # round(0.4 * 5) = 2 test images per class.
  assert ds.train_x.shape == (9, 4, 6, 3) and ds.test_x.shape == (6, 4, 6, 3)
  np.testing.assert_array_equal(np.bincount(ds.train_y), [3, 3, 3])
  np.testing.assert_array_equal(np.bincount(ds.test_y), [2, 2, 2])
  # The split is fixed (seed 0) and partitioned like any other dataset.
  again = sources.load_dataset('folder', data_dir=str(tmp_path), test_fraction=0.4)
  np.testing.assert_array_equal(again.test_y, ds.test_y)
  fed, info = partition.build_fed_data(ds, 3, 'iid', seed=0)
  assert int(np.asarray(fed.n).sum()) == 9


def _write_tiny_imagenet(root, wnids=('n01', 'n02'), per_class=2, size=(8, 8)):
  for c, wnid in enumerate(wnids):
    for i in range(per_class):
      _write(root / 'train' / wnid / 'images' / f'{wnid}_{i}.JPEG', 100 * c + i, size, 'JPEG')
  lines = []
  for j, wnid in enumerate(reversed(wnids)):
    _write(root / 'val' / 'images' / f'val_{j}.JPEG', 200 + j, size, 'JPEG')
    lines.append(f'val_{j}.JPEG\t{wnid}\t0\t0\t7\t7')
  (root / 'val' / 'val_annotations.txt').write_text('\n'.join(lines) + '\n')


def test_tiny_imagenet_release_layout(tmp_path):
  _write_tiny_imagenet(tmp_path / 'tiny-imagenet-200')
  ds = sources.load_dataset('tiny_imagenet', data_dir=str(tmp_path))  # the parent folder works too
  assert ds.num_classes == 2 and ds.train_x.shape == (4, 8, 8, 3) and ds.test_x.shape == (2, 8, 8, 3)
  np.testing.assert_array_equal(ds.train_y, [0, 0, 1, 1])
  np.testing.assert_array_equal(ds.test_y, [1, 0])  # from val_annotations.txt
  small = sources.load_dataset('tiny_imagenet', data_dir=str(tmp_path), image_size=4)
  assert small.train_x.shape == (4, 4, 4, 3)
  assert DatasetInfo.of(small).image_shape == (4, 4, 3)
  bad = tmp_path / 'tiny-imagenet-200' / 'val' / 'val_annotations.txt'
  bad.write_text('val_0.JPEG\tn99\t0\t0\t7\t7\n')
  with pytest.raises(folders.ImageFolderError, match=r'val_annotations.txt line 1 is invalid'):
    sources.load_dataset('tiny_imagenet', data_dir=str(tmp_path))


@pytest.mark.parametrize('case,pattern', [
    ('mixed', r'images differ in size: .*a/0.png is 6x4, .*a/1.png is 5x5 .*config.image_size'),
    ('empty', r'class folder .*/b holds no images'),
    ('unreadable', r'cannot read image .*a/1.png \(UnidentifiedImageError'),
    ('missing', r'image folder .*nowhere does not exist'),
    ('no_classes', r'holds no class folders'),
    ('train_only', r'has a train/ folder but no test/ folder'),
])
def test_folder_bad_input_is_one_line(tmp_path, case, pattern):
  root = tmp_path / 'data'
  root.mkdir()
  _write(root / 'a' / '0.png', 0)
  _write(root / 'a' / '2.png', 0)  # three images: round(0.2 * 3) = 1 goes to the test split
  if case == 'mixed':
    _write(root / 'a' / '1.png', 0, size=(5, 5))
  elif case == 'empty':
    (root / 'b').mkdir()
  elif case == 'unreadable':
    (root / 'a' / '1.png').write_bytes(b'not a png')
  elif case == 'missing':
    root = tmp_path / 'nowhere'
  elif case == 'no_classes':
    root = tmp_path / 'flat'
    root.mkdir()
    _write(root / 'x.png', 0)
  elif case == 'train_only':
    _write(root / 'train' / 'a' / '0.png', 0)
  with pytest.raises(cv.ConfigError, match=pattern) as e:
    sources.load_dataset('folder', data_dir=str(root))
  assert '\n' not in str(e.value)


def _config(**kw):
  config = experiment.default_config()
  config.update(dict(num_clients=2, clients_per_round=2, batch_size=2, knn_k=1, rounds=1))
  config.update(kw)
  return config


def test_config_checks_for_the_new_datasets(tmp_path):
  for kw, pattern in (
      (dict(dataset='cifar10', data_dir=str(tmp_path / 'nope')),
       r"config.data_dir = '.*nope' is invalid for config.dataset = 'cifar10': no such folder; "
       r'.*experiments.prepare_data --dataset cifar10'),
      (dict(dataset='folder', data_dir=''), r"config.data_dir = '' is invalid for config.dataset = "
       r"'folder': must be an existing folder"),
      (dict(dataset='cifar10', image_size=32), r"config.image_size = 32 is invalid for "
       r"config.dataset = 'cifar10'"),
      (dict(dataset='folder', data_dir=str(tmp_path), test_fraction=1.0),
       r'config.test_fraction = 1.0 is invalid'),
      (dict(dataset='stl10_unlabelled'), r"config.partition = 'dirichlet' is invalid for "
       r"config.dataset = 'stl10_unlabelled'.*must be 'iid'"),
      (dict(dataset='tiny_imagenet', data_dir=str(tmp_path), image_size=32, num_clients=60_000),
       r'config.num_clients = 60000 is invalid: 100000 training examples')):
    with pytest.raises(cv.ConfigError, match=pattern):
      configuration.validate_config(_config(**kw))
  configuration.validate_config(_config(dataset='stl10_unlabelled', partition='iid',
                                        encoder='resnet18'))


def test_folder_runs_through_load_data(tmp_path):
  for c in range(2):
    for i in range(4):
      _write(tmp_path / f'class{c}' / f'{i}.png', 30 * c + i, size=(9, 7))
  config = _config(dataset='folder', data_dir=str(tmp_path), image_size=8, partition='iid',
                   test_fraction=0.25, label_fractions=(1.0,))
  configuration.validate_config(config)
  ds = experiment.load_data(config)
  assert ds.train_x.shape == (6, 8, 8, 3) and ds.test_x.shape == (2, 8, 8, 3)
  configuration.check_data_config(config, DatasetInfo.of(ds))
  fed, info = experiment.build_fed_data(config, ds)
  np.testing.assert_array_equal(np.asarray(fed.n), [3, 3])


def test_partition_that_cannot_be_drawn_is_one_line():
  config = _config(dataset='synthetic', num_clients=400, clients_per_round=10)
  ds = experiment.load_data(config)
  with pytest.raises(cv.ConfigError, match=r"config.num_clients = 400 with config.partition = "
                     r"'dirichlet' \(alpha = 0.5\) cannot be drawn on synthetic: no Dirichlet") as e:
    experiment.build_fed_data(config, ds)
  assert '\n' not in str(e.value)


def test_stl10_unlabelled_split_feeds_the_clients():
  with tfds.testing.mock_data(num_examples=6):
    ds = sources.load_dataset('stl10_unlabelled', download=False)
    labelled = sources.load_dataset('stl10', download=False)
    unlabelled = tfds.data_source('stl10', split='unlabelled', download=False)
    ref = np.stack([unlabelled[i]['image'] for i in range(6)])
  assert ds.train_x.shape == (6, 96, 96, 3) and ds.unlabeled_x.shape == (6, 96, 96, 3)
  assert labelled.unlabeled_x is None
  np.testing.assert_array_equal(ds.unlabeled_x, ref)
  np.testing.assert_array_equal(ds.train_y, labelled.train_y)   # labels for the evaluation
  # Normalised with the statistics of the images the clients train on.
  np.testing.assert_allclose(ds.mean, (ref / 255.0).mean(axis=(0, 1, 2)), rtol=1e-12)
  fed, info = partition.build_fed_data(ds, 2, 'iid', seed=0, public_size=2)
  np.testing.assert_array_equal(np.asarray(fed.n), [2, 2])
  assert (np.asarray(fed.y) == -1).all() and info['histogram'].tolist() == [[2], [2]]
  rows = np.asarray(fed.x).reshape(4, -1)
  assert {r.tobytes() for r in rows} <= {r.tobytes() for r in ref.reshape(6, -1)}
  assert DatasetInfo.of(ds).num_unlabeled == 6
  with pytest.raises(ValueError, match=r"scheme 'dirichlet' is invalid for stl10_unlabelled"):
    partition.build_fed_data(ds, 2, 'dirichlet', seed=0, alpha=0.5)
