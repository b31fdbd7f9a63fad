"""Barlow Twins (Zbontar et al., ICML 2021): the cross-correlation of the standardised projections
towards the identity (`losses.barlow_twins`, the authors' released code and λ)."""
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl.ssl import losses
from fedjax_ssl.ssl import registry


def loss(hparams, online, target, batch, shared):
  del target, batch, shared
  return losses.barlow_twins(online[0]['z'], online[1]['z'],
                             off_diagonal_weight=hparams['off_diagonal_weight'])


def defaults() -> ml_collections.ConfigDict:
  block = ml_collections.ConfigDict()
  block.off_diagonal_weight = 0.0051   # λ of the redundancy-reduction term
  return block


def validate(block: ml_collections.ConfigDict) -> None:
  cv.check_float_range('barlow_twins.off_diagonal_weight', block.off_diagonal_weight, 0.0, None)


OBJECTIVE = registry.register(registry.Objective(
    name='barlow_twins', loss=loss, defaults=defaults, validate=validate,
    doc='Barlow Twins: cross-correlation towards the identity'))
