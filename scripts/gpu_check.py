"""The GPU backend's device check (called by scripts/gpu-check.sh).

1. Differential: for each spec, random q, k, v (seeded, in the spec's dtype) go through
   `attnc run --backend cuda` and `attnc run --backend cpu` (the CPU backend is tested against
   attn_dsl::reference in `cargo test`); outputs and lse must agree within the dtype's tolerance,
   and for the variants written out below, also with a float64 reference computed here.
2. Gradients: every golden gradient case (tests/fixtures/gradients, PyTorch float64 autograd)
   through `attnc grad --backend cuda`, within the case's tolerance.
3. Timing (on CUDA only): bf16 forward for causal, ALiBi and sliding window, head dims 64 and
   128, N from 1k to 16k, 16 heads and batch 16k / N (enough CTAs to fill the chip), against
   torch.nn.functional.scaled_dot_product_attention on the same device. One table: TFLOP/s
   (4 B H N^2 D, halved for the masks) and the ratio. Then decode steps (GQA, bf16) against a
   device copy of a paged cache, against SDPA on contiguous K/V. Then the bf16 causal backward
   (`attnc bench --backward --backend cuda`: delta, dq, dk and dv on tensor cores) at D 64 and
   128, N 2k and 8k, against SDPA's backward alone on the cuDNN and FlashAttention-2 backends.
4. sm_90a (compute capability 9.0 only; `--hopper`, or `--hopper-only` for this part alone):
   the differential cases the warp-specialized wgmma forward runs (bf16 and f16, head dims
   multiples of 64; RoPE included) again with ATTN_GPU_WGMMA=1, and the 16-bit cases with
   ATTN_GPU_MMA_WARPS=12 (the mma.sync forward at twelve warps per SM), then the bf16 forward
   timing of both for D 64, 128 and 256, causal and non-causal, N 1k to 16k, next to our sm_90
   kernel, cuDNN SDPA and FlexAttention (compiled once per shape) on the same device.

  python3 scripts/gpu_check.py --attnc PATH [--backend cuda|gpu-sim] [--quick] [--skip-timing]

`--backend gpu-sim` runs the differential part on the GPU IR interpreter (no GPU needed, small
sizes only): a dry run of this script.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

# (spec, batch, Sq, Skv): every kernel path the GPU backend has (tensor cores for bf16 and f16
# with head dims that are multiples of 16, SIMT for f32), masks, positions and score modifiers.
DIFFERENTIAL = [
    ("heads = 4, head_dim = 64, mask = causal, dtype = bf16", 2, 200, 200),
    ("heads = 4, head_dim = 128, mask = causal, dtype = bf16", 1, 130, 130),
    ("heads = 8, kv_heads = 2, head_dim = 128, mask = causal, dtype = bf16", 1, 97, 160),
    ("heads = 4, head_dim = 64, mask = causal, position = alibi, dtype = bf16", 1, 150, 150),
    ("heads = 4, head_dim = 64, mask = sliding_window(48), dtype = bf16", 1, 150, 150),
    ("heads = 4, head_dim = 64, mask = causal, softcap = 30.0, dtype = bf16", 1, 120, 120),
    ("heads = 4, head_dim = 128, mask = causal, position = rope, dtype = bf16", 1, 100, 100),
    ("heads = 4, head_dim = 48, v_head_dim = 24, position = rope(dim = 12), dtype = bf16", 1, 33, 70),
    ("heads = 4, head_dim = 64, dtype = bf16", 1, 64, 90),
    ("heads = 4, kv_heads = 1, head_dim = 64, mask = causal, dtype = f16", 1, 100, 120),
    ("heads = 4, head_dim = 64, mask = causal", 1, 100, 100),
    ("heads = 2, head_dim = 40, mask = sliding_window(20), position = alibi", 1, 60, 60),
]

SMALL_FOR_SIM = 48  # the interpreter is slow: sequences are cut to this length with gpu-sim


def spec_field(spec, name, default=None):
    for part in spec.split(", "):
        if part.startswith(name + " = "):
            return part.split(" = ", 1)[1]
    return default


def reference(spec, q, k, v):
    """float64 attention for the specs whose semantics are written out here, else None
    (docs/semantics.md: bottom-right causal alignment; sliding window W keeps q - k < W; ALiBi slopes
    2^(-8 (h + 1) / H) for a power-of-two H; softcap c tanh(s / c))."""
    position = spec_field(spec, "position", "none")
    if position not in ("none", "alibi") or spec_field(spec, "kv_heads"):
        return None
    if spec_field(spec, "v_head_dim") or spec_field(spec, "scale"):
        return None
    mask = spec_field(spec, "mask", "none")
    q, k, v = (t.double() for t in (q, k, v))
    _, h, sq, d = q.shape
    skv = k.shape[2]
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d)
    softcap = spec_field(spec, "softcap")
    if softcap:
        c = float(softcap)
        s = c * torch.tanh(s / c)
    qpos = torch.arange(sq, dtype=torch.float64)[:, None] + (skv - sq)
    kpos = torch.arange(skv, dtype=torch.float64)[None, :]
    if position == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float64)
        s = s + slopes[None, :, None, None] * (kpos - qpos)[None, None]
    keep = torch.ones(sq, skv, dtype=torch.bool)
    if mask.startswith("causal") and mask != "causal(top_left)":
        keep &= kpos <= qpos
    elif mask.startswith("sliding_window"):
        w = int(mask[len("sliding_window("):-1])
        keep &= (kpos <= qpos) & (qpos - kpos < w)
    elif mask != "none":
        return None
    s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def attnc_run(attnc, spec, inputs, backend, workdir, tag, env=None):
    out = os.path.join(workdir, f"{tag}-{backend}.safetensors")
    r = subprocess.run(
        [attnc, "run", "--spec", spec, "--input", inputs, "--output", out, "--backend", backend],
        capture_output=True,
        text=True,
        env=env,
    )
    if r.returncode != 0:
        raise RuntimeError(f"attnc run --backend {backend} failed ({r.returncode}): {r.stderr.strip()}")
    return load_file(out)


def wgmma_runs(spec):
    """Whether the sm_90a forward takes the spec (codegen::gpu::forward_wgmma::supports)."""
    d = int(spec_field(spec, "head_dim"))
    dv = int(spec_field(spec, "v_head_dim", d))
    return (spec_field(spec, "dtype") in ("bf16", "f16")
            and all(x % 64 == 0 and x <= 256 for x in (d, dv)))


# The differential runs besides the default: which cases each takes, its setting, and its name.
MODES = {
    "wgmma": (wgmma_runs, {"ATTN_GPU_WGMMA": "1"}, "the sm_90a forward"),
    "twelve": (
        lambda spec: spec_field(spec, "dtype") in ("bf16", "f16"),
        {"ATTN_GPU_MMA_WARPS": "12"},
        "the mma.sync forward at twelve warps per SM",
    ),
}


def differential(attnc, backend, mode=None):
    cases, env, what = DIFFERENTIAL, None, ""
    if mode:
        takes, setting, name = MODES[mode]
        cases = [c for c in DIFFERENTIAL if takes(c[0])]
        env = dict(os.environ, **setting)
        what = f" ({' '.join(f'{k}={v}' for k, v in setting.items())}: {name})"
    print(f"== differential{what}: attnc run --backend {backend} against --backend cpu and float64")
    failures = 0
    with tempfile.TemporaryDirectory() as workdir:
        for i, (spec, b, sq, skv) in enumerate(cases):
            if backend == "gpu-sim":
                sq, skv = min(sq, SMALL_FOR_SIM), min(skv, SMALL_FOR_SIM + (skv - sq))
            heads = int(spec_field(spec, "heads"))
            kv_heads = int(spec_field(spec, "kv_heads", heads))
            d = int(spec_field(spec, "head_dim"))
            dv = int(spec_field(spec, "v_head_dim", d))
            dtype = {"bf16": torch.bfloat16, "f16": torch.float16}.get(
                spec_field(spec, "dtype"), torch.float32
            )
            half = dtype != torch.float32
            g = torch.Generator().manual_seed(1000 + i)
            q = (torch.rand(b, heads, sq, d, generator=g) * 2 - 1).to(dtype)
            k = (torch.rand(b, kv_heads, skv, d, generator=g) * 2 - 1).to(dtype)
            v = (torch.rand(b, kv_heads, skv, dv, generator=g) * 2 - 1).to(dtype)
            inputs = os.path.join(workdir, f"in{i}.safetensors")
            save_file({"q": q, "k": k, "v": v}, inputs)
            try:
                dev = attnc_run(attnc, spec, inputs, backend, workdir, f"case{i}", env)
                cpu = attnc_run(attnc, spec, inputs, "cpu", workdir, f"case{i}")
            except RuntimeError as e:
                print(f"FAIL {spec}: {e}")
                failures += 1
                continue
            out_tol, lse_tol = (2e-2, 2e-2) if half else (1e-4, 1e-4)
            err_out = (dev["out"].float() - cpu["out"].float()).abs().max().item()
            finite = torch.isfinite(cpu["lse"])
            same_inf = torch.equal(finite, torch.isfinite(dev["lse"]))
            err_lse = (dev["lse"][finite] - cpu["lse"][finite]).abs().max().item() if finite.any() else 0.0
            ref = reference(spec, q, k, v)
            err_ref = (dev["out"].double() - ref).abs().max().item() if ref is not None else None
            ok = err_out <= out_tol and err_lse <= lse_tol and same_inf
            ok = ok and (ref is None or err_ref <= out_tol)
            failures += not ok
            # The float64 reference here covers the plain variants; the others compare with the
            # CPU backend alone (itself tested against the reference in cargo test).
            vs_ref = f"{err_ref:.2e}" if err_ref is not None else "- (no float64 reference here)"
            print(
                f"{'ok  ' if ok else 'FAIL'} [B {b}, Sq {sq}, Skv {skv}] {spec}: |out - cpu| {err_out:.2e}, "
                f"|lse - cpu| {err_lse:.2e}, |out - f64| {vs_ref}"
            )
    print(f"== differential{what}: {len(cases) - failures} of {len(cases)} agree")
    return failures


def cuda_median_ms(call, reps):
    """Median milliseconds of `call` over `reps` runs after a warm-up, by CUDA events."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def time_torch(variant, b, h, n, d, reps):
    dev = "cuda"
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    f = torch.nn.functional.scaled_dot_product_attention
    if variant == "causal":
        call = lambda: f(q, k, v, is_causal=True)
    else:
        pos = torch.arange(n, device=dev)
        dist = pos[None, :] - pos[:, None]  # k - q
        if variant == "alibi":  # else the sliding window of 1024
            slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device=dev)
            bias = slopes[:, None, None] * dist[None].float()
            bias = bias.masked_fill(dist[None] > 0, float("-inf")).to(torch.bfloat16)
            call = lambda: f(q, k, v, attn_mask=bias)
        else:
            keep = (dist <= 0) & (-dist < 1024)
            call = lambda: f(q, k, v, attn_mask=keep)
    return cuda_median_ms(call, reps)


