"""The torch ops ``attn::attention`` and ``attn::attention_backward``, their fake (shape)
functions, and the autograd formula that joins them; and ``attention``, the function users
call.

Both ops run attn's CPU kernels through the extension module (``attn._attn``), which reads
the input tensors in place and returns outputs the kernels wrote, shared with torch through
DLPack (no copy either way). The backward recomputes each tile's probabilities from the lse
the forward saved.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _attn
from ._attn import AttnError, Variant


class SpecInfo(NamedTuple):
    """What the Python side needs of a spec, as plain values (so that ``torch.compile`` can
    treat it as a constant)."""

    text: str
    heads: int
    v_head_dim: int
    latent_rank: int
    data: Tuple[str, ...]
    int_data: Tuple[str, ...]


_INFOS: Dict[str, SpecInfo] = {}


def info_of_text(text: str) -> SpecInfo:
    """The :class:`SpecInfo` of a spec's text, made once per text."""
    found = _INFOS.get(text)
    if found is None:
        variant = Variant(text)
        data = variant.data
        found = SpecInfo(
            text=variant.text,
            heads=variant.heads,
            v_head_dim=variant.v_head_dim,
            latent_rank=variant.latent_rank or 0,
            data=tuple(name for name, _, _ in data),
            int_data=tuple(name for name, _, dtype in data if dtype == "int32"),
        )
        if len(_INFOS) >= 256:
            _INFOS.clear()
        _INFOS[text] = found
    return found


@torch.compiler.assume_constant_result
def info(variant: Union[Variant, str]) -> SpecInfo:
    """The :class:`SpecInfo` of a variant or a spec string (run once by ``torch.compile``,
    its result kept as a constant of the graph)."""
    if isinstance(variant, Variant):
        return info_of_text(str(variant))
    if isinstance(variant, str):
        return info_of_text(variant)
    raise AttnError(
        f"`variant` is a {type(variant).__name__}; give an attn.Variant or a spec string"
    )


def _split(spec: str, names: str, tensors: List[Tensor]):
    """The op's named tensors as (learnable, data) lists of (name, tensor)."""
    data_names = info_of_text(spec).data
    learned, data = [], []
    for name, t in zip(names.split(",") if names else [], tensors):
        (data if name in data_names else learned).append((name, t))
    return learned, data


def _offsets(t: Optional[Tensor]) -> Optional[List[int]]:
    if t is None:
        return None
    values = t.tolist()
    if not all(-(2**31) <= x < 2**31 for x in values):
        raise AttnError("`cu_seqlens_q` and `cu_seqlens_k` hold offsets that fit in int32")
    return values


def _grad_names(spec: str, names: str) -> List[str]:
    """The named tensors that have gradients (learnable ones and float32 data), in order."""
    spec_info = info_of_text(spec)
    return [n for n in (names.split(",") if names else []) if n not in spec_info.int_data]


@torch.library.custom_op("attn::attention", mutates_args=())
def attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: str,
    position_offset: int,
    names: str,
    tensors: List[Tensor],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    """attn's forward: ``(out, lse)``. ``names`` names ``tensors`` (learnable and data
    tensors), comma-separated."""
    learned, data = _split(spec, names, tensors)
    out, lse = _attn.forward(
        spec,
        q,
        k,
        v,
        position_offset,
        learned,
        data,
        _offsets(cu_seqlens_q),
        _offsets(cu_seqlens_k),
    )
    return torch.from_dlpack(out), torch.from_dlpack(lse)


def _one_device(q: Tensor, k: Tensor, v: Tensor, names: str, tensors: List[Tensor]) -> None:
    """Refuses tensors on different devices (torch would dispatch such a call to the fake
    function, whose outputs hold no values)."""
    named = [("q", q), ("k", k), ("v", v)] + list(zip(names.split(",") if names else [], tensors))
    for name, t in named[1:]:
        if t.device != q.device:
            raise AttnError(
                f"`{name}` is on {t.device} and `q` on {q.device}: give every tensor on one device"
            )


@attention_op.register_fake
def _attention_fake(q, k, v, spec, position_offset, names, tensors, cu_seqlens_q, cu_seqlens_k):
    _one_device(q, k, v, names, tensors)
    spec_info = info_of_text(spec)
    if cu_seqlens_q is None:
        batch, rows = q.shape[0], q.shape[2]
        out = q.new_empty((batch, spec_info.heads, rows, spec_info.v_head_dim))
        lse = q.new_empty((batch, spec_info.heads, rows), dtype=torch.float32)
    else:
        total = q.shape[0]
        out = q.new_empty((total, spec_info.heads, spec_info.v_head_dim))
        lse = q.new_empty((total, spec_info.heads), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("attn::attention_backward", mutates_args=())
def attention_backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    spec: str,
    position_offset: int,
    names: str,
    tensors: List[Tensor],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
) -> List[Tensor]:
    """attn's backward: ``[dq, dk, dv, *d<name>]``, the last for each named tensor with a
    gradient (learnable ones and float32 data), in order."""
    learned, data = _split(spec, names, tensors)
    dq, dk, dv, named = _attn.backward(
        spec,
        q,
        k,
        v,
        out,
        lse,
        dout,
        position_offset,
        learned,
        data,
        _offsets(cu_seqlens_q),
        _offsets(cu_seqlens_k),
    )
    by_name = {name: torch.from_dlpack(g) for name, g in named}
    grads = [torch.from_dlpack(dq), torch.from_dlpack(dk), torch.from_dlpack(dv)]
    return grads + [by_name[name] for name in _grad_names(spec, names)]


