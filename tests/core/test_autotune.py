"""strategy='auto' by measurement (fedjax_ssl/core/autotune.py) and the compile timer and cache folder
(fedjax_ssl/core/compilation.py): the choice is the fastest measured candidate, kept in
CACHE_DIR/strategy.json and reused without timing; a resumed run keeps its recorded strategy; an
unreadable cache is ignored with a warning; a folder that cannot be written is one error line."""
import json
import logging

import jax
import jax.numpy as jnp
import pytest

from fedjax_ssl import experiment
from fedjax_ssl.core import autotune, compilation, strategies
from fedjax_ssl.core import round as rd


def _tiny_config(**overrides):
  config = experiment.default_config()
  config.update(dict(dataset='synthetic', train_size=64, num_clients=4, clients_per_round=4,
                     partition='iid', batch_size=16, local_epochs=1, rounds=2, encoder='mlp',
                     augmentation='flip', ssl_method='simclr', heads='custom', probe='adam',
                     knn_k=8))
  config.update(overrides)
  return config


@pytest.fixture(scope='module')
def setup():
  config = _tiny_config()
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  fed_data, _ = experiment.build_fed_data(config, dataset)
  algo = experiment.build_algorithm(config, dataset)
  init_key, run_key = experiment.run_keys(config)
  return config, fed_data, algo, lambda: rd.init_state(algo, init_key, config.num_clients), run_key


def test_measures_once_keeps_the_fastest_and_reuses_it(setup, tmp_path, monkeypatch):
  config, fed_data, algo, fresh, run_key = setup
  monkeypatch.setenv(autotune.ENV_VAR, 'map1,vmap')  # a CPU has one candidate: time two
  choice, step = experiment.choose_strategy(config, algo, fed_data, fresh, run_key,
                                            cache_dir=tmp_path)
  assert choice.source == 'measured'
  assert set(choice.seconds) == {'map1', 'vmap'}
  assert choice.label == min(choice.seconds, key=choice.seconds.get)
  assert all(v > 0 for v in choice.compile_seconds.values())
  # The run's step is the winner's, compiled already: it runs a round without compiling again.
  state, key = fresh(), jax.random.PRNGKey(0)
  with compilation.compile_timer() as times:
    state, _ = step(state, fed_data, key)
    jax.block_until_ready(state)
  assert times.total < 0.05 * choice.compile_seconds[choice.label], times.to_json()
  stored = json.loads((tmp_path / autotune.FILE).read_text())
  (entry,) = stored.values()
  assert entry['choice']['strategy'] == choice.strategy
  assert entry['program']['backend'] == 'cpu' and entry['program']['config']['encoder'] == 'mlp'

  # A second run of the program (another seed, another lr) times nothing.
  def no_timing(*args, **kwargs):
    raise AssertionError('measured again')
  monkeypatch.setattr(autotune, 'measure', no_timing)
  again, _ = experiment.choose_strategy(_tiny_config(seed=3, lr=0.5), algo, fed_data, fresh,
                                        run_key, cache_dir=tmp_path)
  assert (again.source, again.strategy, again.map_chunk_size) == (
      'cache', choice.strategy, choice.map_chunk_size)
  # A resumed run keeps what it recorded, whatever the cache says.
  other = 'vmap' if choice.strategy == 'map' else 'map'
  resumed, _ = experiment.choose_strategy(
      config, algo, fed_data, fresh, run_key, cache_dir=tmp_path,
      stored=dict(choice.to_json(), strategy=other))
  assert (resumed.source, resumed.strategy) == ('workdir', other)
  # Another shape is another program.
  with pytest.raises(AssertionError, match='measured again'):
    experiment.choose_strategy(_tiny_config(batch_size=8), algo, fed_data, fresh, run_key,
                               cache_dir=tmp_path)


def test_unreadable_cache_is_ignored_with_a_warning(setup, tmp_path, monkeypatch, caplog):
  config, fed_data, algo, fresh, run_key = setup
  monkeypatch.setenv(autotune.ENV_VAR, 'map1,vmap')
  (tmp_path / autotune.FILE).write_text('{not json')
  with caplog.at_level(logging.WARNING):
    choice, _ = experiment.choose_strategy(config, algo, fed_data, fresh, run_key,
                                           cache_dir=tmp_path)
  assert choice.source == 'measured'
  assert any('cannot be read' in r.getMessage() for r in caplog.records)
  assert len(json.loads((tmp_path / autotune.FILE).read_text())) == 1  # rewritten whole


