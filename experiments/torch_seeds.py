"""The seed systems' rounds in eager PyTorch (FedU2, FedSC, Hetero-SSFL, FedEMA), written as their
official codes loop, for `experiments.seed_speed` to time beside our stacked JAX round (issue 65
item 5). Torch is imported only when called: a benchmark-only extra, never a library dependency.

Two ways to run a round's work (`mode`):
  * 'loop': the official codes' per-client loop. Per participant: a copy of the global (or its own)
    model, a fresh SGD optimiser (momentum, weight decay; FedSC's gradient clip 3), E local epochs of
    B images on two pre-made views per step, the method's loss with its extra terms, the BYOL
    target's EMA after every step; then the method's server step. Per method:
      fedu2       BYOL + lambda_u (FUR(z1) + FUR(z2)), FUR the UOT of each view's B projections
                  against B fresh points of the sphere (100 projected steepest-descent iterations,
                  plan held constant: ops/uot.py); server EUA over the online network AND the target
                  (the code's whole-model scope): deviation Gram matrix of the flattened models,
                  g_k = 2 D_k / |D_k|, min-norm simplex weights, theta -= server_lr sum_k p_k g_k;
                  BatchNorm buffers averaged.
      fedsc       at a share round, DP-CalR first: every participant passes `calr_views` views of
                  each of its images through the global encoder + projector (eval, no gradient),
                  NormClips them, averages z zT and adds N(0, sigma^2) on every entry; the server
                  forms each client's leave-one-out R_-j. Local loss: the spectral contrastive loss
                  with alpha and R_-j (losses.spectral_contrastive_loss, NormClip mu); FedAvg.
      hetero_ssfl one cohort per architecture, personal models kept across rounds. Local loss: BYOL +
                  mu (1 - CKA(A AT, Kbar[R, R])), A the predictor output of a fresh RAD sub-batch R of
                  b_R images (train-mode BatchNorm); after training each client uploads its
                  predictor output on the whole RAD (chunks of b_R, no gradient); the server forms
                  Kbar = sum_j A_j A_jT / N [L, L].
      fedema      personal models kept across rounds; at the start mu_k = min(lambda_k d_k, 1) mixes
                  the local online network and predictor with the global ones; BYOL; at the end the
                  divergence d_k (mean L2 distance of the encoder's convolution kernels before and
                  after training) and, after the first round, lambda_k = tau / d_k; FedAvg of the
                  online network and predictor.
  * 'union': the union-batch bound: ONE model per architecture (online, target, optimiser kept
    across rounds) trained for the same steps on the union batch of its clients' images, the
    method's extra terms computed per client block of B rows (FUR's UOT, FedSC's R_-j, the CKA of
    each block's own RAD sub-batch), so the FLOPs are the loop's without the per-client overhead.
    The server steps (EUA, DP-CalR, the RAD upload, FedEMA's mixing) are not in it: it bounds the
    local training, which is where the round's time goes.

Models mirror the flax modules' names (fedjax_ssl/models: the CIFAR ResNets, Fixup-ResNet20, the
MLP encoder and the MLP heads), so `load_flax` copies a flax variable tree into a torch module and
`flax_grads` reads torch gradients back in flax layout (the tests compare the two frameworks from
the same weights). Precision: 'float32' (TF32 on a CUDA device) or 'bfloat16' autocast (parameters
and optimiser float32). Inputs are pre-made float tensors on the device, two views per step: the
timing is model compute plus the methods' terms (the JAX side uses the `flip` views).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

METHODS = ('fedu2', 'fedsc', 'hetero_ssfl', 'fedema')
MODES = ('loop', 'union')
PRECISIONS = ('float32', 'bfloat16')
ENCODERS = ('resnet18', 'resnet34', 'fixup_resnet20', 'mlp')
# Head sizes (hidden, out, BatchNorm) of fedjax_ssl/models/heads.py's presets.
HEADS = {'fedu2': ((2048, 512, True), (2048, 512, True)),
         'easyfl': ((4096, 2048, True), (4096, 2048, True)),
         'fedsc': ((1024, 512, False), None)}


@dataclasses.dataclass(frozen=True)
class Setting:
  """One method's round: what both frameworks train (experiments/seed_speed.py builds our config
  from the same fields).

  Attributes:
    name: the row's name, e.g. 'fedu2_cross_silo'.
    method: one of METHODS.
    cohorts: (encoder, clients) per architecture (one entry except Hetero-SSFL).
    heads: (projector, predictor or None), each (hidden, out, use_bn).
    image: H = W of the square inputs; channels 3.
    batch: B per client; local_epochs: E; batches: batches per epoch of each client's data (the
      timed data size; a paper round scales with it).
    lr, momentum, weight_decay, grad_clip (0 = none), ema: the local optimiser and BYOL's EMA.
    extra: the method's own settings (see `paper_settings`).
  """
  name: str
  method: str
  cohorts: Tuple[Tuple[str, int], ...]
  heads: Tuple[Any, Any]
  image: int
  batch: int
  local_epochs: int
  batches: int
  lr: float
  momentum: float
  weight_decay: float
  grad_clip: float
  ema: float
  extra: Tuple[Tuple[str, Any], ...] = ()

  @property
  def clients(self) -> int:
    return sum(c for _, c in self.cohorts)

  @property
  def steps(self) -> int:
    """Local steps per client per round."""
    return self.local_epochs * self.batches

  def get(self, key: str) -> Any:
    return dict(self.extra)[key]


def paper_settings(batches: int = 1) -> Dict[str, Setting]:
  """The five rows of issue 65 item 5 at their papers' model, image size, batch and local epochs,
  with `batches` batches per client per epoch (the paper's own client sizes give the round's
  scale factor in docs/notes/performance.md#perf-73).

    fedu2_cross_silo    configs/fedu2/paper_cross_silo.py: ResNet-18, 512-2048(BN)-512 heads, 10
                        clients, B 128, E 5, SGD 0.048 / 0.9 / 1e-4, EMA 0.99, FUR (UOT, lambda_u
                        0.1, tau 0.8, 100 iterations), EUA (code direction, server lr 8, whole model)
    fedu2_cross_device  configs/fedu2/paper_cross_device.py: the same with 100 clients
    fedsc               configs/fedsc/common.paper_base('cifar10') with DP shares on (configs/fedsc/
                        dp.py, Table 6's CIFAR-10 eps 3 sigma 0.01, sharing every round): Fixup-
                        ResNet20 widen 8, 512-1024-512 projector without BN, 10 clients, B 512, E 5,
                        SGD 0.03 / 0.9 / 5e-4, clip 3, NormClip mu 4, 10 DP-CalR views
    hetero_ssfl         configs/hetero_ssfl/common.paper_base('cifar10'): 3 ResNet-34 + 2 ResNet-18,
                        EasyFL 4096/2048 BYOL heads, B 200, E 5, SGD 0.032 / 0.9 / 5e-4, EMA 0.99,
                        RAD of 5,000 images, sub-batches of 1,000, mu 0.1
    fedema              FedEMA's CIFAR-10 setting (Zhuang et al., ICLR 2022; EasyFL): ResNet-18,
                        EasyFL heads, 5 clients, B 128, E 5, SGD 0.032 / 0.9 / 5e-4, EMA 0.99,
                        autoscaler tau 0.7
  """
  fedu2 = dict(method='fedu2', heads=HEADS['fedu2'], image=32, batch=128, local_epochs=5,
               batches=batches, lr=0.048, momentum=0.9, weight_decay=1e-4, grad_clip=0.0,
               ema=0.99, extra=(('lambda_u', 0.1), ('tau', 0.8), ('uot_iters', 100),
                                ('server_lr', 8.0)))
  return {
      'fedu2_cross_silo': Setting('fedu2_cross_silo', cohorts=(('resnet18', 10),), **fedu2),
      'fedu2_cross_device': Setting('fedu2_cross_device', cohorts=(('resnet18', 100),), **fedu2),
      'fedsc': Setting('fedsc', 'fedsc', (('fixup_resnet20', 10),), HEADS['fedsc'], 32, 512, 5,
                       batches, 0.03, 0.9, 5e-4, 3.0, 0.0,
                       (('sc_mu', 4.0), ('calr_views', 10), ('sigma', 0.01), ('alpha', 0.9))),
      'hetero_ssfl': Setting('hetero_ssfl', 'hetero_ssfl', (('resnet34', 3), ('resnet18', 2)),
                             HEADS['easyfl'], 32, 200, 5, batches, 0.032, 0.9, 5e-4, 0.0, 0.99,
                             (('rad_size', 5000), ('rad_batch', 1000), ('mu', 0.1))),
      'fedema': Setting('fedema', 'fedema', (('resnet18', 5),), HEADS['easyfl'], 32, 128, 5,
                        batches, 0.032, 0.9, 5e-4, 0.0, 0.99, (('autoscaler_tau', 0.7),)),
  }


def reduced_settings() -> Dict[str, Setting]:
  """The same rows at the CPU size of docs/notes/performance.md#perf-73: the papers' models and
  heads, 8x8 images, batch 8, 1 local epoch of 1 batch, 2 clients per cohort (Hetero-SSFL: one
  ResNet-34 and one ResNet-18; FedU2 cross-device 4), a RAD of 16 images in sub-batches of 8."""
  out = {}
  for name, s in paper_settings(1).items():
    cohorts = tuple((e, 4 if name == 'fedu2_cross_device' else (1 if len(s.cohorts) > 1 else 2))
                    for e, _ in s.cohorts)
    extra = dict(s.extra)
    if 'rad_size' in extra:
      extra.update(rad_size=16, rad_batch=8)
    if 'calr_views' in extra:
      extra.update(calr_views=2)
    out[name] = dataclasses.replace(s, cohorts=cohorts, image=8, batch=8, local_epochs=1,
                                    batches=1, extra=tuple(extra.items()))
  return out


# ------------------------------------------------------------------------------------------------
# Models: torch modules whose parameter names mirror the flax modules' (load_flax).

@functools.lru_cache(maxsize=None)
def _nn():
  """The torch module classes (defined on first use: torch is imported only then)."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top
  F = nn.functional  # pylint: disable=invalid-name

  def bn2d(c):  # flax layers.BatchNorm: momentum 0.9 (torch 0.1), epsilon 1e-5
    return nn.BatchNorm2d(c, momentum=0.1, eps=1e-5)

  class Basic(nn.Module):
    """fedjax_ssl/models/resnet.py BasicBlock."""

    def __init__(self, cin, planes, stride):
      super().__init__()
      self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
      self.bn1 = bn2d(planes)
      self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
      self.bn2 = bn2d(planes)
      self.project = stride != 1 or cin != planes
      if self.project:
        self.shortcut_conv = nn.Conv2d(cin, planes, 1, stride, 0, bias=False)
        self.shortcut_bn = bn2d(planes)

    def forward(self, x):
      out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
      short = self.shortcut_bn(self.shortcut_conv(x)) if self.project else x
      return F.relu(out + short)

  class CifarResNet(nn.Module):
    """fedjax_ssl/models/resnet.py CifarResNet (basic blocks): [B, 3, H, W] -> [B, 512]."""

    def __init__(self, stage_sizes):
      super().__init__()
      self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
      self.bn1 = bn2d(64)
      self.blocks, cin = [], 64
      for i, (num, planes) in enumerate(zip(stage_sizes, (64, 128, 256, 512))):
        for j in range(num):
          name = f'layer{i + 1}_{j}'
          setattr(self, name, Basic(cin, planes, 2 if i > 0 and j == 0 else 1))
          self.blocks.append(name)
          cin = planes

    def forward(self, x):
      x = F.relu(self.bn1(self.conv1(x)))
      for name in self.blocks:
        x = getattr(self, name)(x)
      return x.mean(dim=(2, 3))

  def scalar(value):
    return nn.Parameter(torch.full((), float(value)))

  class FixupBlock(nn.Module):
    """fedjax_ssl/models/fixup.py FixupBlock (the FedSC code's)."""

    def __init__(self, cin, planes, stride, num_layers):
      super().__init__()
      self.stride = stride
      self.bias1a, self.bias1b, self.bias2a = scalar(0), scalar(0), scalar(0)
      self.scale, self.bias2b = scalar(1), scalar(0)
      self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
      self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
      nn.init.normal_(self.conv1.weight, 0, math.sqrt(2 / (planes * 9)) / math.sqrt(num_layers))
      nn.init.zeros_(self.conv2.weight)

    def forward(self, x):
      out = F.relu(self.conv1(x + self.bias1a) + self.bias1b)
      out = self.conv2(out + self.bias2a) * self.scale + self.bias2b
      identity = x
      if self.stride != 1:
        identity = (x + self.bias1a)[:, :, ::self.stride, ::self.stride]
        identity = torch.cat([identity, torch.zeros_like(identity)], dim=1)
      return F.relu(out + identity)

  class FixupResNet20(nn.Module):
    """fedjax_ssl/models/fixup.py FixupResNet20: [B, 3, H, W] -> [B, 64 widen]."""

    def __init__(self, widen=8):
      super().__init__()
      width = 16 * widen
      self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
      self.bias1, self.bias2 = scalar(0), scalar(0)
      self.blocks, cin = [], width
      for i in range(3):
        planes = width * 2 ** i
        for j in range(3):
          name = f'layer{i + 1}_{j}'
          setattr(self, name, FixupBlock(cin, planes, 2 if i > 0 and j == 0 else 1, 9))
          self.blocks.append(name)
          cin = planes

    def forward(self, x):
      x = F.relu(self.conv1(x) + self.bias1)
      for name in self.blocks:
        x = getattr(self, name)(x)
      return x.mean(dim=(2, 3)) + self.bias2

  class MLP(nn.Module):
    """fedjax_ssl/models/small.py MLP (flattens NHWC, as the flax module does)."""

    def __init__(self, din, features=(512, 256, 128)):
      super().__init__()
      self.names = []
      for i, f in enumerate(features):
        setattr(self, f'fc{i + 1}', nn.Linear(din, f))
        self.names.append(f'fc{i + 1}')
        din = f

    def forward(self, x):
      x = x.permute(0, 2, 3, 1).flatten(1)
      for name in self.names:
        x = F.relu(getattr(self, name)(x))
      return x

  class Head(nn.Module):
    """fedjax_ssl/models/heads.py MLPHead, depth 2: fc1 -> [bn] -> relu -> fc2."""

    def __init__(self, din, hidden, out, use_bn):
      super().__init__()
      self.fc1, self.fc2 = nn.Linear(din, hidden), nn.Linear(hidden, out)
      self.bn = nn.BatchNorm1d(hidden, momentum=0.1, eps=1e-5) if use_bn else None

    def forward(self, x):
      x = self.fc1(x)
      if self.bn is not None:
        x = self.bn(x)
      return self.fc2(F.relu(x))

  class Online(nn.Module):
    """SSLModel: encoder -> projector [-> predictor]; forward -> (z, p or None)."""

    def __init__(self, encoder, heads, feature_dim):
      super().__init__()
      (ph, po, pbn), pred = heads
      self.encoder = encoder
      self.projector = Head(feature_dim, ph, po, pbn)
      self.predictor = Head(po, pred[0], pred[1], pred[2]) if pred else None

    def forward(self, x, with_predictor=True):
      z = self.projector(self.encoder(x))
      p = self.predictor(z) if with_predictor and self.predictor is not None else None
      return z, p

  return dict(torch=torch, nn=nn, F=F, CifarResNet=CifarResNet, FixupResNet20=FixupResNet20,
              MLP=MLP, Online=Online)


def make_online(encoder: str, heads, image: int = 32, mlp_features=(512, 256, 128)):
  """A torch SSL model (encoder + heads of `heads`) mirroring the flax SSLModel's names."""
  m = _nn()
  if encoder not in ENCODERS:
    raise ValueError(f'encoder = {encoder!r} is invalid: must be one of {ENCODERS}')
  if encoder == 'mlp':
    enc, dim = m['MLP'](image * image * 3, mlp_features), mlp_features[-1]
  elif encoder == 'fixup_resnet20':
    enc, dim = m['FixupResNet20'](8), 512
  else:
    enc, dim = m['CifarResNet']((2, 2, 2, 2) if encoder == 'resnet18' else (3, 4, 6, 3)), 512
  return m['Online'](enc, heads, dim)


def target_of(online):
  """The BYOL target: a copy of the online network without its predictor (no gradients)."""
  t = copy.deepcopy(online)
  t.predictor = None
  for p in t.parameters():
    p.requires_grad_(False)
  return t


def _flat(tree, prefix=()):
  for k, v in tree.items():
    if isinstance(v, dict) or hasattr(v, 'items'):
      yield from _flat(v, prefix + (k,))
    else:
      yield prefix + (k,), v


def _torch_name(path: Tuple[str, ...], stats: bool, names) -> str:
  """The torch name of flax variable `path` among `names`: kernel / scale -> weight (a Fixup
  scalar named 'scale' keeps its name), mean / var -> running_mean / running_var."""
  last = path[-1]
  if stats:
    last = {'mean': 'running_mean', 'var': 'running_var'}[last]
  else:
    last = {'kernel': 'weight', 'scale': 'weight'}.get(last, last)
  name = '.'.join(path[:-1] + (last,))
  return name if name in names or stats else '.'.join(path)


def _to_torch(value, shape):
  """A flax leaf in torch layout: conv [kh, kw, cin, cout] -> [cout, cin, kh, kw], dense [in, out]
  -> [out, in]."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  a = np.asarray(value, np.float32)
  if a.ndim == 4:
    a = a.transpose(3, 2, 0, 1)
  elif a.ndim == 2:
    a = a.T
  if tuple(a.shape) != tuple(shape):
    raise ValueError(f'flax leaf of shape {np.shape(value)} does not fit torch shape {tuple(shape)}')
  return a


def load_flax(module, params, batch_stats=None) -> None:
  """Copies flax `params` (and `batch_stats`) {'encoder', 'projector'[, 'predictor']} into
  `module` (same names; module docstring). Raises ValueError for a name or shape that differs."""
  torch = _nn()['torch']
  state = module.state_dict()
  trees = [(params, False)] + ([(batch_stats, True)] if batch_stats else [])
  seen = set()
  for tree, stats in trees:
    for path, value in _flat(tree):
      name = _torch_name(path, stats, state)
      if name not in state:
        raise ValueError(f'flax variable {"/".join(path)} has no torch twin {name!r}')
      state[name] = torch.from_numpy(_to_torch(value, state[name].shape).copy())
      seen.add(name)
  missing = [k for k, v in state.items() if k not in seen and v.dtype.is_floating_point
             and 'running' not in k and (batch_stats or 'num_batches' not in k)]
  if missing:
    raise ValueError(f'torch parameters without a flax value: {missing[:5]}')
  module.load_state_dict(state)


def flax_grads(module, params) -> Dict:
  """The torch module's .grad in the flax layout and tree of `params` (leaves numpy float32)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  named = dict(module.named_parameters())

  def one(path, value):
    g = named[_torch_name(path, False, named)].grad
    a = np.zeros(np.shape(value), np.float32) if g is None else g.detach().cpu().numpy()
    if a.ndim == 4:
      a = a.transpose(2, 3, 1, 0)
    elif a.ndim == 2:
      a = a.T
    return a

  def walk(tree, prefix=()):
    return {k: walk(v, prefix + (k,)) if hasattr(v, 'items') else one(prefix + (k,), v)
            for k, v in tree.items()}
  return walk(params)


# ------------------------------------------------------------------------------------------------
# The methods' terms (torch twins of fedjax_ssl/ops and losses; the tests compare them).

def byol_loss(p1, p2, t1, t2):
  """losses.byol_loss: mean(2 - 2 cos(p1, t2)) + mean(2 - 2 cos(p2, t1)), targets detached."""
  F = _nn()['F']
  return ((2 - 2 * F.cosine_similarity(p1, t2.detach(), dim=-1, eps=1e-12)).mean() +
          (2 - 2 * F.cosine_similarity(p2, t1.detach(), dim=-1, eps=1e-12)).mean())


def _normalize(x):
  return _nn()['F'].normalize(x, dim=-1, eps=1e-12)


def sphere_prior(shape, device, generator=None):
  """[..., B, d] points uniform on the sphere (normalised Gaussians; ops.uot.sphere_prior)."""
  torch = _nn()['torch']
  return _normalize(torch.randn(shape, device=device, generator=generator))


def fur_uot_loss(z, prior, *, tau_a=0.8, tau_b=0.8, num_iters=100, mass=1.0):
  """ops.uot.fur_uot_loss (l2 cost, normalised z) over leading batch dims: z, prior [..., B, d] ->
  the sum over the leading dims of the UOT objective at the (constant) plan."""
  torch = _nn()['torch']
  z = _normalize(z)
  sq = ((z * z).sum(-1)[..., :, None] + (prior * prior).sum(-1)[..., None, :]
        - 2 * z @ prior.transpose(-1, -2)).clamp_min(0)
  cost = torch.sqrt(sq + 1e-12)
  n = z.shape[-2]
  marg = torch.full(z.shape[:-1], mass, dtype=z.dtype, device=z.device)
  with torch.no_grad():
    c = cost.detach()
    plan = torch.full_like(c, mass * n / (n * n))
    tiny = torch.finfo(c.dtype).tiny
    for _ in range(num_iters):
      g = (c + tau_a * (plan.sum(-1) - marg)[..., :, None]
           + tau_b * (plan.sum(-2) - marg)[..., None, :])
      curv = tau_a * (g.sum(-1) ** 2).sum((-1,)) + tau_b * (g.sum(-2) ** 2).sum((-1,))
      eta = torch.where(curv > tiny, (g * g).sum((-2, -1)) / curv.clamp_min(tiny),
                        torch.zeros_like(curv))
      plan = (plan - eta[..., None, None] * g).clamp_min(0)
  obj = ((cost * plan).sum((-2, -1)) + 0.5 * tau_a * ((plan.sum(-1) - marg) ** 2).sum(-1)
         + 0.5 * tau_b * ((plan.sum(-2) - marg) ** 2).sum(-1))
  return obj.sum()


def norm_clip(z, sqrt_mu: float):
  """ops.correlation.norm_clip: z * min(1, sqrt_mu / |z|) per row."""
  torch = _nn()['torch']
  sq = (z * z).sum(-1, keepdim=True).clamp_min(1e-24)
  return torch.where(sq < sqrt_mu ** 2, z, sqrt_mu * z * torch.rsqrt(sq))


def sc_loss(z0, z1, *, alpha=1.0, r_other=None, mu=None):
  """losses.spectral_contrastive_loss (the FedSC code's batch loss) over leading batch dims:
  z0, z1 [..., B, H], r_other [..., H, H] or None; summed over the leading dims."""
  if mu is not None:
    z0, z1 = norm_clip(z0, math.sqrt(mu)), norm_clip(z1, math.sqrt(mu))
  b = z0.shape[-2]
  pos = -2.0 / b * (z1 * z0).sum((-2, -1))
  r_hat = (z1.transpose(-1, -2) @ z1 + z0.transpose(-1, -2) @ z0) / (2 * b)
  frob = (r_hat * r_hat).sum((-2, -1))
  if r_other is None:
    return (pos + frob).sum()
  return (pos + alpha * frob + 2.0 * (1.0 - alpha) * (r_hat * r_other.detach()).sum((-2, -1))).sum()


def calr_matrix(model, views: Sequence[Any], sqrt_mu: Optional[float]):
  """DP-CalR before noise: (1 / (V n)) sum_v sum_b clip(z_vb) clip(z_vb)T, the projector output of
  the V views [n, 3, H, W] in eval mode without gradients."""
  torch = _nn()['torch']
  was = model.training
  model.eval()
  acc = None
  with torch.no_grad():
    for x in views:
      z, _ = model(x, with_predictor=False)
      z = z.float()
      if sqrt_mu is not None:
        z = norm_clip(z, sqrt_mu)
      acc = z.T @ z if acc is None else acc + z.T @ z
  model.train(was)
  return acc / (len(views) * views[0].shape[0])


def cka_distance_to_kernel(a, kbar):
  """ops.cka.cka_distance_to_kernel, centred: a [..., b, d], kbar [..., b, b] -> sum over the
  leading dims of 1 - CKA(a aT, kbar)."""
  torch = _nn()['torch']
  a = a - a.mean(-2, keepdim=True)
  kbar = (kbar - kbar.mean(-2, keepdim=True) - kbar.mean(-1, keepdim=True)
          + kbar.mean((-2, -1), keepdim=True))
  cross = (a * (kbar @ a)).sum((-2, -1))
  kk = ((a.transpose(-1, -2) @ a) ** 2).sum((-2, -1))
  mm = (kbar * kbar).sum((-2, -1))
  return (1.0 - cross / torch.sqrt(kk * mm + 1e-12)).sum()


def conv_divergence(before, after):
  """algorithms/divergence.conv_divergence: mean over the encoder's 4-D kernels of |after - before|."""
  torch = _nn()['torch']
  dists = [torch.linalg.vector_norm((b - a).float()) for a, b in
           zip(before.encoder.parameters(), after.encoder.parameters()) if a.ndim == 4]
  return torch.stack(dists).mean()


def simplex_min_norm(gram, iters: int = 2000):
  """argmin_{p in simplex} pT G p by accelerated projected gradient (ops.min_norm 'exact'), in
  float64 numpy on the host (the FedU2 code's solver is numpy too; an [m, m] problem)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  torch = _nn()['torch']
  g = gram.detach().double().cpu().numpy()
  k = g.shape[0]
  step = 1.0 / max(float(np.linalg.eigvalsh(g).max()), 1e-30)
  idx = np.arange(1, k + 1)

  def project(v):
    u = np.sort(v)[::-1]
    css = np.cumsum(u) - 1
    rho = int(np.nonzero(u - css / idx > 0)[0].max())
    return np.maximum(v - css[rho] / (rho + 1), 0)

  p = y = np.full(k, 1.0 / k)
  t = 1.0
  for _ in range(iters):
    p_new = project(y - step * (g @ y))
    t_new = (1 + math.sqrt(1 + 4 * t * t)) / 2
    y = p_new + (t - 1) / t_new * (p_new - p)
    p, t = p_new, t_new
  return torch.from_numpy(p).to(gram.device)


def eua_coefficients(gram_dev, server_lr: float):
  """algorithms/fedu2.eua_coefficients, 'code' direction, fixed step: coef [m] with
  theta <- theta - sum_k coef_k (theta - theta_k)."""
  torch = _nn()['torch']
  sq = torch.diagonal(gram_dev).clamp_min(0).double()
  norm = sq.sqrt()
  s = torch.where(norm > 0, 2.0 / torch.where(norm > 0, norm, torch.ones_like(norm)),
                  torch.zeros_like(norm))
  p = simplex_min_norm(gram_dev.double() * s[:, None] * s[None, :])
  return server_lr * p * s


# ------------------------------------------------------------------------------------------------
# The rounds.

def client_loss(setting: Setting, online, target, x1, x2, *, priors=None, shared=None, rad=None,
                precision='float32', device='cpu', blocks: int = 1):
  """One local step's loss (gradients flow into `online`), as the official code's client computes
  it; with `blocks` > 1 the rows are `blocks` clients' batches (the union bound) and the per-client
  terms are computed per block and summed.

  priors: fedu2, the FUR prior points of the two views, each [blocks, B, d].
  shared: fedsc, (alpha, R_-j [blocks, H, H]) or None before the first share.
  rad: hetero_ssfl, (RAD images [blocks * b_R, 3, H, W], Kbar sub-blocks [blocks, b_R, b_R], mu).
  """
  torch = _nn()['torch']
  split = lambda t: t.reshape((blocks, -1) + tuple(t.shape[1:])).float()
  # The forwards under autocast; the losses and the methods' terms in float32 (as ours: our
  # models return float32 outputs and the losses run in float32 at every precision).
  with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=precision == 'bfloat16'):
    predict = setting.method != 'fedsc'
    z1, p1 = online(x1, with_predictor=predict)
    z2, p2 = online(x2, with_predictor=predict)
    if target is not None:
      with torch.no_grad():
        t1, _ = target(x1, with_predictor=False)
        t2, _ = target(x2, with_predictor=False)
    a = online(rad[0])[1] if setting.method == 'hetero_ssfl' else None
  if setting.method == 'fedsc':
    alpha, r_other = shared if shared is not None else (1.0, None)
    return sc_loss(split(z1), split(z2), alpha=alpha, r_other=r_other,
                   mu=setting.get('sc_mu')) / blocks
  p1, p2, t1, t2 = (split(v) for v in (p1, p2, t1, t2))
  loss = sum(byol_loss(p1[c], p2[c], t1[c], t2[c]) for c in range(blocks))
  if setting.method == 'fedu2':
    kw = dict(tau_a=setting.get('tau'), tau_b=setting.get('tau'),
              num_iters=setting.get('uot_iters'))
    loss = loss + setting.get('lambda_u') * (fur_uot_loss(split(z1), priors[0], **kw) +
                                             fur_uot_loss(split(z2), priors[1], **kw))
  if setting.method == 'hetero_ssfl':
    loss = loss + rad[2] * cka_distance_to_kernel(split(a), rad[1])
  return loss / blocks


def _sgd(setting: Setting, params):
  torch = _nn()['torch']
  return torch.optim.SGD(params, lr=setting.lr, momentum=setting.momentum,
                         weight_decay=setting.weight_decay)


def _step(setting, online, target, opt, loss):
  torch = _nn()['torch']
  opt.zero_grad(set_to_none=True)
  loss.backward()
  if setting.grad_clip:
    torch.nn.utils.clip_grad_norm_(online.parameters(), setting.grad_clip)
  opt.step()
  if target is not None:
    with torch.no_grad():
      tp = list(target.parameters())
      op = [p for n, p in online.named_parameters() if not n.startswith('predictor.')]
      torch._foreach_mul_(tp, setting.ema)  # pylint: disable=protected-access
      torch._foreach_add_(tp, op, alpha=1 - setting.ema)  # pylint: disable=protected-access


def _average_into(glob, states, weights=None):
  """glob <- the (weighted) mean of the state dicts `states` (parameters and BN buffers)."""
  torch = _nn()['torch']
  w = weights or [1.0 / len(states)] * len(states)
  with torch.no_grad():
    avg = {k: sum(wi * s[k].float() for wi, s in zip(w, states)) for k in states[0]}
    glob.load_state_dict({k: v.to(states[0][k].dtype) for k, v in avg.items()})


def build_round(setting: Setting, *, mode: str = 'loop', precision: str = 'float32',
                channels_last: bool = False, device: Optional[str] = None, threads: int = 0,
                seed: int = 0) -> Callable[[], float]:
  """Returns one_round(): one eager-PyTorch round of `setting` (module docstring) that waits for
  the device and returns the last step's loss.

  Raises ImportError without torch, ValueError for a mode or precision outside MODES / PRECISIONS.
  """
  m = _nn()
  torch = m['torch']
  for name, value, allowed in (('mode', mode, MODES), ('precision', precision, PRECISIONS),
                               ('method', setting.method, METHODS)):
    if value not in allowed:
      raise ValueError(f'{name} = {value!r} is invalid: must be one of {allowed}')
  device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
  if threads:
    torch.set_num_threads(threads)
  if device == 'cuda':  # PyTorch's fastest float32: TF32 tensor cores
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
  fmt = torch.channels_last if channels_last else torch.contiguous_format
  torch.manual_seed(seed)
  s = setting
  place = lambda mod: mod.to(device=device, memory_format=fmt)

  def views(n):
    """[steps][2 views] of [n, 3, H, W] images on the device, in the memory format."""
    return [[torch.rand((n, 3, s.image, s.image), device=device).contiguous(memory_format=fmt)
             for _ in range(2)] for _ in range(s.steps)]
  byol = s.method != 'fedsc'
  d_out = s.heads[0][1]
  # Per cohort: the global (or union) model, and per client its data [E*batches, 2, B, ...].
  cohorts = []
  for enc, count in s.cohorts:
    glob = place(make_online(enc, s.heads, s.image))
    data = ([views(s.batch) for _ in range(count)] if mode == 'loop'
            else [views(s.batch * count)])
    cohorts.append(dict(glob=glob, count=count, data=data))
  rad_x = None
  if s.method == 'hetero_ssfl':
    rad_x = torch.rand((s.get('rad_size'), 3, s.image, s.image), device=device)
    kbar = torch.zeros((s.get('rad_size'),) * 2, device=device)
  sync = lambda: torch.cuda.synchronize() if device == 'cuda' else None

  def terms(count, blocks):
    """The per-step extras of `blocks` client blocks of one cohort."""
    kw = {}
    if s.method == 'fedu2':
      kw['priors'] = [sphere_prior((blocks, s.batch, d_out), device) for _ in range(2)]
    if s.method == 'hetero_ssfl':
      b_r = s.get('rad_batch')
      rows = torch.stack([torch.randperm(s.get('rad_size'), device=device)[:b_r]
                          for _ in range(blocks)])
      kb = torch.stack([kbar[r][:, r] for r in rows])
      kw['rad'] = (rad_x[rows.reshape(-1)], kb, s.get('mu'))
    return kw

  def train(online, target, opt, data, blocks, shared=None):
    loss = None
    for x in data:
      loss = client_loss(s, online, target, x[0], x[1], shared=shared, precision=precision,
                         device=device, blocks=blocks, **terms(1, blocks))
      _step(s, online, target, opt, loss)
    return loss

  if mode == 'union':
    for c in cohorts:
      c['target'] = target_of(c['glob']) if byol else None
      c['opt'] = _sgd(s, c['glob'].parameters())
    h = s.heads[0][1]
    fixed_shared = (s.get('alpha'), torch.eye(h, device=device).expand(
        cohorts[0]['count'], h, h) / h) if s.method == 'fedsc' else None

    def one_union_round():
      loss = None
      for c in cohorts:
        loss = train(c['glob'], c['target'], c['opt'], c['data'][0], c['count'], fixed_shared)
      sync()
      return float(loss.detach())
    return one_union_round

  # The loop: per-client state kept across rounds where the method keeps it.
  for c in cohorts:
    glob = c['glob']
    if s.method in ('hetero_ssfl', 'fedema'):
      c['local'] = [copy.deepcopy(glob) for _ in range(c['count'])]
    if s.method == 'fedema':
      c['targets'] = [target_of(glob) for _ in range(c['count'])]
      c['scaler'] = [0.0] * c['count']
      c['divergence'] = [0.0] * c['count']
    if s.method == 'hetero_ssfl':
      c['targets'] = [target_of(glob) for _ in range(c['count'])]
    if s.method == 'fedu2':
      c['target'] = target_of(glob)  # the global target (EUA's whole-model scope)
  h = s.heads[0][1]
  num = s.clients
  cov = torch.zeros((num, h, h), device=device)
  shares = [0]

  def fedsc_prepare(glob, cohort):
    """DP-CalR of every participant on the global model (the code: every round of the schedule)."""
    sigma = s.get('sigma')
    for k in range(cohort['count']):
      data = cohort['data'][k][:s.batches]  # the client's images: one epoch's batches
      imgs = torch.cat([x[0] for x in data])
      v = [torch.flip(imgs, dims=(3,)) if i % 2 else imgs for i in range(s.get('calr_views'))]
      r = calr_matrix(glob, v, math.sqrt(s.get('sc_mu')))
      cov[k] = r + sigma * torch.randn_like(r)
    shares[0] += 1

  def fedu2_server(glob, target, states, tstates):
    """EUA over the online network and target (flattened), BN buffers averaged."""
    keys = [k for k, v in glob.named_parameters()]
    tkeys = [k for k, v in target.named_parameters()]
    with torch.no_grad():
      g_vec = torch.cat([p.flatten() for p in glob.parameters()] +
                        [p.flatten() for p in target.parameters()])
      devs = torch.stack([g_vec - torch.cat([st[k].flatten() for k in keys] +
                                            [ts[k].flatten() for k in tkeys])
                          for st, ts in zip(states, tstates)])
      coef = eua_coefficients(devs @ devs.T, s.get('server_lr')).to(devs.dtype)
      new = g_vec - coef @ devs
      i = 0
      for p in list(glob.parameters()) + list(target.parameters()):
        p.copy_(new[i:i + p.numel()].view_as(p))
        i += p.numel()
      for mod, sts in ((glob, states), (target, tstates)):
        for name, buf in mod.named_buffers():
          if buf.dtype.is_floating_point:
            buf.copy_(sum(st[name].float() for st in sts) / len(sts))

  def one_round():
    loss = None
    for ci, c in enumerate(cohorts):
      glob, states, tstates = c['glob'], [], []
      if s.method == 'fedsc':
        fedsc_prepare(glob, c)
        q = 1.0 / num
        total = cov.sum(0) * q
      for k in range(c['count']):
        data = c['data'][k]
        if s.method == 'fedu2':
          local, target = copy.deepcopy(glob), copy.deepcopy(c['target'])
          loss = train(local, target, _sgd(s, local.parameters()), data, 1)
          states.append(local.state_dict())
          tstates.append(target.state_dict())
        elif s.method == 'fedsc':
          local = copy.deepcopy(glob)
          r_other = ((total - q * cov[k]) / (1 - q))[None]
          loss = train(local, None, _sgd(s, local.parameters()), data, 1,
                       (s.get('alpha'), r_other))
          states.append(local.state_dict())
        elif s.method == 'fedema':
          local, target = c['local'][k], c['targets'][k]
          with torch.no_grad():
            if c['scaler'][k] == 0.0:  # first participation: everything from the server
              local.load_state_dict(glob.state_dict())
              target.load_state_dict({n: v for n, v in glob.state_dict().items()
                                      if not n.startswith('predictor.')})
            else:
              mu = min(c['scaler'][k] * c['divergence'][k], 1.0)
              for (_, pl), (_, pg) in zip(local.named_parameters(), glob.named_parameters()):
                pl.mul_(mu).add_(pg, alpha=1 - mu)
              for (name, bl), (_, bg) in zip(local.named_buffers(), glob.named_buffers()):
                if not name.startswith('predictor.') or mu <= 0.5:  # EasyFL's BN statistics
                  bl.copy_(bg)
          start = copy.deepcopy(local)
          loss = train(local, target, _sgd(s, local.parameters()), data, 1)
          with torch.no_grad():
            d = float(conv_divergence(start, local))
          c['divergence'][k] = d
          if c['scaler'][k] == 0.0:
            c['scaler'][k] = s.get('autoscaler_tau') / max(d, 1e-12)
          states.append(local.state_dict())
        else:  # hetero_ssfl: personal models, the alignment term, the RAD upload
          local, target = c['local'][k], c['targets'][k]
          loss = train(local, target, _sgd(s, local.parameters()), data, 1)
          with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.bfloat16,
                                               enabled=precision == 'bfloat16'):
            b_r = s.get('rad_batch')
            a = torch.cat([local(rad_x[i:i + b_r])[1].float()
                           for i in range(0, s.get('rad_size'), b_r)])
            states.append(a)
      if s.method == 'fedu2':
        fedu2_server(glob, c['target'], states, tstates)
      elif s.method in ('fedsc', 'fedema'):
        _average_into(glob, states)
      else:
        c['reps'] = states
    if s.method == 'hetero_ssfl':  # Kbar over every client of every cohort, weights 1/N
      with torch.no_grad():
        kbar.copy_(sum(a @ a.T for c in cohorts for a in c['reps']) / num)
    sync()
    return float(loss.detach())
  return one_round
