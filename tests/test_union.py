"""Union drafter: value-budgeted merging keeps exactness and stops verifying a member's nodes that
measured acceptance says are worthless."""

from __future__ import annotations

import torch

from selfspec.drafters import UnionDrafter
from selfspec.engine import decode
from selfspec.sampling import SamplingConfig
from stubs import OracleDrafter, table_target


def step_clock():
    """A deterministic clock: every reading advances it by one second (so every step takes the
    same time and an arm's measured rate is its tokens per step)."""
    ticks = iter(range(10**9))
    return lambda: float(next(ticks))


def test_weak_member_nodes_are_dropped_and_output_is_exact():
    cfg, prompt = SamplingConfig(0.0), torch.tensor([1, 2])
    reference = decode(table_target(), prompt, None, cfg, torch.Generator(), 260, set(), 1000).sequences[0].tolist()
    good = OracleDrafter(reference, 6, depth=4, sibling=False)
    bad = OracleDrafter(reference, 6, depth=6, sibling=False, corrupt=lambda pos, tok: (tok + 1) % 6)
    union = UnionDrafter([bad, good], max_nodes=10, clock=step_clock())
    out = decode(table_target(), prompt, union, cfg, torch.Generator(), 240, set(), 1000)
    assert out.sequences[0].tolist() == reference[:242]
    # the always-wrong member's acceptance and its arm's tokens/s are measured as the worst; the
    # oracle's acceptance stays high; without budgeting every step would verify 4 + 6 nodes
    assert union.rate(0, 1, 0) < 0.3 and union.rate(1, 1, 0) > 0.9
    assert min(range(len(union.arms)), key=lambda a: union.arm_rate[a]) == 0  # `bad` alone is slowest
    assert out.stats.draft_nodes / out.stats.steps < 6.0
    assert out.stats.mean_accepted_length > 4.0


def test_union_budget_defaults_to_the_largest_member():
    a = OracleDrafter([0] * 10, 6, depth=2)
    a.cfg = type("C", (), {"max_nodes": 7, "sampled": False})()
    b = OracleDrafter([0] * 10, 6, depth=2)
    assert UnionDrafter([a, b]).max_nodes == 16
    b.cfg = type("C", (), {"max_nodes": 3, "sampled": False})()
    assert UnionDrafter([a, b]).max_nodes == 7


def test_members_outside_the_chosen_arm_are_told_to_skip():
    cfg, prompt = SamplingConfig(0.0), torch.tensor([1, 2])
    reference = decode(table_target(), prompt, None, cfg, torch.Generator(), 60, set(), 1000).sequences[0].tolist()
    seen = {"skip": 0, "propose": 0}

    class Counting(OracleDrafter):
        def skip(self, ctx):
            seen["skip"] += 1

        def propose(self, ctx):
            seen["propose"] += 1
            return super().propose(ctx)

    union = UnionDrafter([Counting(reference, 6, depth=3, sibling=False),
                          OracleDrafter(reference, 6, depth=4, sibling=False)])
    out = decode(table_target(), prompt, union, cfg, torch.Generator(), 40, set(), 1000)
    assert out.sequences[0].tolist() == reference[:42]
    # every drafting step asks it one or the other (the last, one-token step drafts nothing)
    assert seen["skip"] > 0 and seen["propose"] > 0 and out.stats.steps - 1 <= seen["skip"] + seen["propose"] <= out.stats.steps


def test_arm_speeds_are_kept_per_context_state():
    """Each member is right in alternate stretches of the output, and says so through its
    ``context_key``: the union measures arms per state and prefers the member that pays there."""
    cfg, prompt = SamplingConfig(0.0), torch.tensor([1, 2])
    reference = decode(table_target(), prompt, None, cfg, torch.Generator(), 420, set(), 1000).sequences[0].tolist()

    def good_in(phase):
        return lambda pos, tok: tok if (pos // 40) % 2 == phase else (tok + 1) % 6

    class Keyed(OracleDrafter):
        def __init__(self, phase):
            super().__init__(reference, 6, depth=5, sibling=False, corrupt=good_in(phase))
            self.phase = phase

        def context_key(self, ctx):
            return int((ctx.tokens.shape[0] // 40) % 2 == self.phase)

    union = UnionDrafter([Keyed(0), Keyed(1)], max_nodes=5, clock=step_clock())
    out = decode(table_target(), prompt, union, cfg, torch.Generator(), 400, set(), 1000)
    assert out.sequences[0].tolist() == reference[:402]
    assert set(union.rates) == {(1, 0), (0, 1)}
    best = {state: max(range(3), key=lambda a: union.estimates(state)[a] or 0.0) for state in union.rates}
    assert best[(1, 0)] != 1 and best[(0, 1)] != 0  # never the member that is wrong in that stretch
    assert out.stats.mean_accepted_length > 3.0
