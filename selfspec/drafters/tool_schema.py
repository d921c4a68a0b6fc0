"""Tool-schema drafting: the text a tool-call grammar forces is drafted for free.

When the caller passes ``tools`` (``generate(..., tools=...)``), this drafter follows the output
text with a :class:`~selfspec.tool_grammar.ToolCallTracker`: once the model opens a call in its own
format (detected from the chat template, see :class:`~selfspec.tool_grammar.CallFormat`), the
grammar's forced continuation (markers, keys, punctuation, the rest of a uniquely determined tool
name: jump-forward text) is tokenized with the target's tokenizer and drafted as a chain of
point-mass children. The grammar advances only on committed (verified) text, never on drafts, and it constrains nothing: the verifier decides every
token, so the output keeps the target's exact law (greedy: identical to plain greedy). Outside a
call, or where the model has a choice, it drafts nothing (a plain step), and ``context_key`` says
so, so unions and the adaptive policy use it only inside calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..tool_grammar import ToolCallTracker, call_format, check_tools
from ..tree import DraftTree, TreeBuilder
from .base import DraftContext, Drafter, TargetSignature


@dataclass(frozen=True)
class ToolDraftConfig:
    """Options of the tool-schema drafter.

    Attributes:
        max_nodes: longest forced chain drafted.
        trim_last: leave out the last token of the forced text (the model often merges that
            text's end, e.g. an opening quote, with what it writes next, so that token is rarely
            the one it emits).

        call_format: the model's call format: ``"auto"`` (detected from the tokenizer's chat
            template) or a name in :data:`~selfspec.tool_grammar.CALL_FORMATS`.
    """

    max_nodes: int = 16
    trim_last: bool = True
    call_format: str = "auto"

    def __post_init__(self) -> None:
        from ..tool_grammar import CALL_FORMATS

        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if self.call_format != "auto" and self.call_format not in CALL_FORMATS:
            raise ValueError(f"unknown call_format {self.call_format!r}; expected 'auto' or one of {sorted(CALL_FORMATS)}")


class ToolCallDrafter(Drafter):
    """Drafts grammar-forced tool-call text. Needs the target's (fast) tokenizer."""

    kind = "tools"
    empty_key = 0  # nothing forced: an empty draft (see `context_key`)
    uses_tools = True

    def __init__(self, cfg: ToolDraftConfig, tokenizer, signature: TargetSignature | None = None):
        import llguidance.hf

        super().__init__(signature)
        self.cfg, self.tokenizer = cfg, tokenizer
        vocab = signature.vocab_size if signature is not None else None
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.format = call_format(cfg.call_format, tokenizer)
        self.tracker: ToolCallTracker | None = None
        self.tools: list[dict] | None = None

    def set_tools(self, tools) -> None:
        """Use ``tools`` from now on (``None``: no tools, draft nothing)."""
        self.tools = check_tools(tools) if tools else None
        self.tracker = ToolCallTracker(self.tools, self.ll_tokenizer, self.format) if self.tools else None

    def reset(self) -> None:
        if self.tracker is not None:
            self.tracker.reset()

    def _forced(self, ctx: DraftContext) -> str:
        if self.tracker is None:
            return ""
        out = ctx.tokens[ctx.prompt_len:].tolist()
        self.tracker.update(self.tokenizer.decode(out, skip_special_tokens=False))
        return self.tracker.forced()

    def skip(self, ctx: DraftContext) -> None:
        self._forced(ctx)

    def propose(self, ctx: DraftContext) -> DraftTree:
        builder = TreeBuilder(ctx.root_token)
        forced = self._forced(ctx)
        if forced:
            ids = self.tokenizer.encode(forced, add_special_tokens=False)
            if self.cfg.trim_last and len(ids) > 1:
                ids = ids[:-1]
            node = 0
            for tok in ids[: min(self.cfg.max_nodes, ctx.max_depth)]:
                node = builder.add(node, int(tok))
        return builder.build()

    def context_key(self, ctx: DraftContext) -> int:
        """1 while the grammar forces text (inside a call), else 0."""
        return int(bool(self._forced(ctx)))
