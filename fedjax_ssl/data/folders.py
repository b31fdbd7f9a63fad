"""Images in folders: a user's own class folders (the 'folder' source) and Tiny-ImageNet's release.

Both decode every image once with PIL into the arrays the other sources give (uint8 [N, H, W, 3],
int32 labels) and cache them as one .npz beside the data (DATA_DIR/.fedjax_ssl_cache/), keyed by
every file's path, size and modification time and by the decoding options, so that a changed
folder or another image size decodes again. A folder that cannot be written is read every time.

Layouts:
  folder         DATA_DIR/train/<class>/*.png|jpg|... and DATA_DIR/test/<class>/..., or one
                 DATA_DIR/<class>/... split per class by `test_fraction` (a fixed seed: every run
                 sees the same test images). Classes are the sorted folder names of the training
                 split; a test class that has no training folder is an error.
  tiny_imagenet  the released tiny-imagenet-200 folder: train/<wnid>/images/*.JPEG and
                 val/images/*.JPEG with val/val_annotations.txt (file, wnid, box per line); the
                 val split is the test split (the release's test images have no labels). Classes
                 are the sorted wnids (torchvision's ImageFolder order).

Every image becomes RGB (Tiny-ImageNet holds some grayscale JPEGs). `image_size` S > 0 resizes each
to S x S (PIL bilinear, antialiased when shrinking, as torchvision's Resize on PIL images); 0 keeps
the stored size, which must then be the same for every image.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
from typing import Dict, List, Sequence, Tuple

import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl import files

IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg', '.bmp', '.gif', '.webp', '.tif', '.tiff')
CACHE_DIR = '.fedjax_ssl_cache'
TINY_IMAGENET_SIZE = 64       # stored size of Tiny-ImageNet's images
TINY_IMAGENET_CLASSES = 200
TINY_IMAGENET_SPLITS = (100_000, 10_000)  # train (500 per class), val (50 per class)
_SPLIT_SEED = 0               # the folder source's train/test split
_CACHE_VERSION = 1            # bump when the decoding changes: old cache files are then unused

Arrays = Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Tuple[str, ...]]


class ImageFolderError(cv.ConfigError):
  """An image folder that cannot be read as a dataset; one line naming the path and what is
  expected (a ConfigError, so that the binaries print it without a traceback)."""


def _is_image(path: pathlib.Path) -> bool:
  return path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith('.')


def _subfolders(directory: pathlib.Path) -> List[pathlib.Path]:
  return sorted(d for d in directory.iterdir() if d.is_dir() and not d.name.startswith('.'))


def class_files(directory: pathlib.Path) -> Dict[str, List[pathlib.Path]]:
  """{class name: sorted image paths} of DIRECTORY/<class>/*; every class needs >= 1 image."""
  classes = _subfolders(directory)
  if not classes:
    raise ImageFolderError(f'{directory} holds no class folders: expected {directory}/<class>/'
                           f'<image> with images {"|".join(IMAGE_SUFFIXES)}')
  out = {}
  for folder in classes:
    images = sorted(p for p in folder.iterdir() if _is_image(p))
    if not images:
      raise ImageFolderError(f'class folder {folder} holds no images ({"|".join(IMAGE_SUFFIXES)}); '
                             'every class needs at least one (remove the folder or add images)')
    out[folder.name] = images
  return out


def decode_images(paths: Sequence[pathlib.Path], image_size: int = 0) -> np.ndarray:
  """uint8 [N, H, W, 3] of the images `paths` (RGB), resized to image_size x image_size if > 0.

  Raises:
    ImageFolderError: an image PIL cannot read, or (image_size 0) images of different sizes.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top  (only the folder sources need it)
  out, first = None, None
  for i, path in enumerate(paths):
    try:
      with Image.open(path) as image:
        image = image.convert('RGB')
        if image_size:
          image = image.resize((image_size, image_size), Image.BILINEAR)
        array = np.asarray(image, np.uint8)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
      raise ImageFolderError(f'cannot read image {path} ({type(e).__name__}: '
                             f'{str(e).splitlines()[0] if str(e) else ""}); replace or remove '
                             'it') from None
    if out is None:
      out, first = np.empty((len(paths),) + array.shape, np.uint8), path
    elif array.shape != out.shape[1:]:
      raise ImageFolderError(
          f'images differ in size: {first} is {out.shape[2]}x{out.shape[1]}, {path} is '
          f'{array.shape[1]}x{array.shape[0]} (width x height); set config.image_size = S to '
          'resize every image to S x S')
    out[i] = array
  return out


def _cache_path(root: pathlib.Path, kind: str, listing: Sequence[pathlib.Path], options: dict
                ) -> pathlib.Path:
  """DATA_DIR/.fedjax_ssl_cache/<kind>-<hash>.npz; the hash covers every file's path relative to
  root, size and modification time, and the decoding options."""
  h = hashlib.sha256(json.dumps(dict(options, kind=kind, version=_CACHE_VERSION),
                                sort_keys=True).encode())
  for path in listing:
    st = path.stat()
    h.update(f'{path.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n'.encode())
  return root / CACHE_DIR / f'{kind}-{h.hexdigest()[:20]}.npz'


def _cached(root: pathlib.Path, kind: str, listing, options, build) -> Arrays:
  """The arrays of `build()` through the cache file of (kind, listing, options)."""
  path = _cache_path(root, kind, listing, options)
  if path.is_file():
    try:
      with np.load(path) as f:
        return (f['train_x'], f['train_y'], f['test_x'], f['test_y'],
                tuple(str(c) for c in f['classes']))
    except (OSError, ValueError, KeyError) as e:  # a damaged cache file: decode again
      logging.warning('ignoring unreadable cache %s (%s)', path, e)
  arrays = build()
  try:
    path.parent.mkdir(exist_ok=True)
    keys = ('train_x', 'train_y', 'test_x', 'test_y')
    files.write_stream(path, lambda f: np.savez(f, **dict(zip(keys, arrays[:4])),
                                                classes=np.array(arrays[4])))
  except OSError as e:  # a read-only data folder: decode every time
    logging.warning('could not write the decoded-image cache %s (%s); images are decoded on '
                    'every load', path, e)
  return arrays


def _labelled(per_class: Dict[str, List[pathlib.Path]], classes: Sequence[str]
              ) -> Tuple[List[pathlib.Path], np.ndarray]:
  index = {c: i for i, c in enumerate(classes)}
  paths = [p for c in per_class for p in per_class[c]]
  labels = np.array([index[c] for c in per_class for _ in per_class[c]], np.int32)
  return paths, labels


def _split_per_class(labels: np.ndarray, num_classes: int, test_fraction: float
                     ) -> Tuple[np.ndarray, np.ndarray]:
  """(train_idx, test_idx), sorted: round(test_fraction * n_c) test images of each class (at most
  n_c - 1, so every class keeps a training image), drawn with a fixed seed."""
  rng = np.random.default_rng(_SPLIT_SEED)
  train, test = [], []
  for c in range(num_classes):
    idx = rng.permutation(np.flatnonzero(labels == c))
    k = min(int(np.floor(test_fraction * len(idx) + 0.5)), len(idx) - 1)
    test.append(idx[:k])
    train.append(idx[k:])
  return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def load_folder(root, image_size: int = 0, test_fraction: float = 0.2) -> Arrays:
  """(train_x, train_y, test_x, test_y, classes) of a user's image folder (module docstring).

  Raises:
    ImageFolderError: (one line) the folder or its layout cannot be read as a dataset.
  """
  root = pathlib.Path(root)
  if not root.is_dir():
    raise ImageFolderError(f'image folder {root} does not exist: expected {root}/train/<class>/'
                           f'<image> and {root}/test/<class>/<image>, or {root}/<class>/<image>')
  if not 0 < test_fraction < 1:
    raise ImageFolderError(f'test_fraction = {test_fraction} is invalid: must be in (0, 1)')
  if (root / 'train').is_dir() != (root / 'test').is_dir():
    have, lack = ('train', 'test') if (root / 'train').is_dir() else ('test', 'train')
    raise ImageFolderError(f'{root} has a {have}/ folder but no {lack}/ folder: give both '
                           f'({root}/train/<class>/..., {root}/test/<class>/...) or neither '
                           f'({root}/<class>/...)')
  if (root / 'train').is_dir():
    train_files, test_files = class_files(root / 'train'), class_files(root / 'test')
    classes = tuple(train_files)
    unknown = sorted(set(test_files) - set(classes))
    if unknown:
      raise ImageFolderError(f'{root}/test has class folders without a training folder: '
                             f'{unknown[:5]}; test classes must be among {list(classes)[:10]}')
    train_paths, train_y = _labelled(train_files, classes)
    test_paths, test_y = _labelled(test_files, classes)
    options = dict(image_size=image_size)

    def build():
      return (decode_images(train_paths, image_size), train_y,
              decode_images(test_paths, image_size), test_y, classes)
    return _cached(root, 'folder', train_paths + test_paths, options, build)

  per_class = class_files(root)
  classes = tuple(per_class)
  paths, labels = _labelled(per_class, classes)
  train_idx, test_idx = _split_per_class(labels, len(classes), test_fraction)
  if not len(test_idx):
    raise ImageFolderError(f'test_fraction = {test_fraction} of the {len(paths)} images of {root} '
                           'gives no test image: raise it or add images')
  options = dict(image_size=image_size, test_fraction=test_fraction, split_seed=_SPLIT_SEED)

  def build_split():
    x = decode_images(paths, image_size)
    return x[train_idx], labels[train_idx], x[test_idx], labels[test_idx], classes
  return _cached(root, 'folder', paths, options, build_split)


def tiny_imagenet_root(data_dir) -> pathlib.Path:
  """The release folder: data_dir itself, or data_dir/tiny-imagenet-200 when that exists."""
  root = pathlib.Path(data_dir)
  return root / 'tiny-imagenet-200' if (root / 'tiny-imagenet-200').is_dir() else root


def load_tiny_imagenet(data_dir, image_size: int = 0) -> Arrays:
  """(train_x, train_y, test_x, test_y, wnids) of Tiny-ImageNet's released folder (the val split
  as the test split); images TINY_IMAGENET_SIZE or image_size square.

  Raises:
    ImageFolderError: (one line) the folder does not have the release's layout.
  """
  root = tiny_imagenet_root(data_dir)
  annotations = root / 'val' / 'val_annotations.txt'
  layout = ('expected the released tiny-imagenet-200 folder: train/<wnid>/images/*.JPEG, '
            'val/images/*.JPEG and val/val_annotations.txt')
  if not (root / 'train').is_dir() or not annotations.is_file():
    raise ImageFolderError(f'{root} is not a Tiny-ImageNet folder: {layout}')
  wnids = tuple(d.name for d in _subfolders(root / 'train'))
  train_files = {}
  for wnid in wnids:
    images = (sorted(p for p in (root / 'train' / wnid / 'images').iterdir() if _is_image(p))
              if (root / 'train' / wnid / 'images').is_dir() else [])
    if not images:
      raise ImageFolderError(f'class folder {root / "train" / wnid / "images"} holds no images; '
                             f'{layout}')
    train_files[wnid] = images
  train_paths, train_y = _labelled(train_files, wnids)
  index = {w: i for i, w in enumerate(wnids)}
  test_paths, test_y = [], []
  for number, line in enumerate(annotations.read_text().splitlines(), 1):
    if not line.strip():
      continue
    fields = line.split('\t')
    if len(fields) < 2 or fields[1] not in index:
      raise ImageFolderError(f'{annotations} line {number} is invalid: {line[:80]!r}; expected '
                             '"<file>\\t<wnid>\\t<box>" with a wnid that has a train/ folder')
    path = root / 'val' / 'images' / fields[0]
    if not path.is_file():
      raise ImageFolderError(f'{annotations} line {number} names {path}, which does not exist')
    test_paths.append(path)
    test_y.append(index[fields[1]])
  test_y = np.array(test_y, np.int32)
  size = image_size or 0

  def build():
    return (decode_images(train_paths, size), train_y, decode_images(test_paths, size), test_y,
            wnids)
  return _cached(root, 'tiny_imagenet', train_paths + test_paths + [annotations],
                 dict(image_size=size), build)
