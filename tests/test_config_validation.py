"""Tests for fedjax_ssl.config_validation and experiment.validate_config's cross-key checks
(messages checked verbatim)."""

import gzip
import logging
import re

import jax
import ml_collections
import numpy as np
import pytest

from fedjax_ssl import configuration, experiment
from fedjax_ssl.config_validation import (ConfigError, check_choice, check_float_range,
                                          check_int_range, check_known_keys, check_positive,
                                          error_line, unknown_override)
from fedjax_ssl.data import info as data_info
from fedjax_ssl.data import sources


def _reference():
  config = ml_collections.ConfigDict()
  config.method = 'fedbyol'
  config.num_rounds = 100
  config.data = ml_collections.ConfigDict({'name': 'cifar10', 'alpha': 0.5,
                                           'num_clients': 10})
  config.optim = ml_collections.ConfigDict({'lr': 0.05, 'momentum': 0.9})
  config.method_kwargs = None  # placeholder: sub-tree not checked
  return config


def _raises(fn, message):
  with pytest.raises(ConfigError, match='^' + re.escape(message) + '$'):
    fn()


def test_config_error_is_value_error():
  assert issubclass(ConfigError, ValueError)


def test_check_known_keys_accepts_subset_and_opaque_subtree():
  config = _reference()
  del config.optim['momentum']
  config.method_kwargs = {'anything': {'goes': 1}}
  check_known_keys(config, _reference())
  check_known_keys(config.to_dict(), _reference())  # plain dicts too
  check_known_keys(ml_collections.FrozenConfigDict(config), _reference())


def test_check_known_keys_unknown_nested_with_suggestion():
  config = _reference()
  config.optim.lrr = 0.1
  _raises(lambda: check_known_keys(config, _reference()),
          "unknown config key 'config.optim.lrr' (did you mean 'config.optim.lr'?); "
          "known keys at config.optim: ['lr', 'momentum']")


def test_check_known_keys_unknown_top_level_without_suggestion():
  config = _reference()
  config.zzz = 1
  _raises(lambda: check_known_keys(config, _reference()),
          "unknown config key 'config.zzz'; known keys at config: "
          "['data', 'method', 'method_kwargs', 'num_rounds', 'optim']")


def test_check_choice():
  assert check_choice('method', 'fedu2', ['fedbyol', 'fedu2']) == 'fedu2'
  _raises(lambda: check_choice('method', 'fedbyl', ['fedbyol', 'fedu2']),
          "config.method = 'fedbyl' is invalid: must be one of ['fedbyol', 'fedu2']; "
          "did you mean 'fedbyol'?")
  _raises(lambda: check_choice('config.data.name', 'xyz', ('cifar10', 'mnist')),
          "config.data.name = 'xyz' is invalid: must be one of ['cifar10', 'mnist']")
  _raises(lambda: check_choice('k', 3, [1, 2]), 'config.k = 3 is invalid: must be one of [1, 2]')


def test_check_int_range():
  assert check_int_range('data.num_clients', np.int64(10), 1, 1000) == 10
  assert check_int_range('num_rounds', 5, lo=0) == 5
  _raises(lambda: check_int_range('data.num_clients', 0, 1, 1000),
          'config.data.num_clients = 0 is invalid: must be an integer in [1, 1000]')
  _raises(lambda: check_int_range('data.num_clients', 1001, 1, 1000),
          'config.data.num_clients = 1001 is invalid: must be an integer in [1, 1000]')
  _raises(lambda: check_int_range('num_rounds', 2.0, lo=1),
          'config.num_rounds = 2.0 is invalid: must be an integer >= 1')
  _raises(lambda: check_int_range('num_rounds', True, lo=0),
          'config.num_rounds = True is invalid: must be an integer >= 0')
  _raises(lambda: check_int_range('k', 9, hi=8), 'config.k = 9 is invalid: must be an integer <= 8')
  _raises(lambda: check_int_range('k', None), 'config.k = None is invalid: must be an integer')


