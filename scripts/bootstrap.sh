#!/usr/bin/env bash
# Creates .venv beside the repo (once) and installs the package with its test extra into it.
# Idempotent: a second run only checks that the install is current. Uses the local CPU wheel of
# torch where the machine has one (pip's find-links), so nothing of several GB is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
# This machine's pip configuration lists local package folders that may be absent; pip warns about each.
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.mhar-ablate-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # torch first, pinned to the version the CI machine holds locally when no torch is installed yet.
  .venv/bin/python -c "import torch" 2>/dev/null || quiet .venv/bin/python -m pip install -q "torch==2.13.0" \
    || quiet .venv/bin/python -m pip install -q "torch>=2.4"
  quiet .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
