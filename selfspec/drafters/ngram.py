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

from ..decoding.tree import DraftTree, TreeBuilder

#: Matches (longest n-gram first, most recent first) merged into one draft trie.
MAX_MATCHES = 4
from .base import DraftContext, Drafter, Step, TargetSignature
from .registry import config_from_options, register


@dataclass(frozen=True)
class NgramConfig:
    """Options of the n-gram (prompt-lookup) drafter.

    Attributes:
        max_ngram: longest suffix searched for in the context.
        min_ngram: shortest suffix searched for.
        max_depth: longest continuation drafted from one match (:data:`MAX_MATCHES` matches are
            merged into one trie; the controller verifies the part that pays).
        long_depth: deepest chain of the first (longest, most recent) match once chains are
            accepted whole: a step that accepts the whole of that chain, drafted to its depth cap,
            doubles the cap for the next step (from ``max_depth`` up to ``long_depth``); a step that rejects any of it returns the cap to
            ``max_depth`` (as does a new generation). ``None`` (default): 32, or ``max_depth`` if
            deeper; equal to ``max_depth``: a fixed depth. Copied text accepts long chains whole.
    """

    max_ngram: int = 4
    min_ngram: int = 2
    max_depth: int = 8
    long_depth: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")
        if self.long_depth is not None and self.long_depth < self.max_depth:
            raise ValueError(f"long_depth must be >= max_depth ({self.max_depth}), got {self.long_depth}")

    @property
    def grown_depth(self) -> int:
        """The deepest the first match's chain grows to (``long_depth``, by default 32 or
        ``max_depth`` if deeper)."""
        return max(32, self.max_depth) if self.long_depth is None else self.long_depth


class NgramDrafter(Drafter):
    """Drafts trees of earlier continuations of the context's own n-grams."""

    kind = "ngram"

    def __init__(self, config: NgramConfig, signature: TargetSignature | None = None):
        super().__init__(signature)
        self.config = config
        # the latest context's matches: (its token tensor, its version counter, {n: continuation
        # starts}); the controller asks for the context key and then the tree of the same context (the
        # engine's ``tokens[:length]`` view, one object per step), which then share one search; a
        # tensor written in place since (its version moved) is searched again
        self._found: tuple[torch.Tensor, int, dict[int, list[int]]] | None = None
        # the first match's depth cap (see NgramConfig.long_depth) and the chain it drafted in the
        # latest step with that cap (None: no step to judge)
        self._depth = config.max_depth
        self._chain: tuple[list[int], int] | None = None

    def reset(self) -> None:
        self._depth, self._chain = self.config.max_depth, None

    def observe(self, step: Step) -> None:
        """Grow or reset the first match's depth cap by whether the step accepted its whole chain
        (the tree may be a merge: the committed tokens are compared token by token)."""
        drafted, self._chain = self._chain, None
        if not drafted or not step.proposed or self.config.grown_depth == self.config.max_depth:
            return
        chain, cap = drafted
        if step.tokens[: len(chain)] != chain:
            self._depth = self.config.max_depth
        elif len(chain) == cap == self._depth:  # drafted to the cap itself (not cut by the step's
            self._depth = min(self.config.grown_depth, 2 * cap)  # room) and accepted whole

    def propose(self, ctx: DraftContext) -> DraftTree:
        cfg = self.config
        depth = min(cfg.max_depth, ctx.max_depth)
        first = min(self._depth, ctx.max_depth)  # the first match's cap (grown, see long_depth; >= depth)
        builder = TreeBuilder(ctx.root_token)
        self._chain = None
        if depth < 1:
            return builder.build()
        tokens = ctx.tokens.cpu()
        trie: dict[tuple[int, int], int] = {}
        matches = 0
        for start in self._match_ends(ctx.tokens):
            node = 0
            chain = tokens[start:start + (first if matches == 0 else depth)].tolist()
            walked = 0
            for tok in chain:
                child = trie.get((node, tok))
                if child is None:
                    child = trie[(node, tok)] = builder.add(node, tok)
                node, walked = child, walked + 1
            if matches == 0:
                self._chain = (chain[:walked], first)
            matches += 1
            if matches >= MAX_MATCHES:
                break
        return builder.build()

    def context_key(self, ctx: DraftContext) -> int:
        """The longest suffix length ``n`` (``min_ngram..max_ngram``) that occurs earlier in the
        context, 0 when none does (an empty draft): longer matches are accepted far more often."""
        found = self._search(ctx.tokens)
        return next((n for n in sorted(found, reverse=True) if found[n]), 0)

    def _search(self, context: torch.Tensor) -> dict[int, list[int]]:
        """Continuation starts (increasing) of the earlier occurrences of the last ``n`` tokens of
        ``context`` (``[L]`` token ids), for every searched ``n``; once per context (see
        ``_found``). One pass: the positions ``j <= L - 2`` holding the last token, each extended
        backwards while it matches the suffix (at most ``max_ngram`` tokens); an occurrence of the
        last ``n`` tokens ending at ``j`` proposes the tokens from ``j + 1``."""
        if self._found is not None and self._found[0] is context and self._found[1] == context._version:
            return self._found[2]
        low, length = self.config.min_ngram, context.shape[0]
        high = min(self.config.max_ngram, length - 1)
        found: dict[int, list[int]] = {n: [] for n in range(low, high + 1)}
        if found:
            ends = (context[: length - 1] == context[length - 1]).nonzero().flatten().tolist()
            tail = context[max(0, length - 1 - high):].tolist()[::-1]  # tail[k] = context[L - 1 - k]
            window = context[: length - 1].tolist() if ends else []
            for j in ends:
                k = 1  # context[j - k + 1 .. j] equals the last k tokens
                while k < high and j - k >= 0 and window[j - k] == tail[k]:
                    k += 1
                for n in range(low, k + 1):
                    found[n].append(j + 1)
        self._found = (context, context._version, found)
        return found

    def _match_ends(self, context: torch.Tensor):
        """Yield distinct continuation starts in ``context``, longest n-gram first, most recent first."""
        found, seen = self._search(context), set()
        for n in sorted(found, reverse=True):
            for end in reversed(found[n]):
                if end not in seen:
                    seen.add(end)
                    yield end


def build_ngram(model, **options) -> NgramDrafter:
    """``build_drafter(model, "ngram", ...)`` with :class:`NgramConfig` options."""
    return NgramDrafter(config_from_options("ngram", NgramConfig, options), TargetSignature.of(model))


register("ngram", build_ngram)