def test_check_float_range():
  assert check_float_range('optim.momentum', 0.9, 0.0, 1.0, inclusive=(True, False)) == 0.9
  assert check_float_range('tau', 1, 0.0, 1.0) == 1.0  # ints accepted, bounds inclusive
  _raises(lambda: check_float_range('optim.momentum', 1.0, 0.0, 1.0, inclusive=(True, False)),
          'config.optim.momentum = 1.0 is invalid: must be a finite number in [0.0, 1.0)')
  _raises(lambda: check_float_range('temperature', 0.0, 0.0, None, inclusive=False),
          'config.temperature = 0.0 is invalid: must be a finite number > 0.0')
  _raises(lambda: check_float_range('temperature', np.float64(-1.5), lo=0.0),
          'config.temperature = -1.5 is invalid: must be a finite number >= 0.0')
  _raises(lambda: check_float_range('tau', float('nan'), 0.0, 1.0),
          'config.tau = nan is invalid: must be a finite number in [0.0, 1.0]')
  _raises(lambda: check_float_range('tau', '0.5', 0.0, 1.0),
          "config.tau = '0.5' is invalid: must be a finite number in [0.0, 1.0]")
  _raises(lambda: check_float_range('x', 2.5, hi=2, inclusive=False),
          'config.x = 2.5 is invalid: must be a finite number < 2')


def test_check_positive():
  assert check_positive('alpha', 0.1) == 0.1
  assert check_positive('alpha', float('inf')) == float('inf')  # e.g. alpha=inf ~ IID
  assert check_positive('noise', 0, allow_zero=True) == 0
  _raises(lambda: check_positive('alpha', -1.0), 'config.alpha = -1.0 is invalid: must be > 0')
  _raises(lambda: check_positive('alpha', 0), 'config.alpha = 0 is invalid: must be > 0')
  _raises(lambda: check_positive('noise', -0.5, allow_zero=True),
          'config.noise = -0.5 is invalid: must be >= 0')
  _raises(lambda: check_positive('alpha', float('nan')),
          'config.alpha = nan is invalid: must be > 0')
  _raises(lambda: check_positive('alpha', None), 'config.alpha = None is invalid: must be > 0')


# ----------------------------------------------------------------------------------------------
# Binaries: one-line errors and unknown --config.<key> overrides
# ----------------------------------------------------------------------------------------------
def test_error_line_is_one_line():
  assert error_line(ConfigError('config.k = 3 is invalid')) == 'error: config.k = 3 is invalid'
  assert (error_line('Failed loading\n  Attempted:\n    a.py\n') ==
          'error: Failed loading Attempted: a.py')


def test_unknown_override_names_key_flag_and_close_matches():
  argv = ['prog', '--config=c.py', '--config.num_rounds=3', '--config.optim.lrr=0.1']
  error = unknown_override(argv, _reference())
  assert str(error) == ("unknown config key 'config.optim.lrr' in --config.optim.lrr=0.1 (did you "
                        "mean 'config.optim.lr'?); known keys at config.optim: ['lr', 'momentum']")
  error = unknown_override(['prog', '--config.bogus_key=3'], _reference())
  assert str(error).startswith("unknown config key 'config.bogus_key' in --config.bogus_key=3; "
                               "known keys at config: ['data', 'method'")
  error = unknown_override(['prog', '--config.method.x=1'], _reference())
  assert str(error) == ("unknown config key 'config.method.x' in --config.method.x=1: "
                        "config.method = 'fedbyol' is a str, not a config dict")
  assert unknown_override(['prog', '--config.data.alpha=1', '--noconfig.method', '--workdir=x',
                           '--', '--config.zzz=1'], _reference()) is None


# ----------------------------------------------------------------------------------------------
# experiment.validate_config: cross-key checks against the dataset's known sizes and shapes
# ----------------------------------------------------------------------------------------------
def _cfg(**overrides):
  config = experiment.default_config()
  config.dataset = 'synthetic'  # 2,000 train / 500 test images, 32x32x3, 10 classes; no files
  # The Adam probe: these tests shrink train_size below what 1% labels need (the label-fraction
  # checks of the default 'logistic' probe are tested in tests/test_evaluation.py).
  config.probe = 'adam'
  config.update(overrides)
  return config


