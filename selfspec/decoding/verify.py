"""Exact verification of a draft tree against the target's logits.

Terms (``docs/exactness.md``): ``p_u`` is the target law at node u after all logits
processing (:func:`selfspec.decoding.sampling.target_probs`); an *accepted* token is a draft token that
passed its test; a *recovered* token is drawn from the residual after every child of a node was
rejected; the *bonus* token is drawn from the full ``p_u`` of the node the walk ends on when that
node has no children. Every step emits the accepted tokens plus exactly one recovered or bonus
token, so plain decoding (a root-only tree) emits one token per step.

Rule at node u with residual ``r = p_u`` and children ``x_1..x_k`` in drafted order, ``L_i`` the law
``x_i`` was drawn from given its earlier siblings::

    accept x_i iff coin * L_i(x_i) < r(x_i)     (fresh coin ~ U(0,1), strict <)
    else r = normalise(max(0, r - L_i))

Invariant: the emitted tokens are distributed exactly as ancestral sampling from ``p`` along the
accepted path, whatever the drafts were. Greedy (T = 0) is the limit ``p_u = onehot(argmax)``:
accept iff the draft equals the argmax, the same first-maximum tie-break as plain greedy.

This module is pure: it reads the tree, the target logits, the sampling config and a generator,
and returns a :class:`Verdict`; it touches no model and no cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingConfig, draw, target_probs
from .tree import DraftTree, Law


def residual_floor(dtype: torch.dtype) -> float:
    """Mass below which an updated residual is rounding noise (then the pre-update residual is kept).

    ``r - L`` clamped at 0 has an absolute rounding error of about ``eps * (r_v + L_v)`` per entry,
    so at most ``~2 eps`` in total whatever the vocabulary size (both laws sum to 1). A genuine
    residual of a rejected child carries at least the rejection's probability; 16 eps lies well
    above the noise and far below any mass a rejection can leave: float32 1.9e-6, float64 3.6e-15.
    """
    return 16 * torch.finfo(dtype).eps


@dataclass(frozen=True)
class Verdict:
    """Result of verifying one tree.

    Attributes:
        path: accepted node indices, starting with the root (``len(path) - 1`` tokens accepted).
        next_token: the recovered or bonus token; it becomes the next root.
        bonus: True when the walk ended at a node with no children (``next_token`` ~ full p).
    """

    path: list[int]
    next_token: int
    bonus: bool

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def verify_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    cfg: SamplingConfig,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Accept a path of ``tree`` and emit the next token, exactly.

    Args:
        tree: the draft tree with ``n`` nodes.
        logits: ``[n, V]`` target logits, row i computed on the path root..i.
        cfg: sampling parameters (greedy when ``cfg.temperature == 0``).
        generator: source of all randomness (required unless greedy).
    """
    if logits.shape[0] != tree.num_nodes:
        raise ValueError(f"got logits for {logits.shape[0]} nodes, tree has {tree.num_nodes}")
    if cfg.greedy:
        return _verify_greedy(tree, logits)
    if generator is None:
        raise ValueError("sampling (temperature > 0) needs a torch.Generator")
    return _verify_sampled(tree, target_probs(logits, cfg), generator)


def _verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """Vectorised: a node is accepted iff it and all its ancestors equal their parent's argmax."""
    argmax = logits.argmax(-1).cpu()  # [n]
    n = tree.num_nodes
    if n == 1:
        return Verdict([0], int(argmax[0]), True)
    match = torch.ones(n, dtype=torch.bool)
    match[1:] = tree.tokens[1:] == argmax[tree.parents[1:]]
    on_path = ~(tree.ancestors() & ~match).any(-1)  # [n]
    # Deepest accepted node; point-mass duplicates of one token resolve to the first drafted.
    score = torch.where(on_path, tree.depths * n + (n - 1 - torch.arange(n)), -1)
    last = int(score.argmax())
    return Verdict(tree.path_to(last), int(argmax[last]), len(tree.children[last]) == 0)


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """``B`` draft trees of one shape (same parents, laws and draft rows), different tokens and
    draft laws: what :func:`verify_batch` checks in one vectorised walk. The engine verifies one
    tree (``B = 1``, :meth:`of`); the exactness tests verify 10^5 at once through the same code.

    Attributes:
        shape: a tree with the shared topology (its own tokens and draft laws are not read).
        tokens: ``[B, n]`` token ids per tree.
        draft_probs: ``[B, m, V]`` draft laws per tree (row ``shape.draft_row[u]`` for parent u),
            or ``None`` when every child is a point mass.
    """

    shape: DraftTree
    tokens: torch.Tensor
    draft_probs: torch.Tensor | None = None
    laws: torch.Tensor = field(init=False)  # shape.laws on the tokens' device
    draft_row: torch.Tensor | None = field(init=False)  # shape.draft_row on the tokens' device

    def __post_init__(self) -> None:
        dev = self.tokens.device
        object.__setattr__(self, "laws", self.shape.laws.to(dev))
        object.__setattr__(self, "draft_row", None if self.shape.draft_row is None else self.shape.draft_row.to(dev))

    @staticmethod
    def of(tree: DraftTree) -> "TreeBatch":
        return TreeBatch(tree, tree.tokens[None], None if tree.draft_probs is None else tree.draft_probs[None])


