#!/usr/bin/env bash
# The MPI engine in use (idempotent; installs Open MPI and libclang from apt when missing):
# context-parallel attention under `mpirun -n 2` and `-n 4` (Ulysses and ring, forward and
# backward, each rank's part against the single call); ranks that fail (a wrong-sized buffer,
# a rank that exits) end the job with an error in bounded time; `attnc train` over two MPI
# ranks, data- and context-parallel, equal to one process; and a rank killed mid-run, whose
# run resumes to the same end.
set -euo pipefail
cd "$(dirname "$0")/.."

# mpicc comes with libopenmpi-dev; rsmpi's bindings are generated with libclang.
if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null \
  || ! ldconfig -p | grep -q 'libclang[-.0-9]*\.so'; then
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi
  echo "installing Open MPI and libclang (apt)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    openmpi-bin libopenmpi-dev libclang-dev
fi

cargo build -q --features mpi --example context_parallel
BIN=target/debug/examples/context_parallel
MPIRUN=(mpirun --oversubscribe)
if [ "$(id -u)" = 0 ]; then MPIRUN+=(--allow-run-as-root); fi

SPECS=(
  "heads = 4, head_dim = 16, mask = causal"
  "heads = 4, kv_heads = 2, head_dim = 16, mask = causal"
  "heads = 4, head_dim = 16, mask = sliding_window(20)"
  "heads = 4, head_dim = 16, mask = causal, position = rope(scaling = yarn(factor = 4.0, original_max_position = 32))"
  "heads = 4, head_dim = 16, mask = causal, position = alibi"
  "heads = 4, head_dim = 16, mask = causal, softcap = 5.0"
  "heads = 4, head_dim = 16, mask = causal, score_mod = |s, b, h, q, k| s - 0.05 * ((q - k) as f32) + (h as f32) * 0.25"
  "heads = 4, head_dim = 16, mask = causal, sinks = learned"
  "heads = 4, head_dim = 16, mask = causal, params(slopes: [heads]), score_mod = |s, b, h, q, k| s - slopes[h] * ((q - k) as f32)"
  "heads = 4, head_dim = 16"
  "heads = 4, head_dim = 16, v_head_dim = 8, mask_mod = |b, h, q, k| k <= q || k < 12"
  "heads = 4, head_dim = 16, mask = causal, dtype = bf16"
)
ARGS=()
for s in "${SPECS[@]}"; do ARGS+=(--spec "$s"); done

