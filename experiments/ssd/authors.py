r"""SSD / FedAlignUniform trained by the AUTHORS' PyTorch code (github:hc-fang/ssd), scored by ours.

Three steps, two Python environments (issue 68 item 4; docs/notes/ssd.md#ssd-e4):

  # 1. the project's venv: our partition of the quick scale's data (configs/ssd/common.quick_base;
  #    --num_clients 50 the cross-device column, 10 a round)
  python -m experiments.ssd.authors prepare --out /tmp/authors/data.npz --seed 0
  # 2. a torch environment (not the project's): THEIR client / server classes train
  /work/torchenv/bin/python -m experiments.ssd.authors train --data /tmp/authors/data.npz \
      --authors_code /work/ssd_authors_code --method ssd --out /tmp/authors/ssd_seed0.npz
  # 3. the project's venv: the features scored by OUR protocol (evaluation.protocol_metrics)
  python -m experiments.ssd.authors evaluate --data /tmp/authors/data.npz \
      --features /tmp/authors/ssd_seed0.npz --out /tmp/authors/ssd_seed0.json

prepare: the first config.train_size Fashion-MNIST training images, the test split, the dataset's
  mean / std, and the Dirichlet partition's client index lists exactly as a run of that seed draws
  them (`experiment.build_fed_data`), in one .npz (`PREPARED_KEYS`).
train: imports the authors' modules from --authors_code (their tree is never copied here; `wandb`,
  `geoopt`, `tensorloader` and `tqdm` are stubbed in sys.modules, their code does not run them on
  this path), builds a LeNet-5 and an 84-256(BN)-84 projector in torch with our sizes, and runs
  THEIR `FedAlignUniformServer.fit` over THEIR `FedAlignUniformClient`s: their local training
  (SGD momentum 0.9, weight decay 1e-4 by default, optimiser rebuilt every round, losses of
  `methods/loss.py`), their random Q and blocks (`subspace_mode='fixed'`), their aggregation
  (`model_average` weighted by each client's batch count, BatchNorm buffers averaged). The adapter
  sets what SSD-E3 lists: the projector width (`server.dim`, hard-coded 512 there) to 84, the block
  size to --subspace_weight_dim (default floor(84 / K): 8 at K = 10, 1 at 50), each round's client
  lr to the cosine value their server computes and their client ignores, autocast off, the loader's
  last partial batch dropped at K <= 10 and kept above (their rule; --keep_last keeps it at any K);
  the participants are their `select_clients`' (`random.sample` below all); their per-round feature
  extraction and kNN are no-ops here (the features are extracted once, after the last round). The
  views are ours re-implemented in torch (`torch_views`), since torchvision is not installed. Writes
  the encoder's (Tanh 84-d) features of the un-augmented, normalised train and test images,
  trained and at initialisation, and the per-round losses (`FEATURE_KEYS`).
evaluate: `evaluation.protocol_metrics` (the logistic probe and kNN at the label fractions, the code
  path of every quick run's results.json) on both encoders' features; with --ours, the run's own
  results.json 'final' metrics beside them.
table: the evaluate outputs as docs/results/ssd/authors/table.md (numbers, references, verdict).
Only this module's `train` needs torch; the module imports without it.
"""
from __future__ import annotations

import argparse
import copy
import importlib.machinery
import json
import math
import pathlib
import sys
import time
import types
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

PREPARED_KEYS = ('train_x', 'train_y', 'test_x', 'test_y', 'mean', 'std', 'num_classes', 'seed',
                 'alpha', 'clients_per_round', 'client_offsets', 'client_indices', 'dataset')
FEATURE_KEYS = ('trained_train', 'trained_test', 'random_train', 'random_test', 'losses_json',
                'settings_json')
METHODS = ('ssd', 'fedalignuniform')
WEIGHTS = ('batches', 'images')   # how their server weighs a client: theirs, ours
# The coefficients of the authors' scripts (scripts/run_FedAlignUniformSubspace.sh: subspace 1.0,
# distill 0.1, KL; configs/FedAlignUniformSubspace/default.yaml: weight range [10, 10], normalised,
# detached target, mode fixed) and of FedAlignUniform (configs/FedAlignUniform/default.yaml: both
# 0).
METHOD_SETTINGS = {
    'ssd': dict(subspace_coeff=1.0, distill_coeff=0.1, subspace_mode='fixed'),
    'fedalignuniform': dict(subspace_coeff=0.0, distill_coeff=0.0, subspace_mode='none'),
}


