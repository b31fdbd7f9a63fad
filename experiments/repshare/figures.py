r"""Figures 4 and 5 of the representation-sharing paper from an `experiments.reproduce` output of
configs/repshare/table1.py.

  python -m experiments.repshare.figures --out docs/results/repshare/fmnist_quick

Fig. 4 (OUT/fig4_accuracy.png): test accuracy against rounds, one panel per framework and row per
  N, the client mean with a band of +-1 std over clients (seeds averaged: mean of the client means,
  mean of the client stds), from every run's metrics.jsonl.
Fig. 5 (OUT/fig5_embedding.png): the feature space of the N = 2 runs (FL, Ours, IL; seed 0) after
  the last round: penultimate-layer features of 1,000 test images under each client's model,
  projected to 2-D by PCA fitted jointly on both clients' features (the paper uses t-SNE, which
  needs scikit-learn, not a dependency of this library). Colour = class, marker = client.
"""
from __future__ import annotations

import pathlib

from absl import app, flags
import jax
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from fedjax_ssl import experiment  # pylint: disable=wrong-import-position
from fedjax_ssl.runs import plotting  # pylint: disable=wrong-import-position
from fedjax_ssl.core import round as rd  # pylint: disable=wrong-import-position
from fedjax_ssl.runs.run_dir import RunDir  # pylint: disable=wrong-import-position

FRAMEWORKS = ('il', 'fl', 'fd', 'ours', 'cl')
NAMES = {'il': 'IL', 'fl': 'FL', 'fd': 'FD', 'ours': 'Ours', 'cl': 'CL'}


def _curves(run_dirs):
  """(rounds, mean of client means, mean of client stds) over the seeds' metrics.jsonl files."""
  per_seed = []
  for d in run_dirs:
    recs = [r for r in RunDir(d).read_metrics() if 'test_acc' in r]
    per_seed.append({r['round']: (r['test_acc'], r.get('test_acc_client_std', 0.0)) for r in recs})
  rounds = sorted(set.intersection(*(set(s) for s in per_seed)))
  mean = np.array([np.mean([s[r][0] for s in per_seed]) for r in rounds])
  std = np.array([np.mean([s[r][1] for s in per_seed]) for r in rounds])
  return np.array(rounds), mean, std


def fig4(out: pathlib.Path, column: str) -> pathlib.Path:
  runs = out / 'runs'
  ns = (2, 5, 10)
  fig, axes = plt.subplots(len(ns), 4, figsize=(14, 3 * len(ns)), sharex=True, sharey=True)
  for i, n in enumerate(ns):
    cl = sorted((runs / f'cl.{column}-n-2').glob('seed*'))
    for j, fw in enumerate(('il', 'fl', 'fd', 'ours')):
      ax = axes[i, j]
      seeds = sorted((runs / f'{fw}.{column}-n-{n}').glob('seed*'))
      seeds = [s for s in seeds if RunDir(s).results_file.exists()]
      if seeds:
        r, m, s = _curves(seeds)
        ax.plot(r, 100 * m, label=f'{NAMES[fw]} ({len(seeds)} seeds)')
        ax.fill_between(r, 100 * (m - s), 100 * (m + s), alpha=0.3)
      cl = [s for s in cl if RunDir(s).results_file.exists()]
      if cl:
        r, m, _ = _curves(cl)
        ax.plot(r, 100 * m, 'k--', lw=0.8, label='CL')
      ax.set_title(f'{NAMES[fw]}, N = {n}')
      ax.grid(alpha=0.3)
      ax.legend(loc='lower right', fontsize=8)
      if j == 0:
        ax.set_ylabel('test accuracy (%)')
      if i == len(ns) - 1:
        ax.set_xlabel('round')
  fig.suptitle('Test accuracy vs rounds: client mean, band = +-1 std over clients '
               '(the paper\'s Fig. 4)')
  fig.tight_layout()
  path = out / 'fig4_accuracy.png'
  plotting.save_figure(fig, path, dpi=110)
  plt.close(fig)
  return path


def _features(workdir: pathlib.Path, num_images: int):
  """[clients, num_images, d] features of the first test images and their labels, last round."""
  rundir = RunDir(workdir)
  config = rundir.read_config()
  dataset = experiment.load_data(config)
  fed_data, _ = experiment.build_fed_data(config, dataset)
  algo = experiment.build_algorithm(config, dataset, client_sizes=np.asarray(fed_data.n))
  init_key, _ = experiment.run_keys(config)
  template = jax.eval_shape(lambda k: rd.init_state(algo, k, config.num_clients), init_key)
  with rundir.checkpointer(read_only=True) as ckpt:
    _, state, _ = ckpt.restore(template)
  variables, per_client = algo.eval_variables(state)
  feats = np.asarray(experiment.encoder_features(algo, variables, per_client,
                                                 dataset.test_x[:num_images], dataset))
  if not per_client:  # FL: every client holds the global model
    feats = np.stack([feats] * config.num_clients)
  return feats, dataset.test_y[:num_images]


def fig5(out: pathlib.Path, column: str, num_images: int = 1000) -> pathlib.Path:
  fws = ('fl', 'ours', 'il')
  fig, axes = plt.subplots(1, len(fws), figsize=(5 * len(fws), 4.6))
  for ax, fw in zip(axes, fws):
    workdir = out / 'runs' / f'{fw}.{column}-n-2' / 'seed0'
    if not RunDir(workdir).results_file.exists():
      ax.set_title(f'{NAMES[fw]}: no finished run')
      continue
    feats, labels = _features(workdir, num_images)
    flat = feats.reshape(-1, feats.shape[-1])
    centred = flat - flat.mean(0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    emb = (centred @ vt[:2].T).reshape(feats.shape[0], -1, 2)
    for client, marker in zip(range(feats.shape[0]), ('o', '^')):
      ax.scatter(emb[client, :, 0], emb[client, :, 1], c=labels, cmap='tab10', s=6,
                 marker=marker, alpha=0.6, label=f'client {client}')
    ax.set_title(f'{NAMES[fw]}, N = 2, last round')
    ax.legend(fontsize=8, markerscale=2)
  fig.suptitle('Feature space of both clients (PCA of 1,000 test images; colour = class)')
  fig.tight_layout()
  path = out / 'fig5_embedding.png'
  plotting.save_figure(fig, path, dpi=110)
  plt.close(fig)
  return path


def define_flags() -> None:
  """The binary's flags; defined only when it runs, so that any two binaries (whose flag names
  overlap) can be imported in one process, as the tests do."""
  flags.DEFINE_string('out', None, 'experiments.reproduce output directory (with runs/).',
                      required=True)
  flags.DEFINE_string('dataset_label', 'fashion-mnist', 'column slug of the runs.')


def main(argv):
  del argv
  out = pathlib.Path(flags.FLAGS.out)
  for path in (fig4(out, flags.FLAGS.dataset_label), fig5(out, flags.FLAGS.dataset_label)):
    print(path)


if __name__ == '__main__':
  define_flags()
  app.run(main)
