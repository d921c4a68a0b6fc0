"""Tree attention through an unmodified transformers causal LM.

:class:`TreeTarget` owns one sequence's KV cache and runs three operations on the model:

* ``prefill(ids)``: caches every prompt token but the last, which becomes the first root;
* ``forward_tree(tree)``: one forward over the flattened tree with a 4D additive attention mask
  (row i sees the committed prefix, its ancestors and itself) and ``position_ids = prefix_len +
  depth``; returns each node's logits (and last hidden state when asked);
* ``commit(path)``: compacts the KV cache to the accepted path (see :mod:`selfspec.model.kv_cache`).

A layer-skip drafter that ran the target's own unmodified first E layers over every tree node (in
flat order, writing their KV into this cache) hands over their outputs as a :class:`LayerHandoff`;
``forward_tree`` then runs only layers E..L-1 (:mod:`selfspec.model.layer_slice`): same logits, E fewer
layers per node.

Masks: :mod:`selfspec.model.attention_mask`. No modeling code is copied or patched.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .attention_mask import MaskBuilder
from .kv_cache import cache_length, keep_path, new_cache
from .layer_slice import LayerSlice, num_layers, slices_compose
from .lm_head import head_matches_forward, lm_logits
from .taps import capture_taps
from ..decoding.tree import DraftTree


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
            :mod:`selfspec.model.taps`) of each node, or ``None``.
    """

    logits: torch.Tensor | None
    hidden: torch.Tensor | None
    taps: torch.Tensor | None = None


def context_length(model) -> int | None:
    """The model's maximum number of positions, if its config states one."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def forward_model(model, decoder, inputs: dict, *, want_hidden: bool, taps: tuple[int, ...], logits: bool = True,
                  select: torch.Tensor | None = None) -> TreeOutput:
    """The one forward every target runs: the decoder then the model's LM head as its own matmul
    when ``decoder`` is given (:func:`~selfspec.model.lm_head.head_matches_forward` proved it equal to the
    model's forward), the full forward otherwise. ``inputs``: the model's keyword arguments for
    ``[B, N]`` tokens. Returns flattened ``[B * N, ...]`` rows (``select``: only these flat rows),
    ``logits`` ``None`` when not asked (a prefill), ``hidden`` when ``want_hidden`` (with a
    decoder it is always computed), ``taps`` when ``taps`` are asked."""
    with capture_taps(model, taps) as record:
        if decoder is not None:
            hidden = decoder(**inputs).last_hidden_state.flatten(0, 1)
            hidden = hidden if select is None else hidden[select]
            out_logits = lm_logits(model, hidden) if logits else None
        else:
            out = model(**inputs, output_hidden_states=want_hidden, **({} if logits else {"logits_to_keep": 1}))
            out_logits = out.logits.flatten(0, 1) if logits else None
            hidden = out.hidden_states[-1].flatten(0, 1) if want_hidden else None
            if select is not None:
                out_logits = out_logits[select] if out_logits is not None else None
                hidden = hidden[select] if hidden is not None else None
    tapped = record.get().flatten(0, 1) if taps else None
    if tapped is not None and select is not None:
        tapped = tapped[select]
    return TreeOutput(out_logits, hidden if want_hidden else None, tapped)


class Target(Protocol):
    """What the decode step (:func:`selfspec.decoding.step.step`) needs from a target: draft trees of a
    set of rows (one sequence each) scored in one pass.

    Attributes:
        rows: rows held; ``lengths[b]`` row b's committed cache slots (its tokens but its root).
        taps: tap indices recorded by every pass (:mod:`selfspec.model.taps`); ``device`` its device.
        supports_handoff: whether a drafter may run the target's first layers in ``cache`` (one
            row only) and hand them over (:class:`LayerHandoff`).
    """

    rows: int
    lengths: list[int]
    taps: tuple[int, ...]
    device: Any
    supports_handoff: bool
    cache: Any

    def add(self, prompts: list[torch.Tensor]) -> list[TreeOutput]:
        """Prefill new rows (``[L_b]`` each: all but the last token cached); their outputs."""

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in this order)."""

    def forward_trees(self, trees: list[DraftTree], handoffs: list | None = None) -> list[TreeOutput]:
        """One pass over every row's tree (``trees[b]`` rooted at row b's last token)."""

    def commit(self, paths: list[list[int]]) -> None:
        """Keep each row's accepted ``paths[b]`` (node indices, root first; ``[]`` rolls the row's
        step back) after its committed slots."""

    def rollback(self) -> None:
        """Drop whatever a pass (or a drafter's handoff) appended since the last commit."""