@attention_backward_op.register_fake
def _attention_backward_fake(
    q, k, v, out, lse, dout, spec, position_offset, names, tensors, cu_q, cu_k
):
    _one_device(q, k, v, names, tensors)
    with_grads = set(_grad_names(spec, names))
    named = [
        t.new_empty(t.shape, dtype=torch.float32)
        for name, t in zip(names.split(",") if names else [], tensors)
        if name in with_grads
    ]
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)] + named


def _setup_context(ctx, inputs, output):
    q, k, v, spec, position_offset, names, tensors, cu_q, cu_k = inputs
    out, lse = output
    # The kernels recompute the softmax from the lse but do not differentiate it.
    ctx.mark_non_differentiable(lse)
    ctx.spec, ctx.position_offset, ctx.names = spec, position_offset, names
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, *tensors)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, *tensors = ctx.saved_tensors
    grads = attention_backward_op(
        q,
        k,
        v,
        out,
        lse,
        dout,
        ctx.spec,
        ctx.position_offset,
        ctx.names,
        tensors,
        cu_q,
        cu_k,
    )
    dq, dk, dv, named = grads[0], grads[1], grads[2], iter(grads[3:])
    with_grads = set(_grad_names(ctx.spec, ctx.names))
    names = ctx.names.split(",") if ctx.names else []
    dtensors = [next(named) if name in with_grads else None for name in names]
    return dq, dk, dv, None, None, None, dtensors, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def check_offset(position_offset) -> None:
    """A position offset is an int that fits in 64 bits."""
    if not isinstance(position_offset, int):
        raise AttnError(f"`position_offset` is a {type(position_offset).__name__}, not an int")
    if not -(2**63) <= position_offset < 2**63:
        raise AttnError(f"`position_offset` {position_offset} does not fit in 64 bits")


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise AttnError(f"`{name}` is a {type(t).__name__}, not a torch.Tensor")


def _named(kind: str, tensors: Optional[Dict[str, Tensor]]) -> List[Tuple[str, Tensor]]:
    if tensors is None:
        return []
    if not isinstance(tensors, dict):
        raise AttnError(f"`{kind}` is a {type(tensors).__name__}; give a dict of tensors by name")
    for name, t in tensors.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise AttnError(f"`{kind}` has the key {name!r}; keys are the spec's tensor names")
        check_tensor(name, t)
    return list(tensors.items())


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    variant: Union[Variant, str],
    *,
    position_offset: int = 0,
    params: Optional[Dict[str, Tensor]] = None,
    data: Optional[Dict[str, Tensor]] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    return_lse: bool = False,
):
    """Attention of the variant ``variant`` (an :class:`attn.Variant` or a spec string) over
    ``q [B, heads, Sq, head_dim]``, ``k [B, kv_heads, Skv, head_dim]`` and
    ``v [B, kv_heads, Skv, v_head_dim]`` (BHSD, as ``scaled_dot_product_attention`` takes
    them; a BSHD tensor's ``transpose(1, 2)`` is read in place), in the spec's dtype, before
    RoPE. Returns ``out [B, heads, Sq, v_head_dim]``, and with ``return_lse`` also
    ``lse [B, heads, Sq]`` (float32, natural log; it carries no gradient).

    ``position_offset`` is the position of key 0 (queries are the last ``Sq`` positions).
    ``params`` holds the learnable tensors by name (float32; learned sinks are ``"sinks"``)
    and ``data`` the data tensors (int32 or int64 for ``i32`` data, float32 for ``f32``).
    With ``cu_seqlens_q`` and ``cu_seqlens_k`` (``B + 1`` cumulative offsets each), q, k and v
    are a packed variable-length batch, ``[total, heads, dim]``, and out and lse follow
    (``[total_q, heads, v_head_dim]``, ``[total_q, heads]``).

    Gradients flow to q, k, v, the learnable tensors and float32 data tensors. Bad input
    raises :class:`attn.AttnError` with attn's message.
    """
    spec_info = info(variant)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    named = _named("params", params) + [
        (name, t.contiguous()) for name, t in _named("data", data)
    ]
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t is not None:
            check_tensor(name, t)
            if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
                raise AttnError(
                    f"`{name}` is a {t.dim()}-d {t.dtype} tensor; cumulative offsets are a "
                    "1-d torch.int32 or torch.int64 tensor"
                )
    check_offset(position_offset)
    out, lse = attention_op(
        q,
        k,
        v,
        spec_info.text,
        position_offset,
        ",".join(name for name, _ in named),
        [t for _, t in named],
        cu_seqlens_q,
        cu_seqlens_k,
    )
    return (out, lse) if return_lse else out
