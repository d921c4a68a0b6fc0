"""Adaptive speculation: speculate only while it pays, on this machine, for this text.

Per step the engine asks the policy whether to speculate and how deep a draft may go, then reports
what the step cost (a drafter that proposed nothing, e.g. prompt lookup without a match, makes a
plain step) (wall seconds for draft + verify), what it emitted and how deep drafts were
accepted. The policy keeps exponential moving averages (EMA) of

* ``plain_s``: seconds of a plain (root-only) step; the drafter's first step ever is plain;
* ``spec_s`` / ``spec_tokens``: seconds and emitted tokens of a speculative step;
* acceptance per depth (conditional on the walk reaching that depth).

Speculation pays while ``gain = spec_tokens / spec_s * plain_s >= 1 + margin``. After at least
``probe`` speculative steps with a worse gain the policy falls back to plain steps for ``backoff``
steps (doubling, up to ``max_backoff``, while speculation keeps losing), then probes again with
fresh averages: it grows back when acceptance recovers. The draft depth is capped below the first
depth whose acceptance EMA (started optimistic, at 1) falls under ``min_depth_acceptance`` after at
least ``min_depth_samples`` tests; every ``refresh`` speculative steps one step drafts at full
depth (and one step runs plain) so both estimates stay current. The engine keeps one policy per
drafter across ``generate`` calls (:meth:`AdaptivePolicy.begin` starts each call with a plain
step but keeps what was learnt), so a drafter that does not pay stays backed off on the next
prompt instead of paying the probes again.

Exactness: every step, plain or speculative, is exact given the tokens so far, and decisions only
depend on the past, so any mixture keeps the target's distribution (greedy: identical output).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptiveConfig:
    """Knobs of :class:`AdaptivePolicy` (the defaults suit CPU and GPU alike).

    Attributes:
        margin: speculation must beat plain steps by this fraction to continue.
        probe: speculative steps measured before judging (after the start and after a backoff).
        backoff: plain steps after the first losing judgement (doubles per consecutive loss).
        max_backoff: cap of the doubling.
        ema: weight of a new observation in the moving averages.
        min_depth_acceptance: cap the draft depth before depths accepted less often than this.
        min_depth_samples: tests of a depth needed before it can be capped.
        refresh: every this many speculative steps, one full-depth draft and one plain step.
    """

    margin: float = 0.02
    probe: int = 4
    backoff: int = 8
    max_backoff: int = 256
    ema: float = 0.25
    min_depth_acceptance: float = 0.1
    min_depth_samples: int = 4
    refresh: int = 32

    def __post_init__(self) -> None:
        if not 0 < self.ema <= 1 or self.probe < 1 or self.backoff < 1 or self.max_backoff < self.backoff:
            raise ValueError(f"invalid adaptive config {self}")


class AdaptivePolicy:
    """Decides plain vs speculative steps and the draft depth cap for one generation."""

    def __init__(self, cfg: AdaptiveConfig | None = None):
        self.cfg = cfg or AdaptiveConfig()
        self.plain_s: float | None = None
        self.spec_s: float | None = None
        self.spec_tokens: float | None = None
        self.depth_acc: list[float] = []
        self.depth_seen: list[int] = []
        self.plain_left = 1  # the first step is plain: it measures the plain step cost
        self.spec_seen = 0  # speculative steps since the last (re)start of speculation
        self.spec_total = 0
        self.backoff = self.cfg.backoff
        self.fallbacks = 0

    def begin(self) -> None:
        """Start a new generation: backoff, cost, acceptance and gain estimates carry over (a plain
        step first only while the plain cost is still unknown)."""
        if self.plain_s is None:
            self.plain_left = max(1, self.plain_left)

    def speculate(self) -> bool:
        return self.plain_left == 0

    def max_depth(self, budget: int) -> int:
        """Depth cap for this step's draft (``budget``: what the engine allows)."""
        if self.spec_total % self.cfg.refresh == self.cfg.refresh - 1:
            return budget  # a full-depth draft now and then, so capped depths can grow back
        for d, (a, seen) in enumerate(zip(self.depth_acc, self.depth_seen)):
            if seen >= self.cfg.min_depth_samples and a < self.cfg.min_depth_acceptance:
                return max(1, min(budget, d))
        return budget

    def gain(self) -> float | None:
        """Expected tokens/s of speculation over plain steps (``None`` until both are measured)."""
        if self.plain_s is None or self.spec_s is None or self.spec_s <= 0:
            return None
        return self.spec_tokens / self.spec_s * self.plain_s

    def record(self, speculated: bool, seconds: float, emitted: int, num_accepted: int = 0,
               tested_next: bool = False) -> None:
        """Report one step: its wall ``seconds``, ``emitted`` tokens, and for speculative steps
        the accepted drafts and whether a child one level deeper was tested (and rejected)."""
        w = self.cfg.ema
        if not speculated:
            self.plain_s = seconds if self.plain_s is None else (1 - w) * self.plain_s + w * seconds
            if self.plain_left > 0:
                self.plain_left -= 1
                if self.plain_left == 0:
                    self.spec_seen, self.spec_s, self.spec_tokens = 0, None, None  # (re)start measuring
            return
        self.spec_s = seconds if self.spec_s is None else (1 - w) * self.spec_s + w * seconds
        self.spec_tokens = emitted if self.spec_tokens is None else (1 - w) * self.spec_tokens + w * emitted
        self.spec_seen += 1
        self.spec_total += 1
        for d in range(num_accepted + int(tested_next)):
            a = d < num_accepted
            if d == len(self.depth_acc):
                self.depth_acc.append(1.0)  # optimistic prior: one early rejection caps nothing
                self.depth_seen.append(0)
            self.depth_acc[d] = (1 - w) * self.depth_acc[d] + w * float(a)
            self.depth_seen[d] += 1
        gain = self.gain()
        if self.spec_seen >= self.cfg.probe and gain is not None and gain < 1 + self.cfg.margin:
            self.plain_left = self.backoff
            self.backoff = min(self.cfg.max_backoff, self.backoff * 2)
            self.fallbacks += 1
        elif self.spec_seen >= self.cfg.probe and gain is not None:
            self.backoff = self.cfg.backoff
            if self.spec_total % self.cfg.refresh == 0:
                self.plain_left = 1  # keep the plain cost current as the context grows
