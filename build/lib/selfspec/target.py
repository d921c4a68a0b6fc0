"""Tree attention through an unmodified transformers causal LM.

:class:`TreeTarget` owns one sequence's KV cache and runs three operations on the model:

* ``prefill(ids)``: caches every prompt token but the last, which becomes the first root;
* ``forward_tree(tree)``: one forward over the flattened tree with a 4D additive attention mask
  (row i sees the committed prefix, its ancestors and itself) and ``position_ids = prefix_len +
  depth``; returns each node's logits (and last hidden state when asked);
* ``commit(path)``: compacts the KV cache to the accepted path (see :mod:`selfspec.kv_cache`).

A layer-skip drafter that ran the target's own unmodified first E layers over every tree node (in
flat order, writing their KV into this cache) hands over their outputs as a :class:`LayerHandoff`;
``forward_tree`` then runs only layers E..L-1 (:mod:`selfspec.layer_slice`): same logits, E fewer
layers per node.

Masks: :mod:`selfspec.attention_mask`. No modeling code is copied or patched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_mask import MaskBuilder
from .kv_cache import cache_length, keep_path, new_cache
from .layer_slice import LayerSlice, num_layers, slices_compose
from .lm_head import head_matches_forward, lm_logits
from .taps import capture_taps
from .tree import DraftTree


@dataclass
class LayerHandoff:
    """Work a drafter already did for this tree with the target's own first layers.

    Attributes:
        layers: E, the number of leading decoder layers that ran over every tree node; their KV
            for the nodes follow the committed prefix in the target's cache, in flat order.
        hidden: ``[n, H]`` the output of layer E-1 (before any drafter adapter) for each node.
    """

    layers: int
    hidden: torch.Tensor


@dataclass
class TreeOutput:
    """Per-node results of one tree pass.

    Attributes:
        logits: ``[n, V]`` node i's logits, i.e. the target's prediction after path root..i
            (``None`` for a prefill).
        hidden: ``[n, H]`` last (post-norm) hidden states, or ``None`` when not requested.
        taps: ``[n, len(taps) * H]`` the requested intermediate hidden states (see
            :mod:`selfspec.taps`) of each node, or ``None``.
    """

    logits: torch.Tensor | None
    hidden: torch.Tensor | None
    taps: torch.Tensor | None = None


def context_length(model) -> int | None:
    """The model's maximum number of positions, if its config states one."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


