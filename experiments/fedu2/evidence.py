r"""Representation geometry of trained runs: Wang-Isola alignment and uniformity, the covariance
spectrum and its effective rank (FedU2's dimensional-collapse argument, its Fig. 3).

  python -m experiments.fedu2.evidence --out docs/results/fedu2/fmnist_quick

Reads every run under OUT/runs/<cell>/seed<k> written by experiments.reproduce, restores its last
checkpoint (read-only) and the run's own random-init encoder, and measures on the test split
  * uniformity: log mean exp(-2 |f(x) - f(x')|^2) over pairs of --num_images l2-normalised backbone
    features (lower = more uniform on the sphere);
  * alignment: mean |f(v1) - f(v2)|^2 over two augmented views of the same images (the run's
    augmentation; lower = better aligned);
  * spectrum: singular values of the feature covariance of all test images; effective rank.
Writes OUT/geometry.json, OUT/geometry.md (mean +- std over seeds per cell; with --claims
ssd>fedalignuniform,... a verdict per claim, column and metric) and OUT/spectrum.png (log singular
values, mean over seeds, per cell, random init dashed). --render_only rewrites geometry.md from
geometry.json.

Checkpoints are not committed (HARN-15), so a clone, or a table finished across machines, holds
some runs' checkpoints only. A run without one keeps its entry of the previous geometry.json when
that entry was measured on the same results.json (its sha256 is stored beside the measurement) and
with the same --num_images; otherwise it is listed in geometry.md as not measured.
"""
from __future__ import annotations

import collections
import hashlib
import json
import pathlib
import statistics

from absl import app, flags
import jax
import jax.numpy as jnp
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np

from fedjax_ssl import experiment
from fedjax_ssl.runs import plotting
from fedjax_ssl.core import round as rd
from fedjax_ssl.data import augment
from fedjax_ssl.eval import geometry
from fedjax_ssl.runs.run_dir import RunDir
from fedjax_ssl.ssl.losses import l2_normalize


METRICS = ('uniformity', 'alignment', 'effective_rank')


def measure(algo, state, dataset, config, num_images: int) -> dict:
  """Geometry of one state's evaluated encoder on the test split."""
  variables, per_client = algo.eval_variables(state)
  if per_client:
    raise ValueError(f'{algo.name}: personalised encoders are not supported here')
  feats = np.asarray(experiment.encoder_features(algo, variables, False, dataset.test_x, dataset))
  sub = dataset.test_x[:num_images]
  aug = augment.preset(config.augmentation, dataset.image_shape[0])
  views = []
  for k in jax.random.split(jax.random.PRNGKey(0), 2):
    x = augment.augment_batch(k, jnp.asarray(sub), aug)
    x = (np.asarray(augment.normalize(x, dataset.mean, dataset.std)))
    views.append(np.asarray(algo.encoder_apply(variables, jnp.asarray(x))))
  z = l2_normalize(jnp.asarray(feats[:num_images]))
  spectrum = np.asarray(geometry.covariance_spectrum(jnp.asarray(feats)))
  return {'uniformity': float(geometry.uniformity(z)),
          'alignment': float(geometry.alignment(l2_normalize(jnp.asarray(views[0])),
                                                l2_normalize(jnp.asarray(views[1])))),
          'effective_rank': float(geometry.effective_rank(jnp.asarray(feats))),
          'spectrum': spectrum.tolist()}


def results_digest(workdir: pathlib.Path) -> str:
  """sha256 of the run's results.json: which finished run a measurement belongs to."""
  return hashlib.sha256(RunDir(workdir).results_file.read_bytes()).hexdigest()


def measure_run(workdir: pathlib.Path, datasets: dict, num_images: int) -> dict | None:
  """The trained and random-init geometry of one finished run, with its results_digest and
  num_images; None when the run has no checkpoint here."""
  rundir = RunDir(workdir)
  if not rundir.checkpoints.is_dir():
    return None
  config = rundir.read_config()
  key = (config.dataset, config.train_size)
  if key not in datasets:
    datasets[key] = experiment.load_data(config)
  dataset = datasets[key]
  # The run's client sizes: FedSC's privacy plan (and so its algorithm) depends on them.
  sizes = experiment.build_fed_data(config, dataset)[0].n
  algo = experiment.build_algorithm(config, dataset, client_sizes=sizes)
  init_key, _ = experiment.run_keys(config)
  random_state = rd.init_state(algo, init_key, config.num_clients)
  with rundir.checkpointer(read_only=True) as ckpt:
    if ckpt.latest_round() is None:
      return None
    _, trained, _ = ckpt.restore(random_state)
  return {'trained': measure(algo, trained, dataset, config, num_images),
          'random_init': measure(algo, random_state, dataset, config, num_images),
          'results_sha256': results_digest(workdir), 'num_images': num_images}


