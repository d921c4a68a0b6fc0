"""Prompt-lookup drafting: continuations of earlier n-gram matches in the context, as a tree.

The last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are searched for in the
context; each earlier occurrence proposes the tokens that followed it. Matches are taken longest
``n`` first, most recent first, and merged into a trie (shared prefixes become one branch) under a
node budget. Every child is a deterministic choice (``Law.POINT``), so sampling stays exact with
no draft distribution. Training-free and model-agnostic: it needs no weights, only token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import DraftTree, TreeBuilder
from .base import DraftContext, Drafter, TargetSignature


@dataclass(frozen=True)
class NgramConfig:
    """Options of the n-gram (prompt-lookup) drafter.

    Attributes:
        max_ngram: longest suffix searched for in the context.
        min_ngram: shortest suffix searched for.
        max_depth: longest continuation drafted from one match.
        max_nodes: draft-node budget of the tree (root excluded); on CPU verify cost grows with it.
        max_matches: most matches merged into the tree.
    """

    max_ngram: int = 4
    min_ngram: int = 2
    max_depth: int = 8
    max_nodes: int = 12
    max_matches: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        for name in ("max_depth", "max_nodes", "max_matches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class NgramDrafter(Drafter):
    """Drafts trees of earlier continuations of the context's own n-grams."""

    kind = "ngram"

    def __init__(self, config: NgramConfig, signature: TargetSignature | None = None):
        super().__init__(signature)
        self.config = config

    def propose(self, ctx: DraftContext) -> DraftTree:
        cfg = self.config
        depth = min(cfg.max_depth, ctx.max_depth)
        builder = TreeBuilder(ctx.root_token)
        if depth < 1:
            return builder.build()
        tokens = ctx.tokens.cpu()
        trie: dict[tuple[int, int], int] = {}
        matches = 0
        for start in self._match_ends(tokens):
            node = 0
            for tok in tokens[start:start + depth].tolist():
                child = trie.get((node, tok))
                if child is None:
                    if len(builder) > cfg.max_nodes:
                        break
                    child = trie[(node, tok)] = builder.add(node, tok)
                node = child
            matches += 1
            if matches >= cfg.max_matches or len(builder) > cfg.max_nodes:
                break
        return builder.build()

    def context_key(self, ctx: DraftContext) -> int:
        """The longest suffix length ``n`` (``min_ngram..max_ngram``) that occurs earlier in the
        context, 0 when none does: longer matches are accepted far more often."""
        tokens = ctx.tokens.cpu()
        return next((n for n in self._sizes(tokens) if self._hits(tokens, n).numel()), 0)

    def _sizes(self, tokens: torch.Tensor) -> range:
        """Suffix lengths searched, longest first."""
        return range(min(self.config.max_ngram, tokens.shape[0] - 1), self.config.min_ngram - 1, -1)

    @staticmethod
    def _hits(tokens: torch.Tensor, n: int) -> torch.Tensor:
        """Continuation starts (increasing) of earlier occurrences of the last ``n`` tokens."""
        length = tokens.shape[0]
        windows = tokens[: length - 1].unfold(0, n, 1)  # window i = tokens[i:i+n], i + n <= L - 1
        return (windows == tokens[length - n:]).all(-1).nonzero().flatten() + n

    def _match_ends(self, tokens: torch.Tensor):
        """Yield distinct continuation starts, longest n-gram first, most recent first."""
        seen: set[int] = set()
        for n in self._sizes(tokens):
            for end in self._hits(tokens, n).flip(0).tolist():
                if end not in seen:
                    seen.add(end)
                    yield end
