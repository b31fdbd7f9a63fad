"""Alignment and uniformity on the hypersphere (Wang & Isola, ICML 2020), the base objective of
every row of the SSD paper ("FedAlignUniform"): `losses.align_uniform` on the two views'
projections, with the SSD code's defaults (t = 2, uniformity weight 1, unique pairs).
docs/notes/objectives.md#obj-11."""
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl.ssl import losses
from fedjax_ssl.ssl import registry


def loss(hparams, online, target, batch, shared):
  del target, batch, shared
  return losses.align_uniform(online[0]['z'], online[1]['z'], t=hparams['t'],
                              uniform_weight=hparams['uniform_weight'])


def defaults() -> ml_collections.ConfigDict:
  block = ml_collections.ConfigDict()
  block.t = 2.0               # uniformity temperature
  block.uniform_weight = 1.0  # β, the uniformity term's weight
  return block


def validate(block: ml_collections.ConfigDict) -> None:
  cv.check_float_range('align_uniform.t', block.t, 0.0, None, inclusive=(False, True))
  cv.check_float_range('align_uniform.uniform_weight', block.uniform_weight, 0.0, None)


OBJECTIVE = registry.register(registry.Objective(
    name='align_uniform', loss=loss, defaults=defaults, validate=validate,
    doc='alignment + uniformity on the hypersphere (Wang & Isola, ICML 2020)'))
