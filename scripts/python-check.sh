#!/usr/bin/env bash
# The Python package as a user installs it: a fresh venv with torch, the package built and
# installed by the documented command (`pip install ./attn-py`, maturin's build backend, a
# release build), then its pytest suite. The venv is ATTN_PY_VENV (default target/py-venv);
# torch's wheel is about 5.6 GB with the CUDA libraries PyPI's build carries, so a venv that
# already imports torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath -m "${ATTN_PY_VENV:-target/py-venv}")
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip
  "$VENV/bin/pip" install -q torch==2.15.0 numpy
fi
"$VENV/bin/pip" install -q pytest safetensors
echo "== pip install ./attn-py"
time "$VENV/bin/pip" install -q --force-reinstall --no-deps ./attn-py
echo "== pytest attn-py/tests"
# From outside the source tree, so the installed package is what is imported.
cd attn-py/tests
"$VENV/bin/python" -m pytest -q -p no:cacheprovider .
