"""Federated algorithms: each module is a handful of pure per-client functions (see base.py)."""
