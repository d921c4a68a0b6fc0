"""Side-by-side speed measurement: speculative vs plain decoding in one process.

Convention: runs alternate (plain, speculative, plain, speculative, ...) on the same prompt so
that machine noise hits both alike; speedup = plain decode time / speculative decode time summed
over repeats (prefill excluded from both, it is identical). A short warm-up run of each precedes
the measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine import SpecOutput, generate


@dataclass
class Comparison:
    """Plain and speculative runs of one prompt.

    Attributes:
        plain: the last plain run (its ``sequences`` are the reference text).
        spec: the last speculative run.
        plain_time_s / spec_time_s: decode seconds summed over repeats.
        identical: every speculative output equalled the plain output of the same repeat.
    """

    plain: SpecOutput
    spec: SpecOutput
    plain_time_s: float
    spec_time_s: float
    identical: bool

    @property
    def speedup(self) -> float:
        return self.plain_time_s / self.spec_time_s if self.spec_time_s > 0 else 0.0


def compare(model, input_ids: torch.Tensor, drafter, *, repeats: int = 1, warmup: bool = True, **gen) -> Comparison:
    """Time plain and speculative generation alternately on ``input_ids`` (same ``gen`` kwargs).

    With sampling, each repeat uses the same seed for both, so outputs are comparable in law only.
    """
    if warmup:
        generate(model, input_ids, max_new_tokens=4, **_no_budget(gen))
        generate(model, input_ids, drafter=drafter, max_new_tokens=4, **_no_budget(gen))
    plain_t = spec_t = 0.0
    identical = True
    for _ in range(repeats):
        plain = generate(model, input_ids, **gen)
        spec = generate(model, input_ids, drafter=drafter, **gen)
        plain_t += plain.stats.decode_time_s
        spec_t += spec.stats.decode_time_s
        identical &= torch.equal(plain.sequences, spec.sequences)
    return Comparison(plain, spec, plain_t, spec_t, identical)


def _no_budget(gen: dict) -> dict:
    return {k: v for k, v in gen.items() if k != "max_new_tokens"}
