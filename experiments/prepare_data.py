r"""Prepares a dataset into a folder, for machines without internet (issue 64).

  python -m experiments.prepare_data --dataset cifar10 --data_dir /data/tfds
  python -m experiments.prepare_data --dataset tiny_imagenet --data_dir /data/tiny-imagenet-200 \
      --image_size 32

A catalog dataset (cifar10, cifar100, mnist, fashion_mnist, svhn, stl10, stl10_unlabelled) is
downloaded and prepared by tensorflow-datasets into DATA_DIR (array_record files; preparing needs
TensorFlow, reading does not). An image-folder dataset (folder, tiny_imagenet) is decoded once into
its cache DATA_DIR/.fedjax_ssl_cache/. Then copy DATA_DIR to the machine that trains, e.g.
`rsync -a /data/tfds other:/data/`, and run there with `--config.dataset=NAME
--config.data_dir=/data/tfds`. Errors are one `error: ...` line on stderr, exit status 1.
"""
from __future__ import annotations

import pathlib

from absl import flags

from fedjax_ssl import config_validation as cv
from fedjax_ssl.data import sources

PREPARED = sources.CATALOG_NAMES + sources.FOLDER_NAMES


def define_flags():
  """The flags, defined only when this binary runs (other binaries share names)."""
  flags.DEFINE_enum('dataset', None, PREPARED, 'The dataset to prepare.')
  flags.DEFINE_string('data_dir', None, 'The folder to prepare it into (catalog datasets; created '
                      'if missing) or the image folder to decode (folder, tiny_imagenet).')
  flags.DEFINE_integer('image_size', 0, 'folder / tiny_imagenet: resize to S x S (0 = stored '
                       'size); the cache is per size, so use the value the runs will use.')
  flags.DEFINE_float('test_fraction', 0.2, 'folder without train/ and test/: the test share.')
  flags.mark_flags_as_required(['dataset', 'data_dir'])


def prepare(name: str, data_dir: str, image_size: int = 0, test_fraction: float = 0.2) -> str:
  """Prepares dataset `name` in data_dir; returns the line that tells how to use it."""
  if name in sources.FOLDER_NAMES:
    kw = dict(image_size=image_size)
    if name == 'folder':
      kw['test_fraction'] = test_fraction
    ds = sources.load_dataset(name, data_dir=data_dir, **kw)
    flags_text = f'--config.dataset={name} --config.data_dir={data_dir}' + (
        f' --config.image_size={image_size}' if image_size else '')
  else:
    if image_size:
      raise cv.ConfigError(f'--image_size={image_size} is invalid for --dataset={name}: only '
                           f'{sources.FOLDER_NAMES} are resized')
    pathlib.Path(data_dir).mkdir(parents=True, exist_ok=True)
    ds = sources.load_tfds(name, data_dir=data_dir, download=True)
    flags_text = f'--config.dataset={name} --config.data_dir={data_dir}'
  unlabelled = '' if ds.unlabeled_x is None else f' / {len(ds.unlabeled_x)} unlabelled'
  return (f'prepared {name} in {data_dir}: {len(ds.train_y)} train / {len(ds.test_y)} test'
          f'{unlabelled} images of {"x".join(map(str, ds.image_shape))}, {ds.num_classes} classes; '
          f'copy {data_dir} to the training machine and run with {flags_text}')


def main(argv):
  if len(argv) > 1:
    raise cv.ConfigError(f'unexpected arguments: {argv[1:]}')
  f = flags.FLAGS
  print(prepare(f.dataset, f.data_dir, f.image_size, f.test_fraction))


if __name__ == '__main__':
  define_flags()
  cv.run(main)