def _invalid(message, **overrides):
  _raises(lambda: experiment.validate_config(_cfg(**overrides)), message)


def test_knn_k_vs_training_examples():  # the case: --config.train_size=64, knn_k 200
  _invalid('config.knn_k = 200 is invalid: must be <= 64, the number of training examples in the '
           'kNN memory bank (config.train_size = 64)', train_size=64)
  _invalid('config.knn_k = 2001 is invalid: must be <= 2000, the number of training examples in '
           'the kNN memory bank (all of the synthetic training split)', knn_k=2001)
  experiment.validate_config(_cfg(train_size=64, knn_k=64))


def test_train_size_vs_dataset_size():
  _invalid('config.train_size = 2001 is invalid: must be <= 2000, the size of the synthetic '
           'training split (0 = all of it)', train_size=2001)


def test_public_size_vs_training_examples():
  _invalid('config.public_size = 2000 is invalid: must be < 2000, the number of training examples '
           '(all of the synthetic training split)', public_size=2000)


def test_num_clients_vs_examples_left_after_public_set():
  _invalid("config.num_clients = 101 is invalid: 200 training examples (config.train_size = 300, "
           "minus config.public_size = 100) cannot give every client at least 2 examples "
           "(config.partition = 'dirichlet'); must be <= 100",
           train_size=300, public_size=100, knn_k=10, num_clients=101, clients_per_round=5)
  _invalid("config.num_clients = 51 is invalid: 50 training examples (config.train_size = 50) "
           "cannot give every client 1 example (config.partition = 'iid'); must be <= 50",
           train_size=50, knn_k=10, partition='iid', num_clients=51, clients_per_round=5)
  experiment.validate_config(_cfg(train_size=50, knn_k=10, partition='iid', num_clients=50,
                                  clients_per_round=5, batch_size=2))


def test_classes_per_client_vs_number_of_classes():
  _invalid('config.classes_per_client = 11 is invalid: must be <= 10, the number of classes of '
           'synthetic', partition='classes', classes_per_client=11)
  _invalid('config.classes_per_client = 0 is invalid: must be an integer in [1, 1000000]',
           partition='classes', classes_per_client=0)


def test_classes_shard_mode_needs_a_multiple_of_the_classes():
  _invalid('config.classes_per_client = 3 is invalid with config.num_clients = 4: num_clients * '
           'classes_per_client = 12 exceeds the 10 classes of synthetic, so classes are shared '
           'between clients (shard mode) and 12 must be a multiple of 10',
           partition='classes', classes_per_client=3, num_clients=4, clients_per_round=4)
  experiment.validate_config(_cfg(partition='classes', classes_per_client=3, num_clients=10))


def test_encoder_vs_input_shape():
  info = data_info.DatasetInfo('tiny', 500, 100, (8, 8, 1), 10)
  with pytest.raises(ConfigError) as e:
    configuration.check_data_config(_cfg(encoder='hetero_cnn', knn_k=10), info)
  message = str(e.value)
  assert re.match(r"^config\.encoder = 'hetero_cnn' is invalid for the 8x8x1 images of tiny \("
                  r"max_pool window 2 larger than the input 0x0\); encoders that take them: \[",
                  message), message
  fits = eval(message.split('encoders that take them: ')[1])  # pylint: disable=eval-used
  assert 'small_cnn' in fits and 'hetero_cnn' not in fits and 'resnet9' not in fits
  with pytest.raises(ConfigError, match=r"^config.encoder = 'resnet9' is invalid for the 8x8x1"):
    configuration.check_data_config(_cfg(encoder='resnet9', knn_k=10), info)
  configuration.check_data_config(_cfg(encoder='small_cnn', knn_k=10), info)
  for encoder in ('resnet18', 'lenet5', 'hetero_cnn'):  # every catalog image size fits them
    experiment.validate_config(_cfg(encoder=encoder, dataset='fashion_mnist_subset'))


