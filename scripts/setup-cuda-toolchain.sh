#!/usr/bin/env bash
# What the `cuda` feature needs, on a fresh Debian machine (idempotent; no GPU needed):
# - LLVM 19 for the NVPTX backend (apt: llvm-19-dev and the libraries it links);
# - ptxas, to assemble the generated PTX and report registers and spills (the
#   nvidia-cuda-nvcc-cu12 wheel, into .cuda-toolchain/, which git ignores);
# - nvdisasm, to read the machine code ptxas made (scripts/sass_mix.py; the
#   nvidia-cuda-nvdisasm wheel, same folder).
# Prints the environment the build needs; use it as: eval "$(scripts/setup-cuda-toolchain.sh)"
set -euo pipefail
cd "$(dirname "$0")/.."

if ! [ -x /usr/lib/llvm-19/bin/llvm-config ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
  echo "installing LLVM 19 (apt)" >&2
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    llvm-19-dev libpolly-19-dev zlib1g-dev libzstd-dev >&2
fi

TOOLS=.cuda-toolchain
if ! [ -x "$TOOLS/bin/ptxas" ]; then
  echo "installing ptxas (pip wheel nvidia-cuda-nvcc-cu12)" >&2
  python3 -m pip install --quiet --disable-pip-version-check --target "$TOOLS/py" \
    nvidia-cuda-nvcc-cu12==12.9.86 >&2
  mkdir -p "$TOOLS/bin"
  ln -sf ../py/nvidia/cuda_nvcc/bin/ptxas "$TOOLS/bin/ptxas"
fi
if ! [ -x "$TOOLS/bin/nvdisasm" ]; then
  echo "installing nvdisasm (pip wheel nvidia-cuda-nvdisasm)" >&2
  python3 -m pip install --quiet --disable-pip-version-check --target "$TOOLS/nvdisasm" \
    nvidia-cuda-nvdisasm==13.5.37 >&2
  mkdir -p "$TOOLS/bin"
  ln -sf ../nvdisasm/nvidia/cu13/bin/nvdisasm "$TOOLS/bin/nvdisasm"
fi
"$TOOLS/bin/ptxas" --version >/dev/null
"$TOOLS/bin/nvdisasm" --version >/dev/null

echo "export LLVM_SYS_191_PREFIX=/usr/lib/llvm-19"
