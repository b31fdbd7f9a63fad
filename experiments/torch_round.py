"""The benchmark's FedBYOL round in eager PyTorch, as a function (no flags), for `experiments.benchmark`
to time beside the stacked JAX round on the same device. Torch is imported only when called: it is
a benchmark-only extra, never a dependency of the library.

Two ways to run the round's work (`mode`):
  * 'loop': the official codes' per-client loop (EasyFL, FedU2, FedSC). Per participant a fresh copy
    of the global online network, its own target network (kept across rounds), E local steps of
    batch B on two views, BYOL loss, SGD with momentum 0.9 and weight decay 5e-4 at lr 0.05, target
    EMA (0.99) after every step; then FedAvg of the online networks' state dicts (BatchNorm buffers
    included).
  * 'union': ONE model (online, target, optimiser kept across rounds) trained for the same E steps on
    the union batch C x B of the same images: the same FLOPs with no per-client overhead, the bound
    that stacking the clients should approach.

Models: 'small_cnn' (conv16 -> conv32 -> dense256 -> 128, BYOL heads 128-256(BN)-128, 28x28x1) and
'resnet18' (the CIFAR ResNet-18 of fedjax_ssl/models/resnet.py: 3x3 stem, no max-pool, basic blocks
[2, 2, 2, 2], 512-d, with the 'fedu2' heads 512-2048(BN)-512, 32x32x3). Precision: 'float32' (on a
CUDA device TF32 matmuls and convolutions allowed, PyTorch's fastest float32) or 'bfloat16' (autocast;
parameters and optimiser state stay float32, as in fedjax_ssl's bfloat16). `channels_last` stores
activations NHWC (tensor cores' layout). Inputs are pre-made float tensors on the device, two
different views per step, so the timing is model compute only (the benchmark's 'flip' rows).
"""
from __future__ import annotations

import copy
from typing import Callable

MODELS = ('small_cnn', 'resnet18')
MODES = ('loop', 'union')
PRECISIONS = ('float32', 'bfloat16')
_SHAPES = {'small_cnn': (1, 28, 28), 'resnet18': (3, 32, 32)}  # C, H, W
_HEADS = {'small_cnn': (128, 256, 128), 'resnet18': (512, 2048, 512)}  # in, hidden, out
LR, MOMENTUM, WEIGHT_DECAY, EMA = 0.05, 0.9, 5e-4, 0.99


def _networks(model: str):
  """(online_factory, target_of(online)) for `model`: online = encoder + projector + predictor."""
  from torch import nn  # pylint: disable=g-import-not-at-top

  def mlp(i, h, o):
    return nn.Sequential(nn.Linear(i, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, o))

  def conv_bn(cin, cout, k, stride):
    return [nn.Conv2d(cin, cout, k, stride, padding=k // 2, bias=False), nn.BatchNorm2d(cout)]

  class Basic(nn.Module):
    def __init__(self, cin, planes, stride):
      super().__init__()
      self.residual = nn.Sequential(*conv_bn(cin, planes, 3, stride), nn.ReLU(),
                                    *conv_bn(planes, planes, 3, 1))
      self.shortcut = (nn.Sequential(*conv_bn(cin, planes, 1, stride))
                       if stride != 1 or cin != planes else nn.Identity())

    def forward(self, x):
      return nn.functional.relu(self.residual(x) + self.shortcut(x))

  def resnet18():
    blocks, cin = [*conv_bn(3, 64, 3, 1), nn.ReLU()], 64
    for i, planes in enumerate((64, 128, 256, 512)):
      for j in range(2):
        blocks.append(Basic(cin, planes, 2 if i > 0 and j == 0 else 1))
        cin = planes
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten())

  def small_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(32 * 7 * 7, 256), nn.ReLU(), nn.Linear(256, 128))

  heads = _HEADS[model]

  class Online(nn.Module):
    def __init__(self):
      super().__init__()
      self.encoder = resnet18() if model == 'resnet18' else small_cnn()
      self.projector, self.predictor = mlp(*heads), mlp(heads[2], heads[1], heads[2])

  def target_of(online):
    return nn.Sequential(copy.deepcopy(online.encoder), copy.deepcopy(online.projector))
  return Online, target_of


