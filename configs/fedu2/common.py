"""Settings shared by the FedU2 tables (Liao et al., CVPR 2024; docs/notes/fedu2.md).

`paper_base()`: the official code's protocol on CIFAR (ResNet-18, 512-2048(BN)-512 heads, the code's
augmentation, SGD 0.048 momentum 0.9 weight decay 1e-4 constant, reset every round, batch 128,
E = 5, 100 rounds, linear probe Adam 3e-3 200 epochs, kNN k=200 T=0.1), FUR as the paper's UOT
(lambda_u 0.1, tau 0.8) and EUA as the code's (2 D/|D|, exact min-norm weights, server lr 8).
`quick_base()`: the same methods on the first 10,000 Fashion-MNIST training images with LeNet-5,
sized for a 2-core CPU (about 2.5 min per run).
`evidence_base()`: the FedSSL evidence budget (first 20,000 images, small CNN, 50 rounds), where
FedSimCLR beats its random-init encoder (configs/fedssl/fmnist.py), at FedU2's Dirichlet(0.1).
"""
from fedjax_ssl import experiment


def paper_base(dataset: str = 'cifar10'):
  c = experiment.default_config()
  c.dataset = dataset
  c.encoder = 'resnet18'
  c.heads = 'fedu2'
  c.augmentation = 'fedu2'
  c.partition = 'dirichlet'
  c.alpha = 0.1
  c.num_clients = 10
  c.clients_per_round = 10
  c.rounds = 100
  c.local_epochs = 5
  c.batch_size = 128
  c.optimizer = 'sgd'
  c.lr = 0.048
  c.momentum = 0.9
  c.weight_decay = 1e-4
  c.lr_schedule = 'constant'
  c.simclr.temperature = 0.07
  c.byol.ema_tau = 0.99
  c.probe = 'adam'               # the paper's probe, to compare with its numbers
  c.probe_epochs = 200
  c.eval_every = 10
  return c


def quick_base():
  c = experiment.default_config()
  c.dataset = 'fashion_mnist'
  c.train_size = 10000
  c.encoder = 'lenet5'
  c.heads = 'custom'          # 84-256(BN)-128 projector and 128-256(BN)-128 predictor
  c.augmentation = 'fedsc'    # crop scale 0.2-1 (configs/quickstart.py says why)
  c.partition = 'dirichlet'
  c.alpha = 0.1
  c.num_clients = 10
  c.clients_per_round = 10
  c.rounds = 20
  c.local_epochs = 1
  c.batch_size = 128
  c.lr = 0.1
  c.weight_decay = 0.0
  c.lr_schedule = 'cosine'
  c.simclr.temperature = 0.2
  c.byol.ema_tau = 0.99
  c.eval_every = 5
  c.checkpoint_every = 5
  # The code's fixed server step (lr 8, a move of up to 16 in parameter norm) was sized for
  # ResNet-18; LeNet-5's deviations are 0.1-8 after one epoch, so the quick scale sets the step's
  # norm to the data-weighted mean deviation instead (= FedAvg's move when clients agree).
  c.fedu2.step = 'deviation'
  c.fedu2.server_lr = 1.0
  return c


def evidence_base():
  """quick_base at the FedSSL evidence budget (configs/fedssl/fmnist.py: first 20,000 images, the
  small CNN with 128-256(BN)-128 heads, 50 rounds of 1 local epoch, batch 128, SGD 0.1 cosine, SimCLR
  temperature 0.2, the fedsc crop); FedU2's server step normalised as at the quick scale."""
  c = quick_base()
  c.update(dict(train_size=20000, encoder='small_cnn', rounds=50, eval_every=10,
                checkpoint_every=10))
  return c


# The baselines' own hyper-parameters in the FedU2 code (`src/mains/train_*.py`), used at paper
# scale; the quick scale keeps one budget for every row.
BASELINE_HPARAMS = {
    'byol': {'lr': 0.032, 'weight_decay': 5e-4},       # FedBYOL, FedU, FedEMA, FedDecorr, L-DAWA
    'simsiam': {'lr': 0.032, 'weight_decay': 5e-4},
    'simclr': {'lr': 0.032, 'weight_decay': 1e-4, 'simclr.temperature': 0.07},
}
# Baselines whose code sets its own, whatever the backbone (`src/mains/train_fedx.py`,
# `train_fedorche.py`; Orchestra's own block, config.orchestra, keeps the release's clustering
# settings: 128 global / 16 local clusters, a bank of 128, T 0.1, EMA 0.996).
ALGORITHM_HPARAMS = {'fedx': {'lr': 0.01, 'weight_decay': 1e-5},
                     'orchestra': {'lr': 0.01, 'weight_decay': 5e-4}}


def baseline(scale: str, method: str, algorithm: str = 'fedavg', **extra):
  """Overrides of one baseline row: `algorithm` over `method`, with the code's hyper-parameters of
  that baseline at paper scale."""
  hparams = (ALGORITHM_HPARAMS.get(algorithm, BASELINE_HPARAMS[method]) if scale == 'paper'
             else {})
  return {'algorithm': algorithm, 'ssl_method': method, **hparams, **extra}


def fedu2_rows(method: str):
  """FedU2 over `method` and its two ablations (Table 2's naming: 'FedU2-FUR' = without FUR)."""
  m = {'byol': 'BYOL', 'simclr': 'SimCLR', 'simsiam': 'SimSiam'}[method]
  return {
      f'FedU2-FUR-{m} (no FUR)': {'algorithm': 'fedu2', 'ssl_method': method, 'fedu2.fur': 'none'},
      f'FedU2-EUA-{m} (no EUA)': {'algorithm': 'fedu2', 'ssl_method': method, 'fedu2.eua': False},
      f'FedU2-{m}': {'algorithm': 'fedu2', 'ssl_method': method},
  }
