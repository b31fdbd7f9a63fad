"""Settings shared by the SSD tables (Fang, Lin, King, Zhang, ICCV 2025; docs/notes/ssd.md).

`paper_base()`: the official code's protocol (github:hc-fang/ssd, `configs/FedAlignUniformSubspace/
default.yaml`, `scripts/run_FedAlignUniformSubspace.sh`) on CIFAR: ResNet-18, 512-2048(BN)-512
projector and no predictor, SGD 0.1 (0.2 x 128 / 256) momentum 0.9 weight decay 1e-4, constant (the
code's cosine is computed but never applied), optimizer reset every round, batch 128, E = 5, 100
rounds, crop 0.08-1 with the (0.8, 0.8, 0.8, 0.2) jitter, grayscale 0.2, no blur; linear probe Adam
3e-3 for 200 epochs; fine-tuning with the FedU2 code's semi_eval.py protocol (SSD's is the same
code, tested at 50/100/150/200 epochs where FedU2's tests at 100/200).
`quick_base()` / `evidence_base()`: FedU2's Fashion-MNIST budgets (configs/fedu2/common.py), with the
projector's output as wide as the encoder's features (projector distillation compares them
coordinate by coordinate): LeNet-5 84-256(BN)-84 at quick, the small CNN 128-256(BN)-128 at evidence.
Every row of a table shares its model, so the baselines run the same network as SSD.
"""
from configs.fedu2 import common as fedu2_common
from fedjax_ssl import models


def paper_base(dataset: str = 'cifar10'):
  c = fedu2_common.paper_base(dataset)
  c.ssl_method = 'align_uniform'
  c.augmentation = 'byol_easyfl'   # RandomResizedCrop(32) default scale + the strong jitter
  c.lr = 0.1
  c.momentum = 0.9
  c.weight_decay = 1e-4
  c.lr_schedule = 'constant'
  c.finetune = 'fedu2'
  return c


def _match_projector(c):
  """The projector's output as wide as the encoder's features, for projector distillation."""
  c.heads = 'custom'
  c.proj_out = models.feature_dim(c.encoder)
  c.pred_out = c.proj_out   # FedX's predictor (the only row with one) compares with the projector
  return c


def quick_base():
  c = fedu2_common.quick_base()
  c.ssl_method = 'align_uniform'
  return _match_projector(c)


def evidence_base():
  c = fedu2_common.evidence_base()
  c.ssl_method = 'align_uniform'
  return _match_projector(c)


def row(algorithm: str, **extra):
  """Overrides of a row on the alignment-uniformity base (every row of the paper's tables)."""
  return {'algorithm': algorithm, 'ssl_method': 'align_uniform', **extra}


def rows():
  """SSD, its two ablations, hard separation (HSD: DSR's target the projection onto the client's
  subspace, with PD; the paper's soft-against-hard comparison) and the baselines with the
  coefficients of the SSD code's runs (FedU2: the code's SWD FUR at 0.01, EUA as the FedU2 code;
  FedDecorr 0.01; FedX and L-DAWA with their own defaults)."""
  return {
      'SSD': row('ssd'),
      'FedAlignUniform + DSR': row('ssd', **{'ssd.delta': 0.0}),
      'FedAlignUniform + PD': row('ssd', **{'ssd.gamma': 0.0}),
      'HSD': row('ssd', **{'ssd.separation': 'hard'}),
      'FedAlignUniform': row('fedavg'),
      'FedU2': row('fedu2', **{'fedu2.fur': 'swd', 'fedu2.lambda_u': 0.01}),
      'FedDecorr': row('feddecorr', **{'feddecorr.beta': 0.01}),
      'FedX': row('fedx'),
      'L-DAWA': row('ldawa'),
  }


BASELINES = ('FedAlignUniform', 'FedU2', 'FedDecorr', 'FedX', 'L-DAWA')