# ----------------------------------------------------------------------------------------------
# prepare (project venv)
def quick_config(seed: int, num_clients: int = 10):
  """The quick scale's config (configs/ssd/common.quick_base: Dirichlet 0.1, first 10,000 images)
  at `seed`, in table1's column of `num_clients` (10: cross-silo, all every round; 50:
  cross-device, 10 a round): the partition and the probe's seeds of our run of that cell."""
  from configs.ssd import common, table1  # pylint: disable=g-import-not-at-top
  columns = {c['num_clients']: c for c in table1.COLUMNS_SMALL.values()}
  if num_clients not in columns:
    raise ValueError(f'num_clients = {num_clients} is invalid: the quick table has the columns '
                     f'{sorted(columns)}')
  config = common.quick_base()
  config.update(dict(columns[num_clients], seed=seed))
  return config


def prepare_arrays(config) -> Dict[str, np.ndarray]:
  """`PREPARED_KEYS` for `config`: its dataset (train_x uint8 [N, H, W, C], train_y int32 [N],
  test_x, test_y, mean / std float [C]) and its partition (client c's indices into train_x are
  client_indices[client_offsets[c]:client_offsets[c + 1]], as `experiment.build_fed_data` draws
  them for config.seed)."""
  from fedjax_ssl import experiment  # pylint: disable=g-import-not-at-top
  dataset = experiment.load_data(config)
  _, info = experiment.build_fed_data(config, dataset, on_host=True)
  indices = [np.asarray(i, np.int64) for i in info['indices']]
  offsets = np.concatenate([[0], np.cumsum([len(i) for i in indices])]).astype(np.int64)
  return dict(train_x=dataset.train_x, train_y=np.asarray(dataset.train_y, np.int32),
              test_x=dataset.test_x, test_y=np.asarray(dataset.test_y, np.int32),
              mean=np.asarray(dataset.mean, np.float64), std=np.asarray(dataset.std, np.float64),
              num_classes=np.int64(dataset.num_classes), seed=np.int64(config.seed),
              alpha=np.float64(config.alpha),
              clients_per_round=np.int64(config.clients_per_round), client_offsets=offsets,
              client_indices=np.concatenate(indices), dataset=np.str_(dataset.name))


def client_index_lists(prepared) -> List[np.ndarray]:
  """The clients' index arrays of a prepared .npz (or dict)."""
  off, idx = prepared['client_offsets'], prepared['client_indices']
  return [idx[off[c]:off[c + 1]] for c in range(len(off) - 1)]


# ----------------------------------------------------------------------------------------------
# evaluate (project venv)
def dataset_of(prepared):
  """The prepared arrays as a `Dataset` (what `evaluation.protocol_metrics` reads)."""
  from fedjax_ssl.data.types import Dataset  # pylint: disable=g-import-not-at-top
  return Dataset(name=str(prepared['dataset']), train_x=prepared['train_x'],
                 train_y=prepared['train_y'], test_x=prepared['test_x'],
                 test_y=prepared['test_y'], num_classes=int(prepared['num_classes']),
                 mean=tuple(float(m) for m in prepared['mean']),
                 std=tuple(float(s) for s in prepared['std']))


def score(config, dataset, train_f: np.ndarray, test_f: np.ndarray) -> Dict[str, float]:
  """Our protocol on features train_f float [N, d] / test_f [M, d] of dataset's splits: exactly
  `evaluation.protocol_metrics` (what a run's results.json 'final' holds under probe='logistic')."""
  from fedjax_ssl import evaluation  # pylint: disable=g-import-not-at-top
  n, m = len(dataset.train_y), len(dataset.test_y)
  if train_f.ndim != 2 or test_f.ndim != 2 or len(train_f) != n or len(test_f) != m:
    raise ValueError(f'features of shapes {train_f.shape} / {test_f.shape} are invalid: need '
                     f'[{n}, d] / [{m}, d] (the prepared train / test splits)')
  if not (np.isfinite(train_f).all() and np.isfinite(test_f).all()):
    raise ValueError('features contain non-finite values: the torch run diverged')
  return {k: float(v) for k, v in evaluation.protocol_metrics(config, train_f, test_f,
                                                             dataset).items()}


def evaluate(data: pathlib.Path, features: pathlib.Path,
             ours: Optional[pathlib.Path] = None) -> Dict[str, Any]:
  """{'trained', 'random_init'} metrics of a `train` output, its settings and losses; with `ours`
  (a run's results.json), that run's 'final' and 'random_init' metrics under 'ours'."""
  prepared = dict(np.load(data))
  feats = np.load(features)
  config = quick_config(int(prepared['seed']), len(prepared['client_offsets']) - 1)
  dataset = dataset_of(prepared)
  out: Dict[str, Any] = {
      'settings': json.loads(str(feats['settings_json'])),
      'losses': json.loads(str(feats['losses_json'])),
      'trained': score(config, dataset, feats['trained_train'], feats['trained_test']),
      'random_init': score(config, dataset, feats['random_train'], feats['random_test'])}
  if ours is not None:
    res = json.loads(pathlib.Path(ours).read_text())
    out['ours'] = {k: {m: v for m, v in res[k].items() if isinstance(v, float)}
                   for k in ('final', 'random_init')}
  return out


