"""Constrained decoding that speculation keeps exact: one token mask, applied to every tree node.

A :class:`Constraint` says which tokens may follow a given output (``generate(..., constraint=c)``).
The engine masks the target's logits at *every* node of a draft tree with the mask of that node's
own path (committed output + the drafted tokens above it) before verification, and plain decoding
(``drafter=None``) goes through the same loop with root-only trees. So the law verified at each node
is exactly the law constrained plain decoding samples from: speculative output equals constrained
plain decoding (greedy: token for token; sampling: in law), whatever the drafts (a draft the
constraint forbids has probability 0 and is rejected). The mask is applied before temperature,
top-k and top-p, as structured-output engines do.

:class:`ToolCallConstraint` is the grammar of one tool call (see :mod:`selfspec.decoding.tool_grammar`),
in the model's own call format (:class:`~selfspec.decoding.tool_grammar.CallFormat`: markers such as
``<tool_call>\n`` / ``\n</tool_call>``, detected from the chat template by default), compiled by
llguidance; end-of-sequence is allowed only once the call is complete.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .tree import DraftTree


class Constraint(ABC):
    """Which tokens may come next. Implementations may cache state across calls of :meth:`masks`
    within one generation; :meth:`reset` starts a new one."""

    def reset(self) -> None:
        """Called at the start of every generation."""

    @abstractmethod
    def masks(self, output: list[int], tree: DraftTree, vocab: int) -> torch.Tensor:
        """``[n, vocab]`` bool: row i allows the tokens that may follow ``output`` (the tokens
        generated so far: after the first step the tree's root is the last of them; on the first
        step it is empty and the root is the prompt's last token) followed by the drafted path to
        node i. Rows of nodes whose own path the constraint forbids may be anything (never reached)."""


class ToolCallConstraint(Constraint):
    """Output = one call to one of ``tools`` in the model's call format, then EOS.

    Args:
        tools: OpenAI-style or BFCL function list.
        tokenizer: the target's fast tokenizer.
        call_format: a :class:`~selfspec.decoding.tool_grammar.CallFormat`, a name in ``CALL_FORMATS``, or
            ``"auto"`` (from the tokenizer's chat template).
        vocab: the model's vocabulary size (default: the tokenizer's).
    """

    def __init__(self, tools, tokenizer, call_format="auto", vocab: int | None = None):
        from ..extras import need

        need("llguidance.hf", "tools", "a tool-call constraint")
        import llguidance
        import llguidance.hf

        from .tool_grammar import call_format as as_format
        from .tool_grammar import call_grammar

        self.format = as_format(call_format, tokenizer)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar(tools, self.format))
        msg = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)  # "" when valid
        if msg:
            raise ValueError(f"tool-call grammar does not compile: {msg}")
        self._fresh = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        self.reset()

    def reset(self) -> None:
        self.matcher = self._fresh.deep_copy()  # (a matcher in error state does not recover on reset)
        self._consumed: list[int] = []

    def _advance(self, output: list[int]) -> None:
        n = len(self._consumed)
        if output[:n] != self._consumed:
            self.reset()
            n = 0
        new = output[n:]
        if new and not self.matcher.consume_tokens(new):
            raise RuntimeError(f"the committed output left the constraint's grammar ({self.matcher.get_error()})")
        self._consumed = list(output)

    def _mask(self, vocab: int) -> torch.Tensor:
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        bits = allocate_token_bitmask(1, self.ll_tokenizer.vocab_size)
        fill_next_token_bitmask(self.matcher, bits, 0)
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bits[0, :, None] >> shifts) & 1).bool().flatten()
        out = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, allowed.numel())
        out[:n] = allowed[:n]
        return out

    def masks(self, output: list[int], tree: DraftTree, vocab: int) -> torch.Tensor:
        self._advance(output)
        rows = torch.ones(tree.num_nodes, vocab, dtype=torch.bool)
        rows[0] = self._mask(vocab)
        tokens = tree.tokens.tolist()
        for i in range(1, tree.num_nodes):
            path = [tokens[j] for j in tree.path_to(i)[1:]]
            taken = self.matcher.try_consume_tokens(path)  # stops, error-free, at a forbidden token
            if taken == len(path):
                rows[i] = self._mask(vocab)
            if taken:
                self.matcher.rollback(taken)
        return rows
