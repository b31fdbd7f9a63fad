"""fedjax_ssl.runs.shared_references: the raw-pixel row shared by runs that read the same pixels, the
random-init evaluation shared through the cache folder, the references of a config without
training, and a finished run's missing raw-pixel row."""
import dataclasses
import json

import numpy as np
import pytest

from fedjax_ssl import experiment
from fedjax_ssl.runs import shared_references
from fedjax_ssl.runs.run_dir import RunDir
from tests.runs import tiny_config


def test_the_raw_pixel_reference_is_shared_by_runs_that_read_the_same_pixels(tmp_path,
                                                                              monkeypatch):
  config = experiment.default_config()
  config.update(dict(dataset='fashion_mnist_subset', train_size=300, probe='logistic',
                     label_fractions=(1.0, 0.1), label_draws=1, knn_k=20, knn_k_small=5))
  dataset = experiment.load_data(config)
  calls = []

  def evaluate(c, d):
    calls.append(c.seed)
    return {'probe_acc': 0.5 + c.seed, 'knn_acc': 0.25}
  monkeypatch.setattr(experiment, 'raw_pixel_metrics', evaluate)
  shared = tmp_path / 'references'

  def reference(c, name, reuse=True):
    (tmp_path / name).mkdir(exist_ok=True)
    return shared_references.raw_pixel_reference(c, experiment.load_data(c), RunDir(tmp_path / name),
                                     reuse=reuse,
                                     shared_dir=shared)

  first, took = reference(config, 'a')
  assert calls == [0] and took.endswith('s)') and len(list(shared.iterdir())) == 1
  # Another row at the same seed (another method, another encoder): the shared file, no compute.
  other = experiment.default_config()
  other.update(config.to_dict())
  other.update(dict(ssl_method='byol', encoder='mlp', rounds=7))
  got, took = reference(other, 'b')
  assert calls == [0] and got == first and 'references' in took
  assert json.loads((tmp_path / 'b' / 'raw_pixels.json').read_text()) == first
  # What the metrics read differs: the seed (the label draws), a label fraction, the pixels.
  for change in (dict(seed=1), dict(label_fractions=(1.0, 0.2)), dict(train_size=200)):
    c = experiment.default_config()
    c.update(config.to_dict())
    c.update(change)
    reference(c, 'c', reuse=False)
  assert calls == [0, 1, 0, 0] and len(list(shared.iterdir())) == 4
  key = experiment.raw_pixel_key
  assert key(config, dataset) == key(other, experiment.load_data(other))
  flipped = dataclasses.replace(dataset, test_x=np.ascontiguousarray(dataset.test_x[::-1]))
  assert key(config, dataset) != key(config, flipped)
  # Fine-tuning's settings are read (and keyed) only when the row fine-tunes: without it a run
  # keeps the key it always had, whatever finetune_epochs says.
  variant = lambda **kw: dict(config.to_dict(), **kw)
  keys = {}
  for name, values in (('plain', {}), ('epochs', variant(finetune_epochs=3)),
                       ('fedu2', variant(finetune='fedu2')),
                       ('fedu2_3', variant(finetune='fedu2', finetune_epochs=3))):
    c = experiment.default_config()
    c.update(config.to_dict())
    c.update(values)
    keys[name] = key(c, dataset)
  assert keys['plain'] == keys['epochs'] and len({keys['plain'], keys['fedu2'],
                                                  keys['fedu2_3']}) == 3
  # The run's own file wins while its config is unchanged (a resume).
  (tmp_path / 'a' / 'raw_pixels.json').write_text(json.dumps({'probe_acc': 0.9}))
  assert reference(config, 'a')[0] == {'probe_acc': 0.9}
  # No run directory (`reference_evaluations`): the shared file, nothing written besides it.
  got, took = shared_references.raw_pixel_reference(config, dataset, None, reuse=True, shared_dir=shared)
  assert got == first and 'references' in took and calls == [0, 1, 0, 0]
  assert len(list(shared.iterdir())) == 4


def test_a_finished_run_gets_the_raw_pixel_reference_it_lacks_and_nothing_else(tmp_path,
                                                                                monkeypatch):
  """`add_raw_pixel_reference` (reproduce --recompute_references): a fine-tuning run that finished
  before the fine-tuning metrics had a raw-pixel row gets it; its results are otherwise kept."""
  config = experiment.default_config()
  config.update(dict(dataset='fashion_mnist_subset', train_size=300, probe='adam',
                     finetune='hetero_ssfl', finetune_fractions=(0.1,)))
  calls = []

  def evaluate(c, d):
    calls.append(len(d.train_x))
    return {'ft_acc_10pct': 0.375}
  monkeypatch.setattr(experiment, 'raw_pixel_metrics', evaluate)
  rundir = RunDir(tmp_path / 'run')
  rundir.path.mkdir()
  with pytest.raises(ValueError, match='holds no results.json: only a finished run'):
    shared_references.add_raw_pixel_reference(config, rundir)
  results = {'status': 'completed', 'final': {'ft_acc_10pct': 0.5}, 'random_init': {}}
  rundir.write_results(results)
  assert shared_references.add_raw_pixel_reference(config, rundir, str(tmp_path / 'refs')) == {
      'ft_acc_10pct': 0.375}
  assert rundir.read_results() == dict(results, raw_pixels={'ft_acc_10pct': 0.375})
  assert rundir.read_json(rundir.raw_pixels_file) == {'ft_acc_10pct': 0.375} and calls == [300]
  # Complete now: nothing evaluated, nothing written; nor for a run that records no such row.
  assert shared_references.add_raw_pixel_reference(config, rundir) is None and calls == [300]
  config.finetune = 'none'
  assert shared_references.add_raw_pixel_reference(config, rundir) is None and calls == [300]


def test_runs_share_the_random_init_evaluation_and_skip_raw_pixels_on_synthetic(tmp_path, capfd):
  """Through the cache folder's references/: a second run of the same initialisation on the same
  data (another workdir, another number of rounds) reads the first one's random-init evaluation;
  on the synthetic set the raw-pixel row is skipped in one line."""
  from fedjax_ssl.runs import training as train  # pylint: disable=g-import-not-at-top
  config = tiny_config(dataset='synthetic', train_size=120, probe='logistic',
                       label_fractions=(1.0,), label_draws=1, knn_k=10, knn_k_small=0)
  cache = tmp_path / 'cache'
  first = train.train_and_evaluate(config, str(tmp_path / 'a'), cache_dir=cache)
  out = capfd.readouterr().out
  assert 'raw pixels (reference): skipped on the synthetic set' in out
  assert 'raw_pixels' not in first and not (tmp_path / 'a' / 'raw_pixels.json').exists()
  (shared,) = (cache / 'references').iterdir()
  assert shared.name.startswith('random_init-')
  config.rounds = config.rounds + 1
  second = train.train_and_evaluate(config, str(tmp_path / 'b'), cache_dir=cache)
  capfd.readouterr()
  assert second['random_init'] == first['random_init']
  assert f'(from {shared})' in (tmp_path / 'b' / 'train.log').read_text()


def test_reference_evaluations_are_what_a_run_records_at_round_0(tmp_path):
  from fedjax_ssl.runs import training as train
  config = experiment.default_config()
  config.update(dict(dataset='fashion_mnist_subset', train_size=300, num_clients=3,
                     clients_per_round=3, partition='iid', batch_size=25, local_epochs=1,
                     rounds=1, encoder='mlp', augmentation='flip', heads='custom',
                     proj_hidden=16, proj_out=8, pred_hidden=16, pred_out=8, probe='adam',
                     probe_epochs=2, probe_std_epochs=0, knn_k=20, eval_every=0,
                     checkpoint_every=1))
  train.train_and_evaluate(config, str(tmp_path / 'run'), verbose=False)
  memo = {}
  random_init, raw_pixels = shared_references.reference_evaluations(config, None, memo)
  # The same config, seed and code: the run's round-0 file, to the last bit. (No raw-pixel row:
  # that is the logistic protocol's, `raw_pixel_reference`, tested above with workdir None too.)
  assert random_init == json.loads((tmp_path / 'run' / 'random_init.json').read_text())
  assert raw_pixels is None and len(memo) == 1
  # BYOL's, and FedU's, encoder starts from SimCLR's initialisation at one seed (the heads, not
  # evaluated, differ): the same evaluated variables, one evaluation for the three.
  for change in (dict(ssl_method='byol'), dict(algorithm='fedu', ssl_method='byol')):
    other = experiment.default_config()
    other.update(config.to_dict())
    other.update(change)
    assert shared_references.reference_evaluations(other, None, memo)[0] == random_init
  assert len(memo) == 1
  # Another seed initialises other weights: its own evaluation.
  config.seed = 1
  assert shared_references.reference_evaluations(config, None, memo)[0] != random_init
  assert len(memo) == 2
