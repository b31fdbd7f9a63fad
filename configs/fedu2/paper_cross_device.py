r"""FedU2-BYOL at the paper's cross-device setting: CIFAR-10, 100 clients, all 100 every round.

  python -m experiments.plan --config configs/fedu2/paper_cross_device.py     # memory, FLOPs, fit
  python -m experiments.train --config configs/fedu2/paper_cross_device.py --workdir DIR

The Table 1 cell "FedU2-BYOL, C10 Dev" (configs/fedu2/table1.py at paper scale) as one training
run: configs/fedu2/common.paper_base() (ResNet-18, 512-2048(BN)-512 heads, SGD 0.048, batch 128,
E = 5, 100 rounds, FUR as the paper's UOT, EUA as the code's), Dirichlet(0.1) over 100 clients,
full participation (the paper's Algorithm 1 and the code's join ratio 1.0; spec A9), and Table 1's
evaluation (Adam linear probe, FT 1 % / 10 %). `--config.dataset=cifar100` gives "C100 Dev";
`--config.clients_per_round=10` the 10-per-round benchmark of issue 29.

What makes it fit one 80 GB GPU (experiments.plan on the 2-core CPU box, target GPU; XLA:CPU's
temporaries approximate the GPU program's; docs/notes/performance.md#perf-34): the GPU default,
strategy 'vmap', trains the 100 participants side by side and does not fit (XLA asked for 172 GiB
on the H100, PERF-33), so they run one after another inside the round (strategy 'map', chunk 1),
with the stored states on the device and donated:

  memory per device   45.70 GiB (inputs 16.66 GiB: 100 stored states of 168 MiB and the data;
                      outputs 16.52 GiB, all aliased to the donated inputs; temporaries 29.04 GiB)
                      <= 60 GiB usable (80 GiB x JAX's default 0.75): fits
  FLOPs               1.00 TFLOP per local step (B = 128), 1,830 real steps per round,
                      1.83 PFLOP per round, 183 PFLOP in 100 rounds: about 2.8 h at 18 TFLOP/s
                      (an estimate, not a measurement)

Measured on an H100 80GB at E = 1 (docs/notes/performance.md#perf-44; `--measure_rounds 1
--config.local_epochs=1`): 42.31 GiB peak in use (the GPU compile planned 42.28 GiB), one round of
366 steps in 5.63 s (65 TFLOP/s), so at E = 5 about 28 s a round and 47 min for the 100 rounds of
training (extrapolated from one timed round).

Chunks of more participants cost about 1.1 GB each (chunk 10: +10 GB); client_state='host' fits
too but costs more (54.65 GiB at chunk 1: the stored states copied in are on the device whether or
not the round reads them, and FedU2's begin overwrites them). 10 per round: 21.32 GiB, 0.18 PFLOP
per round.
"""
from configs.fedu2 import common


def get_config():
  c = common.paper_base('cifar10')
  c.algorithm = 'fedu2'
  c.ssl_method = 'byol'
  c.num_clients = 100
  c.clients_per_round = 100
  c.finetune = 'fedu2'          # Table 1's FT 1 % / 10 % columns
  c.strategy = 'map'            # one participant at a time: what fits (docstring)
  c.map_chunk_size = 1
  return c
