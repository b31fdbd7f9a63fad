r"""SSD at the paper's cross-device setting: CIFAR-10, 50 clients, 10 a round.

  python -m experiments.plan --config configs/ssd/paper_cross_device.py     # memory, FLOPs, fit
  python -m experiments.train --config configs/ssd/paper_cross_device.py --workdir DIR

The Table 1 cell "SSD, C10 Dev" (configs/ssd/table1.py at paper scale) as one training run:
configs/ssd/common.paper_base() (module docstring of paper_cross_silo.py), Dirichlet(0.1) over 50
clients, 10 sampled a round (the code's join ratio 0.2), alpha 10 on 10 of 512 dimensions per
client, each client keeping its own vector (`ssd.assign = 'client'`; `--config.ssd.assign=slot`
is the code's per-slot assignment, docs/notes/ssd.md). `--config.dataset=cifar100` gives "C100 Dev".
"""
from configs.ssd import common


def get_config():
  c = common.paper_base('cifar10')
  c.algorithm = 'ssd'
  c.num_clients = 50
  c.clients_per_round = 10
  return c