class TreeTarget:
    """Runs a causal LM over draft trees for one sequence (the :class:`Target` protocol with one
    row, and the single-sequence helpers :meth:`prefill` / :meth:`forward_tree`)."""

    def __init__(self, model, *, want_hidden: bool = False, taps: tuple[int, ...] = ()):
        self.model = model
        self.want_hidden = want_hidden
        self.taps = tuple(taps)
        self.masks = MaskBuilder(model)
        self.device, self.dtype = self.masks.device, self.masks.dtype
        self.cache = new_cache()
        self._prefix = 0
        self.rows = 0
        self.reused = 0
        self._upper: dict[int, LayerSlice] = {}
        # Decoder + our own LM-head matmul when that provably equals the model's forward (faster
        # for small trees on CPU, see selfspec.model.lm_head); the full forward otherwise.
        self.decoder = model.get_decoder() if head_matches_forward(model) else None

    @property
    def supports_handoff(self) -> bool:
        """Whether :meth:`forward_tree` can resume from a drafter's :class:`LayerHandoff`."""
        return self.decoder is not None and slices_compose(self.model)

    @property
    def prefix_len(self) -> int:
        """Committed (cached) positions."""
        return self._prefix

    @property
    def lengths(self) -> list[int]:
        return [self._prefix] * self.rows

    # ------------------------------------------------------------------ the Target protocol
    def add(self, prompts: list[torch.Tensor], prefix_cache=None) -> list[TreeOutput]:
        if self.rows or len(prompts) != 1:
            raise ValueError(f"a TreeTarget holds one row; it has {self.rows} and got {len(prompts)} more")
        out = self.prefill(prompts[0], prefix_cache)
        self.rows = 1
        return [out]

    def keep(self, rows: list[int]) -> None:
        if not rows:
            self.rows, self.cache, self._prefix = 0, new_cache(), 0

    def forward_trees(self, trees: list[DraftTree], handoffs: list | None = None) -> list[TreeOutput]:
        if len(trees) != self.rows:
            raise ValueError(f"got {len(trees)} trees for {self.rows} rows")
        return [self.forward_tree(trees[0], handoffs[0] if handoffs else None)]

    def commit(self, paths: list[list[int]]) -> None:
        """Keep the KV of the accepted ``paths[0]`` after the committed slots (``[]``: roll back)."""
        (path,) = paths
        if not path:
            self.rollback()
            return
        keep_path(self.cache, self._prefix, path)
        self._prefix += len(path)

    def rollback(self) -> None:
        """Every layer back to the committed slots, whatever each holds beyond them (a drafter's
        handoff writes only the first layers; a pass that failed part-way, some layers)."""
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False) and layer.keys.shape[-2] > self._prefix:
                layer.keys = layer.keys[..., : self._prefix, :]
                layer.values = layer.values[..., : self._prefix, :]

    # ------------------------------------------------------------------ one sequence
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, prefix_cache=None) -> TreeOutput:
        """Cache ``ids[:-1]`` (``ids``: ``[L]``); the last token is the first root.

        With a :class:`~selfspec.decoding.prefix_cache.PrefixCache`, the longest cached prefix's keys/values
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
        out = forward_model(self.model, self.decoder, inputs, want_hidden=self.want_hidden, taps=self.taps,
                            logits=False)
        taps = out.taps
        if taps is not None and cached_taps is not None:
            taps = torch.cat([cached_taps.to(taps), taps])
        if prefix_cache is not None:
            prefix_cache.store(ids[:-1], self.cache, taps, self.taps)
        return TreeOutput(None, out.hidden[-1:] if self.want_hidden else None, taps)

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
        return forward_model(self.model, self.decoder, inputs, want_hidden=self.want_hidden, taps=self.taps)

    def fork(self) -> "TreeTarget":
        """A new target on the same model whose cache is a copy of this one's (same committed
        prefix); what either runs next leaves the other untouched."""
        import copy

        other = TreeTarget(self.model, want_hidden=self.want_hidden, taps=self.taps)
        other.cache, other._prefix, other.rows = copy.deepcopy(self.cache), self._prefix, self.rows
        return other

    def tree_mask(self, tree: DraftTree, prefix_len: int):
        """The additive 4D mask ``[1, 1, n, prefix_len + n]`` (0 = visible, dtype min = hidden).

        Returns a tensor, or a ``{layer_type: tensor}`` mapping for models with typed layers.
        """
        return self.masks.tree(tree.ancestors(), tree.depths, prefix_len)


_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model) -> threading.RLock:
    """One lock per model object: generations on a shared model run one at a time (their tree
    passes, tap hooks and layer slices touch the model), so concurrent callers get the outputs
    of sequential runs."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock
