"""The benchmark (`python -m experiments.benchmark`, __main__.py): one frozen `settings.Settings`
value, built from the flags, that the setting modules' functions take — `round_speed` (byol,
cross_device), `scale` and `layers` (conv_layers). Nothing here imports JAX, so that __main__ sets
up host memory before anything runs on it. docs/notes/harness.md#benchmark.
"""
