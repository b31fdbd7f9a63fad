"""VICReg (Bardes et al., ICLR 2022): invariance, variance and covariance terms on the two views'
projections (`losses.vicreg`, the authors' released code and weights)."""
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl.ssl import losses
from fedjax_ssl.ssl import registry


def loss(hparams, online, target, batch, shared):
  del target, batch, shared
  return losses.vicreg(online[0]['z'], online[1]['z'], sim_coeff=hparams['sim_coeff'],
                       std_coeff=hparams['std_coeff'], cov_coeff=hparams['cov_coeff'])


def defaults() -> ml_collections.ConfigDict:
  block = ml_collections.ConfigDict()
  block.sim_coeff = 25.0   # λ, invariance
  block.std_coeff = 25.0   # μ, variance
  block.cov_coeff = 1.0    # ν, covariance
  return block


def validate(block: ml_collections.ConfigDict) -> None:
  for key in ('sim_coeff', 'std_coeff', 'cov_coeff'):
    cv.check_float_range(f'vicreg.{key}', block[key], 0.0, None)


OBJECTIVE = registry.register(registry.Objective(
    name='vicreg', loss=loss, defaults=defaults, validate=validate,
    doc='VICReg: invariance + variance + covariance'))
