"""The model `attnc train` trains, in PyTorch eager, with the same defaults: for the side by side
of loss and tokens/s in BENCHMARKS.md. Byte tokens, the last 10% for validation, random windows
of seq + 1; pre-norm RMSNorm blocks, RoPE (rotate-half) attention with SDPA, SwiGLU, tied
embeddings, normal(0, 0.02) init; AdamW (0.9, 0.95), eps 1e-8, weight decay on matrices only;
linear warmup then cosine to 10% of lr; gradient clipping at norm 1.0; 8 validation batches.
Run with the python scripts/setup-torch.sh prints.

usage: train_torch.py CORPUS [--layers 4] [--hidden 128] [--heads 4] [--steps 300] [--batch 16]
       [--seq 128] [--lr 3e-3] [--warmup 30] [--weight-decay 0.1] [--eval-every 50] [--seed 0]
       [--attn-batches] [--init-from model.safetensors]
--attn-batches draws the training windows with attnc train's generator (the same windows for
the same --seed); --init-from starts from a safetensors file of attnc train's (the weights of
`attnc train --steps 1 --lr 1e-9 --warmup 0`): with both, the two runs start equal and see
the same batches.
Prints one JSON line per evaluation: step, train_loss, val_loss, tokens_per_s, elapsed_s."""
import argparse, json, math, time
import numpy as np
import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("corpus")
for name, default in [("layers", 4), ("hidden", 128), ("heads", 4), ("steps", 300), ("batch", 16),
                      ("seq", 128), ("warmup", 30), ("eval-every", 50), ("seed", 0)]:
    p.add_argument("--" + name, type=int, default=default)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--weight-decay", type=float, default=0.1)
p.add_argument("--attn-batches", action="store_true")
p.add_argument("--init-from")
a = p.parse_args()
torch.set_num_threads(2)
torch.manual_seed(a.seed)

data = np.frombuffer(open(a.corpus, "rb").read(), dtype=np.uint8).astype(np.int64)
split = len(data) - len(data) // 10
train, val = torch.from_numpy(data[:split]), torch.from_numpy(data[split:])
MASK = (1 << 64) - 1

class AttnRng:
    """attnc train's batch generator (xorshift64), state for state."""
    def __init__(self, seed): self.s = ((seed * 0x9E3779B97F4A7C15) & MASK) | 1
    def next(self):
        s = self.s
        s ^= (s << 13) & MASK; s ^= s >> 7; s ^= (s << 17) & MASK
        self.s = s
        return s

rng = AttnRng(a.seed) if a.attn_batches else np.random.default_rng(a.seed)

def windows(tokens, g):
    if isinstance(g, AttnRng):
        starts = [g.next() % (len(tokens) - a.seq) for _ in range(a.batch)]
    else:
        starts = g.integers(0, len(tokens) - a.seq, a.batch)
    return torch.stack([tokens[s:s + a.seq + 1] for s in starts])

def read_safetensors(path):
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    out = {}
    for name, v in json.loads(raw[8:8 + n]).items():
        if name == "__metadata__": continue
        lo, hi = v["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(raw[8 + n + lo:8 + n + hi], dtype=np.float32).reshape(v["shape"]).copy())
    return out

D, H = a.hidden, a.heads
HD = D // H
INTER = ((8 * D + 2) // 3 + 63) // 64 * 64  # 8d/3 rounded up, then up to a multiple of 64

class RMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__(); self.weight = torch.nn.Parameter(torch.ones(n))
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).double() / HD))
ang = torch.arange(a.seq).double()[:, None] * inv[None, :]
COS, SIN = torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()

def rope(x):
    x1, x2 = x[..., :HD // 2], x[..., HD // 2:]
    return x * COS + torch.cat([-x2, x1], -1) * SIN

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = RMSNorm(D), RMSNorm(D)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(D, INTER, bias=False), torch.nn.Linear(D, INTER, bias=False)
        self.down = torch.nn.Linear(INTER, D, bias=False)
    def forward(self, x):
        B, S, _ = x.shape
        h = self.n1(x)
        q, k, v = (f(h).view(B, S, H, HD).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, S, D))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(a.layers))
        self.norm = RMSNorm(D)
        for p_ in self.parameters():
            if p_.dim() == 2: torch.nn.init.normal_(p_, 0.0, 0.02)
    def loss(self, w):
        x = self.embed(w[:, :-1])
        for b in self.blocks: x = b(x)
        logits = self.norm(x) @ self.embed.weight.T
        return F.cross_entropy(logits.reshape(-1, 256), w[:, 1:].reshape(-1))

model = Model()
if a.init_from:
    w = read_safetensors(a.init_from)
    with torch.no_grad():
        model.embed.weight.copy_(w["model.embed_tokens.weight"]); model.norm.weight.copy_(w["model.norm.weight"])
        for i, b in enumerate(model.blocks):
            p_ = f"model.layers.{i}."
            b.n1.weight.copy_(w[p_ + "input_layernorm.weight"]); b.n2.weight.copy_(w[p_ + "post_attention_layernorm.weight"])
            for name in "qkvo": getattr(b, name).weight.copy_(w[p_ + f"self_attn.{name}_proj.weight"])
            for name in ("gate", "up", "down"): getattr(b, name).weight.copy_(w[p_ + f"mlp.{name}_proj.weight"])
mats = [p_ for p_ in model.parameters() if p_.dim() >= 2]
vecs = [p_ for p_ in model.parameters() if p_.dim() < 2]
opt = torch.optim.AdamW([{"params": mats, "weight_decay": a.weight_decay}, {"params": vecs, "weight_decay": 0.0}],
                        lr=a.lr, betas=(0.9, 0.95), eps=1e-8)

def lr_at(step):
    if step <= a.warmup: return a.lr * step / a.warmup
    t = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.lr / 10 + (a.lr - a.lr / 10) * (1 + math.cos(math.pi * t)) / 2

start = time.perf_counter()
window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
for step in range(1, a.steps + 1):
    for g_ in opt.param_groups: g_["lr"] = lr_at(step)
    loss = model.loss(windows(train, rng))
    opt.zero_grad(); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    window_loss += loss.item(); window_steps += 1
    if step % a.eval_every == 0 or step == a.steps:
        tps = window_steps * a.batch * a.seq / (time.perf_counter() - window_start)
        with torch.no_grad():
            g = np.random.default_rng(a.seed ^ 0x5EED)
            val_loss = sum(model.loss(windows(val, g)).item() for _ in range(8)) / 8
        print(json.dumps({"step": step, "train_loss": window_loss / window_steps, "val_loss": val_loss,
                          "tokens_per_s": tps, "elapsed_s": time.perf_counter() - start}), flush=True)
        window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
