r"""Synchronous FedAvg against FedBuff at equal virtual time, on the quickstart's federation (issue
69, item 2; core/fedbuff.py, docs/async.md).

  python -m experiments.reproduce --table configs/fedbuff/table.py --out docs/results/fedbuff

The quickstart's federation and method (configs/quickstart.py: FedSimCLR, the small CNN, Fashion-
MNIST, 10 clients, Dirichlet(0.5), FedU2's augmentation, the field's logistic probe) on the first
5,000 training images, under one heavy-tailed latency model: each training lasts speed_c xi,
xi ~ LogNormal(0, 1) per training and speed_c ~ LogNormal(0, 0.5) once per client and seed.
Supervised synchronous FedAvg (lr 0.05) is the labelled reference row. Synchronous FedAvg is
FedBuff with buffer_size = concurrency = 10 (every client, each round as long
as its slowest participant; tests/core/test_fedbuff.py shows it equals the synchronous round), 20
rounds. FedBuff runs concurrency 10, buffer 5, the paper's staleness weight (1 + s)^-1/2 and server
learning rate 1, for SERVER_STEPS steps: the largest count whose virtual time stays within the
synchronous run's at every seed 0-2 (`fedbuff.virtual_times`), so FedBuff never has more virtual
time than FedAvg. Each run's final virtual_time is in its metrics.jsonl.
Time: about 1 h for 3 seeds on 2 shared CPU cores, 15 min of it the references (docs/notes/engine.md#eng-77).
"""
from configs import quickstart
from fedjax_ssl import tables

SCALES = ('quick',)
SYNC_ROUNDS = 10
# The largest FedBuff step count within the synchronous run's virtual time at each of seeds 0-2
# (66, 54, 97 steps fit; docs/notes/engine.md#eng-77 has the command).
SERVER_STEPS = 54
LATENCY = {'fedbuff.enabled': True, 'fedbuff.concurrency': 10, 'fedbuff.latency': 'lognormal',
           'fedbuff.latency_sigma': 1.0, 'fedbuff.speed_sigma': 0.5}


def get_table(scale: str) -> tables.Table:
  del scale
  c = quickstart.get_config()
  c.train_size = 5000
  c.checkpoint_every = 10
  sync = dict(LATENCY, **{'fedbuff.buffer_size': 10, 'rounds': SYNC_ROUNDS, 'eval_every': 2})
  rows = {
      'FedAvg (synchronous)': sync,
      'FedBuff (P=10, B=5)': dict(LATENCY, **{'fedbuff.buffer_size': 5, 'rounds': SERVER_STEPS,
                                              'eval_every': 10, 'checkpoint_every': 10}),
      # The labelled reference with the same encoder and budget, at half the rate as in the
      # other evidence tables (supervised FedAvg diverged at lr 0.1 once, EVAL-15).
      'FedAvg (supervised)': dict(sync, ssl_method='supervised', lr=0.05),
  }
  return tables.Table(
      name='fedbuff_quickstart',
      title='Synchronous FedAvg vs FedBuff at equal virtual time (FedSimCLR, Fashion-MNIST 5k, '
            '10 clients, log-normal latency)',
      base=c, rows=rows, columns={'FMNIST 10 clients Dir(0.5)': {}},
      metrics=('probe_acc', 'knn_acc'),
      notes=('Both rows share the latency model and seed, so the same clients are slow; FedBuff '
             f'runs {SERVER_STEPS} server steps of 5 clients against {SYNC_ROUNDS} rounds of 10, '
             'within the same virtual time at every seed. Supervised FedAvg: the synchronous row '
             'with labels at lr 0.05. Random-init encoder and raw pixels come with every run.'),
      claims=(tables.Claim('FedBuff > synchronous FedAvg at equal virtual time (probe)',
                           'FedBuff (P=10, B=5)', 'FedAvg (synchronous)', 'probe_acc'),
              tables.Claim('FedBuff > synchronous FedAvg at equal virtual time (kNN)',
                           'FedBuff (P=10, B=5)', 'FedAvg (synchronous)', 'knn_acc'),
              tables.Claim('FedBuff learns (probe over its random init)',
                           'FedBuff (P=10, B=5)', tables.RANDOM_INIT, 'probe_acc'),
              tables.Claim('FedAvg learns (probe over its random init)',
                           'FedAvg (synchronous)', tables.RANDOM_INIT, 'probe_acc')))
