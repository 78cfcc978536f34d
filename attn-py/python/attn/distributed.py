"""Context-parallel attention over a ``torch.distributed`` process group: one attention call
whose sequence is split across the group's ranks, each holding its part of q, k and v, equal
to the single call on the whole sequence. attn's own Ulysses (an all-to-all over heads) and
ring attention (keys and values passed around the ranks, partial results merged through their
lse) run the pieces; the group's collectives move the data, so a PyTorch job adds it to the
process group it has::

    import torch.distributed as dist
    import attn, attn.distributed

    dist.init_process_group("gloo")                       # CPU tensors
    variant = attn.Variant("heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = rope")
    mine = attn.distributed.positions(variant, seq_len)   # this rank's positions
    out = attn.distributed.context_parallel_attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], variant)

The learnable tensors' gradients are this rank's share, as every other parameter's gradient in
a context-parallel job is: reduce them over the group as the rest (DDP over the group does).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import _attn
from ._attn import AttnError, Variant
from ._op import _named, check_offset, check_tensor, info

SCHEMES = ("ring", "ulysses")


class _Group:
    """The collectives attn's context parallelism calls, over a torch.distributed group, on
    float32 CPU tensors (the gloo backend). Each checks that every rank gives the length it
    expects first, so a wrong-sized buffer is an error on every rank, not a garbled receive."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _exchange(self, send: Tensor, to: int, recv: Tensor, source: int) -> None:
        ops = [
            dist.P2POp(dist.isend, send, self._global(to), self.group),
            dist.P2POp(dist.irecv, recv, self._global(source), self.group),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    def _same_lengths(self, n: int, what: str) -> None:
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(lengths, torch.tensor([n], dtype=torch.int64), group=self.group)
        found = [int(x) for x in lengths]
        if len(set(found)) != 1:
            raise RuntimeError(f"the ranks called {what} with buffers of different lengths: {found}")

    def send_recv(self, data, recv_len: int, to: int, source: int, _unused: int) -> Tensor:
        send = torch.frombuffer(data, dtype=torch.float32)
        if to == self.rank and source == self.rank:
            return send.clone()
        length = torch.zeros(1, dtype=torch.int64)
        self._exchange(torch.tensor([send.numel()], dtype=torch.int64), to, length, source)
        if int(length) != recv_len:
            raise RuntimeError(f"rank {source} sent {int(length)} values; this call expects {recv_len}")
        recv = torch.empty(recv_len, dtype=torch.float32)
        self._exchange(send, to, recv, source)
        return recv

    def all_to_all(self, data, recv_len: int, *_unused) -> Tensor:
        send = torch.frombuffer(data, dtype=torch.float32)
        self._same_lengths(send.numel(), "all-to-all")
        if send.numel() % self.size != 0:
            raise RuntimeError(f"all-to-all of {send.numel()} values over {self.size} ranks")
        blocks = list(send.chunk(self.size)) if send.numel() else [send] * self.size
        recv = [torch.empty_like(b) for b in blocks]
        recv[self.rank] = blocks[self.rank].clone()
        ops = []
        for peer in range(self.size):
            if peer != self.rank:
                ops.append(dist.P2POp(dist.isend, blocks[peer].contiguous(), self._global(peer), self.group))
                ops.append(dist.P2POp(dist.irecv, recv[peer], self._global(peer), self.group))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return torch.cat(recv)

    def all_reduce(self, data, recv_len: int, *_unused) -> Tensor:
        values = torch.frombuffer(data, dtype=torch.float32).clone()
        self._same_lengths(values.numel(), "all-reduce")
        dist.all_reduce(values, group=self.group)
        return values

    def all_gather(self, data, recv_len: int, *_unused) -> Tensor:
        send = torch.frombuffer(data, dtype=torch.float32).clone()
        self._same_lengths(send.numel(), "all-gather")
        parts = [torch.empty_like(send) for _ in range(self.size)]
        dist.all_gather(parts, send, group=self.group)
        return torch.cat(parts)


def _text(variant: Union[Variant, str]) -> str:
    return info(variant).text


def _scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise AttnError(f"unknown context-parallel scheme {scheme!r}; allowed: ring, ulysses")
    return scheme


def positions(
    variant: Union[Variant, str], seq_len: int, *, scheme: str = "ring", group=None
) -> Tensor:
    """The positions (from 0, an int64 tensor) of a sequence of ``seq_len`` that this rank of
    ``group`` holds under ``scheme``: ``q[:, :, positions(...)]`` is this rank's part. The ring
    splits causal and sliding-window variants zigzag (rank ``r`` holds chunks ``r`` and
    ``2N - 1 - r`` of ``2N``); otherwise each rank holds one contiguous chunk."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    found = _attn.context_positions(_text(variant), _scheme(scheme), ranks, rank, seq_len)
    return torch.tensor(found, dtype=torch.int64)


class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, text, scheme, group, position_offset, names, data_names, q, k, v, *tensors):
        params, data = _split(names, data_names, tensors)
        out, lse = _attn.context_forward(
            text, scheme, _Group(group), q, k, v, position_offset, params, data
        )
        out, lse = torch.from_dlpack(out), torch.from_dlpack(lse)
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.call = (text, scheme, group, position_offset, names, data_names)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        text, scheme, group, position_offset, names, data_names = ctx.call
        params, data = _split(names, data_names, tensors)
        dq, dk, dv, named = _attn.context_backward(
            text, scheme, _Group(group), q, k, v, out, lse, dout, position_offset, params, data
        )
        by_name = {name: torch.from_dlpack(g) for name, g in named}
        grads = [torch.from_dlpack(dq), torch.from_dlpack(dk), torch.from_dlpack(dv)]
        return (
            None, None, None, None, None, None, *grads,
            *[by_name.get(n) for n in names + data_names],
        )


def _split(names, data_names, tensors):
    """The learnable tensors and the data tensors of a call, by name."""
    params = list(zip(names, tensors[: len(names)]))
    return params, list(zip(data_names, tensors[len(names):]))


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    variant: Union[Variant, str],
    *,
    scheme: str = "ring",
    group=None,
    position_offset: int = 0,
    params: Optional[Dict[str, Tensor]] = None,
    data: Optional[Dict[str, Tensor]] = None,
    return_lse: bool = False,
):
    """This rank's part of attention over a sequence split across ``group`` (the default
    group when ``None``; gloo, CPU tensors). ``q [B, heads, L, head_dim]``, ``k`` and ``v``
    ``[B, kv_heads, L, dim]`` hold the positions :func:`positions` gives this rank of a
    sequence of ``ranks * L`` starting at ``position_offset``; every rank calls this with its
    part. Returns this rank's rows of the whole call's ``out`` (and ``lse`` with
    ``return_lse``); gradients flow to q, k, v, ``params`` and float32 ``data`` (this rank's
    share). Data tensors (a document mask's ids, say) are the whole call's on every rank,
    ``[B, S]`` along the sequence, read at global positions.

    ``scheme`` is ``"ring"`` (any heads) or ``"ulysses"`` (heads and kv_heads divisible by
    the ranks). Bad input raises :class:`attn.AttnError`; a failing peer raises an error
    here within the group's timeout.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise AttnError("context_parallel_attention needs torch.distributed initialized "
                        "(dist.init_process_group(\"gloo\"))")
    text = _text(variant)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    check_offset(position_offset)
    named = _named("params", params)
    given = [(name, t.contiguous()) for name, t in _named("data", data)]
    names: List[str] = [name for name, _ in named]
    data_names: List[str] = [name for name, _ in given]
    tensors = [t for _, t in named + given]
    out, lse = _ContextParallel.apply(
        text, _scheme(scheme), group, position_offset, names, data_names, q, k, v, *tensors
    )
    return (out, lse) if return_lse else out
