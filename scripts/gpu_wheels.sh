#!/usr/bin/env bash
# Here, before a GPU check: the pure-Python packages the GPU image lacks (ml-collections,
# dp-accounting, tensorboardX, flatbuffers for jax.export's files), as wheels for its Python 3.12,
# into .whl/ (ignored by git through .git/info/exclude; the device tool carries it with
# `carry: [".whl"]`). Everything else the library needs (jax with CUDA, flax, optax, chex, orbax,
# absl, numpy, scipy, matplotlib, tqdm, torch) is on the image.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PYTHON:-python3}
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation py --implementation cp --platform any --platform manylinux2014_x86_64 -d .whl \
  'ml-collections>=1.1.0,<1.2' 'dp-accounting>=0.6.0,<0.7' 'tensorboardX>=2.6.5,<2.7' \
  'flatbuffers>=24.3.25'
ls -la .whl
