"""Draft trees: the candidates a drafter proposes for one verification step.

Notation (see ``docs/exactness.md``): node 0 is the *root*, the last committed token, whose
KV is not cached yet; every other node is a draft token. Nodes are stored flat in topological
order, so ``parents[i] < i`` for ``i >= 1`` and ``parents[0] == -1``. ``depths[i]`` is the number of
edges from the root; the target sees node ``i`` at position ``prefix_len + depths[i]``.

Each draft node records the *law* its token was drawn from, conditional on its earlier siblings,
because exact rejection sampling needs it:

* ``Law.POINT``: chosen deterministically (top-k of a head, argmax chain, n-gram lookup);
* ``Law.IID``: sampled from its parent's draft distribution ``q`` with replacement;
* ``Law.WOR``: sampled from ``q`` *without* replacement, i.e. from ``q`` with the tokens of all
  earlier siblings removed and renormalised.

The parent's ``q`` (``[V]``) lives in ``draft_probs[draft_row[parent]]``; it must be exactly the
distribution the token was drawn from (same dtype, same filtering).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Sequence

import torch


class Law(IntEnum):
    """How a draft token was chosen, given its parent and earlier siblings."""

    POINT = 0
    IID = 1
    WOR = 2


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A validated draft tree. Build one with :class:`TreeBuilder` or :class:`TreeTemplate`.

    Attributes:
        tokens: ``[n]`` token ids, ``tokens[0]`` is the root.
        parents: ``[n]`` parent indices, ``-1`` for the root, ``parents[i] < i``.
        laws: ``[n]`` :class:`Law` of each node (the root's is ``POINT``).
        draft_probs: ``[m, V]`` draft distributions of parents with sampled children, or ``None``.
        draft_row: ``[n]`` row of ``draft_probs`` holding node i's ``q``, ``-1`` when it has none.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    laws: torch.Tensor
    draft_probs: torch.Tensor | None = None
    draft_row: torch.Tensor | None = None
    depths: torch.Tensor = field(init=False)
    children: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        parents = self.parents.tolist()
        n = len(parents)
        if n == 0 or parents[0] != -1:
            raise ValueError("a draft tree needs a root at index 0 with parent -1")
        if self.tokens.shape != (n,) or self.laws.shape != (n,):
            raise ValueError("tokens, parents and laws must all have shape [n]")
        children: list[list[int]] = [[] for _ in range(n)]
        depths = [0] * n
        for i in range(1, n):
            p = parents[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must precede their children")
            children[p].append(i)
            depths[i] = depths[p] + 1
        row = self.draft_row.tolist() if self.draft_row is not None else [-1] * n
        for i, law in enumerate(self.laws.tolist()):
            if i > 0 and law != Law.POINT and (self.draft_probs is None or row[parents[i]] < 0):
                raise ValueError(f"node {i} was sampled but its parent has no draft distribution")
        object.__setattr__(self, "depths", torch.tensor(depths, dtype=torch.long))
        object.__setattr__(self, "children", tuple(tuple(c) for c in children))

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    @classmethod
    def root_only(cls, root_token: int) -> "DraftTree":
        """The one-node tree: plain decoding of one token."""
        return TreeBuilder(root_token).build()

    def ancestors(self) -> torch.Tensor:
        """``[n, n]`` bool, ``[i, j]`` true iff j is i or an ancestor of i (the tree attention).

        Computed once per tree (the mask and the greedy verifier both read it); do not modify.
        """
        anc = self.__dict__.get("_ancestors")
        if anc is None:
            anc = torch.eye(self.num_nodes, dtype=torch.bool)
            for i, p in enumerate(self.parents.tolist()[1:], start=1):
                anc[i] |= anc[p]
            self.__dict__["_ancestors"] = anc  # a cache, not state: the tree itself is immutable
        return anc

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node``, both included."""
        path, parents = [], self.parents.tolist()
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def prune_depth(self, max_depth: int) -> "DraftTree":
        """The subtree of nodes at depth <= ``max_depth`` (returns self when nothing is cut)."""
        if self.depth <= max_depth:
            return self
        keep = (self.depths <= max_depth).nonzero().flatten()
        remap = torch.full((self.num_nodes,), -1, dtype=torch.long)
        remap[keep] = torch.arange(len(keep))
        parents = self.parents[keep].clone()
        parents[1:] = remap[parents[1:]]
        return DraftTree(
            self.tokens[keep], parents, self.laws[keep], self.draft_probs,
            None if self.draft_row is None else self.draft_row[keep],
        )


