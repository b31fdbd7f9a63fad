r"""Quickstart: FedBYOL on real Fashion-MNIST, 10 clients, Dirichlet(0.5), small CNN, 2 CPU cores.

  python -m experiments.train --config configs/quickstart.py --workdir /tmp/quickstart

Data: the Debian `dataset-fashion-mnist` IDX files (60,000 train / 10,000 test) when installed,
otherwise tensorflow-datasets. Expected result (2-core CPU, BUILD_NOTES.md "Quickstart"): the linear
probe on the trained encoder clearly above the probe on the random-init encoder; both are printed at
the end, with a plot of loss and kNN accuracy against rounds in WORKDIR/metrics.png.
"""
from fedjax_ssl import experiment


def get_config():
  c = experiment.default_config()
  c.dataset = 'fashion_mnist'
  c.num_clients = 10
  c.clients_per_round = 10
  c.partition = 'dirichlet'
  c.alpha = 0.5
  c.algorithm = 'fedavg'
  c.ssl_method = 'byol'
  c.encoder = 'small_cnn'
  c.heads = 'custom'          # small BYOL heads for the 128-d small CNN: 128-256(BN)-128
  c.augmentation = 'byol_easyfl'
  c.train_size = 20000        # first 20k training images (CPU budget); the test split stays whole
  c.rounds = 15
  c.local_epochs = 1
  c.batch_size = 64
  c.lr = 0.05
  c.eval_every = 5
  c.probe_epochs = 20
  c.checkpoint_every = 5
  return c
