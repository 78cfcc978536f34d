"""A small GPT in plain PyTorch, trained on a text file, whose attention is any attn spec.

    python examples/python/train_gpt.py corpus.txt --spec "mask = causal, position = rope"
    python examples/python/train_gpt.py corpus.txt --sdpa        # the same model on SDPA

Tokens are the file's bytes. The spec gives the attention's mask, positions, modifiers and
learnable tensors; `heads` and `head_dim` come from --heads and --dim (written into the spec
when it leaves them out). Prints the loss and tokens/s every --log-every steps, and with --csv
writes `step,loss,tokens_per_s` rows, so two runs' loss curves can be drawn side by side.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re
import sys
import time

import torch
import torch.nn.functional as F

import attn


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, attend: torch.nn.Module | None):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )
        # attn's attention (a module owning the spec's learnable tensors), or None for SDPA.
        self.attend = attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.attend is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = self.attend(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, dim))
        return x + self.mlp(self.norm2(x))


class GPT(torch.nn.Module):
    def __init__(self, args: argparse.Namespace, spec: str | None):
        super().__init__()
        self.embed = torch.nn.Embedding(256, args.dim)
        self.position = torch.nn.Embedding(args.seq, args.dim)
        self.blocks = torch.nn.ModuleList(
            Block(args.dim, args.heads, attn.nn.Attention(spec) if spec else None)
            for _ in range(args.layers)
        )
        self.norm = torch.nn.LayerNorm(args.dim)
        self.head = torch.nn.Linear(args.dim, 256, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def fail(message: str) -> None:
    """Bad input: the message on stderr, exit code 2 (as argparse and attnc do)."""
    print(message if message.startswith("error") else f"error: {message}", file=sys.stderr)
    sys.exit(2)


def full_spec(args: argparse.Namespace) -> str:
    """The spec with the model's heads and head_dim written in where it leaves them out."""
    spec = args.spec.strip()
    items = [spec] if spec else []
    if not re.search(r"(?<![a-z_])heads\s*=", spec):
        items.insert(0, f"heads = {args.heads}")
    if not re.search(r"(?<![a-z_])head_dim\s*=", spec):
        items.insert(1, f"head_dim = {args.dim // args.heads}")
    variant = attn.Variant(", ".join(items))  # AttnError with attn's message if it is wrong
    if variant.heads != args.heads or variant.head_dim * args.heads != args.dim:
        fail(
            f"the spec has {variant.heads} heads of {variant.head_dim} dims; the model has "
            f"{args.heads} heads over --dim {args.dim}"
        )
    return variant.text


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("text", type=pathlib.Path, help="the training text (its bytes are the tokens)")
    p.add_argument("--spec", default="mask = causal", help="the attention's spec (attn's spec language)")
    p.add_argument("--sdpa", action="store_true", help="use torch's scaled_dot_product_attention instead")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--batch", type=int, default=8, help="windows per step (default 8)")
    p.add_argument("--seq", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="weights and batches (default 0)")
    p.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's)")
    p.add_argument("--log-every", type=int, default=10, help="steps between lines (default 10)")
    p.add_argument("--csv", type=pathlib.Path, help="write step,loss,tokens_per_s rows here")
    args = p.parse_args()
    for name in ("steps", "batch", "seq", "dim", "heads", "layers", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
    return args


def main() -> None:
    args = arguments()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        data = torch.frombuffer(bytearray(args.text.read_bytes()), dtype=torch.uint8).long()
    except OSError as e:
        fail(f"cannot read {args.text}: {e.strerror}")
    if data.numel() < args.seq + 2:
        fail(f"{args.text} has {data.numel()} bytes; --seq {args.seq} needs more")
    try:
        spec = None if args.sdpa else full_spec(args)
    except attn.AttnError as e:
        fail(str(e))
    model = GPT(args, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    print(f"attention: {'SDPA (causal)' if args.sdpa else spec}", flush=True)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {data.numel():,} tokens")
    rows = []
    started, tokens = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,))
        window = torch.stack([data[s : s + args.seq + 1] for s in starts.tolist()])
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tokens += args.batch * args.seq
        if step % args.log_every == 0 or step == args.steps:
            rate = tokens / (time.perf_counter() - started)
            print(f"step {step:5d}/{args.steps}  loss {loss.item():.4f}  tokens/s {rate:,.0f}", flush=True)
            rows.append((step, loss.item(), rate))
            if not math.isfinite(loss.item()):
                sys.exit("error: the loss is not finite; try a smaller --lr")  # exit code 1
    if args.csv:
        args.csv.write_text("step,loss,tokens_per_s\n" + "".join(f"{s},{l:.6f},{r:.1f}\n" for s, l, r in rows))


if __name__ == "__main__":
    main()
