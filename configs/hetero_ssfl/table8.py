r"""Hetero-SSFL Table 8 (v001 App. F): small CNN / MLP clients next to ResNets, CIFAR-100 non-IID.

  python -m experiments.reproduce --table configs/hetero_ssfl/table8.py --out DIR --scale paper
  python -m experiments.reproduce --table configs/hetero_ssfl/table8.py --out DIR   # quick

paper: hetero_common.paper_base('cifar100'), 5 clients. "20 % small": 1 FedHeNN CNN + 2 ResNet-18
  + 2 ResNet-34; "40 % small": 1 CNN + 1 MLP + 1 ResNet-18 + 2 ResNet-34 (A26; the paper does not
  say which small model a 20 % mix uses); "Standalone": the 40 % mix with mu = 0. The paper reports
  the mean over the small clients and over the ResNet clients; this table reports each
  architecture's mean (the paper's group means are in the notes).
quick: Fashion-MNIST, the MLP as the small model next to small CNNs: "20 % small" 1 MLP + 4 CNN,
  "40 % small" 2 MLP + 3 CNN, standalone = the 40 % mix with mu = 0.
"""
from configs.hetero_ssfl import common as hetero_common
from fedjax_ssl import tables

PAPER_GROUPS = {'20 % small': (39.4, 64.2), '40 % small': (37.5, 63.7),
                'Standalone': (28.8, 55.3)}
MIXES = {
    'paper': {'20 % small': 'hetero_cnn:1,resnet18:2,resnet34:2',
              '40 % small': 'hetero_cnn:1,mlp:1,resnet18:1,resnet34:2'},
    'quick': {'20 % small': 'mlp:1,small_cnn:4', '40 % small': 'mlp:2,small_cnn:3'},
}
ENCODERS = {'paper': ('hetero_cnn', 'mlp', 'resnet18', 'resnet34'), 'quick': ('mlp', 'small_cnn')}


def get_table(scale: str) -> tables.Table:
  mixes = MIXES[scale]
  rad = 5000 if scale == 'paper' else 1000
  base = hetero_common.paper_base('cifar100') if scale == 'paper' else hetero_common.quick_base()
  rows = {name: hetero_common.hetero_row(mix, rad, base.hetero_ssfl.mu)
          for name, mix in mixes.items()}
  rows['Standalone'] = hetero_common.hetero_row(mixes['40 % small'], rad, 0.0)
  column = 'CIFAR-100 non-IID 5/5' if scale == 'paper' else 'FMNIST 5 x 2 classes'
  metrics = ('probe_acc',) + tuple(f'probe_acc_{e}' for e in ENCODERS[scale])
  return tables.Table(
      name='hetero_table8', title='Hetero-SSFL Table 8: small and ResNet clients in one federation',
      base=base, rows=rows, columns={column: {}}, metrics=metrics, scale=scale,
      notes=('Paper (mean over small clients, mean over ResNet clients): ' +
             '; '.join(f'{k} {s} / {r}' for k, (s, r) in PAPER_GROUPS.items()) + '.'))
