"""Settings shared by the representation-sharing tables (Berdoz et al., arXiv:2211.10943;
docs/notes/repshare.md).

`paper_base()`: the paper's protocol (spec §2): supervised classifiers, no augmentation, the first
k training images (1,200 MNIST / 6,000 Fashion-MNIST / 10,000 CIFAR-10) normalised with that
subset's statistics, split IID into N equal random parts, the full 10,000-image test set; Adam
1e-3 (PyTorch defaults) kept per client across rounds, 1 local epoch per round at batch 16 (A2),
every client every round; each client's classifier evaluated on the test set after every round.

Frameworks (rows): CL (one client holding all k images), FL (FedAvg of every parameter and BN
statistic, one global init, per-client persistent Adam, A3/A4), IL (independent inits, nothing
shared), FD (per-class mean logits, Jeong et al., A5) and Ours (repshare: lambda_kd 10,
lambda_disc 1, n_avg 10).
"""
from fedjax_ssl import experiment

# dataset -> (encoder, training images kept, rounds) of Table 1.
TASKS = {
    'mnist': ('lenet5', 1200, 100),
    'fashion_mnist': ('resnet9', 6000, 20),
    'cifar10': ('resnet18_repshare', 10000, 20),
}
LABELS = {'mnist': 'MNIST', 'fashion_mnist': 'Fashion-MNIST', 'cifar10': 'CIFAR10'}
CLIENTS = (2, 5, 10)
FRAMEWORKS = ('CL', 'FL', 'IL', 'FD', 'Ours')

ROWS = {
    'CL': dict(algorithm='centralized', num_clients=1, clients_per_round=1),
    'FL': dict(algorithm='fedavg'),
    'IL': dict(algorithm='independent'),
    'FD': dict(algorithm='fd'),
    'Ours': dict(algorithm='repshare'),
}


def task(dataset, **overrides):
  """Column overrides of one Table 1 task."""
  encoder, train_size, rounds = TASKS[dataset]
  return dict(dict(dataset=dataset, encoder=encoder, train_size=train_size, rounds=rounds),
              **overrides)


def column(dataset, n):
  return task(dataset, num_clients=n, clients_per_round=n)


def paper_base():
  c = experiment.default_config()
  c.dataset = 'fashion_mnist'
  c.encoder, c.train_size, c.rounds = TASKS['fashion_mnist']
  c.subset_stats = True         # normalised with the kept subset's statistics (A13)
  c.ssl_method = 'supervised'
  c.partition = 'iid'
  c.augmentation = 'none'
  c.optimizer = 'adam'
  c.lr = 1e-3
  c.momentum = 0.0
  c.weight_decay = 0.0
  c.lr_schedule = 'constant'
  c.reset_optimizer = False     # persistent per-client Adam (the author code)
  c.independent.independent_init = True  # IL: every client its own init
  c.local_epochs = 1
  c.batch_size = 16
  c.knn_k = 0                   # the metric is the classifier's test accuracy
  c.probe = 'adam'              # with probe_epochs = 0: no probe, the classifier's test accuracy only
  c.probe_epochs = 0
  c.eval_every = 1              # accuracy after every round (Fig. 4)
  c.checkpoint_every = 5
  return c
