"""Evaluation of a federated state under config.probe = 'logistic' (the field's protocol): the metrics
are those of `protocol.evaluate_features` on the encoder's features, the raw-pixel reference row is
the same protocol on the normalised pixels, and bad label fractions are refused before compute. With
config.finetune, every evaluated encoder is fine-tuned on the same stratified labelled subsets."""
import jax
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment
from fedjax_ssl.core import round as rd
from fedjax_ssl import evaluation
from fedjax_ssl.eval import finetune, protocol


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

  monkeypatch.setattr(evaluation.fs_protocol, 'evaluate_features', recorder)
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
  # The raw-pixel reference: the same protocol on the pixels, [N, 28 * 28], each standardised with
  # the training split's mean and std (float64 reference; float32 rounding of x - mean and * 1/std).
  experiment.raw_pixel_metrics(config, dataset)
  flat = lambda x: np.asarray(x, np.float64).reshape(len(x), -1)
  mean, std = flat(dataset.train_x).mean(0), flat(dataset.train_x).std(0)
  std = np.where(std > 0, std, 1.0)
  for got, x in ((calls[1][0], dataset.train_x), (calls[1][2], dataset.test_x)):
    want = (flat(x) - mean) / std
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * np.finfo(np.float32).eps * (
        1 + np.abs(want).max()))
  np.testing.assert_allclose(calls[1][0].mean(0), 0, atol=1e-5)
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
    (dict(finetune='fedu3'), r"config.finetune = 'fedu3' is invalid: must be one of"),
    (dict(finetune='fedu2', finetune_fractions=(0.0, 0.1)),
     r'config.finetune_fractions = \(0.0, 0.1\) is invalid: must be distinct numbers in \(0, 1\]'),
    (dict(finetune_fractions=(0.1, 0.1)), r'config.finetune_fractions = \(0.1, 0.1\) is invalid'),
    (dict(finetune='hetero_ssfl', finetune_fractions=(0.01, 0.1)),
     r'config.finetune_fractions = \(0.01, 0.1\) is invalid: 0.01 of the 600 training examples .* '
     r'is 6 labelled images, fewer than the 10 classes'),
    (dict(finetune_epochs=-1), r'config.finetune_epochs = -1 is invalid: must be an integer'),
])
def test_bad_evaluation_settings_are_refused_before_compute(overrides, message):
  with pytest.raises(cv.ConfigError, match=message):
    experiment.validate_config(_config(**overrides))


def test_a_fraction_without_a_held_out_split_is_refused_when_the_data_loads():
  # 0.0167 of 600 = 10 labelled images over 10 classes passes validate_config (>= the classes) but
  # the probe's held-out split is empty (a class keeps one image to fit): refused by load_data,
  # before the first evaluation, instead of a traceback at round 0.
  config = _config(label_fractions=(1.0, 0.0167))
  experiment.validate_config(config)
  with pytest.raises(cv.ConfigError, match=(
      r'^config.label_fractions = \(1.0, 0.0167\) is invalid for the 600 labelled training images '
      r'of fashion_mnist_subset \(label fraction 0.0167: holdout = 0.1 of 10 labelled images holds '
      r'out none .*\): drop the smallest fraction or raise config.train_size$')):
    experiment.load_data(config)
  experiment.load_data(_config(label_fractions=(1.0, 0.1)))   # 60 labelled: 6 held out


def test_knn_k_small_equal_to_knn_k_is_refused():
  with pytest.raises(cv.ConfigError, match=r'^config.knn_k_small = 50 is invalid: equal to '
                                           r'config.knn_k it reports the same kNN twice'):
    experiment.validate_config(_config(knn_k_small=50))


def test_finetune_fractions_are_only_checked_against_the_data_when_fine_tuning():
  experiment.validate_config(_config(finetune='none', finetune_fractions=(0.01,)))


def _finetune_config(**overrides):
  """A tiny synthetic run (1,000 images, 10 classes: 1% = one image per class) with FedU2's
  fine-tune cut to 2 epochs (tested after epochs 1 and 2) and a one-epoch Adam probe."""
  c = experiment.default_config()
  c.update(dict(dataset='synthetic', train_size=1000, partition='iid', num_clients=2,
                clients_per_round=2, encoder='mlp', heads='custom', proj_hidden=16, proj_out=8,
                pred_hidden=16, pred_out=8, augmentation='flip', knn_k=10, probe='adam',
                probe_epochs=1, rounds=1, finetune='fedu2', finetune_epochs=2))
  c.update(overrides)
  experiment.validate_config(c)
  return c


def _recorded_finetunes(monkeypatch):
  """Records (train_x, train_y, kwargs) of every semi_supervised_finetune call, then runs it."""
  calls, real = [], finetune.semi_supervised_finetune

  def recorder(encoder, variables, train_x, train_y, *args, **kw):
    calls.append((np.asarray(train_x), np.asarray(train_y), kw))
    return real(encoder, variables, train_x, train_y, *args, **kw)

  monkeypatch.setattr(finetune, 'semi_supervised_finetune', recorder)
  return calls