class TreeTarget:
    """Runs a causal LM over draft trees for one sequence (batch size 1)."""

    def __init__(self, model, *, want_hidden: bool = False, taps: tuple[int, ...] = ()):
        self.model = model
        self.want_hidden = want_hidden
        self.taps = tuple(taps)
        self.masks = MaskBuilder(model)
        self.device, self.dtype = self.masks.device, self.masks.dtype
        self.cache = new_cache()
        self._prefix = 0
        self._upper: dict[int, LayerSlice] = {}
        # Decoder + our own LM-head matmul when that provably equals the model's forward (faster
        # for small trees on CPU, see selfspec.lm_head); the full forward otherwise.
        self.decoder = model.get_decoder() if head_matches_forward(model) else None

    @property
    def supports_handoff(self) -> bool:
        """Whether :meth:`forward_tree` can resume from a drafter's :class:`LayerHandoff`."""
        return self.decoder is not None and slices_compose(self.model)

    @property
    def prefix_len(self) -> int:
        """Committed (cached) positions."""
        return self._prefix

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, prefix_cache=None) -> TreeOutput:
        """Cache ``ids[:-1]`` (``ids``: ``[L]``); the last token is the first root.

        With a :class:`~selfspec.prefix_cache.PrefixCache`, the longest cached prefix's keys/values
        (and taps) are copied in and only the rest is run; the prompt's state is stored back.
        ``self.reused`` says how many positions came from it.

        Returns ``TreeOutput(None, hidden, taps)``: ``hidden`` ``[1, H]`` is the last hidden state at
        position ``L - 2`` (the one that predicted the root) when hidden states are wanted, ``taps``
        ``[L - 1, D]`` the taps of positions ``0 .. L - 2`` when taps are wanted; both ``None`` for
        a one-token prompt.
        """
        self.cache, self.reused, cached_taps = new_cache(), 0, None
        self._prefix = max(0, ids.shape[0] - 1)
        if ids.shape[0] < 2:
            return TreeOutput(None, None, None)
        if prefix_cache is not None:
            hit = prefix_cache.lookup(ids, self.taps)
            if hit is not None:
                self.cache, self.reused, cached_taps = hit.cache(), hit.length, hit.taps
        start = self.reused
        positions = torch.arange(start, ids.shape[0] - 1, device=self.device)[None]
        inputs = dict(input_ids=ids[None, start:-1].to(self.device), position_ids=positions, cache=self.cache,
                      use_cache=True)
        with capture_taps(self.model, self.taps) as record:
            if self.decoder is not None:
                last = self.decoder(**inputs).last_hidden_state[0, -1:]
            else:
                out = self.model(**inputs, output_hidden_states=self.want_hidden, logits_to_keep=1)
                last = out.hidden_states[-1][0, -1:] if self.want_hidden else None
        taps = record.get()[0] if self.taps else None
        if taps is not None and cached_taps is not None:
            taps = torch.cat([cached_taps.to(taps), taps])
        if prefix_cache is not None:
            prefix_cache.store(ids[:-1], self.cache, taps, self.taps)
        return TreeOutput(None, last if self.want_hidden else None, taps)

    @torch.no_grad()
    def forward_tree(self, tree: DraftTree, handoff: LayerHandoff | None = None) -> TreeOutput:
        """One forward over ``tree``; the tree's KV is appended to the cache until :meth:`commit`.

        With a ``handoff`` only layers ``handoff.layers .. L-1`` run, from ``handoff.hidden``.
        """
        prefix = self.prefix_len
        expected = prefix + (tree.num_nodes if handoff is not None else 0)
        if cache_length(self.cache) != expected:  # a drafter left the shared cache inconsistent
            raise RuntimeError(f"KV cache holds {cache_length(self.cache)} slots before the tree pass, expected {expected}")
        mask = self.tree_mask(tree, prefix)
        positions = (prefix + tree.depths).to(self.device)[None]  # [1, n]
        if handoff is not None:
            if self.decoder is None or handoff.hidden.shape[0] != tree.num_nodes:
                raise RuntimeError("a layer handoff needs the decoder/LM-head split and one hidden row per node")
            upper = self._upper.get(handoff.layers)
            if upper is None:
                upper = self._upper[handoff.layers] = LayerSlice(self.model, range(handoff.layers, num_layers(self.model)))
            if self.taps:
                raise RuntimeError("a layer handoff skips the layers that taps read")
            hidden = upper(inputs_embeds=handoff.hidden[None], attention_mask=mask, position_ids=positions,
                           cache=self.cache)[0]
            return TreeOutput(lm_logits(self.model, hidden), hidden if self.want_hidden else None)
        inputs = dict(input_ids=tree.tokens[None].to(self.device), attention_mask=mask, position_ids=positions,
                      cache=self.cache, use_cache=True)
        with capture_taps(self.model, self.taps) as record:
            if self.decoder is not None:
                hidden = self.decoder(**inputs).last_hidden_state[0]
                logits = lm_logits(self.model, hidden)
            else:
                out = self.model(**inputs, output_hidden_states=self.want_hidden)
                logits, hidden = out.logits[0], out.hidden_states[-1][0] if self.want_hidden else None
        return TreeOutput(logits, hidden if self.want_hidden else None, record.get()[0] if self.taps else None)

    def fork(self) -> "TreeTarget":
        """A new target on the same model whose cache is a copy of this one's (same committed
        prefix); what either runs next leaves the other untouched."""
        import copy

        other = TreeTarget(self.model, want_hidden=self.want_hidden, taps=self.taps)
        other.cache, other._prefix = copy.deepcopy(self.cache), self._prefix
        return other

    def commit(self, path: list[int], prefix_len: int) -> None:
        """Keep the KV of the accepted ``path`` after the ``prefix_len`` committed slots."""
        keep_path(self.cache, prefix_len, path)
        self._prefix = prefix_len + len(path)

    def tree_mask(self, tree: DraftTree, prefix_len: int):
        """The additive 4D mask ``[1, 1, n, prefix_len + n]`` (0 = visible, dtype min = hidden).

        Returns a tensor, or a ``{layer_type: tensor}`` mapping for models with typed layers.
        """
        return self.masks.tree(tree.ancestors(), tree.depths, prefix_len)
