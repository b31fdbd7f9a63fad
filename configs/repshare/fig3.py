r"""Representation sharing, Fig. 3: test-accuracy gain of (lambda_kd, lambda_disc) over IL.

  python -m experiments.reproduce --table configs/repshare/fig3.py --out DIR --scale paper
  python -m experiments.reproduce --table configs/repshare/fig3.py --out DIR   # quick

paper: MNIST / LeNet-5, N = 5, 100 rounds (configs/repshare/common.paper_base), lambda_kd
  and lambda_disc each in {0, 0.1, 1, 10, 100} (the figure's values are not in the text; spec A-grid);
  the (0, 0) cell is IL. The paper's finding: L_KD alone helps, L_disc alone does not; the chosen
  (10, 1) is marked. Gain over IL = a cell minus the (0, 0) cell.
quick: the same grid on Fashion-MNIST / LeNet-5 (the dataset this machine has), N = 5, 20 rounds.
"""
from configs.repshare import common as rc
from fedjax_ssl import tables

GRID = (0.0, 0.1, 1.0, 10.0, 100.0)


def get_table(scale: str) -> tables.Table:
  dataset, rounds = ('mnist', 100) if scale == 'paper' else ('fashion_mnist', 20)
  base = rc.paper_base()
  for key, value in rc.task(dataset, encoder='lenet5', rounds=rounds, num_clients=5,
                            clients_per_round=5).items():
    base[key] = value
  rows = {f'lambda_kd={kd:g}': {'algorithm': 'repshare', 'repshare.lambda_kd': kd} for kd in GRID}
  columns = {f'lambda_disc={d:g}': {'repshare.lambda_disc': d} for d in GRID}
  return tables.Table(
      name='repshare_fig3',
      title='Representation sharing Fig. 3: test accuracy over the (lambda_kd, lambda_disc) grid',
      base=base, rows=rows, columns=columns, metrics=('test_acc',), scale=scale,
      notes=('The (0, 0) cell is IL (no term). The paper gives this grid as a heat map of the gain '
             'over IL without numbers: the chosen (10, 1) improves on IL, lambda_disc alone does '
             'not.'))
