#!/usr/bin/env bash
# The README's test command: sets up .venv with the test extra, then runs the whole suite on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS='[test]' source scripts/setup_env.sh
exec .venv/bin/python -m pytest -n 2 --dist worksteal --durations=15 "$@"
