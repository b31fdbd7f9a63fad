"""SwAV (Caron et al., NeurIPS 2020): swapped prediction of Sinkhorn-Knopp codes over learnable
prototypes (`losses.swav`, `losses.swav_codes`), as in the authors' `main_swav.py` with two views
(no multi-crop) and no feature queue.

The prototypes are a layer of the model (`SSLModel.prototypes`, params['prototypes']: a bias-free
linear map of the L2-normalised projection), renormalised to unit rows before every step as the
release does. `swav.shared_prototypes` decides whether clients share them (the FedAvg family
averages them with the online network) or keep their own (stored with the client, as a module the
algorithm does not share). The release freezes the prototypes for its first iterations
(`freeze_prototypes_niters`); here they train from the first step.
"""
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl.ssl import losses
from fedjax_ssl.ssl import registry


def loss(hparams, online, target, batch, shared):
  del target, batch, shared
  return losses.swav(online[0]['scores'], online[1]['scores'], temperature=hparams['temperature'],
                     epsilon=hparams['epsilon'], sinkhorn_iters=hparams['sinkhorn_iters'])


def defaults() -> ml_collections.ConfigDict:
  block = ml_collections.ConfigDict()
  block.num_prototypes = 100      # K: the release's CIFAR-10 setting is 3000; 10x the classes here
  block.temperature = 0.1
  block.epsilon = 0.05
  block.sinkhorn_iters = 3
  block.shared_prototypes = True  # False: every client keeps its own prototypes
  return block


def validate(block: ml_collections.ConfigDict) -> None:
  cv.check_int_range('swav.num_prototypes', block.num_prototypes, 2, 1_000_000)
  for key in ('temperature', 'epsilon'):
    cv.check_float_range(f'swav.{key}', block[key], 0.0, None, inclusive=(False, True))
  cv.check_int_range('swav.sinkhorn_iters', block.sinkhorn_iters, 1, 1000)
  if not isinstance(block.shared_prototypes, bool):
    raise cv.ConfigError(f'config.swav.shared_prototypes = {block.shared_prototypes!r} is invalid: '
                         'must be True or False')


OBJECTIVE = registry.register(registry.Objective(
    name='swav', loss=loss, prototypes=True, defaults=defaults, validate=validate,
    doc='SwAV: swapped prediction of Sinkhorn codes over learnable prototypes'))
