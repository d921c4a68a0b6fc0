"""The batch gate: whether a batch's rows may draft this step, from measured tokens per second.

Every batched pass costs the batch's largest tree for every row, and each row's controller sees
only its own share, so the batch keeps a final word: it compares the measured tokens per second
of speculative steps (each row's controller decides its tree) and plain steps (one token per
row, nothing drafted) at each batch size, and runs plain steps while speculation measures
slower, probing it again after 1, 2, 4, ... plain steps (where it does not pay, a logarithmic
share of the steps finds out); as soon as it measures faster, every step may draft again.

* A speculative step right after a plain one (or the first of a generation) is a *warm-up*: its
  drafters catch up on every position the plain steps skipped, which a run of speculative steps
  does not pay, so it is not recorded; a probe is that step and the next one, which is.
* Rates are moving averages per batch size (weight ``ema`` on the newest step). The gate lives on
  the :class:`~selfspec.control.Controller` (shared by its forks), so what one batch measured
  holds for the next call; a batch size never measured starts from the nearest smaller measured
  one's verdict (speculation's share of a pass only shrinks as rows are added).

Exactness: a plain step is an exact step; the gate reads only clocks and token counts.
"""

from __future__ import annotations


#: Weight of the newest step in the gate's tokens-per-second averages.
GATE_EMA = 0.3


class BatchGate:
    """Measured tokens per second of speculative and plain steps per batch size (module docstring)."""

    def __init__(self, ema: float = GATE_EMA):
        self.ema = ema
        self.rate: dict[tuple[int, bool], float] = {}  # (rows, drafted) -> tokens per second
        self.wait: dict[int, int] = {}  # plain steps left before the next probe
        self.backoff: dict[int, int] = {}
        self.warm = False  # the previous step drafted (this one needs no warm-up)
        self.probing = False  # a warm-up ran: the next step drafts and is measured

    def verdict(self, rows: int) -> bool | None:
        """Whether speculation measured at least as fast as plain at ``rows`` (or, never measured
        there, at the nearest smaller size that was); ``None``: unknown."""
        for r in sorted({r for r, _ in self.rate if r <= rows}, reverse=True):
            spec, plain = self.rate.get((r, True)), self.rate.get((r, False))
            if spec is not None and plain is not None:
                return spec >= plain
        return None

    def draft(self, rows: int) -> bool:
        """Whether this step drafts."""
        if self.probing:
            return True
        spec, plain = self.rate.get((rows, True)), self.rate.get((rows, False))
        if spec is not None and plain is None:
            return False  # measure plain once
        verdict = self.verdict(rows) if spec is None or plain is None else spec >= plain
        if verdict is None or verdict:
            return True
        if rows not in self.wait:  # slower at a smaller size: start as it left off
            smaller = max(r for r in self.backoff if r < rows) if any(r < rows for r in self.backoff) else None
            self.backoff[rows] = self.backoff.get(smaller, 1) if smaller is not None else 1
            self.wait[rows] = self.backoff[rows]
        if self.wait[rows] <= 0:
            return True
        self.wait[rows] -= 1
        return False

    def record(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """One step's ``tokens`` (all rows) in ``seconds``."""
        warm_up = drafted and not self.warm
        self.warm, self.probing = drafted, warm_up
        if warm_up:
            return
        key, rate = (rows, drafted), tokens / max(seconds, 1e-9)
        old = self.rate.get(key)
        self.rate[key] = rate if old is None else old + self.ema * (rate - old)
        plain = self.rate.get((rows, False))
        if drafted and plain is not None:
            if self.rate[key] < plain:
                self.backoff[rows] = 2 * self.backoff.get(rows, 1) if self.wait.get(rows, 0) <= 0 else self.backoff[rows]
                self.wait[rows] = self.backoff[rows]
            else:
                self.backoff[rows], self.wait[rows] = 1, 0

    def reset_warmth(self) -> None:
        """A new generation (or pool) starts: its first speculative step is a warm-up."""
        self.warm = self.probing = False
