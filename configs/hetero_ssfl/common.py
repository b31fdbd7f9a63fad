"""Settings shared by the Hetero-SSFL tables (Makhija et al., arXiv 2205.12493; docs/notes/
hetero_ssfl.md).

`paper_base(dataset)`: the paper's protocol with the EasyFL defaults it leaves unstated (spec §3):
5 clients, non-IID 'classes' split (2 classes per client for CIFAR-10, 20 for CIFAR-100), all
participating; a RAD of L = 5000 training images carved out before partitioning; the CIFAR ResNets
with the EasyFL 4096/2048 BYOL heads; BYOL (EMA 0.99); SGD lr 0.032 momentum 0.9, weight decay
5e-4, cosine over rounds, optimiser reset every round; E = 5, batch 200, 200 rounds; linear probe
Adam 3e-3, batch 512, 100 epochs on backbone features, client mean for personal models.
Hetero-SSFL: mix 3 x ResNet-34 + 2 x ResNet-18 (A17), mu = 0.1 (v001), 1 - centred linear CKA
against the kernel average over all clients' cached predictor outputs, RAD sub-batches of 1000 per
step (A8). Baselines: ResNet-34 on every client (the paper's homogeneous comparison).

`quick_base()`: the same method on the first 10,000 Fashion-MNIST training images with a 1,000-image
RAD, 5 clients x 2 disjoint classes, a mix of 3 small CNNs and 2 MLPs with 256(BN)-128 heads, 15
rounds of 1 local epoch at batch 64, RAD sub-batches of 250; sized for a 2-core CPU.

`evidence_base()`: a budget where the base SSL method learns on a 2-core CPU. BYOL does not within
hours here (docs/notes/evaluation.md#eval-17: FedBYOL at 50 rounds of 20,000 images is level with
its random init), so this scale runs the alignment over SimCLR (Φ = the projector output; the
paper aligns BYOL's predictor output): the first 20,000 Fashion-MNIST training images with a
1,000-image RAD, 5 clients x 2 disjoint classes, a mix of 3 small CNNs and 2 LeNet-5s (the two
architectures whose SimCLR training beats their random init here: docs/results/fedssl/budget), the
quickstart's SimCLR settings (temperature 0.2, the fedsc crop, SGD 0.1 cosine, batch 128),
EVIDENCE_ROUNDS rounds of 1 local epoch, RAD sub-batches of 250.
"""
from fedjax_ssl import experiment

# dataset -> classes per client in the 5-client non-IID split (spec §3.3).
CLASSES_PER_CLIENT = {'cifar10': 2, 'cifar100': 20}
PAPER_MIX = 'resnet34:3,resnet18:2'
QUICK_MIX = 'small_cnn:3,mlp:2'
EVIDENCE_MIX = 'small_cnn:3,lenet5:2'
EVIDENCE_ROUNDS = 40


def _hetero(mix, method='byol', **overrides):
  return dict({'algorithm': 'hetero_ssfl', 'ssl_method': method, 'hetero_ssfl.mix': mix},
              **overrides)


def rows(mix, rad_size):
  """The paper's methods: baselines on one architecture, Hetero-SSFL on the mix (with its RAD)."""
  return {
      'FedBYOL': dict(algorithm='fedavg', ssl_method='byol'),
      'FedSimSiam': dict(algorithm='fedavg', ssl_method='simsiam'),
      'FedU': dict(algorithm='fedu', ssl_method='byol'),
      'FedEMA': dict(algorithm='fedema', ssl_method='byol'),
      'Hetero-SSFL': _hetero(mix, public_size=rad_size),
      'Supervised FedAvg': dict(algorithm='fedavg', ssl_method='supervised'),
      # All data on one client; it ignores the partition, so the IID and non-IID cells of one
      # dataset share a run.
      'Central-BYOL': dict(algorithm='centralized', ssl_method='byol', num_clients=1,
                           clients_per_round=1, partition='iid'),
  }


def hetero_row(mix, rad_size, mu, method='byol'):
  return _hetero(mix, method, public_size=rad_size, **{'hetero_ssfl.mu': mu})


def paper_base(dataset='cifar10'):
  c = experiment.default_config()
  c.dataset = dataset
  c.num_clients = 5
  c.clients_per_round = 5
  c.partition = 'classes'
  c.classes_per_client = CLASSES_PER_CLIENT[dataset]
  c.encoder = 'resnet34'
  c.heads = 'easyfl'
  c.augmentation = 'byol_easyfl'
  c.byol.ema_tau = 0.99
  c.optimizer = 'sgd'
  c.lr = 0.032
  c.momentum = 0.9
  c.weight_decay = 5e-4
  c.lr_schedule = 'cosine'
  c.reset_optimizer = True
  c.local_epochs = 5
  c.batch_size = 200
  c.rounds = 200
  c.probe = 'adam'               # the paper's probe, to compare with its numbers
  c.probe_epochs = 100
  c.probe_batch_size = 512
  c.probe_lr = 3e-3
  c.eval_every = 20
  c.hetero_ssfl.mu = 0.1
  c.hetero_ssfl.rad_batch = 1000
  return c


def quick_base():
  c = experiment.default_config()
  c.dataset = 'fashion_mnist'
  c.train_size = 10000
  c.num_clients = 5
  c.clients_per_round = 5
  c.partition = 'classes'
  c.classes_per_client = 2
  c.encoder = 'small_cnn'
  c.heads = 'custom'
  c.augmentation = 'fedsc'     # crop scale 0.2-1 (configs/quickstart.py says why)
  c.rounds = 15
  c.local_epochs = 1
  c.batch_size = 64
  c.lr = 0.05
  c.weight_decay = 0.0
  c.byol.ema_tau = 0.96
  c.checkpoint_every = 5
  c.hetero_ssfl.mu = 1.0
  c.hetero_ssfl.rad_batch = 250
  return c


def evidence_base():
  """quick_base at the quickstart's SimCLR budget (the module docstring says why SimCLR); the
  mix and the rows' mu come from the table (configs/hetero_ssfl/mu_sweep.py)."""
  c = quick_base()
  c.simclr.temperature = 0.2
  c.update(dict(train_size=20000, ssl_method='simclr', rounds=EVIDENCE_ROUNDS,
                batch_size=128, lr=0.1, eval_every=10, checkpoint_every=10))
  return c
