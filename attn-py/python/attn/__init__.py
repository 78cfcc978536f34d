"""attn from PyTorch: attention variants from a spec, compiled in milliseconds, as a torch op
with autograd.

    import attn
    causal_gqa = attn.Variant("heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = rope")
    out = attn.attention(q, k, v, causal_gqa)     # q [B, 8, S, 64], k and v [B, 2, S, 64]

- :class:`Variant`: a spec, checked (errors as ``attnc check`` prints them) and planned;
- :func:`attention`: the op on torch tensors, with gradients (``torch.ops.attn.attention``);
- :func:`attention_mla`: the same for MLA variants, over their five inputs;
- :func:`differential_attention`: differential heads (``differential = lambda(...)``), with
  lambda's vectors and their gradients;
- :func:`flex_attention`: the same under FlexAttention's argument names, for porting;
- :class:`attn.nn.Attention`: a module owning a variant's learnable tensors;
- ``attn.distributed`` (imported on its own): context-parallel attention over a
  ``torch.distributed`` process group;
- :class:`AttnError`: what bad input raises, carrying attn's message.
"""

import torch  # noqa: F401  (the ops register with torch.library)

from ._attn import AttnError, Variant
from ._op import attention
from ._mla import attention_mla
from ._differential import differential_attention
from .flex import flex_attention
from . import nn

__all__ = [
    "AttnError",
    "Variant",
    "attention",
    "attention_mla",
    "differential_attention",
    "flex_attention",
    "nn",
]
