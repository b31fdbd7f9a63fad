r"""A FedBuff table's kNN monitor against virtual time: one line per row and seed (each run has its
own clock, so the curves are not averaged), from the runs' metrics.jsonl.

  python -m experiments.fedbuff_curves docs/results/fedbuff

writes docs/results/fedbuff/virtual_time.png (reproduce's curves.png is against rounds, where a
FedBuff step and a synchronous round are not comparable).
"""
import pathlib
import sys

from fedjax_ssl.runs import logging_utils, plotting


def main(argv) -> None:
  if len(argv) != 2:
    sys.exit('usage: python -m experiments.fedbuff_curves OUT (a reproduce --out folder)')
  out = pathlib.Path(argv[1])
  runs = {}
  for path in sorted(out.glob('runs/*/seed*/metrics.jsonl')):
    records = logging_utils.read_metrics(str(path))
    if any('virtual_time' in r for r in records):
      runs[f'{path.parent.parent.name.split(".")[0]} {path.parent.name}'] = records
  if not runs:
    sys.exit(f'{out}/runs holds no metrics.jsonl with virtual_time rows')
  plotting.plot_runs(runs, str(out / 'virtual_time.png'), 'knn_acc',
                     title='kNN accuracy against virtual time')
  print(out / 'virtual_time.png')


if __name__ == '__main__':
  main(sys.argv)
