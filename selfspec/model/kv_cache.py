"""The target's KV cache across verification steps.

selfspec keeps a plain ``transformers.DynamicCache`` built *without* a config, so every layer
(sliding-window ones included) stores the full history ``[batch, kv_heads, seq, head_dim]``;
sliding windows are enforced by the attention mask instead (see :mod:`selfspec.model.target`). This
keeps one rule for every architecture: after a tree pass the cache holds ``prefix_len`` committed
slots followed by the ``n`` tree nodes in flat order, and :func:`keep_path` gathers the accepted
path into contiguous slots starting at ``prefix_len`` and drops the rest.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    """An empty cache of plain (full-history) dynamic layers."""
    return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    """Number of cached positions (identical across layers by construction)."""
    return cache.get_seq_length()


def keep_path(cache: DynamicCache, prefix_len: int, path: list[int]) -> None:
    """Compact the cache in place to ``prefix_len`` slots plus the tree nodes in ``path``.

    Args:
        cache: holds ``prefix_len + n`` slots, the last ``n`` being the tree in flat order.
        prefix_len: committed length before the tree pass.
        path: accepted node indices (root first), increasing.
    """
    total = cache_length(cache)
    if path == list(range(len(path))):  # a chain prefix: cropping is enough
        cache.crop(-(total - prefix_len - len(path)))
        return
    index = torch.tensor([prefix_len + i for i in path], dtype=torch.long)
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        idx = index.to(layer.keys.device)
        layer.keys = torch.cat([layer.keys[..., :prefix_len, :], layer.keys.index_select(-2, idx)], dim=-2)
        layer.values = torch.cat(
            [layer.values[..., :prefix_len, :], layer.values.index_select(-2, idx)], dim=-2
        )
