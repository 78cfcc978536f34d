"""BENCHMARKS.md's differential-heads row on the PyTorch side: DIFF Transformer's attention as
its official code writes it, eagerly (softmax weights in pairs, minus lambda, times values of
twice the head dim) and with two SDPA calls (its flash form: each component over the shared
values), against SDPA's causal softmax of the same width. 16 query/key heads of head dim 128
(8 differential heads, values of 256), batch 1, causal, 2 threads, forward + backward; each
timing the median over 3 rounds, alternating the contenders, of the median of REPS runs after a
warm-up. attn's side is `attnc bench` at the same shapes.

    python scripts/bench_differential_torch.py REPS [N]    # in a venv with torch
"""

import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
H, D = 16, 128


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def lam(vectors, init=0.8):
    q1, k1, q2, k2 = vectors
    return torch.exp((q1 * k1).sum()) - torch.exp((q2 * k2).sum()) + init


def differential_eager(q, k, v, vectors):
    """The official eager form: 2H weights viewed as H pairs, A_1 - lambda A_2, times V."""
    b, h2, n, _ = q.shape
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    keep = torch.ones(n, n, dtype=torch.bool).tril()
    a = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1).view(b, h2 // 2, 2, n, n)
    return (a[:, :, 0] - lam(vectors) * a[:, :, 1]) @ v


def differential_sdpa(q, k, v, vectors):
    """The flash form: each component's attention over the shared values, then the difference."""
    o1 = F.scaled_dot_product_attention(q[:, 0::2], k[:, 0::2], v, is_causal=True)
    o2 = F.scaled_dot_product_attention(q[:, 1::2], k[:, 1::2], v, is_causal=True)
    return o1 - lam(vectors) * o2


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, H, n, D, generator=g).requires_grad_() for _ in range(2))
    v_soft = torch.randn(1, H, n, D, generator=g).requires_grad_()
    v_diff = torch.randn(1, H // 2, n, 2 * D, generator=g).requires_grad_()
    vectors = [(0.1 * torch.randn(D, generator=g)).requires_grad_() for _ in range(4)]
    dout_soft = torch.randn(1, H, n, D, generator=g)
    dout_diff = torch.randn(1, H // 2, n, 2 * D, generator=g)

    def step(forward, dout, tensors):
        def run():
            for t in tensors:
                t.grad = None
            forward().backward(dout)
        return run

    diff_inputs = [q, k, v_diff, *vectors]
    contenders = {
        "SDPA causal softmax": step(
            lambda: F.scaled_dot_product_attention(q, k, v_soft, is_causal=True), dout_soft,
            [q, k, v_soft]),
        "PyTorch eager differential": step(
            lambda: differential_eager(q, k, v_diff, vectors), dout_diff, diff_inputs),
        "two SDPA calls differential": step(
            lambda: differential_sdpa(q, k, v_diff, vectors), dout_diff, diff_inputs),
    }
    rounds = {name: [] for name in contenders}
    for _ in range(3):
        for name, fn in contenders.items():
            rounds[name].append(median_ms(fn, reps))
    print(f"forward + backward, {H} q/k heads, D{D}, N{n}, batch 1, causal, "
          f"{torch.get_num_threads()} threads")
    for name, times in rounds.items():
        print(f"| {name} | {statistics.median(times):.1f} |")


if __name__ == "__main__":
    main()
