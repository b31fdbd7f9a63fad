# Sourced by scripts/test.sh and scripts/quickstart.sh: creates .venv, installs the package (with the
# extras in $EXTRAS, e.g. '[test]') at the pinned ranges of pyproject.toml, and, as root, Debian's
# dataset-fashion-mnist (the real Fashion-MNIST IDX files).
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".${EXTRAS:-}"
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1 || \
    echo "note: could not install dataset-fashion-mnist (tests needing it skip; train falls back to tfds)"
fi
