"""``flex_attention`` under FlexAttention's argument names and defaults, for porting code
that calls ``torch.nn.attention.flex_attention.flex_attention``: the score and mask modifiers
become the spec's ``score_mod`` and ``mask_mod``, written in attn's spec language."""

from __future__ import annotations

import math
from typing import Dict, Optional, Union

from torch import Tensor

from ._attn import AttnError, Variant
from ._op import attention


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    spec: Union[Variant, str],
    *,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    params: Optional[Dict[str, Tensor]] = None,
    data: Optional[Dict[str, Tensor]] = None,
):
    """FlexAttention's call over attn's op: ``query [B, Hq, L, E]``, ``key [B, Hkv, S, E]``,
    ``value [B, Hkv, S, Ev]``. As in FlexAttention, fewer key/value heads than query heads
    need ``enable_gqa=True``, ``scale`` defaults to ``1/sqrt(E)``, and ``return_lse=True``
    returns ``(out, lse)`` (natural log). The spec fixes the scale: a ``scale`` that differs
    from it is refused rather than ignored."""
    variant = spec if isinstance(spec, Variant) else Variant(spec)
    if variant.kv_heads != variant.heads and not enable_gqa:
        raise AttnError(
            f"the spec has {variant.heads} query heads and {variant.kv_heads} key/value heads: "
            "pass enable_gqa=True, as flex_attention asks"
        )
    if scale is not None and not math.isclose(scale, variant.scale, rel_tol=1e-6):
        raise AttnError(
            f"scale={scale} but the spec's scale is {variant.scale}: write `scale = {scale}` "
            "in the spec"
        )
    return attention(
        query, key, value, variant, params=params, data=data, return_lse=return_lse
    )


__all__ = ["flex_attention"]
