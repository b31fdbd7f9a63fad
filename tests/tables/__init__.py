"""Tests of fedjax_ssl/tables/ (schema, stats, render: the `fedjax_ssl.tables` API), and the tables
they share with the binary's tests (tests/experiments/test_reproduce.py)."""
import csv
import textwrap

from fedjax_ssl import tables

# A two-cell table of one-round runs on the shipped subset; its 'Broken' row's runs are made to fail
# by the binary's test.
TINY_TABLE = textwrap.dedent('''
    from fedjax_ssl import experiment, tables

    def get_table(scale):
      c = experiment.default_config()
      c.dataset = 'fashion_mnist_subset'
      c.train_size = 300
      c.num_clients = 3
      c.clients_per_round = 3
      c.partition = 'iid'
      c.heads = 'custom'
      c.proj_hidden, c.proj_out, c.pred_hidden, c.pred_out = 16, 8, 16, 8
      c.batch_size = 25
      c.local_epochs = 1
      c.rounds = 1
      c.probe = 'adam'        # the tiny data has too few images for 1% labels
      c.probe_epochs = 2
      c.knn_k = 10
      c.checkpoint_every = 1
      rows = {'FedSimCLR': dict(ssl_method='simclr'),
              # Its runs raise (see `failing` below): recorded, the other cells go on.
              'Broken': dict(ssl_method='byol')}
      columns = {'IID': {}, 'Dir(1)': dict(partition='dirichlet', alpha=1.0)}
      return tables.Table(name='tiny', title='tiny table', base=c, rows=rows, columns=columns,
                             metrics=('probe_acc', 'knn_acc'), scale=scale,
                             paper={('FedSimCLR', 'IID', 'knn_acc'): 50.0})
''')


def read_csv_rows(path):
  """table.csv as {(cell, metric): row}."""
  with open(path) as f:
    return {(r['cell'], r['metric']): r for r in csv.DictReader(f)}


def make_table(**kw):
  """A 2 x 2 table (SimCLR / BYOL rows, IID / Dirichlet columns) on the default config; `kw`
  overrides the Table's fields."""
  from fedjax_ssl import experiment
  args = dict(name='t', title='t', base=experiment.default_config(),
              rows={'A': dict(ssl_method='simclr'), 'B': dict(ssl_method='byol')},
              columns={'IID': dict(partition='iid'), 'Dir': dict(partition='dirichlet', alpha=0.1)},
              metrics=('probe_acc',))
  args.update(kw)
  return tables.Table(**args)
