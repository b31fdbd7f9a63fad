"""What a training run survives: divergence (`divergence`), a stop signal (`signals`), an unreadable
checkpoint and a changed config on resume (`resuming`) and a second run on the same workdir
(`lock`). `runs.training` composes these pieces; each is small and tested alone
(tests/runs/test_run_guard.py) and end to end (tests/experiments/test_train_faults.py). This module
holds what they share: the exit statuses, `RunStateError` and the agreement of every process
(`agree_max`); their fault lines go through the run's console (`logging_utils.Console.report`).

Exit statuses of `experiments.train` (the one place they are defined):

  0                    the run finished; results.json has "status": "completed".
  1    EXIT_REFUSED    refused, before any training: a config error, a config that differs from the
                       workdir's run on resume, a workdir another live run holds, no intact
                       checkpoint left (one `error: ...` line naming the value and what is allowed).
  3    EXIT_DIVERGED   a round's loss or metrics, or the new server parameters, are not finite; the
                       run stopped at that round and results.json has "status": "diverged".
  4    EXIT_PEER_LOST  several processes: a collective failed, most likely because another process
                       of the run stopped; one `error: ...` line, the error itself in train.log; the
                       same command on every process resumes from the last checkpoint.
  128 + signal         stopped by SIGINT (130) or SIGTERM (143) after finishing the round and saving
                       its checkpoint; the same command resumes (`exit_status_for_signal`).
"""
from __future__ import annotations

import numpy as np

from fedjax_ssl import config_validation as cv
from fedjax_ssl.core import strategies

EXIT_REFUSED = 1  # config_validation.run's status for a ConfigError, which RunStateError is
EXIT_DIVERGED = 3
EXIT_PEER_LOST = 4


class RunStateError(cv.ConfigError):
  """The workdir's state refuses this run (reported as one `error:` line, exit status 1)."""


class PeerLost(Exception):
  """A collective of a several-process run failed (`EXIT_PEER_LOST`); the message is one line."""


def agree_max(value: int) -> int:
  """The largest `value` over every process (a collective all of them must reach; the value itself
  with one process). Used so that all processes refuse, stop, or move a checkpoint aside together."""
  if not strategies.multi_process():
    return int(value)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(np.max(multihost_utils.process_allgather(np.int32(value))))
