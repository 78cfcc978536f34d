"""BENCHMARKS.md's torch-op table: attn's op (`attn.attention`) against SDPA and compiled
FlexAttention in one Python process, 16 heads, head dim 128, batch 1, 2 threads: each timing the
median over 3 rounds, alternating the contenders, of the median of REPS runs after a warm-up. Forward, and forward + backward (FlexAttention has no CPU backward:
its column says so). SDPA takes the variants other than causal as a dense mask or bias, as a
user without FlexAttention writes them.

    python scripts/bench_python.py REPS [N ...]    # in a venv with torch and attn installed
    python scripts/bench_python.py overhead ATTNC  # the op against `ATTNC bench`, alternating
"""

import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import attn

torch.set_num_threads(2)
H, D, WINDOW = 16, 128, 256
SLOPES = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)])

# name: (spec items, FlexAttention score_mod, mask_mod, SDPA bias maker)
VARIANTS = {
    "causal": ("mask = causal", None, lambda b, h, q, k: q >= k, None),
    "sliding window 256": (
        f"mask = sliding_window({WINDOW})",
        None,
        lambda b, h, q, k: (q >= k) & (q - k < WINDOW),
        lambda qi, ki: torch.where((qi >= ki) & (qi - ki < WINDOW), 0.0, float("-inf"))[None, None],
    ),
    "ALiBi": (
        "mask = causal, position = alibi",
        lambda s, b, h, q, k: s + SLOPES[h] * (k - q),
        lambda b, h, q, k: q >= k,
        lambda qi, ki: torch.where(qi >= ki, SLOPES[:, None, None] * (ki - qi), float("-inf"))[None],
    ),
    "score_mod": (
        "mask = causal, score_mod = |s, b, h, q, k| s - 0.01 * (q - k) as f32",
        lambda s, b, h, q, k: s - 0.01 * (q - k),
        lambda b, h, q, k: q >= k,
        lambda qi, ki: torch.where(qi >= ki, -0.01 * (qi - ki).float(), float("-inf"))[None, None],
    ),
}


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def forward_backward(fn, inputs, dout):
    def run():
        for x in inputs:
            x.grad = None
        fn(*inputs).backward(dout)

    return run


def bench(name, n, dtype, reps):
    items, score_mod, mask_mod, bias_of = VARIANTS[name]
    suffix = ", dtype = bf16" if dtype == torch.bfloat16 else ""
    variant = attn.Variant(f"heads = {H}, head_dim = {D}, {items}{suffix}")
    q, k, v = (torch.randn(1, H, n, D, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, H, n, D, dtype=dtype)
    idx = torch.arange(n)
    bias = None if bias_of is None else bias_of(idx[:, None], idx[None, :]).to(dtype)

    def ours(q, k, v):
        return attn.attention(q, k, v, variant)

    def sdpa(q, k, v):
        if bias is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    block_mask = create_block_mask(mask_mod, None, None, n, n, device="cpu")
    # A fresh compile for each shape and variant: past dynamo's recompile limit flex_attention
    # falls back to its unfused implementation, which would not be the compiled one timed.
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)

    plain = [x.detach() for x in (q, k, v)]

    def flex_fwd():
        flex(*plain, score_mod=score_mod, block_mask=block_mask)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn(q, k, v)

        return run

    timed = {
        "attn fwd": no_grad(ours),
        "sdpa fwd": no_grad(sdpa),
        "flex fwd": flex_fwd,
        "attn fwd+bwd": forward_backward(ours, (q, k, v), dout),
        "sdpa fwd+bwd": forward_backward(sdpa, (q, k, v), dout),
    }
    rounds = {name: [] for name in timed}
    for _ in range(3):
        for name, fn in timed.items():
            rounds[name].append(median_ms(fn, reps))
    return {name: statistics.median(ms) for name, ms in rounds.items()}


def overhead(attnc, rounds=9, reps=20):
    """The binding's cost: the op's forward and `attnc bench` (the same kernels, no Python) on
    causal f32 H16 D128 N 1,024, alternating, `reps` timed runs each per round."""
    spec = f"heads = {H}, head_dim = {D}, mask = causal"
    variant = attn.Variant(spec)
    q, k, v = (torch.randn(1, H, 1024, D) for _ in range(3))
    ratios = []
    for r in range(rounds):
        cli = subprocess.run(
            [attnc, "bench", spec, "--seq", "1024", "--reps", str(reps), "--json"],
            check=True, capture_output=True, text=True,
        )
        cli_ms = json.loads(cli.stdout.strip().splitlines()[-1])["median_ms"]
        with torch.no_grad():
            op_ms = median_ms(lambda: attn.attention(q, k, v, variant), reps)
        ratios.append(op_ms / cli_ms)
        print(f"round {r + 1}: attnc bench {cli_ms:.2f} ms, the op {op_ms:.2f} ms "
              f"({op_ms / cli_ms:.3f}x)", flush=True)
    print(f"median of the rounds' ratios: {statistics.median(ratios):.3f}x")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "overhead":
        return overhead(sys.argv[2])
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    lengths = [int(x) for x in sys.argv[2:]] or [1024, 4096]
    print("| variant | N | dtype | attn fwd | SDPA fwd | compiled flex fwd | attn fwd+bwd | "
          "SDPA fwd+bwd | flex fwd+bwd | SDPA ÷ attn, fwd+bwd | flex ÷ attn, fwd |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in lengths:
        for dtype in (torch.float32, torch.bfloat16):
            for name in VARIANTS:
                r = bench(name, n, dtype, reps)
                print(
                    f"| {name} | {n} | {str(dtype)[6:]} | {r['attn fwd']:.1f} | {r['sdpa fwd']:.1f} | "
                    f"{r['flex fwd']:.1f} | {r['attn fwd+bwd']:.1f} | {r['sdpa fwd+bwd']:.1f} | "
                    f"none on the CPU | {r['sdpa fwd+bwd'] / r['attn fwd+bwd']:.2f}x | "
                    f"{r['flex fwd'] / r['attn fwd']:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
