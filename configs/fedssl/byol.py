r"""The BYOL family on Fashion-MNIST at the best budget measured for FedBYOL (issue 49 item 2).

  python -m experiments.reproduce --table configs/fedssl/byol.py --out docs/results/fedssl/byol \
      --scale evidence
  python -m experiments.reproduce --table configs/fedssl/byol.py --out DIR --scale paper

paper: the same rows under the FedSSL table's paper protocol (configs/fedssl/fmnist.py: EasyFL /
FedEMA, 60,000 images, 100 rounds of 5 local epochs; a GPU run), IID and Dirichlet(0.1).
evidence: the FedSSL table's evidence setting (configs/fedssl/fmnist.py: first 20,000 training
  images, 10 clients all participating, Dirichlet(0.5), 1 local epoch, batch 128, SGD 0.1 cosine,
  small CNN with 128-256(BN)-128 heads) with the quickstart's augmentation (FedU2's crop and colour
  jitter), the target EMA at 0.99, the FedSSL papers' weight decay 5e-4 and 100 rounds, the best of
  the budgets measured for FedBYOL (docs/notes/fedssl.md#fedssl-20). Rows FedBYOL, FedU, FedEMA and
  supervised FedAvg (lr 0.05, as at the evidence scale), one column; about 30 min a BYOL run on one
  core. Expected: no BYOL row off its random init on the probe or kNN, FedEMA > FedBYOL and FedU >
  FedBYOL not confirmed, supervised FedAvg above all. Results and verdicts:
  docs/results/fedssl/byol/table.md (docs/notes/fedssl.md#fedssl-20).
"""
from configs.fedssl import fmnist
from fedjax_ssl import tables

SCALES = ('evidence', 'paper')
ROWS = ('FedBYOL', 'FedU', 'FedEMA', 'FedAvg (supervised)')


def get_table(scale: str) -> tables.Table:
  fedssl = fmnist.get_table(scale)
  c = fedssl.base
  rows = {r: fedssl.rows[r] if r in fedssl.rows else fmnist.ROWS[r] for r in ROWS}
  claims = ()
  if scale == 'evidence':
    c.augmentation = 'fedu2'
    c.byol.ema_tau = 0.99
    c.weight_decay = 5e-4
    c.rounds = 100
    claims = tuple(x for x in fmnist.CLAIMS if x.better in rows and x.worse in tuple(rows) + (
        tables.RANDOM_INIT, tables.RAW_PIXELS)) + tuple(
            tables.Claim(f'{r} > raw pixels, probe', r, tables.RAW_PIXELS, 'probe_acc')
            for r in ROWS[:3])
  return tables.Table(
      name='fedssl_byol',
      title=('The BYOL family on Fashion-MNIST (10 clients, Dirichlet(0.5), small CNN, target EMA '
             '0.99, weight decay 5e-4, 100 rounds)' if scale == 'evidence' else
             'The BYOL family on Fashion-MNIST: the FedSSL paper protocol'),
      base=c, rows=rows, columns=fedssl.columns, scale=scale, claims=claims,
      metrics=fedssl.metrics,
      notes=('The field\'s protocol (L-BFGS logistic probe on standardised frozen features, C from '
             'a grid on a held-out 10%; 1% = 3 stratified draws; kNN k=200 / 20, T=0.1 cosine on '
             'the labelled subset).'))
