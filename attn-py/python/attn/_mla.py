"""The MLA ops ``attn::attention_mla`` and ``attn::attention_mla_backward``: multi-head latent
attention over DeepSeek's five inputs, with autograd; and ``attention_mla``, the function users
call. The forward also returns the latent output (``softmax @ c_kv`` per head), which the
backward reads instead of recomputing it."""

from __future__ import annotations

from typing import List, Tuple, Union

import torch
from torch import Tensor

from . import _attn
from ._attn import AttnError, Variant
from ._op import check_offset, check_tensor, info, info_of_text


@torch.library.custom_op("attn::attention_mla", mutates_args=())
def attention_mla_op(
    q_nope: Tensor, q_pe: Tensor, c_kv: Tensor, k_pe: Tensor, w_kv_b: Tensor, spec: str,
    position_offset: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """attn's MLA forward: ``(out, lse, latent)``."""
    out, lse, latent = _attn.forward_mla(spec, q_nope, q_pe, c_kv, k_pe, w_kv_b, position_offset)
    return torch.from_dlpack(out), torch.from_dlpack(lse), torch.from_dlpack(latent)


@attention_mla_op.register_fake
def _mla_fake(q_nope, q_pe, c_kv, k_pe, w_kv_b, spec, position_offset):
    spec_info = info_of_text(spec)
    heads, v_dim, rank = spec_info.heads, spec_info.v_head_dim, spec_info.latent_rank
    batch, rows = q_nope.shape[0], q_nope.shape[2]
    return (
        q_nope.new_empty((batch, heads, rows, v_dim)),
        q_nope.new_empty((batch, heads, rows), dtype=torch.float32),
        q_nope.new_empty((batch, heads, rows, rank), dtype=torch.float32),
    )


@torch.library.custom_op("attn::attention_mla_backward", mutates_args=())
def attention_mla_backward_op(
    q_nope: Tensor, q_pe: Tensor, c_kv: Tensor, k_pe: Tensor, w_kv_b: Tensor, latent: Tensor,
    lse: Tensor, dout: Tensor, spec: str, position_offset: int,
) -> List[Tensor]:
    """attn's MLA backward: ``[dq_nope, dq_pe, dc_kv, dk_pe, dw_kv_b]``."""
    grads = _attn.backward_mla(
        spec, q_nope, q_pe, c_kv, k_pe, w_kv_b, latent, lse, dout, position_offset
    )
    return [torch.from_dlpack(g) for g in grads]


@attention_mla_backward_op.register_fake
def _mla_backward_fake(q_nope, q_pe, c_kv, k_pe, w_kv_b, latent, lse, dout, spec, offset):
    return [torch.empty_like(t) for t in (q_nope, q_pe, c_kv, k_pe, w_kv_b)]


def _setup_context(ctx, inputs, output):
    *five, spec, position_offset = inputs
    _, lse, latent = output
    ctx.mark_non_differentiable(lse, latent)
    ctx.spec, ctx.position_offset = spec, position_offset
    ctx.save_for_backward(*five, latent, lse)


def _backward(ctx, dout, _dlse, _dlatent):
    *five, latent, lse = ctx.saved_tensors
    grads = attention_mla_backward_op(*five, latent, lse, dout, ctx.spec, ctx.position_offset)
    return (*grads, None, None)


attention_mla_op.register_autograd(_backward, setup_context=_setup_context)


def attention_mla(
    q_nope: Tensor,
    q_pe: Tensor,
    c_kv: Tensor,
    k_pe: Tensor,
    w_kv_b: Tensor,
    variant: Union[Variant, str],
    *,
    position_offset: int = 0,
    return_lse: bool = False,
):
    """Multi-head latent attention of an MLA variant (``mla(latent_rank, rope_dim)``) over
    ``q_nope [B, H, Sq, head_dim]``, ``q_pe [B, H, Sq, rope_dim]``,
    ``c_kv [B, Skv, latent_rank]`` (after the latent norm), ``k_pe [B, Skv, rope_dim]`` and
    ``w_kv_b [H * (head_dim + v_head_dim), latent_rank]`` (q_pe and k_pe before RoPE), in the
    spec's dtype. Returns ``out [B, H, Sq, v_head_dim]`` (and with ``return_lse`` the lse,
    ``[B, H, Sq]`` f32, without a gradient). Gradients reach all five inputs."""
    spec_info = info(variant)
    names = ("q_nope", "q_pe", "c_kv", "k_pe", "w_kv_b")
    for name, t in zip(names, (q_nope, q_pe, c_kv, k_pe, w_kv_b)):
        check_tensor(name, t)
        if t.device != q_nope.device:
            raise AttnError(f"`{name}` is on {t.device} and `q_nope` on {q_nope.device}: "
                            "give every tensor on one device")
    check_offset(position_offset)
    out, lse, _ = attention_mla_op(
        q_nope, q_pe, c_kv, k_pe, w_kv_b, spec_info.text, position_offset
    )
    return (out, lse) if return_lse else out


__all__ = ["attention_mla"]