# ----------------------------------------------------------------------------------------------
# train (torch environment)
def install_stubs() -> None:
  """sys.modules entries for what the authors' modules import but this path never runs: wandb
  (only `wandb.log`, per round), geoopt (imported by methods/loss.py, unused), tensorloader (their
  kNN, replaced), tqdm (progress bars: the identity)."""
  def module(name, **attrs):
    if name not in sys.modules:
      m = types.ModuleType(name)
      m.__dict__.update(attrs)
      # torch._dynamo probes installed modules with importlib.util.find_spec: a spec is needed.
      m.__spec__ = importlib.machinery.ModuleSpec(name, None)
      sys.modules[name] = m
  module('wandb', log=lambda *a, **k: None, init=lambda *a, **k: None)
  module('geoopt')
  module('tensorloader', TensorLoader=None)
  try:
    import tqdm  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    module('tqdm', tqdm=lambda it=None, *a, **k: it)


def torch_models(in_channels: int, feature_dim: int = 84, hidden: int = 256):
  """Our LeNet-5 (fedjax_ssl/models/repshare.LeNet5: conv 6@5 pad 2, ReLU, max-pool 2, conv 16@5
  pad 2, ReLU, max-pool 2, conv 120@3 pad 1, ReLU, global average pool, Linear 120->84, Tanh) and
  the custom projector (models/heads: Linear 84->256, BatchNorm, ReLU, Linear 256->84), in torch
  with torch's default initialisation."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top

  class LeNet5(nn.Module):

    def __init__(self):
      super().__init__()
      self.conv1 = nn.Conv2d(in_channels, 6, 5, padding=2)
      self.conv2 = nn.Conv2d(6, 16, 5, padding=2)
      self.conv3 = nn.Conv2d(16, 120, 3, padding=1)
      self.feature_layer = nn.Linear(120, feature_dim)

    def forward(self, x):
      x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
      x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
      x = torch.relu(self.conv3(x)).mean(dim=(2, 3))
      return torch.tanh(self.feature_layer(x))

  projector = nn.Sequential(nn.Linear(feature_dim, hidden), nn.BatchNorm1d(hidden),
                            nn.ReLU(inplace=True), nn.Linear(hidden, feature_dim))
  return LeNet5(), projector


def torch_views(x, generator, crop_scale=(0.2, 1.0), ratio=(3 / 4, 4 / 3), flip_prob=0.5,
                jitter_prob=0.8, brightness=0.4, contrast=0.4):
  """Our 'fedsc' views for grayscale images, batched in torch (torchvision is not installed):
  RandomResizedCrop(scale 0.2-1, ratio 3/4-4/3) back to the input size by bilinear sampling
  (affine_grid / grid_sample, not torchvision's integer crop box; a box wider than the image is
  clipped to it), horizontal flip 0.5, with probability 0.8 brightness then contrast or the reverse
  (factors U[0.6, 1.4], clipped to [0, 1]; saturation and hue leave one channel unchanged, grayscale
  is the identity on it).

  Args:
    x: float [B, C, H, W] in [0, 1]. generator: torch.Generator.
  Returns:
    float [B, C, H, W] in [0, 1].
  """
  import torch  # pylint: disable=g-import-not-at-top
  b, _, h, w = x.shape
  u = lambda *shape: torch.rand(*shape, generator=generator)
  area = crop_scale[0] + (crop_scale[1] - crop_scale[0]) * u(b)
  log_r = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u(b)
  r = torch.exp(log_r)
  cw = torch.sqrt(area * r).clamp(max=1.0)       # crop width / image width
  ch = torch.sqrt(area / r).clamp(max=1.0)
  cx = (u(b) * (1 - cw) + cw / 2) * 2 - 1          # crop centre in [-1, 1]
  cy = (u(b) * (1 - ch) + ch / 2) * 2 - 1
  flip = torch.where(u(b) < flip_prob, -1.0, 1.0)
  theta = torch.zeros(b, 2, 3)
  theta[:, 0, 0], theta[:, 0, 2] = cw * flip, cx
  theta[:, 1, 1], theta[:, 1, 2] = ch, cy
  grid = torch.nn.functional.affine_grid(theta, list(x.shape), align_corners=False)
  out = torch.nn.functional.grid_sample(x, grid, mode='bilinear', padding_mode='border',
                                        align_corners=False)
  fb = (1 - brightness + 2 * brightness * u(b)).view(b, 1, 1, 1)
  fc = (1 - contrast + 2 * contrast * u(b)).view(b, 1, 1, 1)
  bright = lambda y: (y * fb).clamp(0, 1)
  contr = lambda y: ((y - y.mean(dim=(1, 2, 3), keepdim=True)) * fc
                     + y.mean(dim=(1, 2, 3), keepdim=True)).clamp(0, 1)
  first_b = (u(b) < 0.5).view(b, 1, 1, 1)
  jittered = torch.where(first_b, contr(bright(out)), bright(contr(out)))
  apply = (u(b) < jitter_prob).view(b, 1, 1, 1)
  return torch.where(apply, jittered, out)


class PairLoader:
  """Their `aug_train_loader` contract: iterates (view1, view2) float batches, `len` = batches per
  epoch (their server weighs a client by it). Reshuffled every epoch; drop_last as their loader for
  <= 10 clients (train_fedalignuniform.py:121-125): a client under one batch yields nothing."""

  def __init__(self, images, batch_size: int, drop_last: bool, generator, mean, std):
    self.images, self.batch_size, self.drop_last = images, batch_size, drop_last
    self.generator, self.mean, self.std = generator, mean, std

  def __len__(self):
    n, b = len(self.images), self.batch_size
    return n // b if self.drop_last else -(-n // b)

  def __iter__(self):
    import torch  # pylint: disable=g-import-not-at-top
    perm = torch.randperm(len(self.images), generator=self.generator)
    for i in range(len(self)):
      x = self.images[perm[i * self.batch_size:(i + 1) * self.batch_size]]
      yield tuple((torch_views(x, self.generator) - self.mean) / self.std for _ in range(2))


def encoder_features(encoder, images, mean, std, batch_size: int = 1000) -> np.ndarray:
  """float32 [N, d] features of float [N, C, H, W] images in [0, 1], normalised, eval mode."""
  import torch  # pylint: disable=g-import-not-at-top
  encoder.eval()
  with torch.no_grad():
    out = [encoder((images[i:i + batch_size] - mean) / std).numpy()
           for i in range(0, len(images), batch_size)]
  return np.concatenate(out).astype(np.float32)


def train(data: pathlib.Path, authors_code: pathlib.Path, method: str, rounds: int, seed: int,
          lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 1e-4,
          batch_size: int = 128, local_epochs: int = 1, subspace_weight_dim: Optional[int] = None,
          subspace_weight: float = 10.0, drop_last: Optional[bool] = None, threads: int = 1,
          weights: str = 'batches') -> Dict[str, np.ndarray]:
  """`FEATURE_KEYS` of `method` trained by the authors' classes on the prepared partition.

  subspace_weight_dim None: floor(84 / K) for K clients (their script's n_dimensions // n_clients).
  drop_last None: their loader's rule, drop the last partial batch at K <= 10 and keep it above.
  weights: 'batches', theirs (the server weighs a client by its batch count), or 'images' (by
  its image count n_k, ours), set by wrapping their server module's `model_average`.
  The round's participants: their `select_clients` (all at K = clients_per_round, otherwise
  `random.sample` of clients_per_round), the i-th of them given their i-th subspace.
  """
  if method not in METHODS:
    raise ValueError(f'method = {method!r} is invalid: must be one of {METHODS}')
  if weights not in WEIGHTS:
    raise ValueError(f'weights = {weights!r} is invalid: must be one of {WEIGHTS}')
  authors_code = pathlib.Path(authors_code)
  if not (authors_code / 'methods' / 'fedalignuniform' / 'server.py').is_file():
    raise ValueError(f'--authors_code = {str(authors_code)!r} is invalid: no '
                     'methods/fedalignuniform/server.py there (the github:hc-fang/ssd tree)')
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(threads)
  install_stubs()
  sys.path.insert(0, str(authors_code))
  from fedbox.utils.training import set_seed  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from methods.fedalignuniform import FedAlignUniformClient, FedAlignUniformServer

  prepared = dict(np.load(data))
  num_clients = len(prepared['client_offsets']) - 1
  if not 1 <= int(prepared['clients_per_round']) <= num_clients:
    raise ValueError(f"clients_per_round = {int(prepared['clients_per_round'])} in {data} is "
                     f'invalid: must lie in [1, {num_clients}] (the prepared clients)')
  if subspace_weight_dim is None:
    subspace_weight_dim = 84 // num_clients
  if drop_last is None:
    drop_last = num_clients <= 10
  set_seed(seed)    # their main.py's set_seed (random, numpy, torch), at our run's seed
  to_images = lambda a: torch.from_numpy(a).permute(0, 3, 1, 2).float() / 255.0
  train_x, test_x = to_images(prepared['train_x']), to_images(prepared['test_x'])
  mean = torch.tensor(prepared['mean'], dtype=torch.float32).view(1, -1, 1, 1)
  std = torch.tensor(prepared['std'], dtype=torch.float32).view(1, -1, 1, 1)
  encoder, projector = torch_models(train_x.shape[1])
  random_train = encoder_features(encoder, train_x, mean, std)
  random_test = encoder_features(encoder, test_x, mean, std)
  generator = torch.Generator().manual_seed(seed)
  settings = METHOD_SETTINGS[method]
  losses: List[Dict[str, Any]] = []

  class Client(FedAlignUniformClient):
    """Theirs, with the round's lr applied: their fit rebuilds SGD from self.lr and drops `lr`."""

    def fit(self, global_encoder=None, global_projector=None, lr=None, current_round=None,
            subspace=None):
      self.lr = lr
      res = super().fit(global_encoder=global_encoder, global_projector=global_projector, lr=lr,
                        current_round=current_round, subspace=subspace)
      losses.append({'round': int(current_round), 'client': int(self.id), 'lr': float(lr),
                     'batches': len(self.aug_train_loader),
                     **{k: (None if v is None or not np.isfinite(v) else float(v))
                        for k, v in res.items() if 'loss' in k}})
      return res

  class Server(FedAlignUniformServer):
    """Theirs, without the per-round feature pass and kNN (features are taken after the run);
    it keeps the round's participants for `weights='images'`."""

    def select_clients(self):
      self.selected = super().select_clients()
      return self.selected

    def gen_feat(self):
      self.train_encoder_feature_norm = self.train_projector_feature_norm = [0.0]
      self.test_encoder_feature_norm = self.test_projector_feature_norm = [0.0]

    def knn_test(self):
      return 0.0

  clients = [
      Client(id=c, encoder=copy.deepcopy(encoder),
             projector=copy.deepcopy(projector),
             aug_train_loader=PairLoader(train_x[torch.from_numpy(idx)], batch_size, drop_last,
                                         generator, mean, std),
             train_set=None, local_epochs=local_epochs, lr=lr, momentum=momentum,
             weight_decay=weight_decay, temperature=0.07, uniform_coeff=1.0,
             subspace_coeff=settings['subspace_coeff'], subspace_norm=True, subspace_detach=True,
             distill_coeff=settings['distill_coeff'], distill_method='KL',
             device=torch.device('cpu'), use_autocast=False)
      for c, idx in enumerate(client_index_lists(prepared))]
  server = Server(clients=clients, encoder=copy.deepcopy(encoder),
                  projector=copy.deepcopy(projector), test_set=None,
                  global_rounds=rounds,
                  join_ratio=float(prepared['clients_per_round']) / num_clients,
                  device=torch.device('cpu'),
                  checkpoint_dir=None, subspace_weight_dim=subspace_weight_dim,
                  subspace_weight_range=[subspace_weight, subspace_weight],
                  subspace_mode=settings['subspace_mode'])
  server.dim = projector[-1].out_features   # hard-coded 512 in their server (SSD-E3)
  if settings['subspace_mode'] == 'fixed' and server.dim < len(clients) * subspace_weight_dim:
    raise ValueError(f'subspace_weight_dim = {subspace_weight_dim} is invalid: {len(clients)} '
                     f'clients need {len(clients) * subspace_weight_dim} > {server.dim} dimensions')
  start = time.time()
  module = sys.modules[FedAlignUniformServer.__module__]
  average, used = module.model_average, []

  def weighted(models, batch_counts, *args, **kwargs):
    """Their average (encoder, then projector, each round) with the weights `weights` names,
    recorded."""
    w = ([len(c.aug_train_loader.images) for c in server.selected] if weights == 'images'
         else list(batch_counts))
    used.append(w)
    return average(models, w, *args, **kwargs)

  module.model_average = weighted
  try:
    server.fit()
  finally:
    module.model_average = average
  settings_out = dict(method=method, rounds=rounds, seed=seed, lr=lr, lr_schedule='their cosine',
                      momentum=momentum, weight_decay=weight_decay, batch_size=batch_size,
                      local_epochs=local_epochs, subspace_weight_dim=subspace_weight_dim,
                      subspace_weight=subspace_weight, drop_last=drop_last, threads=threads,
                      weights=weights, round_weights=used[::2],
                      torch=torch.__version__, train_seconds=round(time.time() - start, 1),
                      client_sizes=[len(i) for i in client_index_lists(prepared)],
                      **settings)
  return dict(trained_train=encoder_features(server.encoder, train_x, mean, std),
              trained_test=encoder_features(server.encoder, test_x, mean, std),
              random_train=random_train, random_test=random_test,
              losses_json=np.str_(json.dumps(losses)),
              settings_json=np.str_(json.dumps(settings_out)))


