"""SimSiam (Chen & He, CVPR 2021): BYOL without the momentum target; the stop-gradient branch is
the online projector (`losses.simsiam_loss`, EasyFL's form)."""
from fedjax_ssl.ssl import losses
from fedjax_ssl.ssl import registry


def loss(hparams, online, target, batch, shared):
  del hparams, target, batch, shared
  return losses.simsiam_loss(online[0]['p'], online[1]['p'], online[0]['z'], online[1]['z'])


OBJECTIVE = registry.register(registry.Objective(
    name='simsiam', loss=loss, predictor=True,
    doc='SimSiam: predictor against the stop-gradient projector'))
