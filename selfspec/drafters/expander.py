"""The level-wise tree expander shared by the model drafters (EAGLE-3 heads, layer-skip drafts).

EAGLE-2's dynamic tree: a candidate's *score* is its path's draft probability (its parent's score
times its own draft probability). Level by level, the drafter's logits for the frontier give each
frontier node its ``branch`` most likely tokens as candidates:

* point-mass children (greedy targets, ``sampled=False``, or when the caller asks for point
  masses): the best candidates by score become nodes (all of them, or with ``forward_all`` the best
  ``width``), and the best ``width`` nodes are forwarded to give the next level;
* sampled children (``sampled`` at T > 0): the best ``width`` (parent, rank) slots by score fix how
  many children each parent gets *before any draw*; each chosen parent's children are then drawn
  without replacement from ``q`` (the target's temperature / top-k / top-p applied to the draft
  logits over the full vocabulary; tokens outside a reduced draft vocabulary have ``q = 0``) and
  recorded as ``Law.WOR`` with ``q``, so the number of draws never depends on the draws.

Depth stops at ``min(policy.max_depth, ctx.max_depth)``; sampled nodes stop at ``ctx.max_nodes``
(the controller's budget, set before drawing); the controller cuts point-mass trees to the size
that pays after drafting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..decoding.sampling import draw_without_replacement, target_probs
from ..decoding.tree import DraftTree, Law, TreeBuilder
from .base import DraftContext


@dataclass(frozen=True)
class TreePolicy:
    """How a model drafter grows its tree (how many calls and candidates; not how many are verified).

    Attributes:
        max_depth: deepest draft level (one draft call per level).
        width: frontier nodes forwarded per level.
        branch: candidate tokens per frontier node.
        sampled: at temperature > 0, draw children from the draft law (else point masses).
    """

    max_depth: int = 5
    width: int = 3
    branch: int = 3
    sampled: bool = True

    def __post_init__(self) -> None:
        for name in ("max_depth", "width", "branch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")


#: ``forward(nodes, parent_rows, depth) -> [len(nodes), V_d]`` logits of the new frontier: the
#: drafter runs its model over tree ``nodes`` (their tokens are the builder's), each continuing
#: the output row ``parent_rows[i]`` of the previous call, at ``depth``.
Forward = Callable[[TreeBuilder, list[int], list[int], int], torch.Tensor]


def pick_slots(level_scores: torch.Tensor, top_probs: torch.Tensor, room: int) -> dict[int, list[int]]:
    """The ``room`` best (parent row, rank) slots by path probability ``level_scores [m] *
    top_probs [m, branch]``; returns ``{parent row: [ranks]}``, both increasing."""
    path = level_scores[:, None] * top_probs
    best = path.flatten().topk(min(max(room, 0), path.numel()))
    chosen: dict[int, list[int]] = {}
    for i in best.indices.tolist():
        chosen.setdefault(i // path.shape[1], []).append(i % path.shape[1])
    return {j: sorted(r) for j, r in sorted(chosen.items())}


def expand(ctx: DraftContext, policy: TreePolicy, logits: torch.Tensor, forward: Forward, *, vocab: int,
           draft_ids: torch.Tensor | None = None, t2d: torch.Tensor | None = None,
           forward_all: bool = False) -> tuple[DraftTree, list[int]]:
    """Grow a tree from the root's draft ``logits`` ``[1, V_d]`` (see the module docstring).

    Args:
        vocab: the target's vocabulary size.
        draft_ids: ``[V_d]`` target id of each draft id (``None``: the draft vocabulary is the
            target's); ``t2d``: ``[vocab]`` its inverse (-1 outside), given with ``draft_ids``.
        forward_all: every node is forwarded (a drafter whose tree KV must cover every node).

    Returns:
        the tree and the nodes of its last level (not forwarded).
    """
    return expand_many([ctx], policy, [logits], lambda calls: [forward(*c[1:]) for c in calls], vocab=vocab,
                       draft_ids=draft_ids, t2d=t2d, forward_all=forward_all)[0]


#: ``forward_many(calls) -> [logits per call]``: each call ``(row, builder, nodes, parent_rows,
#: depth)`` is one row's :data:`Forward` request; all of them run in one model call.
ForwardMany = Callable[[list[tuple[int, TreeBuilder, list[int], list[int], int]]], list[torch.Tensor]]


def expand_many(ctxs: list[DraftContext], policy: TreePolicy, logits: list[torch.Tensor], forward_many: ForwardMany,
                **options) -> list[tuple[DraftTree, list[int]]]:
    """:func:`expand` for several rows in lockstep: level by level, every row still growing asks
    for its frontier's logits and one ``forward_many`` call answers all of them. Each row's tree
    is the one :func:`expand` would grow alone from the same logits (its own context, generator
    and draws; the rows' calls only share the model call). ``options``: as :func:`expand`."""
    growing = {i: _grow(ctx, policy, lg, **options) for i, (ctx, lg) in enumerate(zip(ctxs, logits))}
    out: list = [None] * len(ctxs)
    calls: dict[int, tuple] = {}

    def advance(i, sent):
        try:
            calls[i] = growing[i].send(sent)
        except StopIteration as done:
            out[i] = done.value
            calls.pop(i, None)

    for i in list(growing):
        advance(i, None)
    while calls:
        pending = sorted(calls.items())
        answers = forward_many([(i, *call) for i, call in pending])
        for (i, _), answer in zip(pending, answers):
            advance(i, answer)
    return out


def _grow(ctx: DraftContext, policy: TreePolicy, logits: torch.Tensor, *, vocab: int,
          draft_ids: torch.Tensor | None = None, t2d: torch.Tensor | None = None, forward_all: bool = False):
    """The expansion as a generator: yields ``(builder, nodes, parent_rows, depth)`` forward
    requests, is sent the new frontier's logits, returns ``(tree, last level)``."""
    cap = min(policy.max_depth, ctx.max_depth)
    sampled = policy.sampled and not ctx.sampling.greedy and not ctx.point_mass
    budget = ctx.max_nodes if ctx.max_nodes is not None and sampled else 10 ** 9
    builder = TreeBuilder(ctx.root_token)
    level, scores = [0], [1.0]  # the frontier and each node's path score
    for depth in range(1, cap + 1):
        room = budget - (len(builder) - 1)
        if room <= 0:
            break
        probs = logits.float().softmax(-1)  # [f, V_d]
        top = probs.topk(min(policy.branch, probs.shape[-1]), dim=-1)
        level_scores = torch.tensor([scores[n] for n in level])
        slots = min(room, policy.width if sampled or forward_all else len(level) * policy.branch)
        new, rows = [], []
        for j, ranks in pick_slots(level_scores, top.values.cpu(), slots).items():
            parent = level[j]
            if sampled:
                full = logits[j].float().cpu()
                if draft_ids is not None:
                    full = torch.full((vocab,), -float("inf")).index_put_((draft_ids,), full)
                q = target_probs(full, ctx.sampling)
                builder.set_draft_probs(parent, q)
                for t in draw_without_replacement(q, min(len(ranks), int((q > 0).sum())), ctx.generator):
                    d = int(t2d[t]) if t2d is not None else t
                    new.append(builder.add(parent, t, Law.WOR))
                    scores.append(scores[parent] * float(probs[j, d]))
                    rows.append(j)
            else:
                for r in ranks:
                    d = int(top.indices[j, r])
                    new.append(builder.add(parent, int(draft_ids[d]) if draft_ids is not None else d))
                    scores.append(scores[parent] * float(top.values[j, r]))
                    rows.append(j)
        if not new or depth == cap:
            return builder.build(), new
        pick = new if sampled or forward_all else sorted(sorted(range(len(new)), key=lambda i: -scores[new[i]])[: policy.width])
        if not (sampled or forward_all):
            new, rows = [new[i] for i in pick], [rows[i] for i in pick]
        logits = yield builder, new, rows, depth
        level = new
    return builder.build(), []
