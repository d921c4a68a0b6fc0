"""Tool-schema drafting: the text a tool-call grammar forces is drafted for free.

When the caller passes ``tools`` (``generate(..., tools=...)``), this drafter follows the output
text with a :class:`~selfspec.decoding.tool_grammar.ToolCallTracker`: once the model opens a call in its own
format (detected from the chat template, see :class:`~selfspec.decoding.tool_grammar.CallFormat`), the
grammar's forced continuation (markers, keys, punctuation, the rest of a uniquely determined tool
name: jump-forward text) is tokenized with the target's tokenizer and drafted as a chain of
point-mass children. The grammar advances only on committed (verified) text, never on drafts, and it constrains nothing: the verifier decides every
token, so the output keeps the target's exact law (greedy: identical to plain greedy). Outside a
call, or where the model has a choice, it drafts nothing (a plain step), and ``context_key`` says
so, so the controller runs it only inside calls.
"""

from __future__ import annotations

import copy

from dataclasses import dataclass

from ..decoding.tool_grammar import ToolCallTracker, call_format
from ..decoding.tree import DraftTree, TreeBuilder
from .base import DraftContext, Drafter, Requirements, TargetSignature
from .registry import config_from_options, register


@dataclass(frozen=True)
class ToolDraftConfig:
    """Options of the tool-schema drafter.

    Attributes:
        max_nodes: longest forced chain drafted.
        trim_last: leave out the last token of the forced text (the model often merges that
            text's end, e.g. an opening quote, with what it writes next, so that token is rarely
            the one it emits).

        call_format: the model's call format: ``"auto"`` (detected from the tokenizer's chat
            template) or a name in :data:`~selfspec.decoding.tool_grammar.CALL_FORMATS`.
    """

    max_nodes: int = 16
    trim_last: bool = True
    call_format: str = "auto"

    def __post_init__(self) -> None:
        from ..decoding.tool_grammar import CALL_FORMATS

        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if self.call_format != "auto" and self.call_format not in CALL_FORMATS:
            raise ValueError(f"unknown call_format {self.call_format!r}; expected 'auto' or one of {sorted(CALL_FORMATS)}")


class ToolCallDrafter(Drafter):
    """Drafts grammar-forced tool-call text. Needs the target's (fast) tokenizer."""

    kind = "tools"
    requires = Requirements(tools=True)

    def __init__(self, cfg: ToolDraftConfig, tokenizer, signature: TargetSignature | None = None):
        from ..extras import need

        need("llguidance.hf", "tools", "the tool-schema drafter")
        import llguidance.hf

        super().__init__(signature)
        self.config, self.tokenizer = cfg, tokenizer
        vocab = signature.vocab_size if signature is not None else None
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.format = call_format(cfg.call_format, tokenizer)
        self.tracker: ToolCallTracker | None = None
        self.tools: list[dict] | None = None

    def _use_tools(self, tools) -> None:
        """Track calls of ``tools`` (the caller's, already checked; ``None``: draft nothing)."""
        if tools != self.tools:
            self.tools = tools or None
            self.tracker = ToolCallTracker(self.tools, self.ll_tokenizer, self.format) if self.tools else None

    def reset(self) -> None:
        if self.tracker is not None:
            self.tracker.reset()

    def fork(self) -> "ToolCallDrafter":
        twin = copy.copy(self)
        twin.tracker, twin.tools = None, None  # its own tracker, built at its first call
        return twin

    def _forced(self, ctx: DraftContext) -> str:
        self._use_tools(ctx.tools)
        if self.tracker is None:
            return ""
        out = ctx.tokens[ctx.prompt_len:].tolist()
        self.tracker.update(self.tokenizer.decode(out, skip_special_tokens=False))
        return self.tracker.forced()

    def propose(self, ctx: DraftContext) -> DraftTree:
        builder = TreeBuilder(ctx.root_token)
        forced = self._forced(ctx)
        if forced:
            ids = self.tokenizer.encode(forced, add_special_tokens=False)
            if self.config.trim_last and len(ids) > 1:
                ids = ids[:-1]
            node = 0
            for tok in ids[: min(self.config.max_nodes, ctx.max_depth)]:
                node = builder.add(node, int(tok))
        return builder.build()

    def context_key(self, ctx: DraftContext) -> int:
        """1 while the grammar forces text (inside a call), else 0."""
        return int(bool(self._forced(ctx)))


def build_tools(model, tokenizer=None, **options) -> ToolCallDrafter:
    """``build_drafter(model, "tools", tokenizer=tok, ...)`` with :class:`ToolDraftConfig` options."""
    if tokenizer is None:
        raise ValueError("the tools drafter needs the target's tokenizer: build_drafter(model, 'tools', tokenizer=tok)")
    return ToolCallDrafter(config_from_options("tools", ToolDraftConfig, options), tokenizer, TargetSignature.of(model))


register("tools", build_tools, needs_tokenizer=True)
