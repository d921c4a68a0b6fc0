"""Attention for small tree passes: grouped-query heads packed into rows, keys and values not copied.

transformers' SDPA path (``transformers/integrations/sdpa_attention.py``) runs a grouped-query
model (SmolLM2: 9 query heads on 3 key/value heads) in two ways:

* one query token: the query heads that share a key/value head are packed as rows of that head
  (``pack_gqa``), and ``scaled_dot_product_attention`` runs on the key/value heads as they are;
* more tokens with a mask (every tree pass): each key/value head is first copied to every query
  head it serves (``repeat_kv``), which on a CPU costs two copies of the whole cache per layer and
  pass, and the kernel then runs per query head.

A verify pass of 2-16 tree nodes is a decode step with a few more rows, not a prefill: this module
registers one attention function, :data:`NAME`, through transformers' own ``AttentionInterface``
(no modeling code copied or patched), that packs those passes the way transformers packs one token:
the query ``[B, H, q, D]`` becomes ``[B, H_kv, G*q, D]`` (rows ordered group-major, ``G = H / H_kv``),
the mask ``[B, 1, q, K]`` is repeated to ``[B, 1, G*q, K]`` in the same order, and the same
``scaled_dot_product_attention`` runs on the cache's keys and values uncopied. Every row is the
same dot products, softmax and weighted sum as before, so the result is the same attention (the
tests compare it with transformers' path in float64); in low precision the kernel's blocking may
round a row differently, as batched and sequential passes already do.

Everything else is transformers' own SDPA function, unchanged: one token, no mask (prefill's causal
path), more than :data:`MAX_PACKED_ROWS` packed rows (8 tokens on SmolLM2; larger passes gain
nothing here), models without grouped heads, per-head masks,
position biases, dropout, softcapping. The mask is built by transformers' ``sdpa_mask``, registered
under the same name. Plain decoding thus runs exactly transformers' path: only passes of several
tokens with a mask change, which plain decoding never makes.

Explicit matmuls with a float32 softmax were slower than either SDPA path (per-call overhead),
so the kernel stays SDPA (the measurement is in docs/decisions.md).
"""

from __future__ import annotations

import torch

NAME = "selfspec_packed_sdpa"
MAX_PACKED_ROWS = 24  # packed rows (query tokens x heads per key/value head) at most: packing pays for a
# few tokens but not beyond this (the measurement is in docs/decisions.md)


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[B, H, q, D]``, ``key``/``value``
    ``[B, H_kv, K, D]``, ``attention_mask`` ``[B | 1, 1, q, K]`` additive (or ``None``); returns
    ``([B, q, H, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    q_len = query.shape[2]
    if (groups == 1 or q_len == 1 or groups * q_len > MAX_PACKED_ROWS or attention_mask is None
            or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[2] != q_len
            or dropout or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions", False)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    if heads != kv_heads * groups:
        raise ValueError(f"{heads} query heads do not split into {kv_heads} key/value heads of {groups}")
    packed = query.reshape(batch, kv_heads, groups * q_len, dim)  # row g * q + i: head kv * G + g, token i
    mask = attention_mask.repeat(1, 1, groups, 1)  # the same rows' mask (shared by every head)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    out = out.reshape(out.shape[0], heads, q_len, value.shape[-1]).transpose(1, 2).contiguous()
    return out, None


def register() -> str:
    """Register :data:`NAME` with transformers (attention and mask functions); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, packed_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_packed_attention(model) -> bool:
    """Switch ``model`` from transformers' ``sdpa`` to :data:`NAME` where that changes anything:
    its attention is ``sdpa`` and it has grouped key/value heads. Returns whether it switched."""
    config = model.config.get_text_config(decoder=True)
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if model.config._attn_implementation != "sdpa" or not heads or not kv_heads or heads == kv_heads:
        return False
    model.set_attn_implementation(register())
    return model.config._attn_implementation == NAME
