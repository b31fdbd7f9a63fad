"""Test session setup: XLA flags (four virtual CPU devices, fast compile; tests/subprocess_env.py
says why), set before anything imports jax."""
from tests import subprocess_env

subprocess_env.set_session_flags()


def pytest_collection_modifyitems(config, items):
  """Tests marked slow run first (the order is otherwise kept), so that the two xdist workers do not
  end the suite on one long test while the other idles."""
  del config
  items.sort(key=lambda item: item.get_closest_marker('slow') is None)
