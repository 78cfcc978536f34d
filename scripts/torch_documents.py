"""PyTorch's side of BENCHMARKS.md's document masks: FlexAttention on the CPU (create_block_mask,
then the compiled flex_attention forward) and SDPA run per document in a loop (forward, and
forward + backward), 16 heads, head dim 128, N tokens in 8 and 64 equal causal documents, f32 and
bf16, 2 threads, median of REPS runs after a warm-up.

    /opt/torch-venv/bin/python scripts/torch_documents.py N REPS
"""
import time, sys, torch
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
import torch.nn.functional as F
torch.set_num_threads(2)
H, D = 16, 128
def med(f, reps):
    f(); ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//2]*1e3
def run(N, docs, dtype, reps):
    q,k,v = [torch.randn(1,H,N,D,dtype=dtype) for _ in range(3)]
    doc = (torch.arange(N) * docs // N)
    def mask_mod(b,h,qi,ki):
        return (qi >= ki) & (doc[qi] == doc[ki])
    build = lambda: create_block_mask(mask_mod, None, None, N, N, device="cpu")
    t_build = med(build, reps)
    bm = build()
    flex = torch.compile(flex_attention)
    t_fwd = med(lambda: flex(q,k,v,block_mask=bm), reps)
    L = N // docs
    def loop():
        for d in range(docs):
            s = slice(d*L,(d+1)*L)
            F.scaled_dot_product_attention(q[:,:,s],k[:,:,s],v[:,:,s],is_causal=True)
    t_sdpa = med(loop, reps)
    # forward+backward SDPA loop
    qg,kg,vg = [x.clone().requires_grad_() for x in (q,k,v)]
    def loop_bwd():
        outs=[]
        for d in range(docs):
            s = slice(d*L,(d+1)*L)
            o = F.scaled_dot_product_attention(qg[:,:,s],kg[:,:,s],vg[:,:,s],is_causal=True)
            o.backward(torch.ones_like(o))
    t_sdpa_bwd = med(loop_bwd, max(1,reps//2))
    print(f"N={N} docs={docs} {dtype}: create_block_mask {t_build:.2f} ms, flex fwd {t_fwd:.1f} ms, mask+flex {t_build+t_fwd:.1f} ms, sdpa loop fwd {t_sdpa:.1f} ms, sdpa loop fwd+bwd {t_sdpa_bwd:.1f} ms", flush=True)
N=int(sys.argv[1]); reps=int(sys.argv[2])
for docs in (8,64):
    for dt in (torch.float32, torch.bfloat16):
        try:
            run(N, docs, dt, reps)
        except Exception as e:
            print("failed", docs, dt, type(e).__name__, str(e)[:300], flush=True)