def _child_laws(batch: TreeBatch, rows: torch.Tensor, parent: torch.Tensor, child: torch.Tensor,
                earlier: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[b, V]`` law each ``child`` token was drawn from given its earlier siblings (see :class:`Law`).

    Args:
        batch: the trees, on ``like``'s device.
        rows: ``[b]`` which trees of the batch; ``parent`` / ``child``: ``[b]`` node indices.
        earlier: ``[b, V]`` bool, the tokens of the earlier siblings (excluded from a WOR draw).
        like: ``[b, V]`` tensor whose dtype and device the laws take.
    """
    laws = batch.laws[child]  # [b]
    is_point = laws == Law.POINT
    all_point = bool(is_point.all())
    if all_point or batch.draft_probs is None:
        return torch.nn.functional.one_hot(batch.tokens[rows, child], like.shape[-1]).to(like)
    row = batch.draft_row[parent]  # [b], -1 where the parent has only point children
    q = batch.draft_probs[rows, row.clamp_min(0)].to(like)  # [b, V]
    wor = laws == Law.WOR
    if bool(wor.all()):  # without replacement: q over the tokens not drawn before, renormalised
        q = q.masked_fill(earlier, 0)
        q = q.div_(q.sum(-1, keepdim=True).clamp_min(torch.finfo(like.dtype).tiny))
    elif bool(wor.any()):  # (a batch mixing laws in this column: the same, row by row)
        q = q.masked_fill(wor[:, None] & earlier, 0)
        q = torch.where(wor[:, None], q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(like.dtype).tiny), q)
    if bool(is_point.any()):
        point = torch.nn.functional.one_hot(batch.tokens[rows, child], like.shape[-1]).to(like)
        q = torch.where(is_point[:, None], point, q)
    return q


def _draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``[b]`` one token per row of ``probs`` ``[b, V]`` (:func:`selfspec.decoding.sampling.draw`)."""
    return draw(probs, generator)


def verify_batch(batch: TreeBatch, probs: torch.Tensor, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling of ``B`` trees of one shape at once (see the module's rule).

    Each tree walks from the root: at node u the children are tested in drafted order with one
    fresh coin each (all trees still testing draw their coins together); the first accepted
    child becomes u; when all are rejected, the recovered token is drawn from the residual; at a
    childless node the bonus token is drawn from the full ``p_u``. Trees are independent: the law
    of each tree's result is that of verifying it alone.

    Args:
        batch: the trees (``n`` nodes each).
        probs: ``[B, n, V]`` target laws after logits processing, row i on the path root..i.
        generator: every coin and draw.

    Returns:
        ``last [B]`` (deepest accepted node; the path is ``shape.path_to(last)``), ``next_token
        [B]`` and ``bonus [B]`` (bool).
    """
    shape, dev = batch.shape, probs.device
    B, n, V = probs.shape
    batch = TreeBatch(shape, batch.tokens.to(dev),
                      None if batch.draft_probs is None else batch.draft_probs.to(dev))
    kids = shape.children
    width = max(1, max(len(c) for c in kids))
    table = torch.tensor([list(c) + [-1] * (width - len(c)) for c in kids], dtype=torch.long, device=dev)
    floor = residual_floor(probs.dtype)
    at = torch.zeros(B, dtype=torch.long, device=dev)
    next_token = torch.zeros(B, dtype=torch.long, device=dev)
    bonus = torch.zeros(B, dtype=torch.bool, device=dev)
    walking = torch.arange(B, device=dev)
    while walking.numel():
        node = at[walking]
        first = table[node, 0]
        leaf = first < 0
        if bool(leaf.any()):  # no children: the bonus token, from the full p
            ends = walking[leaf]
            next_token[ends] = _draw(probs[ends, at[ends]], generator)
            bonus[ends] = True
            walking, node = walking[~leaf], node[~leaf]
            if not walking.numel():
                break
        b = walking.numel()
        ar = torch.arange(b, device=dev)
        residual = probs[walking, node]  # [b, V]
        earlier = torch.zeros(b, V, dtype=torch.bool, device=dev)
        accepted = torch.full((b,), -1, dtype=torch.long, device=dev)
        for i in range(width):
            child = table[node, i]
            testing = (child >= 0) & (accepted < 0)
            if not bool(testing.any()):
                break
            child = child.clamp_min(0)
            x = batch.tokens[walking, child]
            law = _child_laws(batch, walking, node, child, earlier, residual)
            coin = torch.rand(b, generator=generator, device=generator.device).to(residual)
            ok = testing & (coin * law[ar, x] < residual[ar, x])
            accepted = torch.where(ok, child, accepted)
            rejected = testing & ~ok
            if bool(rejected.any()):  # the residual after a rejection (nothing to do when all accepted)
                updated = (residual - law).clamp_min_(0)
                mass = updated.sum(-1, keepdim=True)
                keep = rejected[:, None] & (mass > floor)  # else rounding ate it: the pre-update residual
                if bool(keep.all()):  # (one tree, or all rejected: no rows to keep as they were)
                    residual = updated.div_(mass)
                else:
                    residual = torch.where(keep, updated.div_(mass.clamp_min(floor)), residual)
            earlier[ar, x] = earlier[ar, x] | testing
        moved = accepted >= 0
        at[walking[moved]] = accepted[moved]
        stop = ~moved
        if bool(stop.any()):  # every child rejected: the recovered token, from the residual
            ends = walking[stop]
            next_token[ends] = _draw(residual[stop], generator)
        walking = walking[moved]
    return at, next_token, bonus


def _verify_sampled(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator) -> Verdict:
    """One tree through :func:`verify_batch` (``B = 1``)."""
    last, token, bonus = verify_batch(TreeBatch.of(tree), probs[None], generator)
    return Verdict(tree.path_to(int(last[0])), int(token[0]), bool(bonus[0]))
