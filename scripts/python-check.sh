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
  # PyPI's torch pulls several GB of CUDA wheels; a dropped connection must not fail CI.
  # pip resumes a broken download and keeps finished wheels in its cache, so a later
  # attempt fetches only what is missing.
  for attempt in 1 2 3 4; do
    if "$VENV/bin/pip" install -q --resume-retries 20 --timeout 60 torch==2.15.0 numpy; then
      break
    fi
    [ "$attempt" = 4 ] && { echo "torch could not be installed after 4 attempts" >&2; exit 1; }
    echo "torch install attempt $attempt failed; retrying in 10 s" >&2
    sleep 10
  done
fi
"$VENV/bin/pip" install -q pytest safetensors
echo "== pip install ./attn-py"
time "$VENV/bin/pip" install -q --force-reinstall --no-deps ./attn-py
echo "== pytest attn-py/tests"
# From outside the source tree, so the installed package is what is imported.
cd attn-py/tests
"$VENV/bin/python" -m pytest -q -p no:cacheprovider .
