"""Spectral contrastive learning as FedSC trains it ('sc'; `losses.spectral_contrastive_loss`):
NormClip at config.sc_mu inside the loss, and FedSC's inter-client term when the algorithm hands
the loss (alpha, R_other) each step.

Its clip level stays the top-level `config.sc_mu`, not a key of this block: FedSC's privacy
calibration (DP-CalR) reads the same mu. `scale` is 1 (the FedSC code's loss, 2 x the paper's batch
loss); FedSC's `paper_scale` replaces it by 0.5 in the client spec. Without hparams (a spec built by
hand) the loss does not clip and keeps scale 1.
"""
from fedjax_ssl.ssl import losses
from fedjax_ssl.ssl import registry


def loss(hparams, online, target, batch, shared):
  del target
  alpha, r_other = shared if shared is not None else (1.0, None)
  return hparams.get('scale', 1.0) * losses.spectral_contrastive_loss(
      online[0]['z'], online[1]['z'], alpha=alpha, r_global=r_other, mu=hparams.get('mu'),
      mask=batch.get('mask'))


def hparams(config):
  return {'mu': float(config.sc_mu) or None, 'scale': 1.0}


OBJECTIVE = registry.register(registry.Objective(
    name='sc', loss=loss, ragged_batches=True, hparams=hparams,
    doc='spectral contrastive (FedSC), NormClip at config.sc_mu'))
