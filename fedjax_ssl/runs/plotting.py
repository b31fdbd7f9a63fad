"""Training-curve plots from metrics records (as read by logging_utils.read_metrics).

Uses matplotlib's object-oriented API (``Figure`` renders PNG through the Agg
canvas) and never pyplot, so importing this module does not touch the global
backend of the caller's process and works headless.
"""

from __future__ import annotations

import os
import pathlib
from typing import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

PANEL_SIZE_IN = (4.5, 3.5)  # (width, height) of one subplot, inches
DPI = 100


def plot_metrics(records: Sequence[Mapping], out_png: str, keys: Sequence[str],
                 title: str | None = None,
                 hlines: Mapping[str, Mapping[str, float]] | None = None,
                 x_key: str = 'round') -> list[str]:
  """Plots each metric in ``keys`` against ``x_key``, one subplot per metric.

  Args:
    records: dicts such as ``{'round': 3, 'loss': 1.2, 'knn_acc': 0.4}``; a
      record may lack some keys (e.g. accuracies only on evaluation rounds).
    out_png: output path (parent directories are created).
    keys: metrics to plot, in subplot order; keys present in no record are
      skipped.
    title: figure title.
    hlines: reference lines per metric, ``{metric: {label: value}}``, e.g.
      ``{'probe_acc': {'random init': 0.31}}``; keyed by metric because a
      reference accuracy belongs on the accuracy panel only.
    x_key: the abscissa field.

  Returns:
    The keys actually plotted.
  """
  present = [k for k in keys if any(k in r for r in records)]
  if not present:
    available = sorted({k for r in records for k in r} - {x_key})
    raise ValueError(f'none of keys {list(keys)} occurs in the records; available: {available}')
  hlines = hlines or {}
  unknown = sorted(set(hlines) - set(keys))
  if unknown:
    raise ValueError(f'hlines keys {unknown} are not among the plotted keys {list(keys)}')

  fig = Figure(figsize=(PANEL_SIZE_IN[0] * len(present), PANEL_SIZE_IN[1]), dpi=DPI,
               layout='constrained')
  axes = fig.subplots(1, len(present), squeeze=False)[0]
  for ax, key in zip(axes, present):
    points = sorted((r[x_key], r[key]) for r in records if key in r and x_key in r)
    xs, ys = zip(*points)
    ax.plot(xs, ys, marker='o' if len(xs) <= 50 else None, markersize=3, label=key)
    for i, (label, value) in enumerate(hlines.get(key, {}).items()):
      ax.axhline(value, color=f'C{i + 1}', linestyle='--', linewidth=1,
                 label=f'{label} ({value:.4g})')
    ax.set_xlabel(x_key)
    if x_key == 'round':
      ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are integers
    ax.set_title(key)
    ax.grid(alpha=0.3)
    if key in hlines:
      ax.legend(fontsize='small')
  if title:
    fig.suptitle(title)
  save_figure(fig, out_png)
  return present


def time_axis(records: Sequence[Mapping]) -> tuple:
  """(x_key, records) for a run's curves: 'virtual_time' when its rows carry the simulated clock
  (FedBuff, core/fedbuff.py; round 0, the random-init row, at time 0), else 'round'."""
  if not any('virtual_time' in r for r in records):
    return 'round', list(records)
  return 'virtual_time', [dict(r, virtual_time=0.0) if r.get('round') == 0 else r
                          for r in records]


def plot_runs(runs: Mapping[str, Sequence[Mapping]], out_png: str, metric: str,
              x_key: str = 'virtual_time', title: str | None = None) -> None:
  """One line per run: `metric` against `x_key` (after `time_axis`, so round 0 sits at time 0),
  for runs whose abscissas differ (FedBuff's virtual clock: each seed and row has its own).

  Args:
    runs: label -> that run's metrics records.
    out_png: output path.
  """
  fig = Figure(figsize=PANEL_SIZE_IN, dpi=DPI, layout='constrained')
  ax = fig.subplots()
  for label, records in runs.items():
    _, records = time_axis(records) if x_key == 'virtual_time' else (x_key, records)
    points = sorted((r[x_key], r[metric]) for r in records if metric in r and x_key in r)
    if points:
      xs, ys = zip(*points)
      ax.plot(xs, ys, marker='.', label=label)
  ax.set_xlabel(x_key)
  ax.set_ylabel(metric)
  ax.grid(alpha=0.3)
  ax.legend(fontsize='x-small')
  if title:
    ax.set_title(title, fontsize='small')
  save_figure(fig, out_png)


def save_figure(fig: Figure, path: str | os.PathLike, dpi: float | None = None) -> None:
  """Writes `fig` to `path` (PNG) atomically, creating its directory: a reader, or a run killed
  mid-write, never leaves half a file. pyplot figures stay open; the caller closes them."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.stem + '.tmp.png')
  try:
    fig.savefig(tmp, format='png', dpi=dpi)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  os.replace(tmp, path)
