"""Speculative-decoding statistics, with the conventions pinned in one place.

Conventions:
* a *step* is one target verification pass (plain decoding: one step per token);
* mean accepted length (MAT) = new tokens / steps, so it counts the recovered or bonus token and
  plain decoding has MAT = 1; tokens cut by EOS or ``max_new_tokens`` are not counted;
* acceptance at depth d = (steps that accepted a draft at depth d) / (steps whose walk tested a
  child at depth d), i.e. the conditional acceptance rate given the walk got that far;
* times are wall-clock seconds on the host (CUDA work is synchronised before reading clocks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    """Statistics of one ``selfspec.generate`` call.

    ``first_token_s`` is the time to first token (prefill + first step, which emitted
    ``first_step_tokens``); TPOT is the time per token after that step; ``plain_steps`` counts
    steps verified without a draft (the controller's plain arm, or nothing drafted);
    ``prefix_reused`` the prompt positions taken from a :class:`~selfspec.decoding.prefix_cache.PrefixCache`.
    """

    steps: int = 0
    new_tokens: int = 0
    draft_nodes: int = 0
    tested_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    wall_time_s: float = 0.0
    first_token_s: float = 0.0
    first_step_tokens: int = 0
    plain_steps: int = 0
    prefix_reused: int = 0

    @property
    def mean_accepted_length(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_per_depth(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted_per_depth, self.tested_per_depth)]

    @property
    def decode_time_s(self) -> float:
        return self.wall_time_s - self.prefill_time_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of decoding (prefill excluded)."""
        return self.new_tokens / self.decode_time_s if self.decode_time_s > 0 else 0.0

    def record_step(self, num_accepted: int, tested_next: bool, emitted: int, draft_nodes: int) -> None:
        """Count one step: ``num_accepted`` draft tokens passed, then a child at the next depth was
        tested (and rejected) iff ``tested_next``; ``emitted`` tokens were kept."""
        deepest = num_accepted + (1 if tested_next else 0)
        while len(self.tested_per_depth) < deepest:
            self.tested_per_depth.append(0)
            self.accepted_per_depth.append(0)
        for d in range(deepest):
            self.tested_per_depth[d] += 1
            self.accepted_per_depth[d] += d < num_accepted
        self.steps += 1
        self.new_tokens += emitted
        self.draft_nodes += draft_nodes

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(
            mean_accepted_length=self.mean_accepted_length,
            acceptance_per_depth=self.acceptance_per_depth,
            tokens_per_s=self.tokens_per_s,
            decode_time_s=self.decode_time_s,
        )
        return out
