"""Supervised cross-entropy of an encoder with a linear classifier: the supervised reference rows
and the classifiers of representation sharing and FD."""
from fedjax_ssl.ssl import losses
from fedjax_ssl.ssl import registry


def loss(hparams, online, target, batch, shared):
  del hparams, target, shared
  return losses.cross_entropy_loss(online[0], batch['y'])


OBJECTIVE = registry.register(registry.Objective(
    name='supervised', loss=loss, views=1, classifier=True,
    doc='cross-entropy of a linear classifier on the encoder'))