def test_data_source_vs_dataset():
  _invalid("config.data_source = 'tfds' is invalid for config.dataset = 'fashion_mnist_subset': "
           "must be 'auto' (the dataset has a single source)",
           dataset='fashion_mnist_subset', data_source='tfds')
  _invalid("config.data_source = 'idx' is invalid for config.dataset = 'cifar10': IDX files exist "
           "for ('mnist', 'fashion_mnist') only; use 'auto' or 'tfds'",
           dataset='cifar10', data_source='idx')
  _invalid("config.data_source = 'hf' is invalid: must be one of ['auto', 'tfds', 'idx']",
           data_source='hf')


def test_data_dir_vs_data_source(tmp_path):
  _invalid("config.data_dir = '' is invalid for config.data_source = 'idx' and config.dataset = "
           "'mnist': must name the directory of the IDX files", dataset='mnist', data_source='idx')
  _invalid(f"config.data_dir = '{tmp_path}' is invalid for config.data_source = 'idx': {tmp_path} "
           "does not hold the IDX files ['train-images-idx3-ubyte', 'train-labels-idx1-ubyte', "
           "'t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'] (each optionally .gz)",
           dataset='mnist', data_source='idx', data_dir=str(tmp_path))
  _invalid(f"config.data_dir = '{tmp_path / 'x.npz'}' is invalid for config.dataset = "
           "'fashion_mnist_subset': must be the path of the subset's .npz file ('' = the shipped "
           "tests/data/fashion_mnist_subset.npz)",
           dataset='fashion_mnist_subset', data_dir=str(tmp_path / 'x.npz'))


def test_pallas_convolutions_need_a_gpu_backend():
  if jax.default_backend() == 'gpu':
    pytest.skip('the Pallas kernel compiles here')
  _invalid(f"config.conv_impl = 'pallas' is invalid on the '{jax.default_backend()}' backend: needs "
           "one of ('gpu',) (its Triton kernel); use 'packed', 'measured', 'xla' or 'im2col'",
           conv_impl='pallas', encoder='small_cnn')


def test_strategy_participant_error_is_a_config_error():
  if jax.device_count() == 1:
    pytest.skip('needs several devices (tests/conftest.py)')
  n = jax.device_count()
  _invalid(f'config.clients_per_round = {n + 1} is invalid for strategy "shard": it must be a '
           f'multiple of the device count {n}', strategy='shard', clients_per_round=n + 1)


def test_divided_placement_refuses_what_reads_every_client():
  _invalid("config.placement = 'spread' is invalid: must be one of ['replicated', 'divided']",
           placement='spread')
  config = _cfg(placement='divided')
  config.fedbuff.enabled = True
  _raises(lambda: experiment.validate_config(config),
          "config.placement = 'divided' is invalid with config.fedbuff.enabled = True: its pending "
          "updates and clock are one state of all clients; use 'replicated'")


def test_seed_and_data_dir_types():
  _invalid('config.seed = -1 is invalid: must be an integer in [0, 2147483647]', seed=-1)
  config = _cfg()
  config.data_dir = None
  _raises(lambda: experiment.validate_config(config),
          "config.data_dir = None is invalid: must be a path string ('' = the source's default "
          "location)")


def test_batch_larger_than_average_client_warns(caplog):
  with caplog.at_level(logging.WARNING):
    experiment.validate_config(_cfg(train_size=500, knn_k=10, batch_size=128))
  assert ('config.batch_size = 128 exceeds the average client size 50 (500 training examples '
          '(config.train_size = 500) over 10 clients)') in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    experiment.validate_config(_cfg(batch_size=128))
  assert 'batch_size' not in caplog.text


def _write_idx(path, array, gz):
  header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, '>u4').tobytes()
  data = header + array.astype(np.uint8).tobytes()
  path.write_bytes(gzip.compress(data) if gz else data)


def test_dataset_info_reads_only_file_headers(tmp_path):
  assert configuration.dataset_info(_cfg(dataset='fashion_mnist_subset')) == data_info.DatasetInfo(
      'fashion_mnist_subset', 3000, 1000, (28, 28, 1), 10)
  assert configuration.dataset_info(_cfg(dataset='cifar100', data_source='tfds')) == \
      data_info.CATALOG_INFO['cifar100']
  # IDX files in data_dir (one gzipped, one not): their headers give the sizes.
  for key, n, gz in (('train_x', 7, True), ('test_x', 3, False)):
    _write_idx(tmp_path / (sources.IDX_FILES[key] + ('.gz' if gz else '')),
               np.zeros((n, 28, 28)), gz)
  for key, n in (('train_y', 7), ('test_y', 3)):
    _write_idx(tmp_path / sources.IDX_FILES[key], np.zeros((n,)), False)
  config = _cfg(dataset='mnist', data_dir=str(tmp_path))
  assert configuration.dataset_info(config) == data_info.DatasetInfo('mnist', 7, 3, (28, 28, 1), 10)
  _raises(lambda: experiment.validate_config(config),
          "config.num_clients = 10 is invalid: 7 training examples (all of the mnist training "
          "split) cannot give every client at least 2 examples (config.partition = 'dirichlet'); "
          "must be <= 3")
  # A file that is not an npz: unknown before loading (load_data reports it).
  (tmp_path / 'bad.npz').write_text('not a zip')
  assert configuration.dataset_info(_cfg(dataset='fashion_mnist_subset',
                                      data_dir=str(tmp_path / 'bad.npz'))) is None


def test_validate_config_loads_no_data_and_compiles_nothing(monkeypatch, caplog):
  def fail(*args, **kwargs):
    raise AssertionError('validate_config loaded data')
  for name in ('load_dataset', 'load_subset', 'make_synthetic', 'load_idx', 'load_tfds',
               'read_idx'):
    monkeypatch.setattr(sources, name, fail)
  monkeypatch.setattr(experiment, 'load_data', fail)
  monkeypatch.setattr(experiment, 'build_algorithm', fail)
  jax.config.update('jax_log_compiles', True)
  try:
    with caplog.at_level(logging.DEBUG):
      for dataset in ('synthetic', 'fashion_mnist_subset', 'cifar10', 'fashion_mnist'):
        experiment.validate_config(_cfg(dataset=dataset, encoder='resnet18'))
        with pytest.raises(ConfigError, match='config.knn_k = 200'):
          experiment.validate_config(_cfg(dataset=dataset, train_size=64))
  finally:
    jax.config.update('jax_log_compiles', False)
  assert 'Compiling' not in caplog.text and 'Finished XLA compilation' not in caplog.text


def test_smoke_caps_a_cross_device_federation_to_what_its_data_can_partition():
  # 500 clients of 50 a round on the smoke's 2,000 images: 100 clients (Dirichlet needs 2 examples
  # each), 50 a round; a 10-client federation keeps its size, and participants never exceed clients.
  c = configuration.default_config()
  c.update(dict(num_clients=500, clients_per_round=50, rounds=30, train_size=20000))
  small = configuration.smoke(c)
  assert (small.num_clients, small.clients_per_round, small.rounds, small.train_size) == (
      100, 50, 2, 2000)
  c.update(dict(num_clients=500, clients_per_round=200))
  assert (configuration.smoke(c).num_clients, configuration.smoke(c).clients_per_round) == (100, 100)
  c.update(dict(num_clients=10, clients_per_round=10))
  assert (configuration.smoke(c).num_clients, configuration.smoke(c).clients_per_round) == (10, 10)
  # Fine-tuning: 0 (the protocol's 200 or 100 epochs) and 10 both become one epoch.
  assert small.finetune_epochs == 1
  c.finetune_epochs = 10
  assert configuration.smoke(c).finetune_epochs == 1
