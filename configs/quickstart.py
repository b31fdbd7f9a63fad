r"""Quickstart: FedSimCLR on real Fashion-MNIST, 10 clients, Dirichlet(0.5), LeNet-5, 2 CPU cores.

  python -m experiments.train --config configs/quickstart.py --workdir /tmp/quickstart

Data: the Debian `dataset-fashion-mnist` IDX files (first 20,000 of 60,000 train / all 10,000 test)
when installed, otherwise tensorflow-datasets. Scored by the field's protocol (config.probe =
'logistic', fedjax_ssl/eval/protocol.py): L-BFGS logistic probe on standardised frozen features at
100 % and 1 % of the labels (1 %: 200 images, 3 stratified draws), weighted cosine kNN with k = 200
and 20, for the trained encoder, the random-init encoder and raw pixels (per-pixel standardised),
printed at the end and stored in WORKDIR/results.json. Time: 7.5 min on the quiet 2-core box (15-25
min with its cores shared with other jobs); runs are deterministic per seed.

Expected (seeds 0, 1, 2; mean ± std over seeds, percent; measured 2026-11-25 from this file):

  metric               trained        random init    raw pixels     trained − random  − pixels
  probe                81.91 ± 0.91   79.99 ± 0.63   83.85 ± 0.33   +1.92             −1.94
  probe, 1 % labels    68.36 ± 2.70   61.13 ± 5.29   72.01 ± 1.19   +7.23             −3.65
  kNN (k = 200)        74.92 ± 0.91   65.35 ± 1.32   80.69          +9.57             −5.77
  kNN, 1 %, k = 200    64.64 ± 1.02   30.05 ± 2.81   70.76 ± 0.26   +34.58            −6.13
  kNN, 1 %, k = 20     65.91 ± 0.89   43.53 ± 1.81   70.82 ± 0.27   +22.37            −4.92

So in ten minutes the encoder clearly learns (kNN +9.6 points over its random init on every seed)
but it is not yet a better representation than the pixels themselves: the probe gains +1.9 (seed
range +1.3 to +2.5), and 1 %-label kNN trails standardised pixels by 5-6 points. What closing that
gap takes is measured in docs/results/fedssl/budget/table.md: the small CNN beats raw pixels on the
full-label probe (85.3-85.7 vs 84.1) and, at 100 rounds, on 1 %-label kNN by under a point (71.3 vs
70.5); its kNN stops rising after 50 rounds, a wider small CNN does worse (its random init is a
stronger kernel; docs/notes/evaluation.md#eval-19), and neither a stronger jitter nor all 60,000
images reaches the kNN margins (the references rise with the data; docs/notes/evaluation.md#eval-20).
WORKDIR/metrics.png plots loss, kNN and the probe against rounds (round 0 = random init).

Why LeNet-5: its 84-d Tanh feature layer after global average pooling gives weak random features,
so learning shows; the small CNN's flattened map is already a strong random kernel (kNN 75.5 at
init). The fedsc crop (scale 0.2-1) matters: EasyFL's 0.08-1 crops of 28x28 images threw the object
away (docs/notes/fedssl.md#quickstart); a milder 0.64-1 crop makes the SimCLR task too easy.
"""
from fedjax_ssl import experiment


def get_config():
  c = experiment.default_config()
  c.dataset = 'fashion_mnist'
  c.num_clients = 10
  c.clients_per_round = 10
  c.partition = 'dirichlet'
  c.alpha = 0.5
  c.algorithm = 'fedavg'
  # SimCLR learns much faster than BYOL on this tiny budget (docs/notes/fedssl.md#is-it-our-byol).
  c.ssl_method = 'simclr'
  c.simclr.temperature = 0.2         # 0.3: same result (standardised probe 0.8133 vs 0.8141)
  # 84-d Tanh feature layer after global average pooling: random-init features are weak, unlike
  # small_cnn's (see the docstring).
  c.encoder = 'lenet5'
  c.heads = 'custom'          # projector 84-256(BN)-128 (SimCLR uses no predictor)
  # FedSC's crop (scale 0.2-1): EasyFL's 0.08-1 crops of 28x28 images threw the object away
  # (docs/notes/fedssl.md#quickstart); a milder 0.64-1 crop makes the SimCLR task too easy.
  c.augmentation = 'fedsc'
  c.train_size = 20000        # first 20k training images (CPU budget); the test split stays whole
  c.rounds = 25
  c.local_epochs = 1
  c.batch_size = 128
  c.lr = 0.1
  c.weight_decay = 0.0
  c.byol.ema_tau = 0.96       # unused by SimCLR; kept for --config.ssl_method=byol
  c.eval_every = 5            # kNN every 5 rounds (the curve in metrics.png; ~10 s each)
  c.checkpoint_every = 5
  return c
