r"""The benchmark round in eager PyTorch, alone: clients one after another (how the official codes
run) or one model on the union batch.

  pip install torch            # not a dependency of fedjax_ssl; only the benchmarks use it
  python -m experiments.torch_reference --clients 10
  python -m experiments.torch_reference --model resnet18 --mode union --precision bfloat16 \
      --channels_last

The round is `experiments/torch_round.py`: the work of `experiments.benchmark`'s model-compute rows
(augmentation 'flip'), with pre-made float inputs, two different ones per step.
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
  flags.DEFINE_enum('model', 'small_cnn', list(torch_round.MODELS), 'The round\'s model.')
  flags.DEFINE_enum('mode', 'loop', list(torch_round.MODES),
                    'loop: per-client copies (the official codes); union: one model, C x B batch.')
  flags.DEFINE_enum('precision', 'float32', list(torch_round.PRECISIONS),
                    'float32 (TF32 on a GPU) or bfloat16 autocast.')
  flags.DEFINE_bool('channels_last', False, 'NHWC activations and weights.')


def main(argv):
  del argv
  import torch  # pylint: disable=g-import-not-at-top
  one_round = torch_round.build_round(
      FLAGS.clients, FLAGS.local_steps, FLAGS.batch_size, model=FLAGS.model, mode=FLAGS.mode,
      precision=FLAGS.precision, channels_last=FLAGS.channels_last, threads=FLAGS.threads)
  one_round()
  times = []
  for _ in range(FLAGS.repeats):
    t0 = time.perf_counter()
    one_round()
    times.append(time.perf_counter() - t0)
  print(f'torch {torch.__version__}, threads {torch.get_num_threads()}, {FLAGS.model} '
        f'{FLAGS.mode} {FLAGS.precision}: {FLAGS.clients} clients x '
        f'{FLAGS.local_steps} steps x batch {FLAGS.batch_size}: '
        f'{statistics.median(times):.3f} s per round (median of {FLAGS.repeats}; '
        f'all: {[round(t, 3) for t in times]})')


if __name__ == '__main__':
  define_flags()
  app.run(main)
