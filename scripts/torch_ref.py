"""Time PyTorch CPU attention for one config; print JSON. Run with the python scripts/setup-torch.sh prints.
usage: torch_ref.py prefill|decode|flex_alibi H HKV D N [dtype]"""
import sys, json, time, math, torch
torch.set_num_threads(2)
kind, H, HKV, D, N = sys.argv[1], *map(int, sys.argv[2:6])
dt = {"f32": torch.float32, "bf16": torch.bfloat16}[sys.argv[6] if len(sys.argv) > 6 else "f32"]
F = torch.nn.functional
g = torch.Generator().manual_seed(0)
def timeit(fn, reps):
    fn(); fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts) // 2]
if kind == "decode":
    q = torch.randn(1, H, 1, D, generator=g, dtype=dt); k = torch.randn(1, HKV, N, D, generator=g, dtype=dt); v = torch.randn(1, HKV, N, D, generator=g, dtype=dt)
    t = timeit(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 50)
    print(json.dumps({"median_us": t * 1e6, "gbps": 2 * k.numel() * k.element_size() / t / 1e9}))
else:
    q = torch.randn(1, H, N, D, generator=g, dtype=dt); k = torch.randn(1, HKV, N, D, generator=g, dtype=dt); v = torch.randn(1, HKV, N, D, generator=g, dtype=dt)
    flops = 4 * H * N * N * D / 2
    if kind == "prefill":
        t = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=HKV != H), 5)
    else:
        from torch.nn.attention.flex_attention import flex_attention, create_block_mask
        slopes = torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)])
        def alibi(s, b, h, qi, ki): return s + slopes[h] * (ki - qi)
        def causal(b, h, qi, ki): return qi >= ki
        bm = create_block_mask(causal, 1, 1, N, N, device="cpu")
        fa = torch.compile(flex_attention, dynamic=False)
        t = timeit(lambda: fa(q, k, v, score_mod=alibi, block_mask=bm, enable_gqa=HKV != H), 5)
    print(json.dumps({"median_ms": t * 1e3, "gflops": flops / t / 1e9}))
