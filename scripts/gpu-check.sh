#!/usr/bin/env bash
# The GPU backend's device check: decode on the device against the CPU backend (attnc
# check-device), prefill differential tests on the device (against the CPU backend and a float64
# reference), then bf16 prefill and decode timings against PyTorch's
# F.scaled_dot_product_attention on the same device (scripts/gpu_check.py); then models resident
# on the device: logits against the CPU backend, greedy generation against transformers'
# continuations, and a 1B llama-shaped model's decode and prefill times next to transformers'
# generate where it is installed (scripts/model_check.py).
# For a machine with an NVIDIA GPU, its driver and PyTorch (with safetensors); no network.
#
#   scripts/gpu-check.sh [--quick]     check and time (well under 8 minutes; --quick: N 1k and 8k)
#   scripts/gpu-check.sh --hopper-only [--quick]
#                                      the sm_90a forward alone (H100/H200): its differential
#                                      cases with ATTN_GPU_WGMMA=1, then its timing against our
#                                      sm_90 kernel, cuDNN SDPA and FlexAttention
#   scripts/gpu-check.sh --prepare     on a development machine: build attnc (features cuda, llvm),
#                                      examples/shipping-kernels (cuda, aot) and nccl_check
#                                      (nccl: a one-rank NCCL group) into .gpu-bin/
#                                      (ignored by git), for a GPU machine that has no Rust
#                                      toolchain (carry .gpu-bin there)
#
# attnc comes from $ATTNC, else .gpu-bin/attnc, else a `cargo build --release --features cuda,llvm`
# here (which needs LLVM 19: scripts/setup-cuda-toolchain.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--prepare" ]]; then
  eval "$(scripts/setup-cuda-toolchain.sh)"
  cargo build --release --features cuda,llvm --bin attnc
  # The example whose kernels are embedded at cargo time (no compiler in it).
  cargo build --release --manifest-path examples/shipping-kernels/Cargo.toml --target-dir target
  cargo build --release --features nccl --example nccl_check
  mkdir -p .gpu-bin
  cp target/release/attnc target/release/shipping-kernels target/release/examples/nccl_check \
    .gpu-bin/
  strip .gpu-bin/attnc .gpu-bin/shipping-kernels .gpu-bin/nccl_check
  ls -l .gpu-bin/
  exit 0
fi

if [[ -n "${ATTNC:-}" ]]; then
  attnc=$ATTNC
elif [[ -x .gpu-bin/attnc ]]; then
  attnc=.gpu-bin/attnc
elif command -v cargo >/dev/null; then
  eval "$(scripts/setup-cuda-toolchain.sh)"
  cargo build --release --features cuda,llvm --bin attnc
  attnc=target/release/attnc
else
  echo "gpu-check: no attnc: set ATTNC, run scripts/gpu-check.sh --prepare on a machine with" \
    "Rust and carry .gpu-bin, or install Rust here" >&2
  exit 2
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if [[ "${1:-}" == "--hopper-only" ]]; then
  PYTHONUNBUFFERED=1 exec python3 scripts/gpu_check.py --attnc "$attnc" --backend cuda "$@"
fi
status=0
if [[ -x .gpu-bin/shipping-kernels ]]; then
  echo "== kernels embedded at cargo time, run against the CPU backend (examples/shipping-kernels)"
  .gpu-bin/shipping-kernels | grep -v ' from: ' || status=1
fi
if [[ -x .gpu-bin/nccl_check ]]; then
  echo "== NCCL: a one-rank group on GPU 0 (needs libnccl; absent, this reports it and goes on)"
  .gpu-bin/nccl_check || echo "nccl_check failed (libnccl missing, or a wrong result: above)"
fi
echo "== decode on the device against the CPU backend (attnc check-device)"
"$attnc" check-device || status=1
PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --attnc "$attnc" --backend cuda "$@" || status=1
skip_model_timing=()
[[ "${1:-}" == "--quick" ]] && skip_model_timing=(--skip-timing)
PYTHONUNBUFFERED=1 python3 scripts/model_check.py --attnc "$attnc" --backend cuda \
  "${skip_model_timing[@]}" || status=1
exit $status
