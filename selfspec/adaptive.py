"""Adaptive speculation: speculate only while it pays, on this machine, for this text.

Per step the engine asks the policy whether to speculate and how deep a draft may go, then reports
what the step cost (a drafter that proposed nothing, e.g. prompt lookup without a match, makes a
plain step) (wall seconds for draft + verify), what it emitted and how deep drafts were
accepted. The policy keeps

* ``plain_s``: an exponential moving average (EMA) of a plain (root-only) step's seconds; the
  drafter's first step ever is plain;
* ``block``: the (seconds, tokens) of the speculative steps since the last judgement (``spec_s`` /
  ``spec_tokens``, EMAs of the same, only report :meth:`AdaptivePolicy.gain`);
* acceptance per depth (conditional on the walk reaching that depth).

Speculation pays while ``gain = tokens / seconds * plain_s >= 1 + margin``, judged on pooled
blocks of speculative steps (tokens and seconds summed since the last judgement), never on a single
noisy average checked every step: such a check is a sequential test that sooner or later dips under
the bar for a drafter that does pay (EAGLE-3 at MAT ~2 here emits 1 to 5 tokens a step), and the
doubling backoff then turns each false alarm into long plain stretches. A block is judged

* a *loss* once it has ``probe`` steps and even its upper confidence bound (``gain + z * se``, the
  delta-method standard error of the ratio of sums) stays under the bar: a drafter that clearly
  loses is stopped after ``probe`` steps;
* otherwise at ``max_probe`` steps on its point estimate (loss below the bar, else a win that
  starts the next block).

After a loss the policy falls back to plain steps for ``backoff`` steps (doubling, up to
``max_backoff``, while speculation keeps losing), then probes again with a fresh block: it grows
back when acceptance recovers. The draft depth is capped below the first depth whose acceptance
estimate (a count decayed over ``depth_window`` tests, with one optimistic pseudo-acceptance) falls
under ``min_depth_acceptance`` after at least ``min_depth_samples`` tests; every ``refresh``
speculative steps one step drafts at full depth (and one step runs plain) so both estimates stay current. The engine keeps one policy per
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
        probe: speculative steps measured before a block can be judged a clear loss.
        max_probe: speculative steps after which a block is judged on its point estimate.
        z: width of the confidence bound (in standard errors) for the early judgement.
        backoff: plain steps after the first losing judgement (doubles per consecutive loss).
        max_backoff: cap of the doubling.
        ema: weight of a new observation in the moving averages.
        min_depth_acceptance: cap the draft depth before depths accepted less often than this.
        min_depth_samples: tests of a depth needed before it can be capped.
        depth_window: memory (in tests) of the per-depth acceptance estimate, a decayed count with
            one optimistic pseudo-acceptance: a few unlucky rejections of a rarely reached depth
            (an EMA of weight ``ema`` falls under 0.1 after eight) do not cap it.
        refresh: every this many speculative steps, one full-depth draft and one plain step.
    """

    margin: float = 0.02
    probe: int = 4
    max_probe: int = 24
    z: float = 2.0
    backoff: int = 8
    max_backoff: int = 256
    ema: float = 0.25
    min_depth_acceptance: float = 0.1
    min_depth_samples: int = 4
    depth_window: int = 16
    refresh: int = 32

    def __post_init__(self) -> None:
        if (not 0 < self.ema <= 1 or self.probe < 1 or self.max_probe < self.probe or self.z < 0
                or self.depth_window < 1 or self.backoff < 1 or self.max_backoff < self.backoff):
            raise ValueError(f"invalid adaptive config {self}")


class AdaptivePolicy:
    """Decides plain vs speculative steps and the draft depth cap for one generation."""

    def __init__(self, cfg: AdaptiveConfig | None = None):
        self.cfg = cfg or AdaptiveConfig()
        self.plain_s: float | None = None
        self.spec_s: float | None = None
        self.spec_tokens: float | None = None
        self.depth_acc: list[float] = []  # decayed accepted counts per depth (conditional on reaching it)
        self.depth_tests: list[float] = []  # decayed test counts per depth
        self.depth_seen: list[int] = []
        self.plain_left = 1  # the first step is plain: it measures the plain step cost
        self.block: list[tuple[float, float]] = []  # (seconds, tokens) of the block being judged
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
        for d, seen in enumerate(self.depth_seen):
            if seen >= self.cfg.min_depth_samples and self.depth_acceptance(d) < self.cfg.min_depth_acceptance:
                return max(1, min(budget, d))
        return budget

    def depth_acceptance(self, d: int) -> float:
        """Estimated acceptance of depth ``d + 1`` given the walk reached it (1 before any test)."""
        if d >= len(self.depth_acc):
            return 1.0
        return (self.depth_acc[d] + 1.0) / (self.depth_tests[d] + 1.0)

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
                if self.plain_left == 0 and not self.block:  # after a backoff: measure afresh
                    self.spec_s, self.spec_tokens = None, None
            return
        self.spec_s = seconds if self.spec_s is None else (1 - w) * self.spec_s + w * seconds
        self.spec_tokens = emitted if self.spec_tokens is None else (1 - w) * self.spec_tokens + w * emitted
        self.spec_total += 1
        self.block.append((seconds, float(emitted)))
        for d in range(num_accepted + int(tested_next)):
            a = d < num_accepted
            if d == len(self.depth_acc):
                self.depth_acc.append(0.0)
                self.depth_tests.append(0.0)
                self.depth_seen.append(0)
            keep = 1 - 1 / self.cfg.depth_window
            self.depth_acc[d] = keep * self.depth_acc[d] + float(a)
            self.depth_tests[d] = keep * self.depth_tests[d] + 1.0
            self.depth_seen[d] += 1
        verdict = self._judge()
        if verdict is False:
            self.block = []
            self.plain_left = self.backoff
            self.backoff = min(self.cfg.max_backoff, self.backoff * 2)
            self.fallbacks += 1
            return
        if verdict:
            self.block = []
            self.backoff = self.cfg.backoff
        if self.spec_total % self.cfg.refresh == 0:
            self.plain_left = 1  # keep the plain cost current as the context grows (the block goes on)

    def block_gain(self) -> tuple[float, float] | None:
        """``(gain, standard error)`` of the current block (``None`` before the plain cost is known
        or with fewer than two steps): pooled tokens / seconds times ``plain_s``, with the delta-method
        error of a ratio of sums."""
        n = len(self.block)
        if self.plain_s is None or n < 2:
            return None
        secs = sum(s for s, _ in self.block)
        toks = sum(t for _, t in self.block)
        if secs <= 0:
            return None
        rate = toks / secs
        var = sum((t - rate * s) ** 2 for s, t in self.block) / (n - 1) * n / secs ** 2
        return rate * self.plain_s, var ** 0.5 * self.plain_s

    def _judge(self) -> bool | None:
        """``False`` a loss, ``True`` a win, ``None`` not yet (see the module docstring)."""
        n = len(self.block)
        if n < self.cfg.probe:
            return None
        est = self.block_gain()
        if est is None:
            return None
        gain, se = est
        bar = 1 + self.cfg.margin
        if gain + self.cfg.z * se < bar:
            return False
        if n >= self.cfg.max_probe:
            return gain >= bar
        return None
