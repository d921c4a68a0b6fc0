"""Additive 4D attention masks for tree passes through an unmodified transformers model.

A mask row is a query token, a column a key slot of the KV cache (committed prefix first, then the
tokens of the current pass and of earlier draft passes, in cache order). ``visible[i, j]`` says
whether query i may attend to key j; this module turns it into what the model accepts:

* a float mask ``[1, 1, m, K]`` (0 = visible, dtype min = hidden; ``[B, 1, m, K]`` for a batch of
  rows, each with its own visibility and positions), or
* for architectures with typed layers (``config.layer_types``: Gemma 3, Qwen 2/3 with sliding
  windows) a ``{layer_type: mask}`` mapping, where a sliding layer additionally hides keys at
  positions ``<= q_pos - sliding_window`` (transformers' own rule);
* models with one model-wide window and no layer types (Mistral) get the window in their single
  mask, since a custom 4D mask bypasses transformers' own windowing.
"""

from __future__ import annotations

import torch

_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}


class MaskBuilder:
    """Builds masks for one model (layer types, sliding window, dtype and device read once)."""

    def __init__(self, model):
        config = model.config.get_text_config(decoder=True)
        self.layer_types = sorted(set(getattr(config, "layer_types", None) or []))
        unknown = set(self.layer_types) - _SUPPORTED_LAYER_TYPES
        if unknown:
            raise ValueError(f"selfspec cannot build tree masks for attention layer types {sorted(unknown)}")
        self.sliding_window = getattr(config, "sliding_window", None)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    def build(self, visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
        """Mask for ``visible`` ``[m, K]`` bool, query positions ``[m]`` and key positions ``[K]``;
        or one per row: ``[B, m, K]``, ``[B, m]`` and ``[B, K]``."""
        windowed = None
        if self.sliding_window is not None and (not self.layer_types or "sliding_attention" in self.layer_types):
            windowed = visible & (k_pos[..., None, :] > q_pos[..., :, None] - self.sliding_window)
        if not self.layer_types:
            return self._additive(visible if windowed is None else windowed)
        masks = {"full_attention": self._additive(visible)}
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = self._additive(windowed)
        return masks

    def tree(self, ancestors: torch.Tensor, depths: torch.Tensor, prefix_len: int, rows: slice | None = None):
        """Mask of tree nodes over the committed prefix and the nodes before them.

        Args:
            ancestors: ``[n, n]`` the tree's ancestor matrix (``DraftTree.ancestors()``).
            depths: ``[n]`` node depths; node i sits at position ``prefix_len + depths[i]``.
            prefix_len: committed slots in the cache before node 0.
            rows: the nodes queried in this pass (default all); keys are the prefix and nodes
                ``0 .. rows.stop - 1``, which must be in the cache in flat order after this pass.
        """
        rows = rows if rows is not None else slice(0, ancestors.shape[0])
        q = torch.arange(ancestors.shape[0])[rows]
        visible = torch.ones(len(q), prefix_len + rows.stop, dtype=torch.bool)
        visible[:, prefix_len:] = ancestors[q][:, : rows.stop]
        node_pos = prefix_len + depths[: rows.stop]
        return self.build(visible, node_pos[q], torch.cat([torch.arange(prefix_len), node_pos]))

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(visible.shape, dtype=self.dtype)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return (mask[None, None] if mask.dim() == 2 else mask[:, None]).to(self.device)
