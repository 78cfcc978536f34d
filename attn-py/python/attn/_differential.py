"""``differential_attention``: differential heads (``differential = lambda(init = L)``, the DIFF
Transformer) from PyTorch.

The component heads run as one call of the torch op (``attn::attention``) for the spec
without ``differential``, over the values given to both components of a head; lambda and the
pairing ``out_h = O_2h - lambda O_2h+1`` are torch operations in float32, so autograd gives
every gradient (lambda's vectors included) from the op's own.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from . import _attn
from ._attn import AttnError
from ._op import attention, check_tensor

_PARTS: Dict[str, Tuple[str, float]] = {}

LAMBDA_NAMES = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def _parts(spec: str) -> Tuple[str, float]:
    """The component heads' spec text and lambda's init of a differential spec, made once per
    text."""
    if not isinstance(spec, str):
        raise AttnError(
            f"`spec` is a {type(spec).__name__}; differential heads take the spec as a string "
            "(attn.Variant plans one attention per head)"
        )
    found = _PARTS.get(spec)
    if found is None:
        found = _attn.differential_parts(spec)
        if len(_PARTS) >= 256:
            _PARTS.clear()
        _PARTS[spec] = found
    return found


def differential_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: str,
    lambda_q1: Tensor,
    lambda_k1: Tensor,
    lambda_q2: Tensor,
    lambda_k2: Tensor,
    *,
    position_offset: int = 0,
    params: Optional[Dict[str, Tensor]] = None,
    data: Optional[Dict[str, Tensor]] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    return_lse: bool = False,
):
    """Differential attention of ``spec`` (a spec string with ``differential = lambda(...)``)
    over ``q [B, heads, Sq, head_dim]``, ``k [B, kv_heads, Skv, head_dim]`` and
    ``v [B, kv_heads / 2, Skv, v_head_dim]`` (one value head per pair of key heads), with
    lambda's four ``[head_dim]`` float32 vectors: head ``h`` of the output is
    ``O_2h - lambda O_2h+1``, ``lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 .
    lambda_k2) + init`` (docs/semantics.md, "Differential heads"). Returns
    ``out [B, heads / 2, Sq, v_head_dim]`` in the spec's dtype, and with ``return_lse`` also
    the component heads' ``lse [B, heads, Sq]``.

    ``position_offset``, ``params``, ``data`` and the packed layout (``cu_seqlens_q``,
    ``cu_seqlens_k``: q ``[total_q, heads, head_dim]``, k ``[total_k, kv_heads, head_dim]``,
    v ``[total_k, kv_heads / 2, v_head_dim]``) are :func:`attn.attention`'s. Gradients flow
    to q, k, v, lambda's vectors and the spec's learnable tensors. The per-head normalization
    of the paper is the model's.
    """
    components, init = _parts(spec)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    if k.dim() != v.dim() or k.dim() < 3 or 2 * v.shape[1] != k.shape[1]:
        raise AttnError(
            f"`v` has shape {tuple(v.shape)} and `k` {tuple(k.shape)}: differential heads take "
            "one value head per pair of key heads (v's second axis half of k's)"
        )
    head_dim = q.shape[-1]
    vectors = (lambda_q1, lambda_k1, lambda_q2, lambda_k2)
    for name, t in zip(LAMBDA_NAMES, vectors):
        check_tensor(name, t)
        if t.shape != (head_dim,):
            raise AttnError(
                f"`{name}` has shape {tuple(t.shape)}; lambda's vectors are [head_dim] = "
                f"[{head_dim}]"
            )
    lq1, lk1, lq2, lk2 = (t.float() for t in vectors)
    lam = torch.exp(torch.dot(lq1, lk1)) - torch.exp(torch.dot(lq2, lk2)) + init
    if not torch.isfinite(lam):
        raise AttnError(
            f"lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + {init} is "
            f"{lam.item()}; allowed: vectors whose lambda is finite"
        )
    both = v.repeat_interleave(2, dim=1)
    o, lse = attention(
        q,
        k,
        both,
        components,
        position_offset=position_offset,
        params=params,
        data=data,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        return_lse=True,
    )
    out = (o[:, 0::2].float() - lam * o[:, 1::2].float()).to(o.dtype)
    return (out, lse) if return_lse else out
