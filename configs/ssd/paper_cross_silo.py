r"""SSD at the paper's cross-silo setting: CIFAR-10, 10 clients, all 10 every round.

  python -m experiments.plan --config configs/ssd/paper_cross_silo.py     # memory, FLOPs, fit
  python -m experiments.train --config configs/ssd/paper_cross_silo.py --workdir DIR

The Table 1 cell "SSD, C10 Silo" (configs/ssd/table1.py at paper scale) as one training run:
configs/ssd/common.paper_base() (the official code's protocol: ResNet-18, 512-2048(BN)-512
projector, SGD 0.1 constant, batch 128, E = 5, 100 rounds; alignment + uniformity with DSR gamma 1,
alpha 10 on 51 of 512 dimensions per client, PD delta 0.1 at tau 0.5), Dirichlet(0.1), and Table
1's evaluation (Adam linear probe, FT 1 % / 10 %). `--config.dataset=cifar100` gives "C100 Silo";
`--config.ssd.gamma=0 --config.ssd.delta=0` FedAlignUniform.
"""
from configs.ssd import common


def get_config():
  c = common.paper_base('cifar10')
  c.algorithm = 'ssd'
  c.num_clients = 10
  c.clients_per_round = 10
  return c