for n in 2 4; do
  echo "== mpirun -n $n: ${#SPECS[@]} specs, Ulysses and ring, against the single call"
  out=$(timeout 600 "${MPIRUN[@]}" -n "$n" "$BIN" --seq 96 --batch 2 --check --scheme both \
    "${ARGS[@]}" 2>&1) || { echo "$out"; exit 1; }
  checked=$(grep -c "equal to the single call" <<<"$out" || true)
  skipped=$(grep -c "Ulysses skipped" <<<"$out" || true)
  # Every rank checks each spec with both schemes, but for the Ulysses runs skipped (printed
  # once, by rank 0).
  want=$(( n * (2 * ${#SPECS[@]} - skipped) ))
  if [ "$checked" != "$want" ]; then
    echo "$out"
    echo "error: $checked checks passed on $n ranks; expected $want"
    exit 1
  fi
  echo "$checked rank-checks passed ($skipped Ulysses runs skipped: heads not divisible)"
done

echo "== a rank with a wrong-sized buffer: every rank stops with an error"
start=$SECONDS
if out=$(timeout 120 "${MPIRUN[@]}" -n 4 "$BIN" --seq 64 --fail wrong-size 2>&1); then
  echo "$out"; echo "error: the job succeeded"; exit 1
fi
grep -q "buffers of different lengths" <<<"$out" || { echo "$out"; exit 1; }
echo "ended with an error after $((SECONDS - start)) s"

echo "== a rank that exits before the call: the job ends, no rank waits"
start=$SECONDS
if out=$(timeout 120 "${MPIRUN[@]}" -n 2 "$BIN" --seq 64 --fail exit 2>&1); then
  echo "$out"; echo "error: the job succeeded"; exit 1
fi
[ $((SECONDS - start)) -lt 110 ] || { echo "error: the job ran into the timeout"; exit 1; }
echo "ended after $((SECONDS - start)) s"

echo "== attnc train under mpirun -n 2: equal to one process with the same --batch"
cargo build -q --features candle,mpi --bin attnc
ATTNC=target/debug/attnc
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
printf 'vocab = 256\nhidden = 32\nlayers = 1\nattention = "heads = 2, head_dim = 16, mask = causal, position = rope"\n' > "$T/m.toml"
python3 -c "print('the quick brown fox jumps over the lazy dog. ' * 40)" > "$T/c.txt"
TRAIN=(train --model "$T/m.toml" --data "$T/c.txt" --seq 16 --batch 4 --eval-every 10 --warmup 2)
"$ATTNC" "${TRAIN[@]}" --steps 60 --out "$T/one" > /dev/null 2>&1
timeout 300 "${MPIRUN[@]}" -n 2 "$ATTNC" "${TRAIN[@]}" --steps 60 --out "$T/two" > /dev/null 2>&1
same_losses() {
  python3 - "$1" "$2" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(f"{d}/steps.jsonl")] for d in sys.argv[1:])
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
assert len(a) == len(b) == 60 and worst <= 1e-5, (len(a), len(b), worst)
print(f"{len(a)} steps, largest relative difference {worst:.1e}")
PY
}
same_losses "$T/one" "$T/two"

echo "== attnc train --context-parallel 2 under mpirun -n 2 (ring): equal to one process"
timeout 300 "${MPIRUN[@]}" -n 2 "$ATTNC" "${TRAIN[@]}" --steps 60 --context-parallel 2 \
  --out "$T/context" > /dev/null 2>&1
same_losses "$T/one" "$T/context"

echo "== attnc sweep under mpirun -n 2: the variants handed to the ranks, one report"
timeout 300 "${MPIRUN[@]}" -n 2 "$ATTNC" sweep --base "$T/m.toml" --data "$T/c.txt" \
  --vary "kv_heads=1,2" --vary "position=rope,alibi" --steps 4 --eval-every 2 --warmup 1 \
  --batch 2 --seq 16 --out "$T/sweep" > "$T/sweep.log" 2>&1 || { cat "$T/sweep.log"; exit 1; }
rows=$(($(wc -l < "$T/sweep/results.csv") - 1))
for r in 0 1; do
  grep -q "rank $r of 2 trains" "$T/sweep.log" || { cat "$T/sweep.log"; exit 1; }
done
[ "$rows" = 4 ] || { cat "$T/sweep.log"; echo "error: $rows rows, expected 4"; exit 1; }
echo "4 variants over 2 ranks, one results.csv"

echo "== a rank killed mid-run: the job ends, and the last checkpoint resumes to the same end"
"${MPIRUN[@]}" -n 2 "$ATTNC" "${TRAIN[@]}" --steps 60 --out "$T/killed" > /dev/null 2>&1 &
JOB=$!
for _ in $(seq 600); do [ -e "$T/killed/state.json" ] && break; sleep 0.1; done
for pid in $(pgrep -f "attnc train.*$T/killed" || true); do
  if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1'; then
    kill -9 "$pid"
  fi
done
start=$SECONDS
while kill -0 "$JOB" 2>/dev/null && [ $((SECONDS - start)) -lt 120 ]; do sleep 0.2; done
if kill -0 "$JOB" 2>/dev/null; then
  echo "error: the job still runs 120 s after one of its ranks was killed"; exit 1
fi
if wait "$JOB"; then
  echo "error: the job with a killed rank succeeded"; exit 1
fi
echo "ended $((SECONDS - start)) s after the kill"
timeout 300 "${MPIRUN[@]}" -n 2 "$ATTNC" train --resume "$T/killed" > /dev/null 2>&1
same_losses "$T/one" "$T/killed"