def kept_entry(previous: dict, workdir: pathlib.Path, num_images: int) -> dict | None:
  """The previous geometry.json's entry for this run when it was measured on the same
  results.json and num_images; None otherwise (absent, the run redone since, or another sample)."""
  entry = previous.get(workdir.parent.name, {}).get(workdir.name)
  if (entry is None or entry.get('results_sha256') != results_digest(workdir)
      or entry.get('num_images') != num_images):
    return None
  return entry


def _mean_std(values):
  return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


# Which way is better per metric: lower uniformity (more uniform on the sphere), lower alignment
# (views closer), higher effective rank (more dimensions used).
HIGHER_IS_BETTER = {'uniformity': False, 'alignment': False, 'effective_rank': True}


def parse_claim(text: str) -> tuple:
  """'A>B' -> ('A', 'B'): row A's geometry better than row B's in every column both ran."""
  better, sep, worse = text.partition('>')
  if not sep or not better.strip() or not worse.strip():
    raise ValueError(f'--claims entry {text!r} is invalid: must be ROW>ROW, e.g. '
                     'ssd>fedalignuniform (the cell names before the first ".")')
  return better.strip(), worse.strip()


def verdict_lines(results: dict, claims) -> list:
  """The verdict section of geometry.md: for each claim (better row, worse row) and each column
  (the cell name after the row's ".") both rows ran, per METRICS the effect (better minus worse,
  signed so that > 0 is better: HIGHER_IS_BETTER), the larger seed std and `tables.verdict`'s word,
  over the seeds both cells have."""
  from fedjax_ssl import tables  # pylint: disable=g-import-not-at-top
  lines = ['| claim | column | metric | effect | spread | seeds | verdict |',
           '|---|---|---|---|---|---|---|']
  for better, worse in claims:
    columns = sorted({c.split('.', 1)[1] for c in results if c.split('.', 1)[0] == better} &
                     {c.split('.', 1)[1] for c in results if c.split('.', 1)[0] == worse})
    for column in columns:
      hi, lo = results[f'{better}.{column}'], results[f'{worse}.{column}']
      seeds = sorted(set(hi) & set(lo))
      for m in METRICS:
        sign = 1.0 if HIGHER_IS_BETTER[m] else -1.0
        found = tables.verdict([sign * hi[s]['trained'][m] for s in seeds],
                               [sign * lo[s]['trained'][m] for s in seeds])
        lines.append(f'| {better} > {worse} | {column} | {m} | {found["effect"]:+.3f} | '
                     f'{found["spread"]:.3f} | {found["n"]} | {found["verdict"]} |')
  return lines


def markdown(results: dict, claims=(), missing=()) -> str:
  """geometry.md: mean ± std over seeds per cell, the first run's random init, the finished runs
  `missing` from `results` ('cell/seedK', not measured), and with `claims` a verdict section
  (`verdict_lines`)."""
  lines = ['| cell | seeds | ' + ' | '.join(METRICS) + ' |', '|---|---|' + '---|' * len(METRICS)]
  for cell, seeds in sorted(results.items()):
    cols = [f'{m:.3f} ± {s:.3f}' for m, s in
            (_mean_std([r['trained'][k] for r in seeds.values()]) for k in METRICS)]
    lines.append(f'| {cell} | {len(seeds)} | ' + ' | '.join(cols) + ' |')
  for r in [r['random_init'] for seeds in results.values() for r in seeds.values()][:1]:
    lines.append('| random init (first run) | 1 | ' + ' | '.join(f'{r[k]:.3f}' for k in METRICS)
                 + ' |')
  if missing:
    lines += ['', f'Not measured ({len(missing)} finished runs with no entry: no checkpoint where '
              'geometry.json was written and no earlier measurement of the same results.json): '
              + ', '.join(missing) + '.']
  if claims:
    lines += ['', '## Verdict', '',
              'Effect = better row − worse row, signed so that > 0 means better (lower uniformity '
              'and alignment, higher effective rank), over the seeds both cells have; spread = the '
              'larger seed std. *Confirmed* needs effect > 2 × spread, *reversed* effect < −2 × '
              'spread.', '', *verdict_lines(results, claims)]
  return '\n'.join(lines) + '\n'


