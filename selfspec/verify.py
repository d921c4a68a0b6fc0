"""Exact verification of a draft tree against the target's logits.

Terms (``shared/docs/EXACTNESS.md``): ``p_u`` is the target law at node u after all logits
processing (:func:`selfspec.sampling.target_probs`); an *accepted* token is a draft token that
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

from dataclasses import dataclass

import torch

from .sampling import SamplingConfig, sample, target_probs
from .tree import DraftTree, Law

# A residual whose mass falls below this is rounding noise: fall back to the pre-update residual.
_RESIDUAL_FLOOR = 1e-12


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


def _child_law(tree: DraftTree, child: int, earlier: list[int], like: torch.Tensor) -> torch.Tensor:
    """``[V]`` law of ``child``'s token given its earlier siblings (see :class:`Law`)."""
    law = int(tree.laws[child])
    if law == Law.POINT:
        return torch.nn.functional.one_hot(tree.tokens[child], like.shape[-1]).to(like)
    parent = int(tree.parents[child])
    q = tree.draft_probs[int(tree.draft_row[parent])].to(like)
    if law == Law.WOR and earlier:
        q = q.clone()
        q[tree.tokens[earlier]] = 0
        q = q / q.sum()
    return q


def _verify_sampled(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator) -> Verdict:
    """Recursive rejection sampling down the tree; one fresh coin per test, one per final draw."""
    node, path = 0, [0]
    while True:
        kids = tree.children[node]
        if not kids:
            return Verdict(path, sample(probs[node], generator), True)
        residual = probs[node]
        accepted = None
        for i, child in enumerate(kids):
            law = _child_law(tree, child, list(kids[:i]), residual)
            x = int(tree.tokens[child])
            coin = float(torch.rand((), generator=generator, device=generator.device))
            if coin * float(law[x]) < float(residual[x]):
                accepted = child
                break
            updated = (residual - law).clamp_min(0)
            mass = updated.sum()
            if float(mass) > _RESIDUAL_FLOOR:  # else rounding ate it: keep the pre-update residual
                residual = updated / mass
        if accepted is None:
            return Verdict(path, sample(residual, generator), False)
        node = accepted
        path.append(node)
