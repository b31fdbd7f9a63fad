"""Test session setup: four virtual CPU devices so the 'shard' strategy runs on a real mesh.

XLA reads the flag once, when the backend starts, so it is set before anything imports jax.
"""
import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=4').strip()


def pytest_collection_modifyitems(config, items):
  """Tests marked slow run first (the order is otherwise kept), so that the two xdist workers do not
  end the suite on one long test while the other idles."""
  del config
  items.sort(key=lambda item: item.get_closest_marker('slow') is None)
