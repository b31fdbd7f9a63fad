#!/usr/bin/env bash
# The README's main job: installs what it needs, then trains FedBYOL on real Fashion-MNIST.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e .
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1 || \
    echo "note: could not install dataset-fashion-mnist; falling back to tensorflow-datasets"
fi
exec .venv/bin/python -m experiments.train --config configs/quickstart.py \
  --workdir "${WORKDIR:-workdirs/quickstart}" "$@"