def build_round(clients: int, local_steps: int, batch_size: int, *, model: str = 'small_cnn',
                mode: str = 'loop', precision: str = 'float32', channels_last: bool = False,
                device: str | None = None, threads: int = 0, seed: int = 0) -> Callable[[], float]:
  """Returns one_round(): one eager-PyTorch FedBYOL round (module docstring) that waits for the
  device and returns the last step's loss.

  Args:
    clients: the round's participants (C); local_steps: E; batch_size: B (per client).
    model, mode, precision: one of MODELS, MODES, PRECISIONS.
    channels_last: NHWC activations and weights (torch.channels_last).
    device: 'cuda' or 'cpu' (default: cuda when available).
    threads: torch's CPU threads (0 = torch's default).
  Raises ImportError without torch, ValueError for a value outside the tuples above.
  """
  import torch  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as F  # pylint: disable=g-import-not-at-top
  for name, value, allowed in (('model', model, MODELS), ('mode', mode, MODES),
                               ('precision', precision, PRECISIONS)):
    if value not in allowed:
      raise ValueError(f'{name} = {value!r} is invalid: must be one of {allowed}')
  device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
  if threads:
    torch.set_num_threads(threads)
  if device == 'cuda':  # PyTorch's fastest float32: TF32 tensor cores for matmuls and convolutions
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
  memory_format = torch.channels_last if channels_last else torch.contiguous_format
  torch.manual_seed(seed)
  online_cls, target_of = _networks(model)

  def place(module):
    return module.to(device=device, memory_format=memory_format)
  glob = place(online_cls())
  shape = _SHAPES[model]
  # [C, E, 2 views, B, ch, H, W]: every participant's every step, made once on the device.
  data = torch.rand((clients, local_steps, 2, batch_size) + shape, device=device)
  if channels_last:
    data = [[[v.contiguous(memory_format=torch.channels_last) for v in step] for step in c]
            for c in data]

  def byol(p, t):
    return (2 - 2 * F.cosine_similarity(p, t.detach(), dim=-1)).mean()

  def train(model_, target, opt, views_per_step):
    loss = None
    for x1, x2 in views_per_step:
      with torch.autocast(device_type=device, dtype=torch.bfloat16,
                          enabled=precision == 'bfloat16'):
        p1 = model_.predictor(model_.projector(model_.encoder(x1)))
        p2 = model_.predictor(model_.projector(model_.encoder(x2)))
        with torch.no_grad():
          t1, t2 = target(x1), target(x2)
        loss = byol(p1.float(), t2.float()) + byol(p2.float(), t1.float())
      opt.zero_grad(set_to_none=True)
      loss.backward()
      opt.step()
      with torch.no_grad():
        online = list(model_.encoder.parameters()) + list(model_.projector.parameters())
        torch._foreach_mul_(list(target.parameters()), EMA)  # pylint: disable=protected-access
        torch._foreach_add_(list(target.parameters()), online, alpha=1 - EMA)  # pylint: disable=protected-access
    return loss

  def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)

  def wait(loss):
    if device == 'cuda':
      torch.cuda.synchronize()
    return float(loss.detach())

  if mode == 'union':
    target = target_of(glob)
    opt = sgd(glob.parameters())

    def union_views():
      for s in range(local_steps):
        yield (torch.cat([data[c][s][0] for c in range(clients)]),
               torch.cat([data[c][s][1] for c in range(clients)]))

    def one_union_round():
      return wait(train(glob, target, opt, union_views()))
    return one_union_round

  targets = [target_of(glob) for _ in range(clients)]

  def one_round():
    states, loss = [], None
    for c in range(clients):
      local = copy.deepcopy(glob)
      loss = train(local, targets[c], sgd(local.parameters()),
                   ((data[c][s][0], data[c][s][1]) for s in range(local_steps)))
      states.append(local.state_dict())
    with torch.no_grad():
      avg = {k: sum(s[k].float() for s in states) / len(states) for k in states[0]}
      glob.load_state_dict({k: v.to(states[0][k].dtype) for k, v in avg.items()})
    return wait(loss)
  return one_round
