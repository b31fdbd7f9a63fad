r"""The benchmark's ResNet-18 FedBYOL round as a training run: what `scripts/gpu_check.sh` runs twice
to time the compile of a first run and of a second run that reads the compilation cache.

  python -m experiments.train --config configs/gpu_round.py --workdir DIR [--cache_dir CACHE]

ResNet-18 with the 512-2048(BN)-512 heads, 10 clients all training every round, batch 64, SGD
with momentum at lr 0.05, `flip` views (the benchmark's model-compute preset), on the synthetic
32x32x3 set (200 images a client: 3 local steps; the compiled program does not depend on the step
count); 2 rounds, the Adam probe and kNN at k = 20 (the references are not what is timed). On a
CPU the round takes minutes: it is meant for a GPU (docs/notes/performance.md#gpu-check).
"""
from fedjax_ssl import experiment


def get_config():
  c = experiment.default_config()
  c.dataset = 'synthetic'
  c.num_clients = 10
  c.clients_per_round = 10
  c.partition = 'iid'
  c.algorithm = 'fedavg'
  c.ssl_method = 'byol'
  c.encoder = 'resnet18'
  c.heads = 'fedu2'
  c.augmentation = 'flip'
  c.rounds = 2
  c.local_epochs = 1
  c.batch_size = 64
  c.lr = 0.05
  c.probe = 'adam'
  c.probe_epochs = 1
  c.probe_std_epochs = 0
  c.knn_k = 20
  c.checkpoint_every = 2
  return c
