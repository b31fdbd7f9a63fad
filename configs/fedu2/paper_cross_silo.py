r"""FedU2-BYOL at the paper's cross-silo setting: CIFAR-10, 10 clients, all 10 every round.

  python -m experiments.plan --config configs/fedu2/paper_cross_silo.py     # memory, FLOPs, fit
  python -m experiments.train --config configs/fedu2/paper_cross_silo.py --workdir DIR

The Table 1 cell "FedU2-BYOL, C10 Silo" (configs/fedu2/table1.py at paper scale; Table 2's
alpha = 0.1 column trains the same model) as one training run: configs/fedu2/common.paper_base()
(ResNet-18, 512-2048(BN)-512 heads, SGD 0.048, batch 128, E = 5, 100 rounds, FUR as the paper's
UOT, EUA as the code's), Dirichlet(0.1) over 10 clients, full participation, and Table 1's
evaluation (Adam linear probe, FT 1 % / 10 %). `--config.dataset=cifar100` gives "C100 Silo".

On one 80 GB GPU (experiments.plan on the 2-core CPU box, target GPU; XLA:CPU's temporaries
approximate the GPU program's; docs/notes/performance.md#perf-34) the GPU default fits, so nothing
is changed: strategy 'vmap' trains the 10 participants side by side, stored states on the device:

  memory per device   21.80 GiB (inputs 1.89 GiB: 10 stored states of 168 MiB and the data;
                      outputs 1.75 GiB, aliased to the donated inputs; temporaries 19.91 GiB)
                      <= 60 GiB usable (80 GiB x JAX's default 0.75): fits
  FLOPs               1.00 TFLOP per local step (B = 128), 1,935 real steps per round,
                      1.94 PFLOP per round, 194 PFLOP in 100 rounds: about 3.0 h at 18 TFLOP/s,
                      1.7 h at the 31.8 TFLOP/s XLA counts in the measured H100 round (PERF-32)
                      (estimates, not measurements)
"""
from configs.fedu2 import common


def get_config():
  c = common.paper_base('cifar10')
  c.algorithm = 'fedu2'
  c.ssl_method = 'byol'
  c.num_clients = 10
  c.clients_per_round = 10
  c.finetune = 'fedu2'          # Table 1's FT 1 % / 10 % columns
  return c
