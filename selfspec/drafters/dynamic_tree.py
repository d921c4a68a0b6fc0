"""Level-wise budgeting shared by the dynamic-tree drafters (layer-skip, EAGLE-3).

EAGLE-2's rule: a candidate's score is its path's draft probability (parent score times its own
draft probability); at each level the best ``room`` candidate slots above ``min_score`` are kept.
For sampled children only the *number* of slots per parent is read from here (the slots' values
come from the draft's confidence, never from the draws), which keeps rejection sampling exact.
"""

from __future__ import annotations

import torch


def pick_slots(level_scores: torch.Tensor, top_probs: torch.Tensor, room: int, min_score: float) -> dict[int, list[int]]:
    """The ``room`` best (parent, rank) slots by path probability ``level_scores [m, 1] *
    top_probs [m, branch]``, at least ``min_score``; returns ``{parent row: [ranks]}``, both
    increasing."""
    path = level_scores[:, None] * top_probs  # [m, branch]
    best = path.flatten().topk(min(max(room, 0), path.numel()))
    chosen: dict[int, list[int]] = {}
    for v, i in zip(best.values.tolist(), best.indices.tolist()):
        if v >= min_score:
            chosen.setdefault(i // path.shape[1], []).append(i % path.shape[1])
    return {j: sorted(r) for j, r in sorted(chosen.items())}
