r"""Probe sanity check: a supervised small CNN vs the random-init one, on the shipped real subset.

  python -m experiments.train --config configs/probe_sanity.py --workdir /tmp/probe_sanity

Centralized supervised training (one client holding the 3,000-image stratified Fashion-MNIST subset
of tests/data), then the linear probe (frozen 128-d backbone features, full subset train -> its
1,000 test images) for the trained and the random-init encoders. Expected (docs/notes/
evaluation.md#probe-sanity-check): the trained encoder's probe well above the random-init encoder's.
"""
from fedjax_ssl import experiment


def get_config():
  c = experiment.default_config()
  c.dataset = 'fashion_mnist_subset'
  c.algorithm = 'centralized'
  c.ssl_method = 'supervised'
  c.num_clients = 1
  c.clients_per_round = 1
  c.partition = 'iid'
  c.encoder = 'small_cnn'
  c.augmentation = 'none'
  c.rounds = 10
  c.local_epochs = 1
  c.batch_size = 64
  c.lr = 0.05
  c.lr_schedule = 'constant'
  c.weight_decay = 0.0
  c.probe = 'adam'             # this check is of the Adam probe (the papers')
  c.probe_epochs = 50
  c.knn_k = 50
  c.checkpoint_every = 10
  return c
