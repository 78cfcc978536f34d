#!/usr/bin/env bash
# Peak resident memory of `attnc logits` on a llama-shaped bf16 checkpoint of about 168M
# parameters (random weights, made by scripts/make_checkpoint.py), against the bar of
# 1.25 x its weight bytes + 200 MB. Usage: scripts/rss-check.sh [ATTNC] (default: a release build).
set -euo pipefail
cd "$(dirname "$0")/.."
attnc=${1:-target/release/attnc}
[ -x "$attnc" ] || cargo build --release --bin attnc >&2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 scripts/make_checkpoint.py "$dir/ckpt"
python3 - "$attnc" "$dir" <<'PY'
import os, resource, subprocess, sys
attnc, dir = sys.argv[1], sys.argv[2]
weights = os.path.getsize(os.path.join(dir, "ckpt", "model.safetensors"))
subprocess.run([attnc, "logits", "--model", os.path.join(dir, "ckpt"), "--tokens", "1,2,3,4,5,6,7,8",
                "--output", os.path.join(dir, "logits.safetensors")], check=True)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
bar = 1.25 * weights + 200e6
print(f"weights {weights / 2**20:.1f} MiB, peak RSS {peak / 2**20:.1f} MiB "
      f"({peak / weights:.2f}x), bar {bar / 2**20:.1f} MiB: {'met' if peak <= bar else 'MISSED'}")
PY
