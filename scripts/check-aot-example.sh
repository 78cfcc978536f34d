#!/usr/bin/env bash
# The ahead-of-time example (examples/shipping-kernels: attn with features cuda and aot) builds,
# its binary carries PTX for sm_90 and no LLVM, and every kernel of its variants is served from
# what it embedded. Needs LLVM where it builds (scripts/setup-cuda-toolchain.sh); no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
manifest=examples/shipping-kernels/Cargo.toml
cargo fmt --manifest-path "$manifest" -- --check
cargo clippy --manifest-path "$manifest" --target-dir target -- -D warnings
cargo build --manifest-path "$manifest" --target-dir target
bin=target/debug/shipping-kernels
if ! grep -aq '\.target sm_90' "$bin"; then
  echo "error: no sm_90 PTX in $bin" >&2
  exit 1
fi
# LLVM's C API (LLVM...) and C++ namespace (llvm::) symbols; Cranelift's own flag names are not.
if nm "$bin" | grep -E ' (LLVM[A-Z][A-Za-z]+|_ZN4llvm.*)$' | head -3 | grep .; then
  echo "error: LLVM symbols in $bin" >&2
  exit 1
fi
out=$("$bin")
if echo "$out" | grep ' from: ' | grep -v ' from: embedded'; then
  echo "error: kernels above are not served from the embedded PTX" >&2
  exit 1
fi
echo "ok: $(echo "$out" | grep -c ' from: embedded') kernels served from embedded PTX, $(du -h "$bin" | cut -f1) binary, no LLVM symbols"
