r"""Hetero-SSFL Tables 5-6 (ICLR version, App. C): semi-supervised fine-tuning with 1% and 10% of
the labels, CIFAR-100 and CIFAR-10, non-IID, 5 clients.

  python -m experiments.reproduce --table configs/hetero_ssfl/table5_6.py --out DIR --scale paper
  python -m experiments.reproduce --table configs/hetero_ssfl/table5_6.py --out DIR   # quick

Fine-tuning: config.finetune = 'hetero_ssfl' (eval/finetune.PROTOCOLS): each model's whole encoder
and a new linear head, SGD Nesterov 0.9, lr 0.05, batch 256 (1%) / 512 (10%), 100 epochs, no
augmentation, on a class-stratified 1% / 10% of the training split shared by every model of a seed;
tested on the full test split after the last epoch. FedU and FedEMA fine-tune their global model,
Hetero-SSFL each client's personal model (the client mean is reported).
paper: hetero_common.paper_base per dataset (the Table 1 setting: 20 classes per client on
  CIFAR-100, 2 on CIFAR-10, App. C's "5 users"); FedU and FedEMA on ResNet-34, Hetero-SSFL on the
  3 x ResNet-34 + 2 x ResNet-18 mix with its 5,000-image RAD.
quick: Fashion-MNIST (first 10,000 images), 5 clients x 2 classes, the small CNN / MLP mix, 15
  rounds; the protocol's 100 fine-tuning epochs (10 were tried and are not enough: after 10 epochs
  the model is mid-oscillation, docs/notes/hetero_ssfl.md#hetero-e13); no paper number applies.
  Supervised FedAvg and centralized BYOL (small CNN) are rows as references, and the claims add
  whether each method's fine-tuned encoder beats its random-init encoder fine-tuned alike and the
  raw-pixel row (the protocol's linear classifier on the pixels); 3-8 min a run on one core.
  Expected: none of the papers' claims confirmed at this scale, the raw-pixel row above every
  method at 1 % of the labels, and the protocol's lr 0.05 sends some 1 % fine-tunes to chance.
  Results: docs/results/hetero_ssfl/fmnist_quick_finetune/table.md
  (docs/notes/hetero_ssfl.md#hetero-e13).
evidence: the clipped evidence setting of mu_sweep.py (hetero_common.evidence_base with gradients
  clipped at norm 1: 20,000 images, 5 clients x 2 classes, 40 rounds), where Hetero-SSFL (SimCLR,
  mu = 1, 3 small CNNs + 2 LeNet-5s) is confirmed to beat local SSL; FedU and FedEMA as the paper
  runs them (BYOL, one small CNN), FedSimCLR (Hetero-SSFL's objective without its alignment, one
  small CNN) and supervised FedAvg; the protocol in full. 34-38 min a Hetero-SSFL run on one core,
  7-13 min the others. Expected: Hetero-SSFL > FedU / FedEMA reversed at 10 % of the labels and
  within noise at 1 %; every row above raw pixels at 10 %, none at 1 %.
  Results: docs/results/hetero_ssfl/fmnist_evidence_finetune/table.md
  (docs/notes/hetero_ssfl.md#hetero-e14).
Every scale skips the linear probe (these tables report fine-tuning only); the kNN monitor stays.
"""
from configs.hetero_ssfl import common as hetero_common
from fedjax_ssl import tables

METHODS = ('FedU', 'FedEMA', 'Hetero-SSFL')
METRICS = ('ft_acc_1pct', 'ft_acc_10pct')
# Tables 5 (CIFAR-100) and 6 (CIFAR-10), (1%, 10%) of the labels, %.
PAPER = {
    'CIFAR-100': {'FedU': (20.5, 46.3), 'FedEMA': (23.11, 48.6), 'Hetero-SSFL': (37.4, 57.4)},
    'CIFAR-10': {'FedU': (72.9, 86.8), 'FedEMA': (75.8, 87.4), 'Hetero-SSFL': (79.3, 88.7)},
}

# The papers' claim: Hetero-SSFL beats both baselines at either fraction of the labels.
CLAIMS = tuple(tables.Claim(f'Hetero-SSFL > {row} ({metric})', 'Hetero-SSFL', row, metric)
               for metric in METRICS for row in ('FedEMA', 'FedU'))
# Off the paper's scale: whether fine-tuning from each method's encoder beats fine-tuning its
# random-init encoder the same way (the quick scale's budget may not teach anything).
LEARNS = tuple(tables.Claim(f'{row} learns ({metric})', row, tables.RANDOM_INIT, metric)
               for metric in METRICS for row in METHODS)
# And whether it beats the protocol's linear classifier on the pixels (the raw-pixel row:
# eval/finetune.Pixels fine-tuned the same way on the same labelled images).
ABOVE_PIXELS = tuple(tables.Claim(f'{row} > raw pixels ({metric})', row, tables.RAW_PIXELS,
                                  metric) for metric in METRICS for row in METHODS)
