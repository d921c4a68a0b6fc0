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

#: Upper edges of the temperature buckets above greedy: (0, 0.5], (0.5, 1], then above 1.
BUCKET_EDGES = (0.5, 1.0)
#: A rank's share of what the rank before it leaves, where nothing was measured (a guess that only
#: seeds a prior: the counts take over after a few tests).
RANK_DECAY = 0.5
#: Measured rates are clamped to this range before they seed a prior (a prior at 0 or 1 would
#: need unbounded evidence to move).
RATE_RANGE = (0.01, 0.98)


def temperature_bucket(temperature: float) -> int:
    """0 greedy, 1 for T in (0, 0.5], 2 for (0.5, 1], 3 above."""
    return 0 if temperature <= 0 else 1 if temperature <= BUCKET_EDGES[0] else 2 if temperature <= BUCKET_EDGES[1] else 3


class AcceptanceModel:
    """Beta posteriors of acceptance per cell (see the module docstring)."""

    def __init__(self, priors: list[dict | None], *, prior_weight: float, decay: float):
        if prior_weight <= 0 or not 0 < decay <= 1:
            raise ValueError(f"need prior_weight > 0 and 0 < decay <= 1, got {prior_weight}, {decay}")
        self.priors, self.prior_weight, self.decay = priors, prior_weight, decay
        self.counts: dict[Cell, list[float]] = {}  # cell -> decayed [hits, tests]
        self.pooled: dict[tuple[int, int, int, int], list[float]] = {}  # (member, depth, rank, bucket)
        self._means: dict[Cell, float] = {}  # posterior means, valid until the next record

    def measured(self, member: int, depth: int, rank: int, bucket: int) -> float | None:
        """The member's measured acceptance at (depth, rank) (ranks beyond the measured ones: half
        of what the last measured rank leaves, per further rank); ``None`` beyond its table."""
        table = (self.priors[member] or {}).get("greedy" if bucket == 0 else "sampled")
        if table and depth - 1 < len(table) and table[depth - 1]:
            row = table[depth - 1]
            rate = row[rank] if rank < len(row) else (1 - row[-1]) * RANK_DECAY ** (rank - len(row) + 1)
            return float(min(RATE_RANGE[1], max(RATE_RANGE[0], rate)))
        return None

    def posterior(self, cell: Cell) -> tuple[float, float]:
        """Beta ``(alpha, beta)`` of ``cell``: its counts on a prior of strength ``prior_weight``
        whose mean is the member's pooled estimate at this depth and rank over all keys, starting
        from its measurement there; beyond the measured depths, the same key's estimate one
        level up (acceptance given the parent varies slowly with depth: a copied text's chain
        stays likely); at depth 1 without a measurement, 1/2 halved per rank."""
        m, key, d, r, b = cell
        w = self.prior_weight
        base = self.measured(m, d, r, b)
        if base is None:
            base = self.mean((m, key, d - 1, r, b)) if d > 1 else RANK_DECAY ** (r + 1)
        hits, tests = self.pooled.get((m, d, r, b), (0.0, 0.0))
        prior = (base * w + hits) / (w + tests)
        hits, tests = self.counts.get(cell, (0.0, 0.0))
        return prior * w + hits, (1 - prior) * w + tests - hits

    def mean(self, cell: Cell) -> float:
        got = self._means.get(cell)
        if got is None:
            a, b = self.posterior(cell)
            got = self._means[cell] = a / (a + b)
        return got

    def draw(self, cell: Cell, rng: random.Random) -> float:
        """A Thompson sample of the cell's acceptance."""
        a, b = self.posterior(cell)
        return rng.betavariate(max(a, 1e-6), max(b, 1e-6))

    def record(self, member: int, outcomes: list[tuple[Cell, bool]]) -> None:
        """One step of ``member``: decay its counts, then add each tested cell's outcome."""
        self._means = {}
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
        """The member's pooled posterior means ``[depth][rank]`` over all keys (what a checkpoint
        stores as its measured ``acceptance``)."""
        w = self.prior_weight
        out: list[list[float]] = []
        for d in range(1, depth + 1):
            row = []
            for r in range(ranks):
                base = self.measured(member, d, r, bucket)
                if base is None:
                    base = out[-1][r] if out else RANK_DECAY ** (r + 1)
                hits, tests = self.pooled.get((member, d, r, bucket), (0.0, 0.0))
                row.append(round((base * w + hits) / (w + tests), 4))
            out.append(row)
        return out
