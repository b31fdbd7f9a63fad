r"""The benchmark round in eager PyTorch, clients one after another (how the official codes run).

  pip install torch            # not a dependency of fedjax_ssl; only this script uses it
  python -m experiments.torch_reference --clients 10

Same work as `experiments.benchmark --models=small_cnn --augmentation=none`: per client a fresh
copy of the global online network (small CNN conv16 -> conv32 -> dense256 -> 128, BYOL projector and
predictor 128-256(BN)-128), its own target network, 5 local steps of batch 64 on two views, BYOL loss,
SGD with momentum 0.9 and weight decay 5e-4, target EMA after every step, then FedAvg of the online
networks. Inputs are pre-made float tensors (augmentation excluded on both sides). Prints seconds
per round (median of --repeats after a warm-up round).
"""
from __future__ import annotations

import copy
import statistics
import time

from absl import app, flags

_CLIENTS = flags.DEFINE_integer('clients', 10, 'Clients per round.')
_STEPS = flags.DEFINE_integer('local_steps', 5, 'Local steps per client.')
_BATCH = flags.DEFINE_integer('batch_size', 64, 'Local batch size.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed rounds.')
_THREADS = flags.DEFINE_integer('threads', 0, 'torch.set_num_threads (0 = torch default).')


def main(argv):
  del argv
  import torch
  from torch import nn
  import torch.nn.functional as F
  if _THREADS.value:
    torch.set_num_threads(_THREADS.value)

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
  data = [torch.rand(_STEPS.value, 2, _BATCH.value, 1, 28, 28) for _ in range(_CLIENTS.value)]
  targets = [nn.Sequential(copy.deepcopy(glob.encoder), copy.deepcopy(glob.projector))
             for _ in range(_CLIENTS.value)]

  def one_round():
    states = []
    for c in range(_CLIENTS.value):
      model = copy.deepcopy(glob)
      target = targets[c]
      opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
      for s in range(_STEPS.value):
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

  one_round()
  times = []
  for _ in range(_REPEATS.value):
    t0 = time.perf_counter()
    one_round()
    times.append(time.perf_counter() - t0)
  print(f'torch {torch.__version__}, threads {torch.get_num_threads()}: {_CLIENTS.value} clients x '
        f'{_STEPS.value} steps x batch {_BATCH.value}: {statistics.median(times):.3f} s per round '
        f'(median of {_REPEATS.value}; all: {[round(t, 3) for t in times]})')


if __name__ == '__main__':
  app.run(main)
