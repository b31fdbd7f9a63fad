r"""Hetero-SSFL Table 3: CIFAR-100 non-IID at 5, 20 and 100 clients (5, 5 and 10 per round).

  python -m experiments.reproduce --table configs/hetero_ssfl/table3.py --out DIR --scale paper
  python -m experiments.reproduce --table configs/hetero_ssfl/table3.py --out DIR   # quick

paper: hetero_common.paper_base('cifar100'). 5 clients: 20 disjoint classes each; 20 clients: 5
  disjoint classes each; 100 clients: 5 classes each with every class split over the 5 clients
  holding it (the shard split, A18). Hetero-SSFL mixes ResNet-34 and ResNet-18 half and half,
  assigned by a seeded shuffle at 20 and 100 clients (the paper draws each client's architecture at
  random), 3 + 2 in order at 5 clients. Non-participants keep their stale RAD representations in
  K̄ (Algorithm 1).
quick: Fashion-MNIST (first 10,000 images), 5 / 20 clients with 2 / 1 classes (1 / 5 of them per
  round), the small CNN / MLP mix; no paper number applies.
"""
from configs.hetero_ssfl import common as hetero_common
from fedjax_ssl import tables

METHODS = ('FedU', 'FedEMA', 'Hetero-SSFL', 'Supervised FedAvg')
PAPER = {  # v001 (Hetero-SSFL 5 clients: 67.7 in v000 with mu = 0.5)
    '5 clients (5)': (58.9, 61.8, 66.1, 65.6),
    '20 clients (5)': (48.29, 52.5, 57.5, 60.68),
    '100 clients (10)': (41.1, 42.0, 43.3, 55.5),
}


def _column(clients, per_round, classes, mix_encoders):
  a, b = mix_encoders
  mix = (f'{a}:{clients - clients // 2},{b}:{clients // 2}')
  return {'num_clients': clients, 'clients_per_round': per_round, 'classes_per_client': classes,
          'hetero_ssfl.mix': mix, 'hetero_ssfl.assignment': 'ordered' if clients == 5 else 'shuffled'}


def get_table(scale: str) -> tables.Table:
  all_rows = hetero_common.rows(hetero_common.PAPER_MIX if scale == 'paper'
                                else hetero_common.QUICK_MIX, 5000 if scale == 'paper' else 1000)
  rows = {k: all_rows[k] for k in METHODS}
  # Hetero-SSFL takes each column's mix (half and half of the column's client count).
  rows['Hetero-SSFL'] = {k: v for k, v in rows['Hetero-SSFL'].items() if k != 'hetero_ssfl.mix'}
  if scale == 'paper':
    base = hetero_common.paper_base('cifar100')
    encoders = ('resnet34', 'resnet18')
    columns = {'5 clients (5)': _column(5, 5, 20, encoders),
               '20 clients (5)': _column(20, 5, 5, encoders),
               '100 clients (10)': _column(100, 10, 5, encoders)}
    paper = {(row, col, 'probe_acc'): v for col, vals in PAPER.items()
             for row, v in zip(METHODS, vals)}
  else:
    base = hetero_common.quick_base()
    encoders = ('small_cnn', 'mlp')
    columns = {'5 clients (5)': _column(5, 5, 2, encoders),
               '20 clients (5)': _column(20, 5, 1, encoders)}
    paper = {}
  # The mix only applies to Hetero-SSFL: the baselines run one architecture.
  overrides = {(row, col): {'hetero_ssfl.mix': '', 'hetero_ssfl.assignment': 'ordered'}
               for row in rows if row != 'Hetero-SSFL' for col in columns}
  return tables.Table(
      name='hetero_table3', title='Hetero-SSFL Table 3: scale and partial participation (CIFAR-100)',
      base=base, rows=rows, columns=columns, metrics=('probe_acc', 'knn_acc'), paper=paper,
      scale=scale, cell_overrides=overrides,
      notes=('Linear probe as in Table 1. Partial participation samples the round\'s clients '
             'uniformly over all clients; each architecture trains its own participants.'))
