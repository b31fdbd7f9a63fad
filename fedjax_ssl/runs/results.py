"""What a run reports: its results.json (`record`, the communication totals, the best kNN over
rounds) and the lines that show a round's metrics and the closing summary beside the reference
rows."""
from __future__ import annotations

from typing import Sequence

import ml_collections

from fedjax_ssl.core import comm
from fedjax_ssl.core import round as rd
from fedjax_ssl.core.algorithm import Algorithm
from fedjax_ssl.runs.run_dir import RunDir
from fedjax_ssl.runs.shared_references import References

# The evaluations a round's line and the closing summary show, in their order.
EVAL_KEYS = ('test_acc', 'knn_acc', 'probe_acc', 'probe_std_acc', 'ft_acc_1pct', 'ft_acc_10pct')
# The metrics the raw-pixel row is compared on.
_RAW_PIXEL_KEYS = ('probe_acc', 'probe_acc_1pct', 'knn_acc', 'knn_acc_1pct', 'knn_acc_1pct_k20')


def scalars(results: dict) -> dict:
  """The scalar entries of an evaluation dict (per-client lists go to results.json only)."""
  return {k: v for k, v in results.items() if not isinstance(v, list)}


def metrics_text(record: dict) -> str:
  """'loss 1.2345  knn_acc 0.6789 ...': a round's loss and evaluations, as its line shows them."""
  keys = [k for k in ('loss',) + EVAL_KEYS if k in record]
  return '  '.join(f'{k} {record[k]:.4f}' for k in keys)


def best_over_rounds(records: list, key: str) -> dict:
  """{'<key>_best': the highest value of `key` over the logged rounds (round 0, the random-init
  encoder, left out), '<key>_best_round': its round (the first on ties)}; {} when no round has it.

  FedU2 reports the best kNN over rounds (its code logs `best_knn_acc`); the kNN monitor of every
  `eval_every`-th round and the final evaluation compute the same kNN (k = knn_k on the whole
  training split), so their maximum is that number at this run's evaluation cadence.
  """
  rounds = [(r[key], r['round']) for r in records if key in r and r['round'] > 0]
  if not rounds:
    return {}
  best = max(v for v, _ in rounds)
  return {f'{key}_best': best, f'{key}_best_round': min(i for v, i in rounds if v == best)}


def record(status: str, config: ml_collections.ConfigDict, algo: Algorithm, refs: References,
           rundir: RunDir, **fields) -> dict:
  """What every results.json holds: the status, `fields`, the references (random init, raw
  pixels), the run's identity and the config changes it went through."""
  results = {'status': status, **fields, 'random_init': refs.random_init, 'rounds': config.rounds,
             'algorithm': algo.name, 'ssl_method': config.ssl_method}
  if refs.raw_pixels is not None:
    results['raw_pixels'] = refs.raw_pixels
  config_history = rundir.read_config_changes()
  if config_history:
    results['config_changes'] = config_history
  return results


def communication(algo: Algorithm, config: ml_collections.ConfigDict,
                  per_participant: Sequence[comm.MessageBytes], records: list) -> dict:
  """results.json's communication entry: exact per-participant bytes of each cohort, and the
  run's totals summed from the per-round metrics."""
  rounds = [r for r in records if 'bytes_up' in r]
  return {
      'per_participant': {c.name: {'up': b.up, 'down': b.down}
                          for c, b in zip(rd.cohorts(algo, config.num_clients), per_participant)},
      'bytes_up_total': float(sum(r['bytes_up'] for r in rounds)),
      'bytes_down_total': float(sum(r['bytes_down'] for r in rounds)),
      'rounds_counted': len(rounds),
  }


def closing_lines(config: ml_collections.ConfigDict, final: dict, refs: References,
                  totals: dict, rundir: RunDir) -> list[str]:
  """The summary a finished run prints: each final evaluation beside the reference rows, the
  bytes sent (`totals`: results.json's communication entry) and where the files are."""
  init = lambda key: refs.value('random_init', key)
  lines = []
  if 'test_acc' in final:
    lines.append(f'test accuracy (classifier): {final["test_acc"]:.4f} | random init '
                 f'{init("test_acc"):.4f}')
  lines.append(f'communication: {totals["bytes_up_total"]:,.0f} B up, '
               f'{totals["bytes_down_total"]:,.0f} B down in {config.rounds} rounds')
  if 'probe_acc' in final:
    lines.append(f'linear probe accuracy: trained encoder {final["probe_acc"]:.4f} | '
                 f'random-init encoder {init("probe_acc"):.4f}')
  if 'probe_std_acc' in final:
    lines.append(f'standardised probe:    trained encoder {final["probe_std_acc"]:.4f} | '
                 f'random-init encoder {init("probe_std_acc"):.4f}  '
                 f'({config.probe_std_epochs} epochs on z-scored features)')
  if 'knn_acc' in final:
    lines.append(f'kNN accuracy:          trained encoder {final["knn_acc"]:.4f} | '
                 f'random-init encoder {init("knn_acc"):.4f}')
  for key in ('ft_acc_1pct', 'ft_acc_10pct'):
    if key in final:
      lines.append(f'{key + ":":22s} trained encoder {final[key]:.4f} | random-init encoder '
                   f'{init(key):.4f}  (fine-tuned, config.finetune = {config.finetune!r})')
  if refs.raw_pixels is not None:
    for key in _RAW_PIXEL_KEYS:
      if key in final:
        lines.append(f'{key + ":":22s} trained encoder {final[key]:.4f} | random-init encoder '
                     f'{init(key):.4f} | raw pixels {refs.value("raw_pixels", key):.4f}')
  lines.append(f'results: {rundir.results_file}   plot: {rundir.plot_file}   '
               f'log: {rundir.log_file()}')
  return lines
