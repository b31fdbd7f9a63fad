r"""Hetero-SSFL Tables 1 and 2: linear probe of every method, non-IID and IID, 5 clients.

  python -m experiments.reproduce --table configs/hetero_ssfl/table1.py --out DIR --scale paper
  python -m experiments.reproduce --table configs/hetero_ssfl/table1.py --out DIR   # quick

paper: configs/hetero_ssfl/common.paper_base per dataset. Non-IID = 2 (CIFAR-10) / 20 (CIFAR-100)
  disjoint classes per client (Table 1); IID = an equal random split (Table 2, which reports no
  supervised FedAvg or Central-BYOL). Baselines use ResNet-34 on every client; Hetero-SSFL the mix
  3 x ResNet-34 + 2 x ResNet-18 with its 5,000-image RAD and mu = 0.1 (v001; v000's 0.5 gives
  CIFAR-100 67.7 instead of 66.1). Baselines are evaluated through their global model, Hetero-SSFL
  as the mean of its 5 personal models. Central-BYOL: one client, 200 rounds of 5 epochs (a
  compute-matched 1000 epochs; the paper states no budget, A24).
  Tiny-ImageNet (Table 1's third column) is not a dataset of this library (no tfds catalog entry
  with the paper's 64x64 split); its paper numbers are in the notes.
quick: Fashion-MNIST (first 10,000 images), 5 clients, small CNN baselines and a 3 small CNN + 2
  MLP mix for Hetero-SSFL, 15 rounds; no paper number applies.
"""
from configs.hetero_ssfl import common as hetero_common
from fedjax_ssl import tables

METHODS = ('FedBYOL', 'FedSimSiam', 'FedU', 'FedEMA', 'Hetero-SSFL', 'Supervised FedAvg',
           'Central-BYOL')
# Table 1 (non-IID; v001 Hetero-SSFL CIFAR-100) and Table 2 (IID), linear probe %.
PAPER = {
    'CIFAR-10 non-IID': (78.1, 76.7, 79.6, 81.2, 90.29, 68.5, 94.3),
    'CIFAR-100 non-IID': (58.1, 53.2, 58.9, 61.8, 66.1, 44.29, 74.2),
    'CIFAR-10 IID': (82.24, 80.4, 81.6, 85.9, 88.5, None, None),
    'CIFAR-100 IID': (23.8, 22.19, 20.4, 25.7, 34.8, None, None),
}
TINY_IMAGENET = dict(zip(METHODS, (31.8, 29.1, 58.23, 58.2, 61.5, 27.2, 78.7)))


def get_table(scale: str) -> tables.Table:
  if scale == 'paper':
    base = hetero_common.paper_base('cifar10')
    columns = {f'{name.upper().replace("CIFAR", "CIFAR-")} {split}': dict(
        dataset=name, classes_per_client=hetero_common.CLASSES_PER_CLIENT[name],
        partition='classes' if split == 'non-IID' else 'iid')
               for split in ('non-IID', 'IID') for name in ('cifar10', 'cifar100')}
    rows = hetero_common.rows(hetero_common.PAPER_MIX, 5000)
    paper = {(row, col, 'probe_acc'): v for col, vals in PAPER.items()
             for row, v in zip(METHODS, vals) if v is not None}
    skip = frozenset((row, col) for col, vals in PAPER.items()
                     for row, v in zip(METHODS, vals) if v is None)
  else:
    base = hetero_common.quick_base()
    columns = {'FMNIST non-IID': dict(partition='classes'), 'FMNIST IID': dict(partition='iid')}
    rows, paper, skip = hetero_common.rows(hetero_common.QUICK_MIX, 1000), {}, frozenset()
  return tables.Table(
      name='hetero_table1', title='Hetero-SSFL Tables 1-2: linear probe, non-IID and IID, 5 clients',
      base=base, rows=rows, columns=columns, metrics=('probe_acc', 'knn_acc'), paper=paper,
      scale=scale, skip=skip,
      notes=('Linear probe: Adam 3e-3, batch 512, 100 epochs (quick: 30) on frozen backbone '
             'features, full train -> full test. Not run: Tiny-ImageNet (paper: ' +
             '; '.join(f'{k} {v}' for k, v in TINY_IMAGENET.items()) + ').'))
