"""Attention in float64 PyTorch, written out from docs/semantics.md: what the tests compare
attn's op against (gradients by torch's autograd through it)."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch


def rope_inv_freq(
    dim: int, base: float = 10000.0, scaling: Optional[dict] = None, seq_end: int = 0
) -> tuple[torch.Tensor, float]:
    """``inv_freq`` and the attention factor of RoPE over ``dim`` dims with a scaling as the
    transformers library computes it (``linear``, ``ntk``, ``llama3``, ``yarn``)."""
    kind = (scaling or {}).get("type")
    if kind == "ntk":
        base = base * scaling["factor"] ** (dim / (dim - 2))
    i = torch.arange(0, dim, 2, dtype=torch.float64)
    inv = base ** (-i / dim)
    factor = 1.0
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        s, low, high, orig = (
            scaling["factor"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
            scaling["original_max_position"],
        )
        wave = 2 * math.pi / inv
        t = ((orig / wave - low) / (high - low)).clamp(0, 1)
        blended = (1 - t) * inv / s + t * inv
        inv = torch.where(wave > orig / low, inv / s, torch.where(wave < orig / high, inv, blended))
    elif kind == "yarn":
        s, orig = scaling["factor"], scaling["original_max_position"]
        beta_fast, beta_slow = scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0)

        def corr(r):
            return dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))

        lo = max(math.floor(corr(beta_fast)), 0)
        hi = min(math.ceil(corr(beta_slow)), dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        inv = (inv / s) * ramp + inv * (1 - ramp)
        factor = 0.1 * math.log(s) + 1 if s > 1 else 1.0
    return inv, factor


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, factor: float):
    """``x [.., S, D]`` rotated (layout ``half``) at ``positions [S]``."""
    angle = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([angle.cos(), angle.cos()], -1) * factor
    sin = torch.cat([angle.sin(), angle.sin()], -1) * factor
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    alibi: bool = False,
    rope_scaling: Optional[dict] = None,
    rope_base: float = 10000.0,
    position_offset: int = 0,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    sinks: Optional[torch.Tensor] = None,
):
    """``(out, lse)`` of BHSD q, k, v in float64. Keys sit at positions
    ``position_offset + j``, queries at the last ``Sq`` of them (bottom-right).
    ``score_mod(s, b, h, qpos, kpos)`` and ``mask_mod(b, h, qpos, kpos)`` take broadcast
    index tensors; ``qpos`` and ``kpos`` are positions."""
    q, k, v = q.double(), k.double(), v.double()
    batch, heads, sq, d = q.shape
    kv_heads, skv = k.shape[1], k.shape[2]
    group = heads // kv_heads
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    kpos = position_offset + torch.arange(skv)
    qpos = position_offset + skv - sq + torch.arange(sq)
    if rope_scaling is not None:
        inv, factor = rope_inv_freq(d, rope_base, rope_scaling.get("scaling"))
        q, k = rope(q, qpos, inv, factor), rope(k, kpos, inv, factor)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(d))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qp, kp = qpos[:, None], kpos[None, :]
    if alibi:
        slopes = torch.tensor(
            [2 ** (-8 * (h + 1) / heads) for h in range(heads)], dtype=torch.float64
        )
        s = s + slopes[:, None, None] * (kp - qp).to(torch.float64)
    b_idx = torch.arange(batch)[:, None, None, None]
    h_idx = torch.arange(heads)[None, :, None, None]
    if score_mod is not None:
        s = score_mod(s, b_idx, h_idx, qp[None, None], kp[None, None])
    keep = torch.ones(batch, heads, sq, skv, dtype=torch.bool)
    if causal:
        keep = keep & (kp <= qp)
    if window is not None:
        keep = keep & (qp - kp < window)
    if mask_mod is not None:
        keep = keep & mask_mod(b_idx, h_idx, qp[None, None], kp[None, None])
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[None, :, None, None].expand(batch, heads, sq, 1)
        lse = torch.logsumexp(torch.cat([s, sink], -1), -1)
    else:
        lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse
