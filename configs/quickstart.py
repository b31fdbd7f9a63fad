r"""Quickstart: FedSimCLR on real Fashion-MNIST, 10 clients, Dirichlet(0.5), the small CNN, 2 CPU cores.

  python -m experiments.train --config configs/quickstart.py --workdir /tmp/quickstart

Time: 8.5 min on the quiet 2-core box for a first run (the reference rows included); a second run
of the same config reuses the compiled round and the references from the cache folder.
Expected: the trained encoder above raw pixels on the full-label linear probe and above its random
init on the probe and kNN, at each of seeds 0-2. The numbers, per-seed margins and why these
settings: docs/results/quickstart/table.md (the README's table is generated from the same runs).
Scored by the field's protocol (config.probe = 'logistic').
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
  # SimCLR learns much faster than BYOL on this tiny budget (docs/notes/fedssl.md#is-it-our-byol).
  c.ssl_method = 'simclr'
  c.simclr.temperature = 0.2
  # The small CNN beats raw pixels on the probe within this budget; LeNet-5 (84-d Tanh features)
  # plateaus below them (docs/results/quickstart/lenet5/table.md).
  c.encoder = 'small_cnn'
  c.heads = 'custom'          # projector 256(BN)-128 (SimCLR uses no predictor)
  # The 0.2-1 crop with FedU2's colour jitter (brightness / contrast 0.8): the small CNN's random
  # features are already a strong kNN kernel, and the jitter is what lifts kNN above them at every
  # seed (docs/notes/fedssl.md#fedssl-17).
  c.augmentation = 'fedu2'
  c.train_size = 20000        # first 20k training images (CPU budget); the test split stays whole
  c.rounds = 50
  c.local_epochs = 1
  c.batch_size = 128
  c.lr = 0.1
  c.weight_decay = 0.0
  c.byol.ema_tau = 0.96       # unused by SimCLR; kept for --config.ssl_method=byol
  c.eval_every = 10           # kNN every 10 rounds (the curve in metrics.png; ~5 s each)
  c.checkpoint_every = 10
  return c
