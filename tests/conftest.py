"""Test session setup.

* Four virtual CPU devices, so the 'shard' strategy runs on a real mesh. XLA reads the flag once,
  when the backend starts, so it is set before anything imports jax.
* One persistent compilation cache for the session, shared by the xdist workers and by the
  binaries the end-to-end tests start (train, reproduce, two-process runs): they compile the same
  programs again and again, which is most of their time. It lives in a fresh directory, removed at
  the end, so a run never reuses another run's programs and the suite's time is what CI sees.
"""
import os
import shutil
import tempfile

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=4').strip()


def pytest_configure(config):
  """The controller (or the only process without xdist) makes the cache directory; the workers and
  subprocesses inherit it through the environment, where jax reads it when first imported."""
  if hasattr(config, 'workerinput') or 'JAX_COMPILATION_CACHE_DIR' in os.environ:
    return
  config.fedjax_ssl_jax_cache = tempfile.mkdtemp(prefix='fedjax_ssl_tests_jax_cache_')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = config.fedjax_ssl_jax_cache


def pytest_unconfigure(config):
  cache = getattr(config, 'fedjax_ssl_jax_cache', None)
  if cache:
    shutil.rmtree(cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
  """Tests marked slow run first (the order is otherwise kept), so that the two xdist workers do not
  end the suite on one long test while the other idles."""
  del config
  items.sort(key=lambda item: item.get_closest_marker('slow') is None)
