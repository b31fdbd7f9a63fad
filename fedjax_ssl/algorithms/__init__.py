"""Federated algorithms, one module each, and their registry.

Each module is a handful of pure per-client functions (the contract: `fedjax_ssl.core.algorithm`),
its config block, its validation and `build(config, info)`, and registers itself on import:

  fedjax_ssl.algorithms.names()          # every registered algorithm
  fedjax_ssl.algorithms.register(name, build, defaults=..., validate=..., methods=...)

A researcher's own algorithm registers the same way from their own file
(`configs/examples/custom_algorithm.py`).
"""
# Importing a module registers it; the order is the order of `names()`.
from fedjax_ssl.algorithms import fedavg, fedu, fedema, fedu2, fedsc, hetero_ssfl  # noqa: F401
from fedjax_ssl.algorithms import repshare, fd, independent, feddecorr, ldawa, fedx  # noqa: F401
from fedjax_ssl.algorithms import fedca  # noqa: F401
from fedjax_ssl.algorithms import orchestra  # noqa: F401
from fedjax_ssl.algorithms import ssd  # noqa: F401
from fedjax_ssl.algorithms.registry import Plan, get, names, register  # noqa: F401
