"""BENCHMARKS.md's table of recent papers' attention: attn's kernels (`attn.attention`,
`attn.differential_attention`) against the papers' PyTorch eager formulations and SDPA's causal
softmax, in one Python process: 16 query heads, head dim 128, batch 1, causal, 2 threads,
forward + backward (differential heads in the paper's layout: 8 of them, values of 256); each
timing the median over 3 rounds, alternating the contenders, of the median of REPS runs after a
warm-up.

    python scripts/bench_papers.py REPS [N]    # in a venv with torch and attn installed
"""

import math
import statistics
import sys

import torch
import torch.nn.functional as F

import attn
from bench_differential_torch import differential_eager, differential_sdpa
from bench_python import median_ms

torch.set_num_threads(2)
H, D = 16, 128


def sigmoid_eager(q, k, v, bias):
    """Sigmoid attention as the paper writes it: sigmoid(QK^T / sqrt(d) + b), causal, times V."""
    n = q.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(D) + bias
    keep = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.where(keep, torch.sigmoid(s), torch.zeros((), dtype=s.dtype)) @ v


def stick_breaking_eager(q, k, v):
    """Stick-breaking as its paper writes it: log A = log sigmoid(s) plus the reversed cumulative
    sum of log(1 - sigmoid(s)) over the nearer kept keys, causal, times V."""
    n = q.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    keep = torch.ones(n, n, dtype=torch.bool).tril()
    zero = torch.zeros((), dtype=s.dtype)
    rest = torch.where(keep, F.logsigmoid(-s), zero)
    nearer = torch.flip(torch.cumsum(torch.flip(rest, [-1]), -1), [-1]) - rest
    return torch.where(keep, torch.exp(F.logsigmoid(s) + nearer), zero) @ v


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    bias = -math.log(n)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(1, H, n, D, generator=g)

    v_diff = torch.randn(1, H // 2, n, 2 * D, generator=g).requires_grad_()
    vectors = [(0.1 * torch.randn(D, generator=g)).requires_grad_() for _ in range(4)]
    dout_diff = torch.randn(1, H // 2, n, 2 * D, generator=g)
    diff_spec = (f"heads = {H}, head_dim = {D}, v_head_dim = {2 * D}, mask = causal, "
                 "differential = lambda")

    def step(forward, grad=dout, tensors=(q, k, v)):
        def run():
            for t in tensors:
                t.grad = None
            forward().backward(grad)
        return run

    def differential(forward):
        return step(forward, dout_diff, (q, k, v_diff, *vectors))

    contenders = {
        "attn causal softmax": step(lambda: attn.attention(q, k, v, f"heads = {H}, head_dim = {D}, mask = causal")),
        f"attn sigmoid (bias = -ln({n}))": step(lambda: attn.attention(
            q, k, v, f"heads = {H}, head_dim = {D}, mask = causal, normalize = sigmoid(bias = -ln({n}))")),
        "attn stick-breaking": step(lambda: attn.attention(
            q, k, v, f"heads = {H}, head_dim = {D}, mask = causal, normalize = stick_breaking")),
        "SDPA causal softmax": step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "PyTorch eager sigmoid": step(lambda: sigmoid_eager(q, k, v, bias)),
        "PyTorch eager stick-breaking": step(lambda: stick_breaking_eager(q, k, v)),
        "attn differential (values of 256)": differential(
            lambda: attn.differential_attention(q, k, v_diff, diff_spec, *vectors)),
        "PyTorch eager differential": differential(
            lambda: differential_eager(q, k, v_diff, vectors)),
        "two SDPA calls differential": differential(
            lambda: differential_sdpa(q, k, v_diff, vectors)),
    }
    rounds = {name: [] for name in contenders}
    for _ in range(3):
        for name, fn in contenders.items():
            rounds[name].append(median_ms(fn, reps))
    base = statistics.median(rounds["attn causal softmax"])
    print(f"forward + backward, H{H} D{D} N{n}, batch 1, causal, {torch.get_num_threads()} threads")
    print("| contender | median ms | vs attn causal softmax |")
    print("|---|---:|---:|")
    for name, times in rounds.items():
        ms = statistics.median(times)
        print(f"| {name} | {ms:.1f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
