"""Suffix drafting (SuffixDecoding): frequency-scored trees from the context and from past outputs.

Two :class:`~selfspec.drafters.suffix_trie.SuffixTrie` indexes: a per-generation one over the prompt and the
output so far (extended as tokens are committed), and a global one over the outputs of earlier
generations with this drafter (bounded in tokens; the oldest outputs are evicted first). Each step
finds, in each index, the longest suffix of the context (at most ``max_depth - max_nodes`` tokens,
so a draft of ``max_nodes`` levels still fits) that occurred before with a continuation
(``match_length`` tokens), then expands a tree best-first by the empirical frequency of each
continuation, keeping nodes whose path probability is at least ``min_prob``, at most
``ceil(spec_factor * match_length + spec_offset)`` nodes (longer matches are more reliable, so
they draft more; capped by ``max_nodes``). The index whose tree has the higher expected accepted
length (sum of path probabilities) wins the step.

Against prompt lookup (:mod:`.ngram`), it remembers across calls (an agent's repeated tool calls,
step formats, answers), matches up to ``max_depth - 1`` tokens instead of 2-4, and ranks
continuations by frequency instead of recency. Every child is a point mass (``Law.POINT``), so the
verifier keeps the target's exact law at any temperature, and unions can merge its trees.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from .suffix_trie import Draft, SuffixTrie, TrieCursor
from ..decoding.tree import DraftTree, TreeBuilder
from .base import DraftContext, Drafter, Requirements, TargetSignature
from .registry import config_from_options, register


@dataclass(frozen=True)
class SuffixConfig:
    """Options of the suffix drafter (defaults follow the SuffixDecoding paper and vLLM's
    ``method: "suffix"``, except ``max_nodes``: verifying a node costs more on a CPU).

    Attributes:
        max_depth: longest token string indexed (matches use up to ``max_depth - 1`` tokens).
        max_nodes: draft-node budget of one tree (root excluded).
        spec_factor / spec_offset: a match of ``n`` tokens drafts at most
            ``ceil(spec_factor * n + spec_offset)`` nodes.
        min_prob: smallest path probability drafted.
        min_match: shortest context suffix that counts as a match.
        max_cached_tokens: output tokens of earlier generations kept in the global index
            (0: no global index); memory is at most ``max_depth`` trie nodes per token.
    """

    max_depth: int = 24
    max_nodes: int = 12
    spec_factor: float = 1.0
    spec_offset: float = 0.0
    min_prob: float = 0.1
    min_match: int = 1
    max_cached_tokens: int = 65536

    def __post_init__(self) -> None:
        if self.max_depth < 2 or self.max_nodes < 1 or self.min_match < 1 or self.max_cached_tokens < 0:
            raise ValueError(f"invalid suffix config {self}: need max_depth >= 2, max_nodes >= 1, "
                             "min_match >= 1, max_cached_tokens >= 0")
        if not 0.0 <= self.min_prob <= 1.0 or self.spec_factor < 0:
            raise ValueError(f"invalid suffix config {self}: need 0 <= min_prob <= 1 and spec_factor >= 0")


class SuffixDrafter(Drafter):
    """Drafts frequency-scored continuations of the longest matching suffix (context or history).

    State: the per-generation index is rebuilt at :meth:`reset`; the global index lives as long as
    the drafter object (share one drafter across the calls of an agent session to use it).
    """

    kind = "suffix"
    requires = Requirements(learns=True)  # the global index holds every earlier output

    def __init__(self, cfg: SuffixConfig, signature: TargetSignature | None = None):
        super().__init__(signature)
        self.config = cfg
        self.history = SuffixTrie(cfg.max_depth)  # outputs of earlier generations
        self.outputs: deque[list[int]] = deque()
        self.cached_tokens = 0
        self.reset()

    def reset(self) -> None:
        self.local = SuffixTrie(self.config.max_depth)
        self._cursor = TrieCursor()
        self._seen: list[int] = []

    def end(self, tokens: torch.Tensor, prompt_len: int) -> None:
        """Remember this generation's output in the global index (oldest outputs evicted)."""
        out = tokens[prompt_len:].tolist()
        cap = self.config.max_cached_tokens
        if not out or cap == 0:
            return
        out = out[-cap:]
        self.history.insert(out)
        self.outputs.append(out)
        self.cached_tokens += len(out)
        while self.cached_tokens > cap:
            old = self.outputs.popleft()
            self.history.remove(old)
            self.cached_tokens -= len(old)

    @property
    def max_match(self) -> int:
        """Longest suffix matched: ``max_depth - max_nodes`` (at least ``min_match``), so that a
        match always leaves room to draft ``max_nodes`` levels (as SuffixDecoding does); longer
        matches would only shorten the draft."""
        return max(self.config.min_match, self.config.max_depth - self.config.max_nodes)

    def _sync(self, ctx: DraftContext) -> list[int]:
        """Index the committed tokens not indexed yet; return the whole context as a list."""
        tokens = ctx.tokens.tolist()
        n = len(self._seen)
        if n > len(tokens) or tokens[:n] != self._seen[:n]:  # not a continuation: start over
            self.reset()
            n = 0
        self.local.extend(self._cursor, tokens[n:])
        self._seen = tokens
        return tokens

    def _best(self, tokens: list[int], max_depth: int) -> Draft | None:
        cfg, best = self.config, None
        for trie in (self.local, self.history):
            node, n = trie.match(tokens, cfg.min_match, self.max_match)
            if node is None:
                continue
            budget = min(cfg.max_nodes, math.ceil(cfg.spec_factor * n + cfg.spec_offset))
            draft = trie.draft(node, n, budget, max_depth, cfg.min_prob)
            if draft.tokens and (best is None or draft.score > best.score):
                best = draft
        return best

    def propose(self, ctx: DraftContext) -> DraftTree:
        tokens = self._sync(ctx)
        builder = TreeBuilder(ctx.root_token)
        draft = self._best(tokens, ctx.max_depth) if ctx.max_depth >= 1 else None
        if draft is not None:
            index = [0] * len(draft.tokens)
            for i, (parent, tok) in enumerate(zip(draft.parents, draft.tokens)):
                index[i] = builder.add(0 if parent < 0 else index[parent], tok)
        return builder.build()

    def context_key(self, ctx: DraftContext) -> int:
        """0 without a match; else 1, 2, 3 for matches of 1-2, 3-5, 6+ tokens (longer matches are
        accepted more often), in whichever index matches longer."""
        tokens = self._sync(ctx)
        n = max(trie.match(tokens, self.config.min_match, self.max_match)[1] for trie in (self.local, self.history))
        return 0 if n == 0 else 1 + (n >= 3) + (n >= 6)


def build_suffix(model, **options) -> SuffixDrafter:
    """``build_drafter(model, "suffix", ...)`` with :class:`SuffixConfig` options."""
    return SuffixDrafter(config_from_options("suffix", SuffixConfig, options), TargetSignature.of(model))


register("suffix", build_suffix)
