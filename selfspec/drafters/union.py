"""Union of drafters: several deterministic draft trees merged into one trie under a node budget.

Each member proposes a tree for the same root; their root-to-leaf token paths are inserted member
by member (first member first, its nodes in flat order) into one trie, sharing common prefixes,
until ``max_nodes`` draft nodes. Used to let prompt lookup catch copy-heavy text (tool calls,
rewrites) while trained heads cover the rest. Only point-mass trees can be merged: a sampled child
carries a law tied to its own siblings, which a merge would break.
"""

from __future__ import annotations

from ..tree import DraftTree, Law, TreeBuilder
from ..verify import Verdict
from .base import DraftContext, Drafter


class UnionDrafter(Drafter):
    """Merges the trees of ``members`` (all proposing point-mass children)."""

    kind = "union"

    def __init__(self, members: list[Drafter], max_nodes: int = 16):
        if not members:
            raise ValueError("a union drafter needs at least one member")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        super().__init__(members[0].signature)
        # members that can sample their children are asked for point-mass trees instead
        members = [m.with_options(sampled=False) if getattr(getattr(m, "cfg", None), "sampled", False) else m
                   for m in members]
        self.members, self.max_nodes = members, max_nodes
        self.needs_hidden = any(m.needs_hidden for m in members)
        taps = {m.taps for m in members if m.taps}
        if len(taps) > 1:
            raise ValueError(f"union members read different target taps {sorted(taps)}")
        self.taps = taps.pop() if taps else ()

    def check_target(self, model) -> None:
        for m in self.members:
            m.check_target(model)

    def reset(self) -> None:
        for m in self.members:
            m.reset()

    def propose(self, ctx: DraftContext) -> DraftTree:
        builder = TreeBuilder(ctx.root_token)
        trie: dict[tuple[int, int], int] = {}
        for member in self.members:
            tree = member.propose(ctx)
            if bool((tree.laws[1:] != Law.POINT).any()):
                raise ValueError(f"{member.kind} drafted sampled children, which a union cannot merge")
            where = {0: 0}  # member node -> union node
            tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
            for i in range(1, tree.num_nodes):
                if parents[i] not in where:
                    continue
                key = (where[parents[i]], tokens[i])
                if key not in trie:
                    if len(builder) > self.max_nodes:
                        continue
                    trie[key] = builder.add(key[0], key[1])
                where[i] = trie[key]
        return builder.build()

    def observe(self, ctx: DraftContext, tree: DraftTree, verdict: Verdict) -> None:
        for m in self.members:
            m.observe(ctx, tree, verdict)
