"""A depth-bounded suffix trie with occurrence counts: the index behind suffix drafting.

Every inserted sequence contributes all its suffixes, each cut to ``max_depth`` tokens, so the node
of a token string ``s`` (``len(s) <= max_depth``) counts the positions where ``s`` occurs in the
inserted text, and ``count(s + [t]) / sum_u count(s + [u])`` is the empirical frequency of ``t``
right after ``s``. A growing sequence (a prompt and the output being generated) is extended one
token at a time in ``O(max_depth)`` through a :class:`TrieCursor`; whole sequences (earlier outputs)
are inserted and removed again on eviction in ``O(len * max_depth)``; a removed sequence leaves the
trie exactly as if it had never been inserted (nodes whose count reaches zero are deleted), so
memory stays within ``max_depth`` nodes per token held.

This is SuffixDecoding's data structure (Oliaro et al., 2024; Snowflake's ArcticInference), written
here in Python because ``arctic-inference`` ships only as a source package whose build needs a
second PyTorch and a C++ toolchain: a count trie of
bounded depth instead of a compressed suffix tree, which keeps every operation a few dictionary
look-ups per token.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


class TrieNode:
    """One token string: its occurrence ``count`` and its one-token extensions."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, TrieNode] = {}


@dataclass
class TrieCursor:
    """Insertion state of one growing sequence: the nodes of its last ``max_depth - 1`` suffixes
    (``(node, depth)``, shortest first), which the next token extends."""

    active: list[tuple[TrieNode, int]] = field(default_factory=list)
    length: int = 0


@dataclass
class Draft:
    """A speculation tree read off the trie: nodes in best-first order.

    Attributes:
        parents: per node, the index of its parent node (-1: a child of the root).
        tokens: per node, its token.
        probs: per node, the product of the empirical frequencies along its path (the trie's
            estimate that verification accepts it).
        match_length: length of the context suffix the draft continues.
    """

    parents: list[int]
    tokens: list[int]
    probs: list[float]
    match_length: int

    @property
    def score(self) -> float:
        """Expected accepted tokens under the trie's frequencies (the sum of path probabilities)."""
        return sum(self.probs)


class SuffixTrie:
    """Counts every substring of at most ``max_depth`` tokens of the inserted sequences."""

    def __init__(self, max_depth: int = 24):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = TrieNode()
        self.num_nodes = 0

    # ------------------------------------------------------------------ building
    def extend(self, cursor: TrieCursor, tokens) -> None:
        """Append ``tokens`` to the sequence that ``cursor`` tracks (every new suffix counted)."""
        for t in tokens:
            t = int(t)
            nxt: list[tuple[TrieNode, int]] = []
            for node, depth in [(self.root, 0), *cursor.active]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = TrieNode()
                    self.num_nodes += 1
                child.count += 1
                if depth + 1 < self.max_depth:
                    nxt.append((child, depth + 1))
            cursor.active = nxt
            cursor.length += 1

    def insert(self, tokens) -> None:
        """Insert a whole sequence."""
        self.extend(TrieCursor(), tokens)

    def remove(self, tokens) -> None:
        """Undo :meth:`insert` of the same ``tokens`` (nodes whose count reaches 0 are deleted)."""
        tokens = [int(t) for t in tokens]
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start : start + self.max_depth]:
                child = node.children.get(t)
                if child is None:
                    raise KeyError(f"remove: the sequence was not inserted (token {t} at {start})")
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    self.num_nodes -= _size(child)
                    break  # its whole subtree counted occurrences of this suffix only
                node = child

    # ------------------------------------------------------------------ reading
    def match(self, context: list[int], min_length: int = 1, max_length: int | None = None
              ) -> tuple[TrieNode | None, int]:
        """The node of the longest suffix of ``context`` (``min_length .. max_length`` tokens,
        at most ``max_depth - 1``) that occurs in the trie with a continuation; ``(None, 0)`` when
        none does. A match of ``n`` tokens leaves ``max_depth - n`` levels to draft from."""
        longest = min(len(context), self.max_depth - 1, max_length or self.max_depth)
        for n in range(longest, min_length - 1, -1):
            node = self.root
            for t in context[len(context) - n :]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, n
        return None, 0

    def draft(self, node: TrieNode, match_length: int, max_nodes: int, max_depth: int,
              min_prob: float) -> Draft:
        """Best-first expansion below ``node``: repeatedly add the candidate with the highest path
        probability (product of each step's frequency among its siblings) while it is at least
        ``min_prob``, within ``max_nodes`` nodes and ``max_depth`` levels."""
        out = Draft([], [], [], match_length)
        heap: list[tuple[float, int, int, int, TrieNode, int]] = []
        tie = 0

        def push(parent_node: TrieNode, parent_index: int, prob: float, depth: int) -> None:
            nonlocal tie
            total = sum(c.count for c in parent_node.children.values())
            for tok, child in parent_node.children.items():
                p = prob * child.count / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, tie, parent_index, tok, child, depth))
                    tie += 1

        if max_depth >= 1:
            push(node, -1, 1.0, 1)
        while heap and len(out.tokens) < max_nodes:
            neg, _, parent, tok, child, depth = heapq.heappop(heap)
            out.parents.append(parent)
            out.tokens.append(tok)
            out.probs.append(-neg)
            if depth < max_depth and child.children:
                push(child, len(out.tokens) - 1, -neg, depth + 1)
        return out


def _size(node: TrieNode) -> int:
    stack, n = [node], 0
    while stack:
        cur = stack.pop()
        n += 1
        stack.extend(cur.children.values())
    return n
