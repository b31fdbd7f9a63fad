"""Self-supervised losses (BYOL, SimSiam, SimCLR NT-Xent, spectral contrastive) and EMA targets."""
from fedjax_ssl.ssl.losses import byol_loss
from fedjax_ssl.ssl.losses import cross_entropy_loss
from fedjax_ssl.ssl.losses import ema_update
from fedjax_ssl.ssl.losses import l2_normalize
from fedjax_ssl.ssl.losses import nt_xent
from fedjax_ssl.ssl.losses import simsiam_loss
from fedjax_ssl.ssl.losses import spectral_contrastive_loss
