"""The per-layer setting (`conv_layers`): each convolution layer of the CPU benchmark models under
the candidate implementations of experiments/conv_layers.py, beside the layer's three GEMMs alone.

What it reports: docs/notes/harness.md#benchmark; the candidates: experiments/conv_layers.py.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Dict, List

import jax

from experiments import conv_layers

if TYPE_CHECKING:  # settings imports this module for its defaults
  from experiments.benchmark.settings import Settings


# The setting's defaults (settings.make: an explicitly given value wins); variants: every candidate,
# less 'pallas' off a GPU (conv_layers.default_variants asks the backend when settings are made).
CONV_LAYERS_DEFAULTS = dict(variants=conv_layers.default_variants, repeats=7)


def run(s: Settings) -> List[Dict]:
  """--setting=conv_layers (experiments/conv_layers.py): the info row, then one row per layer."""
  info = {'backend': jax.default_backend(), 'setting': 'conv_layers',
          'cpu_affinity': sorted(os.sched_getaffinity(0)), 'jax': jax.__version__,
          'steps_per_scan': conv_layers.STEPS, 'repeats': s.repeats}
  print(json.dumps(info))
  return [info] + conv_layers.run(s.variants, s.repeats)
