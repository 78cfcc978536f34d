#!/usr/bin/env bash
# Side-by-side CPU prefill timings: attnc bench against PyTorch (SDPA, and FlexAttention with
# ALiBi), alternating runs so both see the same machine load. Prints one table row per config:
# the median over ROUNDS alternations of each side's median, and our ratio.
#
#   scripts/bench-vs-torch.sh [ROUNDS]        (default 5; installs PyTorch with scripts/setup-torch.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
PY=$(bash scripts/setup-torch.sh)
REF=scripts/torch_ref.py
cargo build --release --quiet --bin attnc
ATTNC=target/release/attnc

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
field() { python3 -c "import json,sys; print(json.loads(sys.stdin.read())['$1'])"; }

# name | our spec | torch kind
CONFIGS=(
  "causal|heads = 16, head_dim = 128, mask = causal|prefill"
  "alibi|heads = 16, head_dim = 128, mask = causal, position = alibi|flex_alibi"
  "sliding_window_1024|heads = 16, head_dim = 128, mask = sliding_window(1024)|prefill"
  "softcap_30|heads = 16, head_dim = 128, mask = causal, softcap = 30.0|prefill"
)
N=${SEQ:-2048}
printf "%-20s %12s %14s %14s %8s\n" config "ours GF/s" "torch GF/s" "torch kind" ratio
for c in "${CONFIGS[@]}"; do
  IFS='|' read -r name spec kind <<<"$c"
  ours=(); theirs=()
  for _ in $(seq "$ROUNDS"); do
    ours+=("$($ATTNC bench "$spec" --seq "$N" --reps 5 --json | field gflops)")
    theirs+=("$($PY $REF "$kind" 16 16 128 "$N" | field gflops)")
  done
  o=$(printf "%s\n" "${ours[@]}" | median)
  t=$(printf "%s\n" "${theirs[@]}" | median)
  printf "%-20s %12.1f %14.1f %14s %8.2f\n" "$name" "$o" "$t" "$kind" "$(python3 -c "print($o/$t)")"
done
