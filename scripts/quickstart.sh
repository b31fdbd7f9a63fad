#!/usr/bin/env bash
# The README's main job: sets up .venv, then trains FedSimCLR (small CNN) on real Fashion-MNIST (configs/quickstart.py).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec .venv/bin/python -m experiments.train --config configs/quickstart.py \
  --workdir "${WORKDIR:-workdirs/quickstart}" "$@"
