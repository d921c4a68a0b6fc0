"""Stub targets and drafters for the exactness tests (no HF model needed where noted)."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from selfspec.drafters.base import DraftContext, Drafter
from selfspec.model.target import TreeOutput
from selfspec.decoding.tree import DraftTree, Law, TreeBuilder


def fixed(drafter, **config):
    """``drafter`` (one or several) under a controller that drafts every step with all of them and
    verifies their trees whole (no arm choice: the old ``control=False``), at a flat cost."""
    from selfspec.control import ControlConfig, Controller, CostModel

    if drafter is None or isinstance(drafter, Controller):
        return drafter
    return Controller(drafter, ControlConfig(**({"fixed": True} | config)), cost=CostModel.flat())


def decode(target, ids, controller, cfg, gen, max_new_tokens, eos, context_limit, clock=None, streamer=None,
           constraint=None, logits_processor=None, stopping_criteria=None, tools=None):
    """One prompt decoded on a stub ``target`` through the decode step (a pool of one row):
    the request built by hand from validated settings, the output returned (its error raised)."""
    import time

    from selfspec.batch import Pool
    from selfspec.decoding.arguments import Settings
    from selfspec.decoding.request import Request

    request = Request(torch.as_tensor(ids), None, Settings(cfg, gen, max_new_tokens, set(eos), context_limit,
                                                            logits_processor, stopping_criteria, constraint, tools),
                      streamer)
    pool = Pool(None, controller, max_batch=1, clock=clock or time.perf_counter, target=target)
    handle = pool.add(request)
    pool.run()
    return handle.result()


class TableTarget:
    """A cheap target: logits depend on the last two tokens through a fixed random table.

    Implements the :class:`selfspec.model.target.Target` protocol for one row.
    """

    def __init__(self, vocab: int = 6, seed: int = 0, scale: float = 2.0, hidden_size: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, vocab, generator=g, dtype=torch.float64) * scale
        # Optional fake last hidden states, so hidden-reading drafters (Medusa) can run on it.
        self.hidden_table = torch.randn(vocab, vocab, hidden_size, generator=g, dtype=torch.float64)
        self.want_hidden = hidden_size > 0
        self.committed: list[int] = []
        self.rows, self.reused, self.taps, self.device, self.cache = 0, 0, (), None, None
        self.supports_handoff = False

    def logits_after(self, context: list[int]) -> torch.Tensor:
        return self.table[context[-2], context[-1]]

    @property
    def prefix_len(self) -> int:
        return len(self.committed)

    def prefill(self, ids: torch.Tensor):
        self.committed = ids[:-1].tolist()
        if self.want_hidden and len(self.committed) >= 2:
            return TreeOutput(None, self.hidden_table[self.committed[-2], self.committed[-1]][None])
        return TreeOutput(None, None)

    def forward_tree(self, tree: DraftTree) -> TreeOutput:
        self._tree = tree
        toks, parents = tree.tokens.tolist(), tree.parents.tolist()
        paths: list[list[int]] = []
        for i, p in enumerate(parents):
            paths.append((paths[p] if p >= 0 else self.committed) + [toks[i]])
        hidden = torch.stack([self.hidden_table[c[-2], c[-1]] for c in paths]) if self.want_hidden else None
        return TreeOutput(torch.stack([self.logits_after(c) for c in paths]), hidden)

    def commit(self, paths: list[list[int]]) -> None:
        (path,) = paths
        self.committed += self._tree.tokens[path].tolist()

    # the Target protocol, one row
    @property
    def lengths(self) -> list[int]:
        return [len(self.committed)] * self.rows

    def add(self, prompts):
        assert self.rows == 0 and len(prompts) == 1
        self.rows = 1
        return [self.prefill(prompts[0])]

    def keep(self, rows):
        if not rows:
            self.rows, self.committed = 0, []

    def forward_trees(self, trees, handoffs=None):
        return [self.forward_tree(trees[0])]

    def rollback(self) -> None:
        pass


class VirtualClock:
    """Virtual seconds, advanced only by the stubs (no sleeps, no load sensitivity), each cost
    scaled by seeded log-normal noise (sigma 0.25) as real step times jitter."""

    def __init__(self, seed: int = 0):
        self.now, self.gen = 0.0, torch.Generator().manual_seed(seed)

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds * float(torch.exp(0.25 * torch.randn((), generator=self.gen)))


class TimedTarget(TableTarget):
    """A table target whose pass costs 1 virtual second plus ``per_node`` per draft node on
    ``clock`` (a CPU's small GEMMs)."""

    def __init__(self, clock: VirtualClock, vocab: int = 6, per_node: float = 0.15):
        super().__init__(vocab, 0)
        self.clock, self.per_node = clock, per_node

    def forward_tree(self, tree, handoff=None):
        self.clock.spend(1.0 + self.per_node * (tree.num_nodes - 1))
        return super().forward_tree(tree)


def table_target(vocab: int = 6, seed: int = 0, hidden_size: int = 0) -> TableTarget:
    return TableTarget(vocab, seed, hidden_size=hidden_size)


class FakeLM(torch.nn.Module):
    """The slice of a transformers model a Medusa drafter touches: config and output embeddings."""

    def __init__(self, vocab: int, hidden: int, seed: int = 0):
        super().__init__()
        from transformers import LlamaConfig

        torch.manual_seed(seed)
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1,
                                  num_attention_heads=1, intermediate_size=4)
        self.head = torch.nn.Linear(hidden, vocab, bias=False).double()

    def get_output_embeddings(self):
        return self.head


