"""Tests for fedjax_ssl.config_validation (messages checked verbatim)."""

import re

import ml_collections
import numpy as np
import pytest

from fedjax_ssl.config_validation import (ConfigError, check_choice, check_float_range,
                                          check_int_range, check_known_keys, check_positive)


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
