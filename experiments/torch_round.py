"""The benchmark's FedBYOL round in eager PyTorch, as a function (no flags, so that
`experiments.benchmark` can time it in its own process). Torch is imported only when called.

Per client a fresh copy of the global online network (small CNN conv16 -> conv32 -> dense256 -> 128,
BYOL projector and predictor 128-256(BN)-128), its own target network, E local steps of batch B on
two views, BYOL loss, SGD with momentum 0.9 and weight decay 5e-4, target EMA after every step, then
FedAvg of the online networks. Inputs are pre-made float tensors, two different ones per step.
"""
from __future__ import annotations

import copy
from typing import Callable


def build_round(clients: int, local_steps: int, batch_size: int, threads: int = 0) -> Callable[[], None]:
  """Returns one_round(): one eager-PyTorch FedBYOL round of the benchmark's work (module docstring).

  Raises ImportError without torch.
  """
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as F  # pylint: disable=g-import-not-at-top
  if threads:
    torch.set_num_threads(threads)

  def mlp():
    return nn.Sequential(nn.Linear(128, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 128))

  class Online(nn.Module):
    def __init__(self):
      super().__init__()
      self.encoder = nn.Sequential(
          nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
          nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
          nn.Linear(32 * 7 * 7, 256), nn.ReLU(), nn.Linear(256, 128))
      self.projector, self.predictor = mlp(), mlp()

  def byol(p, t):
    return (2 - 2 * F.cosine_similarity(p, t.detach(), dim=-1)).mean()

  torch.manual_seed(0)
  glob = Online()
  data = [torch.rand(local_steps, 2, batch_size, 1, 28, 28) for _ in range(clients)]
  targets = [nn.Sequential(copy.deepcopy(glob.encoder), copy.deepcopy(glob.projector))
             for _ in range(clients)]

  def one_round():
    states = []
    for c in range(clients):
      model = copy.deepcopy(glob)
      target = targets[c]
      opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
      for s in range(local_steps):
        x1, x2 = data[c][s, 0], data[c][s, 1]
        p1 = model.predictor(model.projector(model.encoder(x1)))
        p2 = model.predictor(model.projector(model.encoder(x2)))
        with torch.no_grad():
          t1, t2 = target(x1), target(x2)
        loss = byol(p1, t2) + byol(p2, t1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
          online = list(model.encoder.parameters()) + list(model.projector.parameters())
          for tp, op in zip(target.parameters(), online):
            tp.mul_(0.99).add_(op, alpha=0.01)
      states.append(model.state_dict())
    with torch.no_grad():
      avg = {k: sum(s[k].float() for s in states) / len(states) for k in states[0]}
      glob.load_state_dict({k: v.to(states[0][k].dtype) for k, v in avg.items()})

  return one_round