class ScriptedDrafter(Drafter):
    """Drafts a poor tree with every kind of child law, depth 2.

    Root children: ``point`` deterministic tokens, then ``sampled`` tokens drawn from a draft law q
    (``law`` IID or WOR); under the first root child, ``sampled`` more children drawn the same way.
    q is a softmax of a fixed random table (unrelated to the target) so rejections are frequent.
    """

    kind = "scripted"

    def __init__(self, vocab: int, *, point: int = 1, sampled: int = 2, law: Law = Law.WOR, seed: int = 1):
        super().__init__(None)
        g = torch.Generator().manual_seed(seed)
        self.q_table = (torch.randn(vocab, vocab, generator=g, dtype=torch.float64) * 1.5).softmax(-1)
        self.point_table = torch.randint(0, vocab, (vocab, max(point, 1)), generator=g)
        self.point, self.sampled, self.law = point, sampled, law

    def _add_children(self, b: TreeBuilder, node: int, last: int, gen: torch.Generator) -> list[int]:
        made = []
        for j in range(self.point):
            made.append(b.add(node, int(self.point_table[last, j]), Law.POINT))
        if self.sampled:
            q = self.q_table[last]
            b.set_draft_probs(node, q)
            if self.law == Law.IID:
                draws = torch.multinomial(q, self.sampled, replacement=True, generator=gen).tolist()
            else:
                base = q.clone()
                base[[b.token(m) for m in made]] = 0  # WOR: exclude the earlier siblings
                draws = torch.multinomial(base / base.sum(), self.sampled, replacement=False, generator=gen).tolist()
            made += [b.add(node, t, self.law) for t in draws]
        return made

    def propose(self, ctx: DraftContext) -> DraftTree:
        if ctx.point_mass and self.sampled:  # asked for point masses (a merge with another member's sampled tree)
            merged = copy.copy(self)
            merged.point, merged.sampled = max(self.point, 1), 0
            return merged.propose(replace(ctx, point_mass=False))
        b = TreeBuilder(ctx.root_token)
        if ctx.max_depth >= 1:
            kids = self._add_children(b, 0, ctx.root_token, ctx.generator)
            if ctx.max_depth >= 2 and kids:
                self._add_children(b, kids[0], b.token(kids[0]), ctx.generator)
        return b.build()


class OracleDrafter(Drafter):
    """Drafts from a known reference continuation: a chain of ``depth`` tokens plus a wrong sibling
    at every level. ``corrupt(pos)`` may alter the drafted token at absolute position ``pos``."""

    kind = "oracle"

    def __init__(self, reference: list[int], vocab: int, depth: int = 4, corrupt=None, sibling: bool = True):
        super().__init__(None)
        self.reference, self.vocab, self.depth = reference, vocab, depth
        self.corrupt = corrupt or (lambda pos, tok: tok)
        self.sibling = sibling

    def propose(self, ctx: DraftContext) -> DraftTree:
        b = TreeBuilder(ctx.root_token)
        node, pos = 0, ctx.tokens.shape[0]
        for d in range(min(self.depth, ctx.max_depth)):
            if pos + d >= len(self.reference):
                break
            tok = self.corrupt(pos + d, self.reference[pos + d])
            if self.sibling:
                b.add(node, (tok + 1) % self.vocab)
            node = b.add(node, tok)
        return b.build()


def padded(rows: list[list[int]], pad: int = 0, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, max_len]`` ids padded with ``pad`` on the left (or right) and their attention mask."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[b, cols], mask[b, cols] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask
