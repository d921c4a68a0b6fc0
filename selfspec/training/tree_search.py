"""Choosing a static draft tree from measured acceptance, for a node budget.

Model (Medusa's sparse-tree construction): ``acc[d][r]`` is the measured probability that the
rank-r candidate at depth d+1 is the target's token, and depths are treated as independent, so
the node with path ``(r1, ..., rd)`` is reached and accepted with probability
``prod_i acc[i][r_i]``. The expected mean accepted length of a tree (MAT, counting the bonus token)
is ``1 + sum over nodes`` of that product. Because a child's value never exceeds its parent's,
best-first growth (always add the most valuable child of the current tree) yields the tree of
maximal expected MAT for every budget.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from ..decoding.tree import TreeTemplate


def path_value(path: Sequence[int], acc: Sequence[Sequence[float]]) -> float:
    value = 1.0
    for depth, rank in enumerate(path):
        value *= acc[depth][rank]
    return value


def expected_accepted_length(paths: Sequence[Sequence[int]], acc: Sequence[Sequence[float]]) -> float:
    """Expected MAT of the tree ``paths`` under the independence model (bonus token included)."""
    return 1.0 + sum(path_value(p, acc) for p in paths if len(p) <= len(acc) and max(p) < len(acc[0]))


def best_tree(acc: Sequence[Sequence[float]], budget: int, max_depth: int | None = None) -> TreeTemplate:
    """The tree of ``budget`` draft nodes maximising expected MAT.

    Args:
        acc: ``[D][R]`` rank-wise acceptance probability per depth.
        budget: number of draft nodes (root excluded).
        max_depth: deepest level allowed (default ``D``).
    """
    depth_limit = min(len(acc), max_depth or len(acc))
    ranks = len(acc[0]) if acc else 0
    heap: list[tuple[float, tuple[int, ...]]] = [(-acc[0][r], (r,)) for r in range(ranks)] if depth_limit else []
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < depth_limit:
            for r in range(ranks):
                heapq.heappush(heap, (neg * acc[len(path)][r], path + (r,)))
    return TreeTemplate(chosen)
