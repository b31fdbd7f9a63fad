"""Per-client scoring primitives: the kNN score of one client (its own labelled images as the memory
bank, on its held-out split and on the whole test set), the spread of a score over clients (mean,
std, worst-10 %, best-10 %), the metric names they are reported under, and their section of a
result table. Nothing here knows a federation's state: `fedjax_ssl.evaluation.per_client_results`
gathers the models and the splits; the design and its cost are docs/notes/evaluation.md#eval-25.

Metric names: `<score>_<model>_<data>_<stat>`, where score is 'knn_acc' (the weighted kNN) or
'test_acc' (a supervised model's own classifier), model is 'own' (the client's own model) or
'global' (the global model), data is 'split' (the client's held-out split) or 'test' (the whole
test set) and stat is one of STATS, e.g. 'knn_acc_own_split_worst10'.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from fedjax_ssl.eval import knn as knn_lib

SCORES = ('knn_acc', 'test_acc')
MODELS = ('own', 'global')
DATA = ('split', 'test')
STATS = ('mean', 'std', 'worst10', 'best10')

_SCORE_NAMES = {'knn_acc': 'kNN on the client\'s own labelled images',
                'test_acc': 'the model\'s own classifier'}
_MODEL_NAMES = {'own': 'each client\'s own model', 'global': 'the global model'}
_DATA_NAMES = {'split': 'each client\'s held-out split', 'test': 'the whole test set'}
_STAT_NAMES = {'mean': 'mean', 'std': 'std', 'worst10': 'worst-10 %', 'best10': 'best-10 %'}


def tail_count(num_clients: int) -> int:
  """The number of clients in a 10 % tail: ceil(C / 10), so at least one client."""
  return -(-int(num_clients) // 10)


def spread(values: Sequence[float]) -> Dict[str, float]:
  """{mean, std (over clients, ddof = 0), worst10, best10} of per-client values [C] (C >= 1):
  worst10 / best10 are the means of the tail_count(C) lowest / highest values."""
  v = np.sort(np.asarray(values, np.float64))
  if v.ndim != 1 or v.size == 0:
    raise ValueError(f'values must be a non-empty [C] sequence, got shape {v.shape}')
  t = tail_count(v.size)
  return {'mean': float(v.mean()), 'std': float(v.std()), 'worst10': float(v[:t].mean()),
          'best10': float(v[-t:].mean())}


def knn_scores(bank_f: Any, bank_y: Any, query_f: Any, query_y: Any, splits: Mapping[str, Any],
               num_classes: int, *, k: int, temperature: float) -> Dict[str, float]:
  """One client's kNN accuracies: the weighted cosine kNN (`knn.knn_predict`; k capped at the bank
  size, as the protocol's `knn_accuracy`) with the memory bank bank_f [n, d] / bank_y [n] (the
  client's own labelled training images), over the queries query_f [M, d] / query_y [M].

  Args:
    splits: {data name: int index array into the queries}, e.g. {'split': the client's held-out
      rows, 'test': every row}; each must be non-empty.
  Returns:
    {data name: accuracy over those rows}.
  """
  preds = knn_lib.knn_predict(bank_f, bank_y, query_f, num_classes, k=min(k, len(bank_y)),
                              temperature=temperature)
  return correct_rates(preds == np.asarray(query_y), splits)


def correct_rates(correct: Any, splits: Mapping[str, Any]) -> Dict[str, float]:
  """{name: mean of correct [M] (bool) over rows idx} for each (name, idx) of `splits`."""
  correct = np.asarray(correct, bool)
  out = {}
  for name, idx in splits.items():
    idx = np.asarray(idx)
    if idx.size == 0:
      raise ValueError(f'the rows of {name!r} are empty: an accuracy needs at least one')
    out[name] = float(correct[idx].mean())
  return out


def metric_key(score: str, model: str, data: str, stat: str) -> str:
  """The results.json 'final' key of one spread statistic (module docstring)."""
  return f'{score}_{model}_{data}_{stat}'


def parse_key(metric: str) -> Optional[Tuple[str, str, str, str]]:
  """(score, model, data, stat) of a per-client metric name, else None."""
  for score in SCORES:
    if metric.startswith(score + '_'):
      parts = metric[len(score) + 1:].split('_')
      if len(parts) == 3 and parts[0] in MODELS and parts[1] in DATA and parts[2] in STATS:
        return score, parts[0], parts[1], parts[2]
  return None


def metric_names() -> Dict[str, str]:
  """{metric key: how a table names it} for every per-client metric (the tables' METRICS)."""
  return {metric_key(s, m, d, t): f'{_SCORE_NAMES[s]}, {_MODEL_NAMES[m]} on {_DATA_NAMES[d]}, '
                                  f'{_STAT_NAMES[t]} over clients (%)'
          for s in SCORES for m in MODELS for d in DATA for t in STATS}


def summary(entries: Sequence[Mapping[str, Any]]) -> Dict[str, float]:
  """The spread statistics (`spread`) of every score of the per-client entries (results.json's
  'per_client': {'own': {data: {score: value}}, 'global': ...} per client), keyed by `metric_key`;
  a (model, data, score) that some client lacks is left out."""
  out = {}
  for model in MODELS:
    for data in DATA:
      for score in SCORES:
        values = [e.get(model, {}).get(data, {}).get(score) for e in entries]
        if entries and all(v is not None for v in values):
          out.update({metric_key(score, model, data, stat): v
                      for stat, v in spread(values).items()})
  return out


def table_metrics(scores: Sequence[str], models: Sequence[str] = MODELS,
                  data: Sequence[str] = DATA) -> Tuple[str, ...]:
  """The per-client metric keys of a table reporting `scores` for `models` on `data`."""
  return tuple(metric_key(s, m, d, t) for s in scores for m in models for d in data for t in STATS)


def markdown_lines(metrics: Sequence[str], rows: Sequence[str], columns: Sequence[str],
                   by_key: Mapping[Tuple[str, str, str], Mapping[str, Any]],
                   cell: Callable[[Mapping[str, Any]], str]) -> List[str]:
  """The per-client section of a table.md: one grid per (score, model, data) of `metrics` with a
  row per (table row, column) cell and the columns mean, std, worst-10 % and best-10 % over clients
  (each cell formatted by `cell` from the table's summary entry by_key[(row, column, metric)], its
  mean ± std over seeds). A grid no run has a value in yet is left out, and so is a cell that has
  values in other grids only (a run of FedAvg has no own models). [] when `metrics` has no
  per-client metric."""
  groups: Dict[Tuple[str, str, str], None] = {}
  for metric in metrics:
    parsed = parse_key(metric)
    if parsed is not None:
      groups[parsed[:3]] = None
  if not groups:
    return []
  # Cells with a per-client value somewhere: a grid of a model they lack leaves them out; a cell
  # with none yet (every seed pending or failed) is shown in every grid, with its mark.
  scored = {(r, c) for (r, c, m), e in by_key.items() if parse_key(m) and e.get('n')}
  lines = ['', '## Per-client results', '',
           'Each client scored on its own held-out split of the test set (drawn like its training '
           'partition) and on the whole test set; mean, std, worst-10 % and best-10 % over the '
           'clients of a run, then mean ± std of those over seeds (docs/notes/evaluation.md'
           '#eval-25).']
  for score, model, data in groups:
    keys = [metric_key(score, model, data, stat) for stat in STATS]
    cells = [(r, c) for r in rows for c in columns
             if any(by_key.get((r, c, k), {}).get('n') for k in keys)
             or ((r, c) not in scored and any((r, c, k) in by_key for k in keys))]
    if not any(by_key.get((r, c, k), {}).get('n') for r, c in cells for k in keys):
      continue  # no run reports this model and score (yet)
    lines += ['', f'### {_SCORE_NAMES[score]}: {_MODEL_NAMES[model]} on {_DATA_NAMES[data]}', '',
              '| | ' + ' | '.join(_STAT_NAMES[s] for s in STATS) + ' |',
              '|---|' + '---|' * len(STATS)]
    for r, c in cells:
      label = r if len(columns) == 1 else f'{r}, {c}'
      lines.append(f'| {label} | ' + ' | '.join(
          cell(by_key[(r, c, k)]) if (r, c, k) in by_key else '–' for k in keys) + ' |')
  return lines
