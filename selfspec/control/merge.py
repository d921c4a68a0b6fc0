"""Merging members' trees into one, and the one tree-sizing rule.

**Merge.** Point-mass trees merge into a trie keyed by token path: a node proposed by several
members is verified once and keeps every proposer as a *source*. When the first member (the
*anchor*) drafted sampled children (``Law.IID`` / ``Law.WOR``), its tree is kept as drafted
(tokens, laws, recorded draft laws, node ``i`` keeps index ``i``) and the other members'
point-mass nodes are *grafted* on it, each after every child its parent already has. Exact at any
temperature: the verifier tests the anchor's children first, each against the law it was drawn
from given its earlier siblings, as in the anchor's own tree; a grafted point-mass child x comes
after them and is accepted with the residual's r(x), a valid proposal whatever the earlier
siblings were. Which point-mass nodes are present depends on the anchor's draws only through the
tokens drawn (a token already drawn is not grafted again: its residual is 0), never on a coin.

**Sizing.** Given each node's value v (its estimated probability of being accepted: the product
along its path of its sources' acceptance), a tree of n nodes emits ``1 + sum(v)`` tokens in
expectation and costs ``fixed + c(n)`` seconds (``fixed``: drafting; ``c``: the verify curve). Nodes
are taken best value first (a node only after its parent, and a sampled node only after its
earlier sampled siblings, whose laws it depends on) and the prefix with the most tokens per
second is kept: a node stays when its expected acceptance pays for its marginal verify cost. A
drawn tree's sampled nodes are never cut (whether they stay would then depend on the tokens drawn
below or beside them); their number is set before the draw, from sizing the latest tree
(``DraftContext.max_nodes``), and only point-mass nodes are cut after drafting.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

import torch

from ..decoding.tree import DraftTree, Law, TreeBuilder
from .acceptance import Cell


def member_sources(tree: DraftTree, member: int, key: int, bucket: int) -> list[list[Cell]]:
    """Per node of one member's ``tree``, its one source cell ``(member, key, depth, rank,
    bucket)``, rank being the node's place among its siblings (root: none)."""
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    seen: dict[int, int] = {}
    out: list[list[Cell]] = [[]]
    for i in range(1, tree.num_nodes):
        rank = seen.get(parents[i], 0)
        seen[parents[i]] = rank + 1
        out.append([(member, key, depths[i], rank, bucket)])
    return out


def merge(parts: Sequence[tuple[DraftTree, list[list[Cell]]]]) -> tuple[DraftTree, list[list[Cell]]]:
    """One tree from members' ``(tree, sources)`` parts (the first is the anchor); see the module
    docstring. Returns the merged tree and each node's sources."""
    anchor, anchor_src = parts[0]
    tokens, parents, laws = anchor.tokens.tolist(), anchor.parents.tolist(), anchor.laws.tolist()
    sampled = any(law != Law.POINT for law in laws[1:])
    builder, index = TreeBuilder(tokens[0]), {(): 0}
    sources: list[list[Cell]] = [[]]
    paths: list[tuple] = [()]
    if sampled:  # the anchor as drafted; a token drawn twice (with replacement) keeps its first index
        for i in range(1, anchor.num_nodes):
            builder.add(parents[i], tokens[i], Law(laws[i]))
            paths.append(paths[parents[i]] + (tokens[i],))
            index.setdefault(paths[i], i)
            sources.append(list(anchor_src[i]))
        rows = anchor.draft_row.tolist() if anchor.draft_row is not None else []
        for i, row in enumerate(rows):
            if row >= 0:
                builder.set_draft_probs(i, anchor.draft_probs[row])
        parts = parts[1:]
    for tree, src in parts:
        if bool((tree.laws[1:] != Law.POINT).any()):
            raise ValueError("only the first member of a merge may draft sampled children")
        toks, pars = tree.tokens.tolist(), tree.parents.tolist()
        own: list[tuple] = [()]
        for i in range(1, tree.num_nodes):
            own.append(own[pars[i]] + (toks[i],))
            at = index.get(own[i])
            if at is None:
                at = index[own[i]] = builder.add(index[own[pars[i]]], toks[i])
                sources.append([])
            sources[at] = sources[at] + src[i]
    return builder.build(), sources


def node_values(tree: DraftTree, sources: list[list[Cell]], rate: Callable[[Cell], float]) -> list[float]:
    """Per node, the probability the walk accepts it: along its path, the best of its sources'
    rates (root: 1). A sampled node counts its own drafter's (first) source only, so its value
    depends on its position, never on the token drawn."""
    parents, laws = tree.parents.tolist(), tree.laws.tolist()
    values = [1.0] * tree.num_nodes
    for i in range(1, tree.num_nodes):
        cells = sources[i][:1] if laws[i] != Law.POINT else sources[i]
        values[i] = values[parents[i]] * max((rate(c) for c in cells), default=0.0)
    return values


