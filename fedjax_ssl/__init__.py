"""fedjax_ssl: federated self-supervised learning in JAX/Flax.

  import fedjax_ssl as fs
  config = fs.experiment.default_config()
  dataset = fs.experiment.load_data(config)
  fed_data, info = fs.experiment.build_fed_data(config, dataset)
  algo = fs.experiment.build_algorithm(config, dataset)
  round_step = fs.core.make_round_step(algo, fs.experiment.round_config(config), config.num_clients)
  state = fs.core.init_state(algo, jax.random.PRNGKey(0), config.num_clients)
  for r in range(config.rounds):
    state, metrics = round_step(state, fed_data, fs.core.round_key(root_key, r))

Importing the package changes nothing process-wide. The binaries (experiments/train.py,
benchmark/__main__.py, reproduce.py) tune glibc's malloc first thing with
`fs.core.host_memory.keep_freed_memory()`, so that repeated XLA:CPU executions reuse freed
temporaries (FEDJAX_SSL_MALLOC=system keeps glibc's defaults); a program of your own can call it
likewise, before it runs anything on JAX.
"""
from fedjax_ssl import algorithms, core, data, eval, experiment, models, ssl  # noqa: F401
from fedjax_ssl.core import host_memory  # noqa: F401  (fs.core.host_memory; applies nothing)