TABLE_METRICS = ('probe_acc', 'probe_acc_10pct', 'probe_acc_1pct', 'knn_acc', 'knn_acc_1pct')
VERDICT_METRICS = ('probe_acc', 'knn_acc')
AUTHORS_WEIGHT_DECAY = 1e-4   # their setting: the verdict's authors column
COLUMN_NAMES = {10: 'silo 10', 50: 'device 50'}


def _is_default(settings: Dict[str, Any]) -> bool:
  """The authors' own setting: their weight decay, their last-batch rule (drop at K <= 10) and
  their batch-count weights."""
  k = len(settings['client_sizes'])
  return (settings['weight_decay'] == AUTHORS_WEIGHT_DECAY
          and settings.get('drop_last', k <= 10) == (k <= 10)
          and settings.get('weights', 'batches') == 'batches')


def our_run(runs: pathlib.Path, method: str, num_clients: int, seed: int) -> Optional[Dict]:
  """Our quick-table run of `method` in the column of `num_clients` at `seed`: results.json's
  'final' and 'random_init' and raw_pixels.json, or None while it has not finished."""
  column = 'silo-10' if num_clients == 10 else f'device-{num_clients}'
  run = pathlib.Path(runs) / f'{method}.fmnist-{column}' / f'seed{seed}'
  if not (run / 'results.json').exists():
    return None
  res = json.loads((run / 'results.json').read_text())
  pixels = run / 'raw_pixels.json'
  return {'final': res['final'], 'random_init': res['random_init'],
          'raw_pixels': json.loads(pixels.read_text()) if pixels.exists() else None}