REFERENCES = ('Supervised FedAvg', 'Central-BYOL')


SCALES = ('quick', 'evidence', 'paper')


def _evidence_rows():
  """The evidence scale's rows: Hetero-SSFL where it is confirmed to beat local SSL (SimCLR,
  mu = 1; docs/results/hetero_ssfl/fmnist_evidence_clip), FedU and FedEMA as the paper runs them
  (BYOL, one small CNN for every client), FedSimCLR (the same objective as Hetero-SSFL here, one
  small CNN: the algorithm's share of any gap) and supervised FedAvg."""
  rows = hetero_common.rows(hetero_common.EVIDENCE_MIX, 1000)
  return {'Hetero-SSFL': hetero_common.hetero_row(hetero_common.EVIDENCE_MIX, 1000, 1.0, 'simclr'),
          'FedU': rows['FedU'], 'FedEMA': rows['FedEMA'],
          'FedSimCLR': dict(algorithm='fedavg', ssl_method='simclr'),
          'Supervised FedAvg': rows['Supervised FedAvg']}


def get_table(scale: str) -> tables.Table:
  methods, claims = METHODS, CLAIMS
  if scale == 'evidence':
    # The clipped evidence setting of the mu sweep, where no client collapses (HETERO-E12).
    base = hetero_common.evidence_base()
    base.grad_clip_norm = 1.0
    columns = {'FMNIST 5 x 2 classes': {}}
    all_rows = _evidence_rows()
    methods = tuple(all_rows)
    paper = {}
    claims += tuple(tables.Claim(f'Hetero-SSFL > FedSimCLR ({m})', 'Hetero-SSFL', 'FedSimCLR', m)
                    for m in METRICS)
    claims += tuple(tables.Claim(f'{row} {what} ({m})', row, ref, m)
                    for what, ref in (('learns', tables.RANDOM_INIT),
                                      ('> raw pixels', tables.RAW_PIXELS))
                    for m in METRICS for row in methods[:4])
  elif scale == 'paper':
    base = hetero_common.paper_base('cifar10')
    columns = {'CIFAR-100': dict(dataset='cifar100', classes_per_client=20),
               'CIFAR-10': dict(dataset='cifar10', classes_per_client=2)}
    all_rows = hetero_common.rows(hetero_common.PAPER_MIX, 5000)
    paper = {(row, col, metric): v for col, by_row in PAPER.items()
             for row, pair in by_row.items() for metric, v in zip(METRICS, pair)}
  else:
    base = hetero_common.quick_base()
    columns = {'FMNIST non-IID': {}}
    all_rows = hetero_common.rows(hetero_common.QUICK_MIX, 1000)
    paper = {}
    claims += LEARNS + ABOVE_PIXELS
    # Off the paper's scale the trained references are rows too (the random-init encoder,
    # fine-tuned the same way, comes with every run).
    methods += REFERENCES
  base.finetune = 'hetero_ssfl'
  base.probe, base.probe_epochs = 'adam', 0   # no linear probe: its numbers are not reported here
  return tables.Table(
      name='hetero_table5_6',
      title='Hetero-SSFL Tables 5-6: semi-supervised fine-tuning, 1% and 10% of the labels',
      base=base, rows={k: all_rows[k] for k in methods}, columns=columns, metrics=METRICS,
      paper=paper, scale=scale, claims=claims,
      notes=('Fine-tuned: encoder + linear head, SGD Nesterov 0.9, lr 0.05, batch 256 (1%) / 512 '
             '(10%), 100 epochs, no augmentation, on a class-stratified subset of the training '
             'split; personal models: the client mean. The paper\'s labelled subset is unstated '
             '(ours: stratified, one draw per seed).' + (
                 ' Evidence scale: the first 20,000 Fashion-MNIST images (RAD 1,000 carved out '
                 'first), 5 clients x 2 disjoint classes, 40 rounds of 1 local epoch, SGD 0.1 '
                 'cosine, gradients clipped at norm 1; Hetero-SSFL with SimCLR at mu = 1 on 3 '
                 'small CNNs + 2 LeNet-5s, FedU / FedEMA with BYOL and FedSimCLR on one small CNN. '
                 'Not comparable to the paper (CIFAR, ResNet-18/34). Where it falls short: '
                 'Hetero-SSFL\'s client mean carries its LeNet-5 clients against one small CNN; '
                 'BYOL (FedU, FedEMA) does not learn on this budget; lr 0.05 diverges on some 1 % '
                 'fine-tunes (a diverged reference takes its seed out: 2 seeds for the global '
                 'rows at 1 %).' if scale == 'evidence'
                 else '')))
