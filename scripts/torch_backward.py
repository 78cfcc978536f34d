"""Time PyTorch SDPA forward + backward on the CPU (2 threads), for side-by-side ratios with
`attnc bench SPEC --backward`. Prints JSON {"median_ms", "gflops"} (GFLOP/s counted as 3.5
forwards of 4 H N^2 D, halved for causal, as attnc counts them).
usage: torch_backward.py H HKV D N [f32|bf16] [causal|none]"""
import sys, json, time, torch

torch.set_num_threads(2)
H, HKV, D, N = map(int, sys.argv[1:5])
dt = {"f32": torch.float32, "bf16": torch.bfloat16}[sys.argv[5] if len(sys.argv) > 5 else "f32"]
causal = (sys.argv[6] if len(sys.argv) > 6 else "causal") == "causal"
g = torch.Generator().manual_seed(0)
q = torch.randn(1, H, N, D, generator=g, dtype=dt, requires_grad=True)
k = torch.randn(1, HKV, N, D, generator=g, dtype=dt, requires_grad=True)
v = torch.randn(1, HKV, N, D, generator=g, dtype=dt, requires_grad=True)
dout = torch.randn(1, H, N, D, generator=g, dtype=dt)


def step():
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=HKV != H
    )
    q.grad = k.grad = v.grad = None
    out.backward(dout)


step()
step()
times = []
for _ in range(5):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
times.sort()
median = times[len(times) // 2]
flops = 3.5 * 4 * H * N * N * D * (0.5 if causal else 1.0)
print(json.dumps({"median_ms": median * 1e3, "gflops": flops / median / 1e9}))
