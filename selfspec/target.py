"""Tree attention through an unmodified transformers causal LM.

:class:`TreeTarget` owns one sequence's KV cache and runs three operations on the model:

* ``prefill(ids)``: caches every prompt token but the last, which becomes the first root;
* ``forward_tree(tree)``: one forward over the flattened tree with a 4D additive attention mask
  (row i sees the committed prefix, its ancestors and itself) and ``position_ids = prefix_len +
  depth``; returns each node's logits (and last hidden state when asked);
* ``commit(path)``: compacts the KV cache to the accepted path (see :mod:`selfspec.kv_cache`).

Architectures with per-layer attention types (``config.layer_types``: Gemma 3, Qwen 2/3 with
sliding windows) get one mask per type, passed as the ``{layer_type: mask}`` mapping those models
accept; a sliding layer additionally hides keys at positions ``<= q_pos - sliding_window``, the
same rule transformers uses. Models with one model-wide window and no layer types (Mistral) get
that window in their single mask, since a custom 4D mask bypasses transformers' own windowing.
No modeling code is copied or patched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import cache_length, keep_path, new_cache
from .lm_head import head_matches_forward, lm_logits
from .tree import DraftTree

_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass
class TreeOutput:
    """Per-node results of one tree pass.

    Attributes:
        logits: ``[n, V]`` node i's logits, i.e. the target's prediction after path root..i.
        hidden: ``[n, H]`` last (post-norm) hidden states, or ``None`` when not requested.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None


def context_length(model) -> int | None:
    """The model's maximum number of positions, if its config states one."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


class TreeTarget:
    """Runs a causal LM over draft trees for one sequence (batch size 1)."""

    def __init__(self, model, *, want_hidden: bool = False):
        self.model = model
        self.want_hidden = want_hidden
        config = model.config.get_text_config(decoder=True)
        self.layer_types = sorted(set(getattr(config, "layer_types", None) or []))
        unknown = set(self.layer_types) - _SUPPORTED_LAYER_TYPES
        if unknown:
            raise ValueError(f"selfspec cannot build tree masks for attention layer types {sorted(unknown)}")
        self.sliding_window = getattr(config, "sliding_window", None)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = new_cache()
        # Decoder + our own LM-head matmul when that provably equals the model's forward (faster
        # for small trees on CPU, see selfspec.lm_head); the full forward otherwise.
        self.decoder = model.get_decoder() if head_matches_forward(model) else None

    @property
    def prefix_len(self) -> int:
        """Committed (cached) positions."""
        return cache_length(self.cache)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Cache ``ids[:-1]`` (``ids``: ``[L]``); the last token is the first root.

        Returns the last hidden state ``[H]`` at position ``L - 2`` (the one that predicted the
        root) when hidden states are wanted and the prompt has two tokens or more, else ``None``.
        """
        self.cache = new_cache()
        if ids.shape[0] < 2:
            return None
        inputs = dict(input_ids=ids[None, :-1].to(self.device), cache=self.cache, use_cache=True)
        if self.decoder is not None:
            last = self.decoder(**inputs).last_hidden_state[0, -1]
            return last if self.want_hidden else None
        out = self.model(**inputs, output_hidden_states=self.want_hidden, logits_to_keep=1)
        return out.hidden_states[-1][0, -1] if self.want_hidden else None

    @torch.no_grad()
    def forward_tree(self, tree: DraftTree) -> TreeOutput:
        """One forward over ``tree``; the tree's KV is appended to the cache until :meth:`commit`."""
        prefix = self.prefix_len
        inputs = dict(
            input_ids=tree.tokens[None].to(self.device),
            attention_mask=self.tree_mask(tree, prefix),
            position_ids=(prefix + tree.depths).to(self.device)[None],  # [1, n]
            cache=self.cache,
            use_cache=True,
        )
        if self.decoder is not None:
            hidden = self.decoder(**inputs).last_hidden_state[0]
            return TreeOutput(lm_logits(self.model, hidden), hidden if self.want_hidden else None)
        out = self.model(**inputs, output_hidden_states=self.want_hidden)
        return TreeOutput(out.logits[0], out.hidden_states[-1][0] if self.want_hidden else None)

    def commit(self, path: list[int], prefix_len: int) -> None:
        """Keep the KV of the accepted ``path`` after the ``prefix_len`` committed slots."""
        keep_path(self.cache, prefix_len, path)

    def tree_mask(self, tree: DraftTree, prefix_len: int):
        """The additive 4D mask ``[1, 1, n, prefix_len + n]`` (0 = visible, dtype min = hidden).

        Returns a tensor, or a ``{layer_type: tensor}`` mapping for models with typed layers.
        """
        n = tree.num_nodes
        visible = torch.ones(n, prefix_len + n, dtype=torch.bool)
        visible[:, prefix_len:] = tree.ancestors()
        windowed = None
        if self.sliding_window is not None and (not self.layer_types or "sliding_attention" in self.layer_types):
            q_pos = prefix_len + tree.depths  # [n]
            k_pos = torch.cat([torch.arange(prefix_len), q_pos])  # [prefix_len + n]
            windowed = visible & (k_pos[None, :] > q_pos[:, None] - self.sliding_window)
        if not self.layer_types:  # one attention type; a model-wide window (Mistral) applies to all
            return self._additive(visible if windowed is None else windowed)
        masks = {"full_attention": self._additive(visible)}
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = self._additive(windowed)
        return masks

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(visible.shape, dtype=self.dtype)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask[None, None].to(self.device)
