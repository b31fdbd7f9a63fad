"""Tests of fedjax_ssl/runs/, one file per module."""


def tiny_config(**overrides):
  """The quickstart config at a size a test trains in seconds (200 images, 2 clients, 1 round)."""
  from configs import quickstart  # pylint: disable=g-import-not-at-top
  config = quickstart.get_config()
  config.update(dict(dataset='fashion_mnist_subset', train_size=200, num_clients=2,
                     clients_per_round=2, partition='iid', batch_size=20, local_epochs=1, rounds=1,
                     checkpoint_every=1, probe='adam', probe_epochs=1, probe_std_epochs=0, eval_every=0,
                     knn_k=10, encoder='mlp', augmentation='flip'))
  config.update(overrides)
  return config
