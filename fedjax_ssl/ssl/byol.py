"""BYOL (Grill et al., NeurIPS 2020): the online predictor regresses the momentum target's
projection of the other view (EasyFL's symmetrised loss, `losses.byol_loss`)."""
import ml_collections

from fedjax_ssl import config_validation as cv
from fedjax_ssl.ssl import losses
from fedjax_ssl.ssl import registry


def loss(hparams, online, target, batch, shared):
  del hparams, batch, shared
  return losses.byol_loss(online[0]['p'], online[1]['p'], target[0]['z'], target[1]['z'])


EMA_SCHEDULES = ('constant', 'lr')


def defaults() -> ml_collections.ConfigDict:
  block = ml_collections.ConfigDict()
  # Target EMA after every local step (EasyFL / FedU / FedEMA: 0.99).
  block.ema_tau = 0.99
  # 'constant': ema_tau at every step (the federated BYOL codes). 'lr': ema_tau ** (lr / config.lr)
  # at a round's learning rate lr, so 1 - tau follows the learning-rate schedule
  # (`ssl_client.target_rate`): under the cosine schedule, BYOL's own schedule of tau towards 1.
  block.ema_schedule = 'constant'
  return block


def validate(block: ml_collections.ConfigDict) -> None:
  cv.check_float_range('byol.ema_tau', block.ema_tau, 0.0, 1.0)
  cv.check_choice('byol.ema_schedule', block.ema_schedule, EMA_SCHEDULES)


def hparams(config: ml_collections.ConfigDict) -> dict:
  """The block's values and the base learning rate the 'lr' schedule divides by."""
  return {**config.byol.to_dict(), 'base_lr': float(config.lr)}


OBJECTIVE = registry.register(registry.Objective(
    name='byol', loss=loss, predictor=True, target=True, defaults=defaults, validate=validate,
    hparams=hparams,
    doc='BYOL: predictor regresses the momentum target'))
