"""Builds tests/data/fashion_mnist_subset.npz: a stratified subset of the real Fashion-MNIST.

Reads the original IDX files installed by Debian's `dataset-fashion-mnist` package and keeps, with a
fixed seed, 300 train images per class (3,000) and 100 test images per class (1,000). The chosen
source indices are stored next to the images (train_idx, test_idx) so the subset can be checked
against the full files.

Usage:  python tests/data/make_subset.py [--idx_dir DIR] [--out PATH]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parents[1]))  # the repository root, so the script runs from anywhere

from fedjax_ssl.data import sources  # pylint: disable=g-import-not-at-top,wrong-import-position

SEED = 0
TRAIN_PER_CLASS = 300
TEST_PER_CLASS = 100


def stratified_indices(labels: np.ndarray, per_class: int, rng: np.random.Generator) -> np.ndarray:
  """`per_class` indices of every label value, drawn without replacement, returned sorted (int32)."""
  chosen = [rng.choice(np.flatnonzero(labels == c), per_class, replace=False)
            for c in range(int(labels.max()) + 1)]
  return np.sort(np.concatenate(chosen)).astype(np.int32)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--idx_dir', default=sources.DEBIAN_FASHION_MNIST_DIR)
  parser.add_argument('--out', default=str(_HERE / 'fashion_mnist_subset.npz'))
  args = parser.parse_args(argv)

  full = sources.load_idx(args.idx_dir, 'fashion_mnist')
  rng = np.random.default_rng(SEED)
  train_idx = stratified_indices(full.train_y, TRAIN_PER_CLASS, rng)
  test_idx = stratified_indices(full.test_y, TEST_PER_CLASS, rng)
  np.savez_compressed(args.out,
                      train_x=full.train_x[train_idx], train_y=full.train_y[train_idx],
                      test_x=full.test_x[test_idx], test_y=full.test_y[test_idx],
                      train_idx=train_idx, test_idx=test_idx)
  print(f'wrote {args.out}: {train_idx.size} train, {test_idx.size} test images')


if __name__ == '__main__':
  main()
