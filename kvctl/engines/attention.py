"""The reference engine's attention: SDPA on the KV heads as they are and causal alignment read
off the shapes, so a prefill on top of reused KV runs the same fused kernel as a full one.

transformers' own ``sdpa`` builds an explicit mask whenever the queries are fewer than the keys
(a prefill after reused chunks), and with a mask it repeats every KV head for each query head it
serves before calling the kernel: on the Llama-3.1-8B shape at 100k cached tokens that is 4x
the context's KV written and read again in every layer, which made the 64-token prefill after a
reuse cost more than the copy of 12.5 GiB across the host link. Here the queries are aligned to
the end of the keys (``causal_lower_right``: the last query sees every key), which SDPA's flash
and memory-efficient kernels take without a mask, and grouped-query attention stays in the
kernel (``enable_gqa``).

No mask is built for this implementation (transformers skips mask creation for attention it
does not know), so it is for unpadded inputs only: the reference engine's, one request per call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

#: the ``attn_implementation`` name models built by kvctl.engines.models use
KV_ATTENTION = "kvctl_sdpa"


def kv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """(batch, heads, q, dim) queries over (batch, kv heads, k, dim) keys, causal with the
    queries at the end: a full prefill (q == k), a prefill after reuse (q < k), a decode step
    (q == 1). Returns (batch, q, heads, dim) as transformers' attention functions do."""
    if attention_mask is not None:
        raise ValueError(
            f"{KV_ATTENTION} takes unpadded inputs and no attention mask; use 'sdpa' for padded "
            "batches"
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = getattr(module, "is_causal", True) and q_len > 1
    mask: Any = None
    if causal and q_len != kv_len:
        mask = causal_lower_right(q_len, kv_len)
        causal = False
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=causal,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(KV_ATTENTION, kv_attention)
