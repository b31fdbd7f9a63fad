#!/usr/bin/env bash
# The README's test command: creates .venv if needed, installs the package with its test extra
# (pinned ranges from pyproject.toml), installs the Debian Fashion-MNIST files when apt is usable
# (tests that need them skip otherwise; the shipped subset in tests/data covers the rest), runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test]'
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1 || \
    echo "note: could not install dataset-fashion-mnist; tests needing it will skip"
fi
exec .venv/bin/python -m pytest -n 2 --durations=15 "$@"