class TreeBuilder:
    """Builds a :class:`DraftTree` node by node (for trees made on the fly)."""

    def __init__(self, root_token: int):
        self._tokens, self._parents, self._laws = [int(root_token)], [-1], [int(Law.POINT)]
        self._rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def add(self, parent: int, token: int, law: Law = Law.POINT) -> int:
        """Append a child of ``parent``; returns the new node's index."""
        if not 0 <= parent < len(self._tokens):
            raise ValueError(f"unknown parent {parent}")
        self._tokens.append(int(token))
        self._parents.append(int(parent))
        self._laws.append(int(law))
        return len(self._tokens) - 1

    def token(self, node: int) -> int:
        """Token id of an added node."""
        return self._tokens[node]

    def parent(self, node: int) -> int:
        """Parent index of an added node (-1 for the root)."""
        return self._parents[node]

    def set_draft_probs(self, node: int, q: torch.Tensor) -> None:
        """Record ``q`` ``[V]``, the distribution ``node``'s sampled children were drawn from."""
        self._rows[node] = q

    def build(self) -> DraftTree:
        n = len(self._tokens)
        probs, row = None, None
        if self._rows:
            nodes = sorted(self._rows)
            probs = torch.stack([self._rows[i] for i in nodes])
            row = torch.full((n,), -1, dtype=torch.long)
            row[nodes] = torch.arange(len(nodes))
        return DraftTree(
            torch.tensor(self._tokens, dtype=torch.long),
            torch.tensor(self._parents, dtype=torch.long),
            torch.tensor(self._laws, dtype=torch.long),
            probs,
            row,
        )


class TreeTemplate:
    """A static tree shape, Medusa-style: a set of top-k index paths.

    The path ``(i1, i2, ..., id)`` is the node at depth d whose token is the ``i_d``-th candidate of
    depth d, under the node ``(i1, ..., i_{d-1})``. Every prefix of a path must be in the set.
    """

    def __init__(self, paths: Sequence[Sequence[int]]):
        uniq = sorted({tuple(int(i) for i in p) for p in paths if len(p) > 0}, key=lambda p: (len(p), p))
        known = {()}
        for p in uniq:
            if min(p) < 0:
                raise ValueError(f"tree path {p} has a negative rank")
            if p[:-1] not in known:
                raise ValueError(f"tree path {p} lacks its parent {p[:-1]}")
            known.add(p)
        self.paths: tuple[tuple[int, ...], ...] = tuple(uniq)
        index = {(): 0} | {p: i + 1 for i, p in enumerate(uniq)}
        self.parent_index = [-1] + [index[p[:-1]] for p in uniq]
        self._depth_idx = torch.tensor([len(p) - 1 for p in uniq], dtype=torch.long)
        self._rank_idx = torch.tensor([p[-1] for p in uniq], dtype=torch.long)

    @classmethod
    def chain(cls, depth: int) -> "TreeTemplate":
        return cls([(0,) * d for d in range(1, depth + 1)])

    @classmethod
    def full(cls, width: int, depth: int) -> "TreeTemplate":
        paths: list[tuple[int, ...]] = [()]
        out = []
        for _ in range(depth):
            paths = [p + (i,) for p in paths for i in range(width)]
            out += paths
        return cls(out)

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def max_rank(self) -> int:
        """How many candidates per depth the template reads (max rank + 1)."""
        return 1 + max((max(p) for p in self.paths), default=-1)

    def fill(self, root_token: int, candidates: torch.Tensor) -> DraftTree:
        """Instantiate the template with point-mass children.

        Args:
            root_token: the last committed token.
            candidates: ``[D, k]`` token ids, row d holding the ranked candidates for depth d + 1,
                with ``D >= depth`` and ``k >= max_rank``.
        """
        if candidates.shape[0] < self.depth or candidates.shape[1] < self.max_rank:
            raise ValueError(
                f"template needs candidates of shape >= [{self.depth}, {self.max_rank}], "
                f"got {tuple(candidates.shape)}"
            )
        drafted = candidates.to("cpu", torch.long)[self._depth_idx, self._rank_idx]
        tokens = torch.cat([torch.tensor([int(root_token)]), drafted])
        return DraftTree(
            tokens,
            torch.tensor(self.parent_index, dtype=torch.long),
            torch.zeros(self.num_nodes, dtype=torch.long),
        )

    def to_list(self) -> list[list[int]]:
        return [list(p) for p in self.paths]
