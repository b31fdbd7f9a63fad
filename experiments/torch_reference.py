r"""The benchmark round in eager PyTorch, clients one after another (how the official codes run).

  pip install torch            # not a dependency of fedjax_ssl; only this script uses it
  python -m experiments.torch_reference --clients 10

The round is `experiments/torch_round.py`: the work of `experiments.benchmark --models=small_cnn`'s
model-compute rows (augmentation 'flip'), with pre-made float inputs, two different ones per step.
`experiments.benchmark` times it beside those rows, in the same run, when torch is importable; this
binary times it alone. Prints seconds per round (median of --repeats after a warm-up round).
"""
from __future__ import annotations

import statistics
import time

from absl import app, flags

from experiments import torch_round


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The binary's flags; defined only when it runs, so that any two binaries (whose flag names
  overlap) can be imported in one process, as the tests do."""
  flags.DEFINE_integer('clients', 10, 'Clients per round.')
  flags.DEFINE_integer('local_steps', 5, 'Local steps per client.')
  flags.DEFINE_integer('batch_size', 64, 'Local batch size.')
  flags.DEFINE_integer('repeats', 5, 'Timed rounds.')
  flags.DEFINE_integer('threads', 0, 'torch.set_num_threads (0 = torch default).')


def main(argv):
  del argv
  import torch  # pylint: disable=g-import-not-at-top
  one_round = torch_round.build_round(FLAGS.clients, FLAGS.local_steps, FLAGS.batch_size,
                                     FLAGS.threads)
  one_round()
  times = []
  for _ in range(FLAGS.repeats):
    t0 = time.perf_counter()
    one_round()
    times.append(time.perf_counter() - t0)
  print(f'torch {torch.__version__}, threads {torch.get_num_threads()}: {FLAGS.clients} clients x '
        f'{FLAGS.local_steps} steps x batch {FLAGS.batch_size}: '
        f'{statistics.median(times):.3f} s per round (median of {FLAGS.repeats}; '
        f'all: {[round(t, 3) for t in times]})')


if __name__ == '__main__':
  define_flags()
  app.run(main)
