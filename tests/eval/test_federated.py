"""Evaluation of a federated state under config.probe = 'logistic' (the field's protocol): the metrics
are those of `protocol.evaluate_features` on the encoder's features, the raw-pixel reference row is
the same protocol on the normalised pixels, and bad label fractions are refused before compute."""
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment
from fedjax_ssl.core import round as rd
from fedjax_ssl.eval import federated, features


def _config(**overrides):
  c = experiment.default_config()
  c.update(dict(dataset='fashion_mnist_subset', train_size=600, partition='iid', num_clients=2,
                clients_per_round=2, encoder='mlp', heads='custom', proj_hidden=16, proj_out=8,
                pred_hidden=16, pred_out=8, augmentation='flip', knn_k=50, knn_k_small=5,
                probe='logistic', label_fractions=(1.0, 0.1), label_draws=2, rounds=1))
  c.update(overrides)
  return c


def test_logistic_probe_passes_the_encoder_features_and_the_settings_to_the_protocol(monkeypatch):
  config = _config(encoder='small_cnn')
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  algo = experiment.build_algorithm(config, dataset)
  state = rd.init_state(algo, experiment.run_keys(config)[0], config.num_clients)
  calls = []

  def recorder(train_f, train_y, test_f, test_y, num_classes, **kw):
    calls.append((np.asarray(train_f), np.asarray(train_y), np.asarray(test_f),
                  np.asarray(test_y), num_classes, kw))
    return {'probe_acc': 0.5, 'knn_acc': 0.25}

  monkeypatch.setattr(federated.fs_protocol, 'evaluate_features', recorder)
  assert experiment.evaluate(config, algo, state, dataset) == {'probe_acc': 0.5, 'knn_acc': 0.25}
  variables, _ = algo.eval_variables(state)
  feats = lambda x: np.asarray(experiment.encoder_features(algo, variables, False, x, dataset))
  train_f, train_y, test_f, test_y, k, kw = calls[0]
  np.testing.assert_array_equal(train_f, feats(dataset.train_x))
  np.testing.assert_array_equal(test_f, feats(dataset.test_x))
  np.testing.assert_array_equal(train_y, dataset.train_y)
  np.testing.assert_array_equal(test_y, dataset.test_y)
  assert k == 10 and kw == dict(fractions=(1.0, 0.1), draws=2, seed=0, knn_k=(50, 5),
                                knn_temperature=0.1)
  # The raw-pixel reference: the same protocol on the normalised pixels, [N, 28 * 28].
  experiment.raw_pixel_metrics(config, dataset)
  pixels = lambda x: np.asarray(features.normalize_images(
      x, np.asarray(dataset.mean, np.float32), np.asarray(dataset.std, np.float32))).reshape(len(x), -1)
  np.testing.assert_array_equal(calls[1][0], pixels(dataset.train_x))
  np.testing.assert_array_equal(calls[1][2], pixels(dataset.test_x))
  assert calls[1][5] == kw


def test_logistic_probe_reports_the_protocol_metrics():
  config = _config(train_size=300, label_fractions=(1.0, 0.5), label_draws=1)
  dataset = experiment.load_data(config)
  algo = experiment.build_algorithm(config, dataset)
  state = rd.init_state(algo, experiment.run_keys(config)[0], config.num_clients)
  got = experiment.evaluate(config, algo, state, dataset)
  assert {'probe_acc', 'probe_acc_50pct', 'knn_acc', 'knn_acc_k5', 'knn_acc_50pct_k5'} <= set(got)
  assert 0.1 < got['probe_acc'] <= 1.0 and 0.1 < got['knn_acc'] <= 1.0


@pytest.mark.parametrize('overrides, message', [
    (dict(label_fractions=(1.0, 0.0)), r'config.label_fractions = \(1.0, 0.0\) is invalid: must be '
                                       r'distinct numbers in \(0, 1\]'),
    (dict(label_fractions=(1.5,)), r'config.label_fractions = \(1.5,\) is invalid'),
    (dict(label_fractions=()), r'config.label_fractions = \(\) is invalid'),
    (dict(label_fractions=(0.01,)), r'config.label_fractions = \(0.01,\) is invalid: 0.01 of the '
                                    r'600 training examples .* is 6 labelled images, fewer than '
                                    r'the 10 classes'),
    (dict(label_draws=0), r'config.label_draws = 0 is invalid'),
    (dict(probe='sgd'), r"config.probe = 'sgd' is invalid: must be one of"),
])
def test_bad_evaluation_settings_are_refused_before_compute(overrides, message):
  with pytest.raises(cv.ConfigError, match=message):
    experiment.validate_config(_config(**overrides))
