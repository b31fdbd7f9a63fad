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
"""
from fedjax_ssl.core import host_memory as _host_memory

# Before anything allocates: XLA:CPU executions then reuse freed temporaries instead of page-faulting
# fresh ones on every call (core/host_memory.py; FEDJAX_SSL_MALLOC=system keeps glibc's defaults).
_host_memory.keep_freed_memory()

from fedjax_ssl import algorithms, core, data, eval, experiment, models, ssl  # noqa: E402,F401
