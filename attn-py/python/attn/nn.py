"""Modules over attn's op."""

from __future__ import annotations

from typing import Dict, Optional, Union

import torch
from torch import Tensor

from ._attn import Variant
from ._op import attention, info


class Attention(torch.nn.Module):
    """A variant's attention, owning its learnable tensors (the spec's ``params(...)`` and, with
    ``sinks = learned``, ``sinks``) as float32 ``nn.Parameter``s of the spec's shapes, each
    starting where the spec says (``params(w: [heads] = normal(0.02))``; 0 when it says
    nothing, and for sinks). Random initial values are drawn from a seed taken from torch's
    generator, so ``torch.manual_seed`` fixes them; a spec with none leaves the generator alone.

    ``forward(q, k, v, ...)`` takes what :func:`attn.attention` takes besides the variant and
    the learnable tensors.
    """

    def __init__(self, variant: Union[Variant, str]):
        super().__init__()
        self.variant = variant if isinstance(variant, Variant) else Variant(variant)
        self.spec = info(self.variant).text
        seed = int(torch.randint(0, 2**62, ()).item()) if self.variant.random_start else 0
        for name, shape, values in self.variant.initial_values(seed):
            start = torch.tensor(values, dtype=torch.float32).reshape(shape)
            self.register_parameter(name, torch.nn.Parameter(start))

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        position_offset: int = 0,
        data: Optional[Dict[str, Tensor]] = None,
        cu_seqlens_q: Optional[Tensor] = None,
        cu_seqlens_k: Optional[Tensor] = None,
        return_lse: bool = False,
    ):
        params = {name: p for name, p in self.named_parameters(recurse=False)}
        return attention(
            q,
            k,
            v,
            self.spec,
            position_offset=position_offset,
            params=params or None,
            data=data,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            return_lse=return_lse,
        )

    def extra_repr(self) -> str:
        return repr(self.spec)


__all__ = ["Attention"]