def _numbers(results, ours) -> List[str]:
  """Per result the authors' trainer and, once per (method, clients, seed), our run."""
  head = ('| method | clients | trainer | seed | weight decay | ' + ' | '.join(TABLE_METRICS)
          + ' | random-init probe_acc | random-init knn_acc |')
  lines = [head, '|' + '---|' * (head.count('|') - 1)]
  pct = lambda d, m: f'{100 * d[m]:.2f}' if m in d else 'n/a'
  seen = set()
  for res in results:
    st = res['settings']
    k = len(st['client_sizes'])
    # Their loader's rule (drop the last partial batch at K <= 10) overridden: said in the column.
    rule = st.get('drop_last', k <= 10) == (k <= 10)
    trainer = ('authors (torch)' + ('' if rule else ', last batch kept' if k <= 10 else
                                    ', dropped')
               + (', image weights' if st.get('weights', 'batches') == 'images' else ''))
    rows = [(trainer, st['weight_decay'], res['trained'], res['random_init'])]
    mine = ours.get((st['method'], k, st['seed']))
    if mine is not None and (st['method'], k, st['seed']) not in seen:
      seen.add((st['method'], k, st['seed']))
      # Our quick scale's weight decay (configs/fedu2/common.quick_base).
      rows.append(('ours (fedjax_ssl)', 0.0, mine['final'], mine['random_init']))
    for trainer, wd, final, init in rows:
      lines.append(f'| {st["method"]} | {k} | {trainer} | {st["seed"]} | {wd:g} | '
                   + ' | '.join(pct(final, m) for m in TABLE_METRICS)
                   + f' | {pct(init, "probe_acc")} | {pct(init, "knn_acc")} |')
  return lines


