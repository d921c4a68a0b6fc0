"""The batch's word on tree size: one node budget for every row of a pass.

Every batched pass costs the batch's largest tree for every row, which no row's controller sees.
So after the rows' controllers have sized their trees, the batch picks one node budget N for all
of them, the one with the most expected tokens per second of the whole pass: each row keeps its
uncuttable (sampled) nodes and its best others up to N by this step's acceptance draws
(:meth:`~selfspec.control.Controller.offer`), against ``c(rows * (N + 1))``; rows over N are cut
to their best N nodes (:meth:`~selfspec.control.Controller.cut`).

Exactness: cuts drop point-mass nodes only, chosen from past measurements and the controller's
own draws, never this step's verification coins.
"""

from __future__ import annotations

from typing import Callable


def node_budget(offers: list[tuple[list[float], list[float]] | None], nodes: list[int], draft_s: float,
                verify: Callable[[int, int], float]) -> int | None:
    """The draft-node budget N for every row (``None``: nothing may be cut).

    Args:
        offers: per row, :meth:`~selfspec.control.Controller.offer`'s ``(values of uncuttable
            nodes, values of the others in the order they are taken)``, or ``None``.
        nodes: per row, its tree's draft nodes now.
        draft_s: seconds already spent drafting this step (all rows).
        verify: ``verify(n, rows)``, one row's share of a pass over ``n`` nodes per row.
    """
    if not any(offers):
        return None
    rows = len(nodes)
    low = max(len(o[0]) for o in offers if o)
    high = max(nodes)
    best, best_n = -1.0, high
    for n in range(low, high + 1):
        tokens = float(rows)
        for o in offers:
            if o:
                fixed, ranked = o
                tokens += sum(fixed) + sum(ranked[: n - len(fixed)])
        rate = tokens / (draft_s + rows * verify(n + 1, rows))
        if rate > best:
            best, best_n = rate, n
    return best_n