def size_tree(tree: DraftTree, values: list[float], verify: Callable[[int], float], fixed: float,
              max_nodes: int, cut_sampled: bool = True) -> tuple[list[int], float]:
    """``(kept nodes in index order, expected tokens per second)`` by the sizing rule (module
    docstring): at most ``max_nodes`` draft nodes, ``fixed`` seconds of drafting. With
    ``cut_sampled=False`` (a drawn tree about to be verified) every sampled node stays and only
    point-mass nodes are cut: which sampled nodes exist depends on the draws, so cutting them by
    what lies below could favour some tokens over others; their budget is set before drawing
    instead (``DraftContext.max_nodes``)."""
    if cut_sampled:
        return _grow(tree, values, verify, fixed, max_nodes, [0], 1.0, 1.0 / (fixed + verify(1)),
                     set(range(1, tree.num_nodes)))[::2]
    sampled = pinned(tree)
    tokens = 1.0 + sum(values[i] for i in sampled)
    kept = [0] + sampled
    rest = set(range(1, tree.num_nodes)) - set(sampled)
    kept, _, rate = _grow(tree, values, verify, fixed, max(max_nodes, len(sampled)), kept, tokens,
                          tokens / (fixed + verify(len(kept))), rest)
    return sorted(kept), rate


def pinned(tree: DraftTree) -> list[int]:
    """The nodes a cut after drafting must keep (increasing): every sampled node, and what it was
    drawn given, its ancestors and its earlier siblings."""
    laws, parents, children = tree.laws.tolist(), tree.parents.tolist(), tree.children
    keep: set[int] = set()
    for i in range(1, tree.num_nodes):
        if laws[i] != Law.POINT:
            keep.update(s for s in children[parents[i]] if s <= i)
            p = parents[i]
            while p > 0:
                keep.add(p)
                p = parents[p]
    return sorted(keep)


def _grow(tree, values, verify, fixed, max_nodes, kept, tokens, rate, allowed):
    """Add ``allowed`` nodes to ``kept`` best value first (:func:`take_order`) and keep the prefix
    with the best rate."""
    order = take_order(tree, values, kept, allowed, max_nodes - (len(kept) - 1))
    best, best_len, total = rate, 0, tokens
    for k, i in enumerate(order):
        total += values[i]
        r = total / (fixed + verify(len(kept) + k + 1))
        if r > best:
            best, best_len, tokens = r, k + 1, total
    return sorted(kept + order[:best_len]), tokens, best


def take_order(tree: DraftTree, values: list[float], kept: list[int], allowed: set[int], limit: int) -> list[int]:
    """The order in which the sizing rule takes ``allowed`` nodes after ``kept`` (which holds the
    root): best value first, a node after its parent, a sampled node after its previous sampled
    sibling; at most ``limit`` nodes. A heap of the nodes ready to be taken: O(n log n)."""
    laws, children = tree.laws.tolist(), tree.children
    prev, nxt = {}, {}
    for kids in children:
        for a, b in zip(kids, kids[1:]):
            prev[b], nxt[a] = a, b
    have, order = set(kept), []

    def startable(c: int) -> bool:  # a sampled node waits for its previous sampled sibling
        p = prev.get(c)
        return c in allowed and c not in have and (laws[c] == Law.POINT or p is None or laws[p] == Law.POINT
                                                   or p in have)

    heap = [(-values[c], c) for k in have for c in children[k] if startable(c)]
    heapq.heapify(heap)
    queued = {c for _, c in heap}
    while heap and len(order) < limit:
        _, i = heapq.heappop(heap)
        have.add(i)
        order.append(i)
        for c in children[i] + ((nxt[i],) if i in nxt else ()):
            if c not in queued and startable(c):
                queued.add(c)
                heapq.heappush(heap, (-values[c], c))
    return order


def subtree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The tree of the ``keep`` nodes (increasing, closed under parents), laws and draft laws kept."""
    if len(keep) == tree.num_nodes:
        return tree
    idx = torch.tensor(keep, dtype=torch.long)
    remap = torch.full((tree.num_nodes,), -1, dtype=torch.long)
    remap[idx] = torch.arange(len(keep))
    parents = tree.parents[idx].clone()
    parents[1:] = remap[parents[1:]]
    return DraftTree(tree.tokens[idx], parents, tree.laws[idx], tree.draft_probs,
                     None if tree.draft_row is None else tree.draft_row[idx])