def _ms(values: Sequence[float]) -> str:
  return (f'{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f}' if len(values) > 1
          else f'{values[0]:.2f}' if values else 'n/a')


def _references(results, ours) -> List[str]:
  """Raw pixels (our runs' raw_pixels.json: the same images, split and protocol serve both
  trainers) and each trainer's random-init encoder, as ranges over the seeds read."""
  lines = []
  for metric in VERDICT_METRICS:
    pixels = [100 * o['raw_pixels'][metric] for o in ours.values()
              if o['raw_pixels'] and metric in o['raw_pixels']]
    # One encoder per (method, clients, seed) whatever the trainer's settings: counted once.
    theirs = list({(r['settings']['method'], len(r['settings']['client_sizes']),
                    r['settings']['seed']): 100 * r['random_init'][metric]
                   for r in results if metric in r['random_init']}.values())
    mine = [100 * o['random_init'][metric] for o in ours.values() if metric in o['random_init']]
    span = lambda v: f'{min(v):.2f}–{max(v):.2f} ({len(v)} runs)' if v else 'n/a'
    lines.append(f'| {metric} | {span(pixels)} | {span(theirs)} | {span(mine)} |')
  return ['| metric | raw pixels | random init, authors (torch) | random init, ours (flax) |',
          '|---|---|---|---|', *lines]


def _verdicts(results, ours) -> List[str]:
  """Ours against the authors' trainer (their setting) per column and method, and SSD >
  FedAlignUniform per trainer and column, by the project's rule (`tables.verdict`: effect beyond
  twice the larger seed std)."""
  from fedjax_ssl import tables  # pylint: disable=g-import-not-at-top  (train runs without jax)
  per = {}   # (trainer, method, k) -> {seed: trained metrics}
  for res in results:
    st = res['settings']
    if _is_default(st):
      per.setdefault(('authors', st['method'], len(st['client_sizes'])), {})[st['seed']] = (
          res['trained'])
  for (method, k, seed), mine in ours.items():
    per.setdefault(('ours', method, k), {})[seed] = mine['final']
  values = lambda key, metric, seeds: [100 * per[key][s].get(metric, math.nan) for s in seeds]

  def judge(hi, lo):   # a metric one side did not record is not judged
    if not all(map(math.isfinite, hi + lo)):
      return {'effect': math.nan, 'spread': math.nan, 'verdict': 'n/a'}
    return tables.verdict(hi, lo)

  # 'effect (probe / kNN) | twice the spread' cells of one row.
  sizes = lambda found: (' / '.join(f'{f["effect"]:+.2f}' for f in found) + ' | '
                         + ' / '.join(f'{2 * f["spread"]:.2f}' for f in found))
  both = ['| column | method | authors | ours | ours − authors (probe / kNN) | twice the spread '
          '| seeds | verdict |', '|---|---|---|---|---|---|---|---|']
  claims = ['| claim | trainer | column | effect (probe / kNN) | twice the spread | seeds | '
            'verdict (probe / kNN) |', '|---|---|---|---|---|---|---|']
  word = {'confirmed': 'ours higher', 'reversed': 'ours lower', 'not confirmed': 'same within '
          'seed noise'}
  for k in sorted({key[2] for key in per}):
    column = COLUMN_NAMES.get(k, f'{k} clients')
    for method in METHODS:
      a, o = per.get(('authors', method, k), {}), per.get(('ours', method, k), {})
      seeds = sorted(set(a) & set(o))
      if not seeds:
        continue
      found = [judge(values(('ours', method, k), m, seeds),
                     values(('authors', method, k), m, seeds)) for m in VERDICT_METRICS]
      show = lambda key: ' / '.join(_ms(values(key, m, seeds)) for m in VERDICT_METRICS)
      both.append(f'| {column} | {method} | {show(("authors", method, k))} | '
                  f'{show(("ours", method, k))} | {sizes(found)} | {len(seeds)} | '
                  + ' / '.join(word.get(f['verdict'], f['verdict']) for f in found) + ' |')
    for trainer in ('authors', 'ours'):
      hi, lo = per.get((trainer, 'ssd', k), {}), per.get((trainer, 'fedalignuniform', k), {})
      seeds = sorted(set(hi) & set(lo))
      if not seeds:
        continue
      found = [judge(values((trainer, 'ssd', k), m, seeds),
                     values((trainer, 'fedalignuniform', k), m, seeds)) for m in VERDICT_METRICS]
      claims.append(f'| SSD > FedAlignUniform | {trainer} | {column} | {sizes(found)} | '
                    f'{len(seeds)} | ' + ' / '.join(f['verdict'] for f in found) + ' |')
  return both + [''] + claims


def table(results: Sequence[Dict[str, Any]], runs: Optional[pathlib.Path] = None) -> str:
  """table.md from `evaluate` outputs: the numbers (per result the authors' trainer and our run of
  the same method, clients and seed: from `runs`, our quick table's runs folder, else from the
  result's 'ours'), the reference rows, and the verdicts (ours against theirs in their setting;
  SSD > FedAlignUniform per trainer); accuracies in %."""
  ours = {}
  for res in results:
    st = res['settings']
    key = (st['method'], len(st['client_sizes']), st['seed'])
    found = our_run(runs, *key) if runs is not None else (
        dict(res['ours'], raw_pixels=None) if 'ours' in res else None)
    if found is not None:
      ours[key] = found
  source = (f'our quick table\'s runs (`{runs}`)' if runs is not None
            else 'the `ours` field of each JSON')
  return '\n'.join([
      '# SSD and FedAlignUniform: the authors\' trainer beside ours (numbers, references, verdict)',
      '', 'Written by `python -m experiments.ssd.authors table` from the JSONs beside this file and '
      f'{source}; how they were made and how to read them: [README.md](README.md).', '',
      '## Numbers (accuracy, %)', '', *_numbers(results, ours), '',
      '## Reference rows (%)', '',
      'The same images, split and protocol for both trainers, so one raw-pixel reference serves '
      'both; each trainer\'s random-init encoder is its own (torch\'s or flax\'s initialisation). '
      'No supervised row was trained by the authors\' code; ours is in the quick table '
      '(docs/results/ssd/fmnist_quick/table.md).', '', *_references(results, ours), '',
      '## Verdict', '',
      'Mean ± sample std over the seeds both sides finished (authors: their setting, weight decay '
      f'{AUTHORS_WEIGHT_DECAY:g} and their last-batch rule; ours: the quick table), probe / kNN in '
      '%. A difference counts when it exceeds twice the larger seed std (`tables.verdict`).', '',
      *_verdicts(results, ours), ''])


