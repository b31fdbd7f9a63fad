# Sourced by scripts/test.sh and scripts/quickstart.sh: creates .venv, installs the package (with the
# extras in $EXTRAS, e.g. '[test]') at the pinned ranges of pyproject.toml, and, as root, Debian's
# dataset-fashion-mnist (the real Fashion-MNIST IDX files). pip runs again only when pyproject.toml
# or the extras asked for changed since the last install into this .venv (a stamp per extras set:
# an install with extras also holds the plain package).
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
_stamp=".venv/.fedjax_ssl_installed${EXTRAS:-}"
_hash=$(sha256sum pyproject.toml | cut -d' ' -f1)
if ! { [ -f "$_stamp" ] && [ "$(cat "$_stamp")" = "$_hash" ]; } && \
   ! { [ -z "${EXTRAS:-}" ] && grep -qsx "$_hash" .venv/.fedjax_ssl_installed*; }; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".${EXTRAS:-}"
  echo "$_hash" > "$_stamp"
fi
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1 || \
    echo "note: could not install dataset-fashion-mnist (tests needing it skip; train falls back to tfds)"
fi