def finished_runs(out: pathlib.Path) -> list:
  """OUT/runs/<cell>/seed<k> directories holding a results.json, sorted."""
  return sorted(p.parent for p in (out / 'runs').glob('*/seed*/results.json'))


def missing_runs(out: pathlib.Path, results: dict) -> list:
  """'cell/seedK' of the finished runs under OUT that `results` has no entry for."""
  return [f'{r.parent.name}/{r.name}' for r in finished_runs(out)
          if r.name not in results.get(r.parent.name, {})]


def define_flags() -> None:
  """The binary's flags; defined only when it runs, so that tests can import this module beside
  `experiments.reproduce`, whose --out would clash."""
  flags.DEFINE_string('out', None, 'An experiments.reproduce output directory.', required=True)
  flags.DEFINE_integer('num_images', 2000, 'Test images for uniformity and alignment.')
  flags.DEFINE_list('claims', [], 'ROW>ROW pairs judged per column in geometry.md, e.g. '
                    'ssd>fedalignuniform (rows: the cell names before the first ".").')
  flags.DEFINE_bool('render_only', False, 'Rewrite geometry.md from geometry.json, measuring '
                    'nothing.')


def main(argv):
  del argv
  out = pathlib.Path(flags.FLAGS.out)
  try:
    claims = [parse_claim(c) for c in flags.FLAGS.claims]
  except ValueError as e:
    raise SystemExit(f'error: {e}') from None
  if flags.FLAGS.render_only:
    if not (out / 'geometry.json').exists():
      raise SystemExit(f'error: --render_only: {out / "geometry.json"} does not exist: run '
                       'without --render_only first')
    results = json.loads((out / 'geometry.json').read_text())
    (out / 'geometry.md').write_text(markdown(results, claims, missing_runs(out, results)))
    print((out / 'geometry.md').read_text(), end='')
    return
  runs = finished_runs(out)
  if not runs:
    raise SystemExit(f'error: no finished runs under {out / "runs"}')
  previous = (json.loads((out / 'geometry.json').read_text())
              if (out / 'geometry.json').exists() else {})
  datasets, results = {}, collections.defaultdict(dict)
  for run in runs:
    entry = measure_run(run, datasets, flags.FLAGS.num_images)
    how = 'measured'
    if entry is None:
      entry, how = kept_entry(previous, run, flags.FLAGS.num_images), 'kept from geometry.json'
    if entry is None:
      print(run.parent.name, run.name, 'not measured: no checkpoint', flush=True)
      continue
    results[run.parent.name][run.name] = entry
    print(run.parent.name, run.name, how, {k: round(entry['trained'][k], 4) for k in METRICS},
          flush=True)
  if not results:
    raise SystemExit(f'error: no run under {out / "runs"} has a checkpoint or an earlier '
                     'measurement in geometry.json')
  (out / 'geometry.json').write_text(json.dumps(results, indent=1))
  ref = [r['random_init'] for seeds in results.values() for r in seeds.values()][:1]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for cell, seeds in sorted(results.items()):
    spec = np.mean([r['trained']['spectrum'] for r in seeds.values()], axis=0)
    ax.plot(np.log10(np.maximum(spec, 1e-12)), label=cell)
  for r in ref:
    ax.plot(np.log10(np.maximum(r['spectrum'], 1e-12)), 'k--', label='random init')
  ax.set_xlabel('singular value index')
  ax.set_ylabel('log10 singular value of the feature covariance')
  ax.set_title('Test-set feature spectrum (mean over seeds)')
  ax.legend(fontsize=7)
  fig.tight_layout()
  plotting.save_figure(fig, out / 'spectrum.png', dpi=120)
  plt.close(fig)
  (out / 'geometry.md').write_text(markdown(results, claims, missing_runs(out, results)))
  print((out / 'geometry.md').read_text(), end='')


if __name__ == '__main__':
  define_flags()
  app.run(main)