def timing(attnc, quick):
    print("== timing (bf16 forward, 16 heads, batch 16k / N; TFLOP/s = 4 B H N^2 D / 2 / time)")
    print(f"{'config':<22} {'D':>4} {'N':>6} {'B':>3} {'ours ms':>9} {'ours TF/s':>10} {'torch ms':>9} {'torch TF/s':>11} {'ratio':>6}")
    specs = {
        "causal": "mask = causal",
        "alibi": "mask = causal, position = alibi",
        "sliding_window_1024": "mask = sliding_window(1024)",
    }
    sizes = [1024, 8192] if quick else [1024, 2048, 4096, 8192, 16384]
    rows = []
    for name, body in specs.items():
        for d in (64, 128):
            slow = False
            for n in sizes:
                b, h = max(1, 16384 // n), 16
                flops = 4 * b * h * n * n * d / 2
                if slow:
                    print(f"{name:<22} {d:>4} {n:>6} {b:>3}   skipped (the previous size took over 2 s a launch)")
                    continue
                spec = f"heads = {h}, head_dim = {d}, {body}, dtype = bf16"
                r = subprocess.run(
                    [attnc, "bench", spec, "--seq", str(n), "--batch", str(b), "--reps", "5",
                     "--backend", "cuda", "--json"],
                    capture_output=True, text=True,
                )
                if r.returncode != 0:
                    print(f"{name:<22} {d:>4} {n:>6} {b:>3}   ours failed: {r.stderr.strip()}")
                    continue
                ours = json.loads(r.stdout)["median_ms"]
                slow = ours > 2000
                theirs = time_torch(name, b, h, n, d, 5)
                rows.append((name, d, n, ours, theirs))
                print(
                    f"{name:<22} {d:>4} {n:>6} {b:>3} {ours:>9.3f} {flops / ours / 1e9:>10.1f} "
                    f"{theirs:>9.3f} {flops / theirs / 1e9:>11.1f} {theirs / ours:>6.2f}"
                )
                sys.stdout.flush()
    return rows


def time_torch_decode(b, h, hkv, kv_len, d, reps):
    dev = "cuda"
    q = torch.randn(b, h, 1, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, kv_len, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    f = torch.nn.functional.scaled_dot_product_attention
    call = lambda: f(q, k, v, enable_gqa=True)
    return cuda_median_ms(call, reps)


def decode_timing(attnc):
    print("== decode steps (bf16, 32 query heads over 8 kv heads, D 128, one query per sequence;")
    print("   ours: a whole step against a device copy of a paged cache, host preparation")
    print("   included, and its kernels alone (decode + merge, CUDA events); GB/s of K+V read)")
    print(f"{'kv len':>7} {'B':>4} {'step us':>9} {'kernel us':>10} {'kernel GB/s':>12} "
          f"{'torch us':>9} {'torch GB/s':>11} {'step x':>7} {'kernel x':>9}")
    spec = "heads = 32, kv_heads = 8, head_dim = 128, dtype = bf16"
    for kv_len, b in [(4096, 1), (4096, 8), (4096, 32), (4096, 128), (32768, 8)]:
        r = subprocess.run(
            [attnc, "bench-decode", spec, "--kv-len", str(kv_len), "--batch", str(b),
             "--reps", "20", "--backend", "cuda", "--json"],
            capture_output=True, text=True,
        )
        if r.returncode != 0:
            print(f"{kv_len:>7} {b:>4}   ours failed: {r.stderr.strip()}")
            continue
        ours = json.loads(r.stdout)
        theirs = time_torch_decode(b, 32, 8, kv_len, 128, 20) * 1e3
        kv_bytes = b * 8 * kv_len * 128 * 2 * 2
        kernel_us = ours.get("kernel_us", float("nan"))
        print(
            f"{kv_len:>7} {b:>4} {ours['median_us']:>9.1f} {kernel_us:>10.1f} "
            f"{ours.get('kernel_gbps', float('nan')):>12.1f} {theirs:>9.1f} "
            f"{kv_bytes / (theirs * 1e-6) / 1e9:>11.1f} {theirs / ours['median_us']:>7.2f} "
            f"{theirs / kernel_us:>9.2f}"
        )
        sys.stdout.flush()
    # MLA decode (the bar: 128 heads, rank 512, rope 64, bf16, kv 4096, batch 64, at
    # least 2.5 TB/s). No PyTorch kernel to set beside it: FlashMLA reports 3000 GB/s on an H800.
    spec = ("heads = 128, head_dim = 128, mla(latent_rank = 512, rope_dim = 64), "
            "dtype = bf16")
    r = subprocess.run(
        [attnc, "bench-decode", spec, "--kv-len", "4096", "--batch", "64", "--reps", "20",
         "--backend", "cuda", "--json"],
        capture_output=True, text=True,
    )
    if r.returncode != 0:
        print(f"   MLA decode (128 heads, 512 + 64, B 64, kv 4096) failed: {r.stderr.strip()}")
    else:
        ours = json.loads(r.stdout)
        print(f"   MLA decode (128 heads, 512 + 64, B 64, kv 4096): step {ours['median_us']:.1f} us, "
              f"kernels {ours.get('kernel_us', float('nan')):.1f} us, "
              f"{ours.get('kernel_gbps', float('nan')):.1f} GB/s of latent cache read")


def time_torch_backward(b, h, n, d, reps):
    """cuDNN SDPA's backward alone (bf16, causal): the forward once, then `reps` timed backward
    passes of the same graph."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dev = "cuda"
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16)
    results = {}
    for name, backend in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)]:
        try:
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                call = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                results[name] = cuda_median_ms(call, reps)
        except RuntimeError as e:
            results[name] = None
            print(f"   torch {name} backward unavailable: {e}")
    return results


def backward_timing(attnc):
    print("== backward timing (bf16 causal, 16 heads, batch 16k / N; our three kernels against")
    print("   SDPA's backward alone; TFLOP/s = 2.5 x 4 B H N^2 D / 2 / time)")
    print(f"{'D':>4} {'N':>6} {'B':>3} {'ours ms':>9} {'ours TF/s':>10} {'cuDNN ms':>9} "
          f"{'cuDNN TF/s':>11} {'FA2 ms':>8} {'x cuDNN':>8}")
    for d in (64, 128):
        for n in (2048, 8192):
            b, h = max(1, 16384 // n), 16
            flops = 2.5 * 4 * b * h * n * n * d / 2
            spec = f"heads = {h}, head_dim = {d}, mask = causal, dtype = bf16"
            r = subprocess.run(
                [attnc, "bench", spec, "--seq", str(n), "--batch", str(b), "--reps", "5",
                 "--backend", "cuda", "--backward", "--json"],
                capture_output=True, text=True,
            )
            if r.returncode != 0:
                print(f"{d:>4} {n:>6} {b:>3}   ours failed: {r.stderr.strip()}")
                continue
            ours = json.loads(r.stdout)["median_ms"]
            theirs = time_torch_backward(b, h, n, d, 5)
            cudnn, fa2 = theirs.get("cudnn"), theirs.get("fa2")
            fmt = lambda x, w: f"{x:>{w}.3f}" if x else f"{'-':>{w}}"
            print(
                f"{d:>4} {n:>6} {b:>3} {ours:>9.3f} {flops / ours / 1e9:>10.1f} {fmt(cudnn, 9)} "
                f"{(flops / cudnn / 1e9 if cudnn else 0):>11.1f} {fmt(fa2, 8)} "
                f"{(cudnn / ours if cudnn else 0):>8.2f}"
            )
            sys.stdout.flush()


def time_flex(causal, b, h, n, d, reps):
    """FlexAttention (torch.compile'd once per shape; the compile is not timed), bf16."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    dev = "cuda"
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    flex = torch.compile(flex_attention)
    mask = None
    if causal:
        mask = create_block_mask(lambda b_, h_, q_, k_: q_ >= k_, None, None, n, n, device=dev)
    return cuda_median_ms(lambda: flex(q, k, v, block_mask=mask), reps)


def time_cudnn(causal, b, h, n, d, reps):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        f = torch.nn.functional.scaled_dot_product_attention
        return cuda_median_ms(lambda: f(q, k, v, is_causal=causal), reps)


def attnc_bench(attnc, spec, n, b, env=None):
    r = subprocess.run(
        [attnc, "bench", spec, "--seq", str(n), "--batch", str(b), "--reps", "5",
         "--backend", "cuda", "--json"],
        capture_output=True, text=True, env=env,
    )
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip())
    return json.loads(r.stdout)["median_ms"]


def hopper_timing(attnc, quick):
    """The sm_90a forward (ATTN_GPU_WGMMA=1) next to our sm_90 kernel (at eight warps per SM and
    at twelve, ATTN_GPU_MMA_WARPS=12), cuDNN and FlexAttention."""
    print("== sm_90a timing (bf16 forward, 16 heads, batch 16k / N; TFLOP/s = 4 B H N^2 D, halved")
    print("   when causal; x cuDNN and x flex are ratios of times, above 1 faster than them)")
    print(f"{'mask':<7} {'D':>4} {'N':>6} {'B':>3} {'wgmma TF/s':>11} {'sm_90 TF/s':>11} "
          f"{'12 warps':>9} {'cuDNN TF/s':>11} {'flex TF/s':>10} {'x cuDNN':>8} {'x flex':>7}")
    env = dict(os.environ, ATTN_GPU_WGMMA="1")
    twelve_env = dict(os.environ, ATTN_GPU_MMA_WARPS="12")
    sizes = [1024, 8192] if quick else [1024, 2048, 4096, 8192, 16384]
    for causal in (True, False):
        for d in (64, 128, 256):
            for n in sizes:
                b, h = max(1, 16384 // n), 16
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                mask = "causal" if causal else "none"
                spec = f"heads = {h}, head_dim = {d}, mask = {mask}, dtype = bf16"
                tf = lambda ms: flops / ms / 1e9 if ms else 0.0
                try:
                    ours = attnc_bench(attnc, spec, n, b, env)
                    base = attnc_bench(attnc, spec, n, b)
                    twelve = attnc_bench(attnc, spec, n, b, twelve_env)
                except RuntimeError as e:
                    print(f"{mask:<7} {d:>4} {n:>6} {b:>3}   ours failed: {e}")
                    continue
                try:
                    cudnn = time_cudnn(causal, b, h, n, d, 5)
                except RuntimeError:
                    cudnn = None
                try:
                    flex = time_flex(causal, b, h, n, d, 5)
                except Exception as e:  # FlexAttention needs triton; report and go on
                    print(f"   flex unavailable: {type(e).__name__}")
                    flex = None
                print(
                    f"{mask:<7} {d:>4} {n:>6} {b:>3} {tf(ours):>11.1f} {tf(base):>11.1f} "
                    f"{tf(twelve):>9.1f} {tf(cudnn):>11.1f} {tf(flex):>10.1f} "
                    f"{(cudnn / ours if cudnn else 0):>8.2f} {(flex / ours if flex else 0):>7.2f}"
                )
                sys.stdout.flush()


def gradients(attnc, backend):
    """The golden gradient cases (PyTorch float64 autograd) through `attnc grad --backend`."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "gradients")
    with open(os.path.join(root, "manifest.json")) as f:
        cases = json.load(f)["cases"]
    print(f"== gradients: attnc grad --backend {backend} against PyTorch float64 autograd")
    failures = 0
    with tempfile.TemporaryDirectory() as workdir:
        for name, case in cases.items():
            if "grads" in case:
                print(f"skip {name}: the MLA backward runs on the CPU backend only")
                continue
            out = os.path.join(workdir, f"{name}.safetensors")
            inputs = os.path.join(root, case["file"])
            r = subprocess.run(
                [attnc, "grad", "--spec", case["spec"], "--input", inputs, "--output", out,
                 "--position-offset", str(case["position_offset"]), "--backend", backend],
                capture_output=True, text=True,
            )
            if r.returncode != 0:
                print(f"FAIL {name}: attnc grad failed ({r.returncode}): {r.stderr.strip()}")
                failures += 1
                continue
            got, want = load_file(out), load_file(inputs)
            errors = {g: (got[g].double() - want[g]).abs().max().item() for g in ["dq", "dk", "dv"]}
            if case["dtype"] == "f32":
                ok = all(
                    ((got[g].double() - want[g]).abs() <= 1e-4 + 1e-3 * want[g].abs()).all().item()
                    for g in errors
                )
            else:
                ok = all(errors[g] <= 2 * case["torch_lowp_grad_max_abs_err"][g] for g in errors)
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name}: " + ", ".join(f"|{g} - f64| {e:.2e}" for g, e in errors.items()))
    run = sum("grads" not in c for c in cases.values())
    print(f"== gradients: {run - failures} of {run} pass")
    return failures


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attnc", required=True)
    p.add_argument("--backend", default="cuda", choices=["cuda", "gpu-sim"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--hopper", action="store_true", help="also the sm_90a part (9.0 devices)")
    p.add_argument("--hopper-only", action="store_true", help="only the sm_90a part")
    a = p.parse_args()
    start = time.time()
    if a.hopper_only:
        failures = differential(a.attnc, a.backend, "wgmma")
        failures += differential(a.attnc, a.backend, "twelve")
        if a.backend == "cuda" and not a.skip_timing and torch.cuda.is_available():
            print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
            hopper_timing(a.attnc, a.quick)
        print(f"== done in {time.time() - start:.0f} s")
        sys.exit(1 if failures else 0)
    failures = differential(a.attnc, a.backend)
    if a.hopper:
        failures += differential(a.attnc, a.backend, "wgmma")
        failures += differential(a.attnc, a.backend, "twelve")
    failures += gradients(a.attnc, a.backend)
    if a.backend == "cuda" and not a.skip_timing:
        if not torch.cuda.is_available():
            print("no CUDA device visible to PyTorch: timing skipped")
        else:
            print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
            timing(a.attnc, a.quick)
            decode_timing(a.attnc)
            backward_timing(a.attnc)
            if a.hopper:
                hopper_timing(a.attnc, a.quick)
    print(f"== done in {time.time() - start:.0f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
