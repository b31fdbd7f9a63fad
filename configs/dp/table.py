r"""User-level DP-FedAvg on FedSimCLR (issue 69): epsilon = 1, 4, 8 and no DP, Fashion-MNIST.

  python -m experiments.reproduce --table configs/dp/table.py --out docs/results/dp/fmnist_quick

draft
"""
from fedjax_ssl import experiment, reproduce

SCALES = ('quick',)
DELTA = 1e-5
CLIP_NORM = 1.0
EPSILONS = (8, 4, 1)


def base_config():
  c = experiment.default_config()
  c.dataset = 'fashion_mnist'
  c.algorithm = 'fedavg'
  c.ssl_method = 'simclr'
  c.simclr.temperature = 0.2
  c.encoder = 'small_cnn'
  c.heads = 'custom'
  c.head_bn = False
  c.augmentation = 'fedu2'
  c.train_size = 20000
  c.num_clients = 500
  c.clients_per_round = 50
  c.partition = 'dirichlet'
  c.alpha = 0.5
  c.rounds = 100
  c.local_epochs = 1
  c.batch_size = 16
  c.lr = 0.1
  c.weight_decay = 0.0
  c.eval_every = 25
  c.checkpoint_every = 25
  return c


def get_table(scale: str) -> reproduce.Table:
  rows = {'FedSimCLR (no DP)': {}}
  for e in EPSILONS:
    rows[f'FedSimCLR eps={e}'] = {'dp.enabled': True, 'dp.clip_norm': CLIP_NORM,
                                  'dp.delta': DELTA, 'dp.target_epsilon': float(e)}
  return reproduce.Table(name='dp_fedsimclr', title='draft', base=base_config(), rows=rows,
                         columns={'cross-device 500/50': {}},
                         metrics=('probe_acc', 'knn_acc'), scale=scale)
