"""FedDecorr (Shi et al., "Towards Understanding and Mitigating Dimensional Collapse in
Heterogeneous Federated Learning", ICLR 2023) over an SSL client, as FedU2's FedDecorr-SimSiam /
-BYOL baselines.

FedAvg of the online network (`fedavg.make`: the same server, broadcast and client) whose local loss
gains beta * `ops.decorr.feddecorr_loss` once per view, on the backbone features h (the paper's
representation; `feddecorr.features='projector'` takes the projector output z, as the FedU2 code's
BYOL client does). beta = 0.1 is the authors' default (`--feddecorr_coef`) and the weight the FedU2
code uses. beta = 0 is FedAvg exactly. docs/notes/fedu2.md#fedu2-baselines.
"""
from __future__ import annotations

import dataclasses

import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl.algorithms import fedavg, registry, ssl_client
from fedjax_ssl.core.algorithm import Algorithm
from fedjax_ssl.data.types import DataInfo
from fedjax_ssl.ops import decorr

METHODS = ('byol', 'simsiam', 'simclr', 'align_uniform')
# config value -> the SSLModel output the loss sees (ssl_client.ClientSpec.regularized).
FEATURES = {'backbone': 'h', 'projector': 'z'}


def make(spec: ssl_client.ClientSpec, *, beta: float = 0.1, features: str = 'backbone',
         byol_target_sync: str = 'keep', stateless: bool = True) -> Algorithm:
  """FedAvg of `spec` with beta * FedDecorr's loss on `features` added per view (`stateless` as
  in fedavg.make)."""
  if spec.method not in METHODS:
    raise ValueError(f'FedDecorr: ssl_method = {spec.method!r} is invalid, must be one of '
                     f'{METHODS}')
  if features not in FEATURES:
    raise ValueError(f'feddecorr.features = {features!r} is invalid: must be one of '
                     f'{tuple(FEATURES)}')
  if beta < 0:
    raise ValueError(f'feddecorr.beta = {beta} is invalid: must be >= 0')
  # beta = 0 adds no term at all (not a zero one), so the step is FedAvg's bit for bit.
  reg = None if beta == 0 else (lambda z, key: beta * decorr.feddecorr_loss(z))
  spec = dataclasses.replace(spec, feature_regularizer=reg, regularized=FEATURES[features])
  return fedavg.make(spec, byol_target_sync=byol_target_sync, name='feddecorr', stateless=stateless)


def config_block() -> ml_collections.ConfigDict:
  """FedDecorr's keys, `config.feddecorr`."""
  return ml_collections.ConfigDict({'beta': 0.1, 'features': 'backbone'})


def validate(config: ml_collections.ConfigDict, dataset_info=None) -> None:
  del dataset_info
  cv.check_float_range('feddecorr.beta', config.feddecorr.beta, 0.0, None)
  cv.check_choice('feddecorr.features', config.feddecorr.features, tuple(FEATURES))


def build(config: ml_collections.ConfigDict, info: DataInfo) -> Algorithm:
  f = config.feddecorr
  return make(ssl_client.spec_from_config(config, info), beta=float(f.beta), features=f.features,
              byol_target_sync=config.byol_target_sync)


registry.register('feddecorr', build, dp=True,
                  defaults=config_block, validate=validate, methods=METHODS,
                  methods_note='the SSL methods FedU2 and SSD pair it with; supervised is not wired',
                  doc='FedAvg + beta * FedDecorr decorrelation loss (Shi et al., ICLR 2023)')
