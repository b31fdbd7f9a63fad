"""Self-supervised objectives on their registry (`ssl.registry`), their losses (`ssl.losses`) and
EMA targets. Importing the package registers the built-in objectives, in this order."""
from fedjax_ssl.ssl import byol
from fedjax_ssl.ssl import simsiam
from fedjax_ssl.ssl import simclr
from fedjax_ssl.ssl import spectral_contrastive
from fedjax_ssl.ssl import supervised
from fedjax_ssl.ssl import vicreg
from fedjax_ssl.ssl import barlow_twins
from fedjax_ssl.ssl import moco
from fedjax_ssl.ssl import swav
from fedjax_ssl.ssl import align_uniform
from fedjax_ssl.ssl.losses import byol_loss
from fedjax_ssl.ssl.losses import cross_entropy_loss
from fedjax_ssl.ssl.losses import ema_update
from fedjax_ssl.ssl.losses import l2_normalize
from fedjax_ssl.ssl.losses import nt_xent
from fedjax_ssl.ssl.losses import simsiam_loss
from fedjax_ssl.ssl.losses import spectral_contrastive_loss
from fedjax_ssl.ssl.registry import CAPABILITIES
from fedjax_ssl.ssl.registry import Objective
from fedjax_ssl.ssl.registry import get
from fedjax_ssl.ssl.registry import names
from fedjax_ssl.ssl.registry import register
