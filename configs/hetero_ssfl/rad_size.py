r"""Hetero-SSFL Fig. 3 (v001 App. D): linear probe against the RAD size, CIFAR-100 non-IID.

  python -m experiments.reproduce --table configs/hetero_ssfl/rad_size.py --out DIR --scale paper
  python -m experiments.reproduce --table configs/hetero_ssfl/rad_size.py --out DIR   # quick

paper: hetero_common.paper_base('cifar100'), the 3 x ResNet-34 + 2 x ResNet-18 mix, mu = 0.1,
  L in {100, 500, 1000, 3000, 5000}, RAD sub-batches of min(L, 1000) points (the whole RAD when
  it is smaller). The figure has no numbers: the paper says accuracy grows with L, is close to
  standalone for a very small RAD and gains little beyond 3000.
quick: Fashion-MNIST, the small CNN / MLP mix, L in {250, 500, 1000}.
"""
from configs.hetero_ssfl import common as hetero_common
from fedjax_ssl import tables

SIZES = {'paper': (100, 500, 1000, 3000, 5000), 'quick': (250, 500, 1000)}


def get_table(scale: str) -> tables.Table:
  base = hetero_common.paper_base('cifar100') if scale == 'paper' else hetero_common.quick_base()
  mix = hetero_common.PAPER_MIX if scale == 'paper' else hetero_common.QUICK_MIX
  cap = base.hetero_ssfl.rad_batch
  rows = {f'L = {size}': dict(hetero_common.hetero_row(mix, size, base.hetero_ssfl.mu),
                              **{'hetero_ssfl.rad_batch': min(size, cap)})
          for size in SIZES[scale]}
  column = 'CIFAR-100 non-IID 5/5' if scale == 'paper' else 'FMNIST 5 x 2 classes'
  return tables.Table(
      name='hetero_rad_size', title='Hetero-SSFL: linear probe against the RAD size',
      base=base, rows=rows, columns={column: {}}, metrics=('probe_acc', 'knn_acc'), scale=scale,
      notes='Fig. 3 of the paper has no numbers; see the module docstring for its claims.')