# ----------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
  """The subcommands' flags (argparse: `train` runs where absl is not installed)."""
  p = argparse.ArgumentParser(prog='python -m experiments.ssd.authors', description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest='command', required=True)
  pr = sub.add_parser('prepare', help='our partition and data, as .npz (project venv)')
  pr.add_argument('--out', required=True, type=pathlib.Path)
  pr.add_argument('--seed', type=int, default=0)
  pr.add_argument('--num_clients', type=int, default=10, help='10 (silo) or 50 (device)')
  tr = sub.add_parser('train', help="the authors' classes train; features as .npz (torch)")
  tr.add_argument('--data', required=True, type=pathlib.Path)
  tr.add_argument('--authors_code', required=True, type=pathlib.Path)
  tr.add_argument('--method', required=True, choices=METHODS)
  tr.add_argument('--out', required=True, type=pathlib.Path)
  tr.add_argument('--rounds', type=int, default=20)
  tr.add_argument('--seed', type=int, default=None, help="default: the prepared run's seed")
  tr.add_argument('--lr', type=float, default=0.1)
  tr.add_argument('--weight_decay', type=float, default=1e-4, help="their 1e-4; ours is 0")
  tr.add_argument('--subspace_weight_dim', type=int, default=None,
                  help='dimensions per client (default floor(84 / clients))')
  tr.add_argument('--keep_last', action='store_true', default=None,
                  help='keep the last partial batch (default: their rule, kept above 10 clients)')
  tr.add_argument('--threads', type=int, default=1)
  tr.add_argument('--weights', choices=WEIGHTS, default='batches',
                  help="a client's weight in their average: its batch count (theirs) or images")
  ev = sub.add_parser('evaluate', help='our protocol on the features (project venv)')
  ev.add_argument('--data', required=True, type=pathlib.Path)
  ev.add_argument('--features', required=True, type=pathlib.Path)
  ev.add_argument('--out', required=True, type=pathlib.Path)
  ev.add_argument('--ours', type=pathlib.Path, default=None, help="our run's results.json")
  ta = sub.add_parser('table', help='table.md (numbers, references, verdict) of evaluate outputs')
  ta.add_argument('results', nargs='+', type=pathlib.Path)
  ta.add_argument('--runs', type=pathlib.Path, default=None,
                  help="our quick table's runs folder (docs/results/ssd/fmnist_quick/runs)")
  return p


def full_help(p: argparse.ArgumentParser) -> str:
  """Every subcommand's help, for `--helpfull` (absl's name, which the docs test reads)."""
  # pylint: disable-next=protected-access
  subs = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
  return p.format_help() + ''.join(sp.format_help() for sp in subs.choices.values())


def main(argv: Sequence[str]) -> int:
  if list(argv) == ['--helpfull']:
    print(full_help(parser()))
    return 0
  args = parser().parse_args(argv)
  if args.command == 'prepare':
    arrays = prepare_arrays(quick_config(args.seed, args.num_clients))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    sizes = np.diff(arrays['client_offsets']).tolist()
    print(json.dumps({'out': str(args.out), 'client_sizes': sizes}))
  elif args.command == 'train':
    seed = args.seed if args.seed is not None else int(np.load(args.data)['seed'])
    out = train(args.data, args.authors_code, args.method, args.rounds, seed, lr=args.lr,
                weight_decay=args.weight_decay, subspace_weight_dim=args.subspace_weight_dim,
                drop_last=None if args.keep_last is None else False, threads=args.threads,
                weights=args.weights)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(out['settings_json'])
  elif args.command == 'table':
    print(table([json.loads(p.read_text()) for p in args.results], args.runs), end='')
  else:
    res = evaluate(args.data, args.features, args.ours)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    keys = ('probe_acc', 'knn_acc', 'probe_acc_1pct', 'knn_acc_1pct')
    print(json.dumps({k: {m: res[k].get(m) for m in keys}
                      for k in ('trained', 'random_init')}))
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
