"""Acceptance model: how likely verification accepts a draft node, per source and context.

A *cell* is ``(member, context key, depth, rank, temperature bucket)``: the member that proposed
the node, its :meth:`~selfspec.drafters.base.Drafter.context_key` when it proposed, the node's depth
and its rank among that member's siblings. A node is *tested* when its parent lies on the accepted
path, and *hit* when the token emitted after its parent is its own token: for a point-mass child
that is exactly the event "the verifier accepts it" whatever its siblings (the emitted token is
distributed as the target's law at the parent), so a merged step measures every member's nodes as
if it had drafted alone.

Each cell holds a Beta posterior, hierarchical: a cell's prior is its member's pooled cell over
all keys (strength ``prior_weight``), whose prior in turn is the member's measured acceptance
(:meth:`~selfspec.drafters.base.Drafter.prior`, e.g. a checkpoint's) or a default that falls with
depth and rank. Counts decay (``decay`` per step of the member) so the model follows the text.
Nothing here touches the law of the output: it only ranks and sizes what is verified.
"""

from __future__ import annotations

import random

Cell = tuple[int, int, int, int, int]  # (member, key, depth, rank, temperature bucket)


def temperature_bucket(temperature: float) -> int:
    """0 greedy, 1 for T in (0, 0.5], 2 for (0.5, 1], 3 above."""
    return 0 if temperature <= 0 else 1 if temperature <= 0.5 else 2 if temperature <= 1.0 else 3


class AcceptanceModel:
    """Beta posteriors of acceptance per cell (see the module docstring)."""

    def __init__(self, priors: list[dict | None], *, prior_weight: float = 4.0, decay: float = 0.99):
        if prior_weight <= 0 or not 0 < decay <= 1:
            raise ValueError(f"need prior_weight > 0 and 0 < decay <= 1, got {prior_weight}, {decay}")
        self.priors, self.prior_weight, self.decay = priors, prior_weight, decay
        self.counts: dict[Cell, list[float]] = {}  # cell -> decayed [hits, tests]
        self.pooled: dict[tuple[int, int, int, int], list[float]] = {}  # (member, depth, rank, bucket)

    def base_rate(self, member: int, depth: int, rank: int, bucket: int) -> float:
        """The member's measured acceptance at (depth, rank); ranks beyond the measured ones get
        half of what the last measured rank leaves per further rank; without a measurement a
        default (1/2 at depth 1 rank 0, 0.85 times less per level, half per rank)."""
        table = (self.priors[member] or {}).get("greedy" if bucket == 0 else "sampled")
        if table and depth - 1 < len(table) and table[depth - 1]:
            row = table[depth - 1]
            rate = row[rank] if rank < len(row) else (1 - row[-1]) * 0.5 ** (rank - len(row) + 1)
            return float(min(0.98, max(0.01, rate)))
        return 0.5 * 0.85 ** (depth - 1) * 0.5 ** rank

    def posterior(self, cell: Cell) -> tuple[float, float]:
        """Beta ``(alpha, beta)`` of ``cell``."""
        m, _, d, r, b = cell
        w = self.prior_weight
        base = self.base_rate(m, d, r, b)
        hits, tests = self.pooled.get((m, d, r, b), (0.0, 0.0))
        pooled_mean = (base * w + hits) / (w + tests)
        hits, tests = self.counts.get(cell, (0.0, 0.0))
        return pooled_mean * w + hits, (1 - pooled_mean) * w + tests - hits

    def mean(self, cell: Cell) -> float:
        a, b = self.posterior(cell)
        return a / (a + b)

    def draw(self, cell: Cell, rng: random.Random) -> float:
        """A Thompson sample of the cell's acceptance."""
        a, b = self.posterior(cell)
        return rng.betavariate(max(a, 1e-6), max(b, 1e-6))

    def record(self, member: int, outcomes: list[tuple[Cell, bool]]) -> None:
        """One step of ``member``: decay its counts, then add each tested cell's outcome."""
        for table in (self.counts, self.pooled):
            for key, hc in table.items():
                if key[0] == member:
                    hc[0] *= self.decay
                    hc[1] *= self.decay
        for cell, hit in outcomes:
            m, _, d, r, b = cell
            for table, key in ((self.counts, cell), (self.pooled, (m, d, r, b))):
                hc = table.setdefault(key, [0.0, 0.0])
                hc[0] += float(hit)
                hc[1] += 1.0

    def table(self, member: int, bucket: int, depth: int = 8, ranks: int = 4) -> list[list[float]]:
        """The member's pooled posterior means ``[depth][rank]`` (what a checkpoint stores as its
        measured ``acceptance``)."""
        return [[round(self._pooled_mean(member, d, r, bucket), 4) for r in range(ranks)] for d in range(1, depth + 1)]

    def _pooled_mean(self, m: int, d: int, r: int, b: int) -> float:
        w = self.prior_weight
        hits, tests = self.pooled.get((m, d, r, b), (0.0, 0.0))
        return (self.base_rate(m, d, r, b) * w + hits) / (w + tests)
