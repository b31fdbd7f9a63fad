"""experiments.prepare_data and the train binary's one-line refusal of a dataset it cannot get."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from experiments import prepare_data
from fedjax_ssl.data import folders

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_prepare_folder_decodes_once_into_its_cache(tmp_path):
  for c in range(2):
    for i in range(3):
      path = tmp_path / f'c{c}' / f'{i}.png'
      path.parent.mkdir(exist_ok=True)
      Image.fromarray(np.full((5, 7, 3), 20 * c + i, np.uint8)).save(path)
  line = prepare_data.prepare('folder', str(tmp_path), image_size=4)
  assert line == (f'prepared folder in {tmp_path}: 4 train / 2 test images of 4x4x3, 2 classes; '
                  f'copy {tmp_path} to the training machine and run with --config.dataset=folder '
                  f'--config.data_dir={tmp_path} --config.image_size=4')
  assert len(list((tmp_path / folders.CACHE_DIR).glob('folder-*.npz'))) == 1


@pytest.mark.skipif(importlib.util.find_spec('tensorflow') is not None,
                    reason='with TensorFlow the binary would download CIFAR-10 from the internet')
def test_train_cifar10_not_prepared_is_one_line(tmp_path):
  """A fresh install (no TensorFlow) asked for cifar10 stops in one line before any download."""
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS='cpu')
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.train', '--config', 'configs/quickstart.py',
       '--config.dataset=cifar10', '--config.rounds=1', f'--config.data_dir={tmp_path}',
       '--workdir', str(tmp_path / 'w'), '--cache_dir='],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1
  assert out.stderr.splitlines() == [
      f"error: dataset 'cifar10' is not prepared in {tmp_path}, and tensorflow-datasets' cifar10 "
      "builder needs TensorFlow to prepare it (pip install -e '.[prepare]' where you prepare it); "
      f'on a machine with internet run `python -m experiments.prepare_data --dataset cifar10 '
      f'--data_dir {tmp_path}` and copy that folder here (--config.data_dir=FOLDER)']