def test_evaluate_fine_tunes_every_encoder_on_the_same_stratified_subsets(monkeypatch):
  config = _finetune_config()
  dataset = experiment.load_data(config)
  algo = experiment.build_algorithm(config, dataset)
  calls = _recorded_finetunes(monkeypatch)
  states = [rd.init_state(algo, key, config.num_clients)   # two encoders of one run
            for key in jax.random.split(experiment.run_keys(config)[0])]
  results = [experiment.evaluate(config, algo, s, dataset) for s in states]
  for got in results:
    assert {'ft_acc_1pct', 'ft_acc_10pct', 'probe_acc', 'knn_acc'} <= set(got)
    assert all(0.0 <= got[k] <= 1.0 for k in ('ft_acc_1pct', 'ft_acc_10pct'))
  assert len(calls) == 4   # (1%, 10%) per encoder
  for fraction, (x, y, kw) in zip((0.01, 0.1, 0.01, 0.1), calls):
    idx = evaluation.finetune_subset(config, dataset, fraction)
    np.testing.assert_array_equal(x, dataset.train_x[idx])
    counts = np.bincount(y, minlength=10)   # stratified: every class, in proportion
    np.testing.assert_array_equal(counts, protocol.subset_counts(dataset.train_y, 10, fraction))
    assert counts.min() >= 1 and counts.sum() == round(1000 * fraction)
    assert kw['augment_fn'] is evaluation.finetune_augment_fn('fedu2_finetune', dataset)
    assert {k: kw[k] for k in ('epochs', 'eval_epochs', 'batch_size', 'lr', 'head_lr', 'momentum',
                               'nesterov', 'seed')} == dict(
        epochs=2, eval_epochs=(1, 2), batch_size=128, lr=1e-3, head_lr=0.3, momentum=0.9,
        nesterov=False, seed=0)
  # The round's kNN monitor (probe=False) does not fine-tune.
  assert 'ft_acc_1pct' not in experiment.evaluate(config, algo, states[0], dataset, probe=False)
  assert len(calls) == 4


def test_evaluate_fine_tunes_each_personal_model():
  config = _finetune_config(algorithm='independent', finetune='hetero_ssfl', finetune_epochs=1,
                            finetune_fractions=(0.1,))
  dataset = experiment.load_data(config)
  algo = experiment.build_algorithm(config, dataset)
  state = rd.init_state(algo, experiment.run_keys(config)[0], config.num_clients)
  got = experiment.evaluate(config, algo, state, dataset)
  assert len(got['ft_acc_10pct_clients']) == 2 and 'ft_acc_1pct' not in got
  assert got['ft_acc_10pct'] == pytest.approx(np.mean(got['ft_acc_10pct_clients']))


def test_the_raw_pixel_reference_fine_tunes_the_pixels_on_the_models_labelled_images(monkeypatch):
  """With config.finetune the reference row also holds the protocol applied to the identity
  encoder (`finetune.Pixels`): the same labelled subsets, settings and seed as every model, without
  the protocol's augmentation."""
  config = _finetune_config()   # probe 'adam': the row is the fine-tuning alone
  dataset = experiment.load_data(config)
  calls = []
  real = finetune.semi_supervised_finetune

  def recorder(encoder, variables, train_x, train_y, *args, **kw):
    calls.append((encoder, variables, np.asarray(train_x), kw))
    return real(encoder, variables, train_x, train_y, *args, **kw)

  monkeypatch.setattr(finetune, 'semi_supervised_finetune', recorder)
  got = experiment.raw_pixel_metrics(config, dataset)
  assert sorted(got) == ['ft_acc_10pct', 'ft_acc_1pct'] == sorted(experiment.finetune_keys(config))
  for fraction, (encoder, variables, x, kw) in zip((0.01, 0.1), calls):
    assert isinstance(encoder, finetune.Pixels) and variables == {'params': {}}
    np.testing.assert_array_equal(x, dataset.train_x[evaluation.finetune_subset(config, dataset,
                                                                                fraction)])
    assert (kw['lr'], kw['head_lr'], kw['epochs'], kw['seed']) == (1e-3, 0.3, 2, 0)
    assert kw['augment_fn'] is None   # a linear model on pixels: no crops (EVAL-24)
  # The synthetic set's classes differ in their mean image: runs skip the row there.
  assert not experiment.has_raw_pixel_reference(config)
  for changes, has in ((dict(dataset='fashion_mnist_subset'), True),
                       (dict(dataset='fashion_mnist_subset', finetune='none'), False),
                       (dict(dataset='fashion_mnist_subset', finetune='none', probe='logistic'),
                        True)):
    c = experiment.default_config()
    c.update(dict(config.to_dict(), **changes))
    assert experiment.has_raw_pixel_reference(c) == has, changes


def test_evaluate_reports_the_standardised_probe_when_asked():
  """probe_std_epochs > 0 adds 'probe_std_acc': the linear probe on z-scored features."""
  from fedjax_ssl import eval as fs_eval  # pylint: disable=g-import-not-at-top
  from fedjax_ssl.core import round as rd  # pylint: disable=g-import-not-at-top
  from tests.runs import tiny_config  # pylint: disable=g-import-not-at-top
  config = tiny_config(probe_std_epochs=3, probe_epochs=2)
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  algo = experiment.build_algorithm(config, dataset)
  state = rd.init_state(algo, jax.random.PRNGKey(0), config.num_clients)
  got = experiment.evaluate(config, algo, state, dataset, knn=False)
  variables, per_client = algo.eval_variables(state)
  feats = [experiment.encoder_features(algo, variables, per_client, x, dataset)
           for x in (dataset.train_x, dataset.test_x)]
  for key, epochs, standardize in (('probe_acc', 2, False), ('probe_std_acc', 3, True)):
    ref = fs_eval.linear_probe(feats[0], dataset.train_y, feats[1], dataset.test_y,
                               dataset.num_classes, epochs=epochs,
                               batch_size=config.probe_batch_size, lr=config.probe_lr,
                               seed=config.seed, standardize=standardize)
    assert got[key] == ref['test_acc'], key
  assert experiment.evaluate(tiny_config(), algo, state, dataset, knn=False).keys() == {'probe_acc'}
