"""SimCLR (Chen et al., ICML 2020): NT-Xent over the 2B projections of a batch
(`losses.nt_xent`)."""
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl.ssl import losses
from fedjax_ssl.ssl import registry


def loss(hparams, online, target, batch, shared):
  del target, batch, shared
  return losses.nt_xent(online[0]['z'], online[1]['z'], hparams['temperature'],
                        zero_diagonal=hparams['zero_diagonal'])


def defaults() -> ml_collections.ConfigDict:
  block = ml_collections.ConfigDict()
  block.temperature = 0.5
  # FedU2 code's quirk: the self-similarity logit is zeroed rather than masked (arXiv:2403.16398;
  # docs/notes/evaluation.md#losses-and-evaluation).
  block.zero_diagonal = False
  return block


def validate(block: ml_collections.ConfigDict) -> None:
  # zero_diagonal needs no check: the ConfigDict keeps it a bool.
  cv.check_float_range('simclr.temperature', block.temperature, 0.0, None,
                       inclusive=(False, True))


OBJECTIVE = registry.register(registry.Objective(
    name='simclr', loss=loss, defaults=defaults, validate=validate,
    doc='SimCLR: NT-Xent over the 2B projections'))