def test_without_measurement_auto_is_the_static_default(setup, tmp_path, monkeypatch):
  config, fed_data, algo, fresh, run_key = setup
  monkeypatch.setenv(autotune.ENV_VAR, '0')
  choice, _ = experiment.choose_strategy(config, algo, fed_data, fresh, run_key,
                                         cache_dir=tmp_path)
  assert (choice.source, choice.strategy) == ('static', strategies.default_strategy())
  monkeypatch.setenv(autotune.ENV_VAR, 'map1,vmap')
  choice, _ = experiment.choose_strategy(config, algo, fed_data, fresh, run_key, cache_dir=None)
  assert choice.source == 'static'
  monkeypatch.setenv(autotune.ENV_VAR, '1')  # the CPU default: one candidate, nothing to time
  choice, _ = experiment.choose_strategy(config, algo, fed_data, fresh, run_key,
                                         cache_dir=tmp_path)
  assert (choice.source, choice.strategy) == ('static', 'map')
  monkeypatch.setenv(autotune.ENV_VAR, 'vmap')  # one listed candidate: used without timing
  choice, _ = experiment.choose_strategy(config, algo, fed_data, fresh, run_key,
                                         cache_dir=tmp_path)
  assert (choice.source, choice.strategy) == ('static', 'vmap')
  pinned, _ = experiment.choose_strategy(_tiny_config(strategy='vmap'), algo, fed_data, fresh,
                                         run_key, cache_dir=tmp_path)
  assert (pinned.source, pinned.strategy) == ('config', 'vmap')
  assert not (tmp_path / autotune.FILE).exists()


def test_a_failing_candidate_is_recorded_and_skipped():
  def make_step(strategy, chunk):
    def step(state, data, key):
      if strategy == 'vmap':
        raise RuntimeError('RESOURCE_EXHAUSTED: out of memory\nmore')
      return state + 1, {}
    return step
  keys = [jax.random.PRNGKey(i) for i in range(3)]
  choice, steps = autotune.measure(make_step, lambda: jnp.zeros(3), None, keys,
                                   [('map', 1), ('vmap', 1)])
  assert (choice.strategy, choice.source) == ('map', 'measured')
  assert choice.errors == {'vmap': 'RuntimeError: RESOURCE_EXHAUSTED: out of memory'}
  assert set(steps) == {'map1'}
  with pytest.raises(RuntimeError, match='RESOURCE_EXHAUSTED'):
    autotune.measure(make_step, lambda: jnp.zeros(3), None, keys, [('vmap', 1)])


def test_candidates_per_backend_and_from_the_environment(monkeypatch):
  monkeypatch.delenv(autotune.ENV_VAR, raising=False)
  assert autotune.candidates('cpu', 10) == [('map', 1)]
  assert autotune.candidates('gpu', 10) == [('map', 1), ('vmap', 1), ('map', 5)]
  assert autotune.candidates('gpu', 2) == [('map', 1), ('vmap', 1)]
  assert autotune.candidates('gpu', 1) == [('map', 1)]
  monkeypatch.setenv(autotune.ENV_VAR, 'map1, vmap,map4,map4,map20')
  assert autotune.candidates('cpu', 10) == [('map', 1), ('vmap', 1), ('map', 4)]
  monkeypatch.setenv(autotune.ENV_VAR, 'map0')
  with pytest.raises(ValueError, match=r"FEDJAX_SSL_AUTOTUNE = 'map0' is invalid: 'map0' is not"):
    autotune.candidates('cpu', 10)


def test_cache_folder_that_cannot_be_written_is_one_line(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('')
  with pytest.raises(compilation.CacheError) as e:
    compilation.resolve_cache_dir(str(blocker / 'cache'))
  assert str(e.value).startswith(f"cache_dir = '{blocker / 'cache'}' cannot be written (")
  assert '\n' not in str(e.value)
  assert compilation.resolve_cache_dir('') is None
  assert compilation.resolve_cache_dir('none') is None
  path = compilation.resolve_cache_dir(str(tmp_path / 'c'))
  assert path == tmp_path / 'c' and (path / 'xla').is_dir() and not list(path.glob('.write*'))


def test_default_cache_folder_follows_the_environment(monkeypatch, tmp_path):
  monkeypatch.delenv(compilation.ENV_VAR, raising=False)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  assert compilation.default_cache_dir() == str(tmp_path / 'fedjax_ssl')
  monkeypatch.setenv(compilation.ENV_VAR, '')
  assert compilation.default_cache_dir() == ''


def test_compile_timer_counts_compiles_not_runs():
  f = jax.jit(lambda x: jnp.sin(x) @ x.T + 3.0)
  x = jnp.ones((32, 32))
  with compilation.compile_timer() as first:
    f(x).block_until_ready()
  with compilation.compile_timer() as second:  # cached in the process: no compile
    f(x).block_until_ready()
  assert first.total > 0 and first.seconds['xla'] > 0 and first.total <= first.wall
  assert second.total == 0.0
