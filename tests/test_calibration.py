"""Hardware-aware tree choice, training-free exit choice, and adaptive speculation."""

from __future__ import annotations

import math

import pytest
import torch

from selfspec.adaptive import AdaptiveConfig, AdaptivePolicy
from selfspec.measurement.calibration import choose_tree
from selfspec.drafters.base import DraftContext, Drafter
from selfspec.engine import decode
from selfspec.measurement.exit_search import rank_exits
from selfspec.sampling import SamplingConfig
from selfspec.tree import TreeBuilder
from stubs import OracleDrafter, TableTarget

PASS_S = 0.002  # a target pass costs about the same for 1 or 6 nodes, as on real hardware


class VirtualClock:
    """Deterministic time: only the stubs below advance it (no sleeps, no load sensitivity)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


CLOCK = VirtualClock()


class TimedTarget(TableTarget):
    def forward_tree(self, tree, handoff=None):
        CLOCK.advance(PASS_S)
        return super().forward_tree(tree)


def table_target():
    return TimedTarget(6, 0)

ACC = [[0.7, 0.15, 0.05], [0.55, 0.15, 0.05], [0.45, 0.1, 0.05], [0.4, 0.1, 0.05]]


def costs(per_node: float, n: int = 16) -> dict[int, float]:
    return {k: 1.0 + per_node * (k - 1) for k in range(1, n + 1)}


def test_calibration_picks_a_smaller_tree_when_nodes_cost_more():
    cheap, _ = choose_tree(ACC, costs(0.01))
    steep, _ = choose_tree(ACC, costs(0.15))
    assert steep.budget < cheap.budget
    assert cheap.budget >= 10  # nearly free nodes: a large tree (until a node adds < its cost)
    assert steep.budget >= 1
    plain, _ = choose_tree(ACC, costs(2.0))
    assert plain.budget == 0  # speculation cannot pay: plain decoding


def test_calibration_uses_the_measured_curve_not_a_rule():
    """A non-monotonic cost curve (as measured on CPU): 5 nodes are cheaper than 3, so the
    choice jumps over the expensive sizes."""
    curve = {1: 1.0, 2: 1.3, 3: 1.5, 4: 1.5, 5: 1.1, 6: 1.2, 7: 1.4}
    best, options = choose_tree(ACC, curve)
    assert best.budget == 4 and len(options) == 7
    assert best.tokens_per_s == max(o.tokens_per_s for o in options)


def test_exit_ranking_trades_acceptance_for_cost():
    acceptance = [0.1, 0.3, 0.6, 0.8]  # exits after 1..4 layers
    level = {1: 0.05, 2: 0.1, 3: 0.15, 4: 0.9}  # the deepest exit costs almost a full pass
    verify = costs(0.05, 8)
    ranked = rank_exits(acceptance, level, verify, max_depth=4)
    assert ranked[0].exit_layer == 3
    assert ranked[0].expected_speedup == max(c.expected_speedup for c in ranked)


def test_policy_falls_back_then_probes_and_grows_back():
    cfg = AdaptiveConfig(probe=3, backoff=4, max_backoff=8, ema=0.5, refresh=1000)
    p = AdaptivePolicy(cfg)
    assert not p.speculate()  # the first step is plain: it measures the plain cost
    p.record(False, 1.0, 1)
    for _ in range(3):  # speculation emits one token per step and costs more: a loss
        assert p.speculate()
        p.record(True, 1.3, 1, 0, True)
    assert not p.speculate() and p.fallbacks == 1
    for _ in range(4):
        assert not p.speculate()
        p.record(False, 1.0, 1)
    assert p.speculate()  # the probe after the backoff
    for _ in range(3):
        p.record(True, 1.3, 3, 2, True)  # acceptance recovered: three tokens a step
    assert p.speculate() and p.fallbacks == 1 and p.gain() > 2


def test_policy_caps_depth_below_rarely_accepted_levels():
    p = AdaptivePolicy(AdaptiveConfig(refresh=1000, min_depth_acceptance=0.6, min_depth_samples=1, depth_window=1))
    p.record(False, 1.0, 1)
    p.record(True, 1.0, 2, 1, True)  # depth 1 accepted, depth 2 rejected: (0 + 1) / (1 + 1)
    assert p.max_depth(8) == 1
    p.record(True, 1.0, 3, 2, False)  # depth 2 accepted again
    assert p.max_depth(8) == 8
    q = AdaptivePolicy()  # defaults: a few rejections cap nothing, a long run of them does
    q.record(False, 1.0, 1)
    for _ in range(8):  # an EMA of weight 0.25 would be under 0.1 now
        q.record(True, 1.0, 2, 1, True)
    assert q.max_depth(8) == 8 and q.depth_acceptance(1) > 0.1
    for _ in range(8):
        q.record(True, 1.0, 2, 1, True)
    assert q.max_depth(8) == 1 and q.depth_acceptance(0) > 0.9


def test_policy_state_carries_over_between_generations():
    """A drafter that lost in one call starts the next call backed off, not probing again."""
    from selfspec.engine import policy_for

    drafter = OracleDrafter([0], 6)
    p = policy_for(drafter, AdaptiveConfig(probe=2, backoff=8))
    assert drafter.adaptive_policy is p  # the default state lives on the drafter, in the open
    p.record(False, 1.0, 1)
    for _ in range(2):
        p.record(True, 2.0, 1, 0, True)
    assert p.fallbacks == 1
    again = policy_for(drafter, AdaptiveConfig(probe=2, backoff=8))
    again.begin()
    assert again is p and not again.speculate() and again.plain_left == 8  # still backed off
    for _ in range(8):
        again.record(False, 1.0, 1)
    again.begin()
    assert again.speculate()  # the plain cost is known: a new call does not start with a plain step
    assert policy_for(drafter, AdaptiveConfig(probe=3)) is not p  # another config: a fresh policy
    mine = AdaptivePolicy(AdaptiveConfig(probe=2))
    assert policy_for(drafter, mine) is mine and policy_for(drafter, False) is None  # the caller's own
    with pytest.raises(ValueError, match="adaptive must be"):
        policy_for(drafter, "yes")


class SlowWrongDrafter(Drafter):
    """Always wrong (drafts a token the greedy target never picks next) and slow."""

    kind = "slow-wrong"

    def __init__(self, target):
        super().__init__(None)
        self.target = target

    def propose(self, ctx: DraftContext):
        CLOCK.advance(2 * PASS_S)
        logits = self.target.logits_after(ctx.tokens.tolist())
        b = TreeBuilder(ctx.root_token)
        b.add(0, int(logits.argmin()))
        return b.build()


def test_adaptive_fallback_engages_and_leaves_output_unchanged():
    cfg, prompt = SamplingConfig(0.0), torch.tensor([1, 2])
    plain = decode(table_target(), prompt, None, cfg, torch.Generator(), 60, set(), 1000, clock=CLOCK)
    target = table_target()
    out = decode(target, prompt, SlowWrongDrafter(target), cfg, torch.Generator(), 60, set(), 1000,
                 AdaptivePolicy(AdaptiveConfig(probe=3, backoff=8)), clock=CLOCK)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.stats.fallbacks >= 1 and out.stats.plain_steps > out.stats.steps // 2


def test_adaptive_keeps_speculating_when_drafts_pay():
    cfg, prompt = SamplingConfig(0.0), torch.tensor([1, 2])
    reference = decode(table_target(), prompt, None, cfg, torch.Generator(), 120, set(), 1000).sequences[0].tolist()
    out = decode(table_target(), prompt, OracleDrafter(reference, 6, depth=5, sibling=False), cfg, torch.Generator(),
                 100, set(), 1000, AdaptivePolicy(), clock=CLOCK)
    assert out.sequences[0].tolist() == reference[:102]
    assert out.stats.fallbacks == 0 and out.stats.plain_steps <= 2


def _simulate(cfg, accept: float, steps: int = 2500, seed: int = 0) -> tuple[float, float, float]:
    """Tokens per second of (policy, always speculating, always plain) on one simulated stream: a
    plain step costs 1 s, a speculative step of depth d costs 1.26 + 0.06 d s (a CPU's draft levels
    and small tree), both times a log-normal timing noise of 15%; a draft is accepted level by level
    with probability ``accept`` (EAGLE-3 at MAT ~2 on this machine)."""
    import math

    gen = torch.Generator().manual_seed(seed)

    def noise() -> float:
        return math.exp(0.15 * float(torch.randn((), generator=gen)))

    def one(mode: str) -> float:
        policy = AdaptivePolicy(cfg) if mode == "policy" else None
        secs = toks = 0.0
        for _ in range(steps):
            spec = mode == "spec" or (policy is not None and policy.speculate())
            if spec:
                depth = policy.max_depth(4) if policy else 4
                acc = 0
                while acc < depth and float(torch.rand((), generator=gen)) < accept:
                    acc += 1
                s, n = (1.26 + 0.06 * depth) * noise(), acc + 1
                if policy:
                    policy.record(True, s, n, acc, acc < depth)
            else:
                s, n = noise(), 1
                if policy:
                    policy.record(False, s, n)
            secs, toks = secs + s, toks + n
        return toks / secs

    return one("policy"), one("spec"), one("plain")


@pytest.mark.parametrize("accept", [0.0, 0.2, 0.5, 0.56, 0.8])
def test_adaptive_policy_is_as_fast_as_the_better_of_speculating_and_plain(accept):
    """The adaptive policy against both fixed choices, on streams where speculation pays (gain about
    1.4 at accept 0.5-0.56, a noisy MAT of ~2) or loses. Negative control: judging speculation on
    short blocks of its own noisy estimate (the rule before pooled blocks and confidence bounds; an
    EMA checked every step behaves the same) backs off a paying drafter far too often."""
    rates = [_simulate(AdaptiveConfig(), accept, seed=s) for s in range(3)]
    policy, spec, plain = (sum(r[i] for r in rates) / 3 for i in range(3))
    assert policy >= 0.97 * max(spec, plain), (policy, spec, plain)
    if 0.5 <= accept <= 0.56:
        noisy = [_simulate(AdaptiveConfig(probe=2, max_probe=2, z=0.0), accept, seed=s)[0] for s in range(3)]
        assert sum(noisy) / 3 < 0.9 * spec, (noisy, spec)


def test_calibration_races_entries_until_the_best_is_clear():
    """Entries are measured four prompts at a time; one clearly slower than the leader on the same
    prompts (paired, two standard errors) is out after a batch, close ones run on until they
    separate or the prompts run out, and the best geometric mean left wins."""
    from selfspec.measurement.calibration import raced_choice

    g = torch.Generator().manual_seed(0)
    prompt_effect = (torch.rand(24, generator=g) * 2.0 + 0.5).tolist()  # prompts differ a lot...
    noise = {k: (torch.randn(24, generator=g) * 0.02).tolist() for k in ("chain3", "tree", "deep", "twin")}
    true = {"chain3": 1.30, "tree": 1.36, "deep": 1.05, "twin": 1.36}
    calls = []

    def measure(keys, prompts):
        calls.append((list(keys), list(prompts)))
        return {k: [true[k] * prompt_effect[p] * math.exp(noise[k][p]) for p in prompts] for k in keys}

    chosen, speedups, rounds = raced_choice(measure, ["chain3", "tree", "deep"], list(range(24)))
    assert chosen == "tree"
    assert "deep" not in rounds[0]["left"]  # clearly slower: out after the first four prompts
    assert rounds[-1]["left"] == ["tree"] and rounds[-1]["prompts"] < 24  # separated before the end
    assert sum(len(k) * len(p) for k, p in calls) < 3 * 24  # far fewer runs than measuring everything
    # a true tie never separates: both run on every prompt, and the better mean measured wins
    chosen, speedups, rounds = raced_choice(measure, ["tree", "twin", "deep"], list(range(24)))
    assert set(rounds[-1]["left"]) == {"tree", "twin"} and rounds[-1]["prompts"] == 24
    assert chosen == max(["tree", "twin"], key=speedups.get)
    # negative control, same harness: pairing is what separates them. With each entry's prompts in
    # its own order (speedups paired with another prompt's), the race cannot tell 1.30 from 1.36
    order = {k: torch.randperm(24, generator=torch.Generator().manual_seed(i)).tolist()
             for i, k in enumerate(("chain3", "tree", "deep"))}

    def unpaired(keys, prompts):
        return {k: measure([k], [order[k][p] for p in prompts])[k] for k in keys}

    rounds = raced_choice(unpaired, ["chain3", "tree", "deep"], list(range(24)))[2]
    assert {"chain3", "tree"} <= set(rounds[-1]["left"]) and rounds[-1]["prompts"] == 24


def test_race_uses_student_t_quantiles():
    from scipy import stats

    from selfspec.measurement.calibration import _T975, _clearly_worse

    assert [round(float(stats.t.ppf(0.975, d)), 3) for d in range(1, 31)] == list(_T975)
    # four paired differences of mean -1 and standard error 0.41: out at z = 2, not at t(3) = 3.18
    diff = [-2.0, -1.0, 0.0, -1.0]
    assert not _clearly_worse(diff, [0.0] * 4)
    assert _clearly_worse(diff * 3, [0.0] * 12)  # the same spread over twelve prompts is clear


def test_race_entries_are_interleaved_prompt_by_prompt(monkeypatch):
    """Each prompt runs every entry in turn (order rotated per prompt), so a burst of machine load
    falls on all entries of that prompt rather than on every prompt of one entry."""
    import selfspec.measurement.measure as measure_mod
    from selfspec.measurement.calibration import measured_speedups

    calls = []
    monkeypatch.setattr(measure_mod, "pooled_speedup", lambda runs: 1.0)
    monkeypatch.setattr(measure_mod, "compare", lambda model, ids, drafter, **kw: calls.append((drafter, ids)))
    made = []
    out = measured_speedups(None, lambda k: made.append(k) or f"d{k}", [10, 11, 12], ["a", "b", "c"])
    assert made == ["a", "b", "c"] and out == {k: [1.0, 1.0, 1.0] for k in "abc"}
    assert calls == [("da", 10), ("db", 10), ("dc", 10), ("db", 11), ("dc", 11), ("da", 11),
                     ("dc", 12), ("da", 12), ("db", 12)]


def test_calibrations_are_looked_up_for_this_class_of_machine_first():
    """``dtype@class`` entries (scripts/calibrate.py since round 28) win over the bare dtype's
    (earlier rounds, another CPU), which is the fallback; other dtypes and classes are ignored."""
    from selfspec.machine import cpu_class, for_machine, machine_key

    amx = {"flags": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]}
    zen4 = {"flags": ["avx2", "avx512f", "avx512_bf16"]}
    zen3 = {"flags": ["avx2"]}
    assert [cpu_class(c) for c in (amx, zen4, zen3, {"flags": []})] == ["amx", "avx512_bf16", "avx2", "other"]
    assert machine_key("bfloat16", "cpu", amx) == "bfloat16@amx"
    assert machine_key("bfloat16", "cuda", amx) == "bfloat16@cuda"
    table = {"bfloat16": {"max_nodes": 6}, "bfloat16@amx": {"max_nodes": 16}, "float32@avx2": {"max_nodes": 3}}
    assert for_machine(table, "bfloat16", "cpu", amx) == {"max_nodes": 16}
    assert for_machine(table, "bfloat16", "cpu", zen4) == {"max_nodes": 6}
    assert for_machine(table, "float32", "cpu", zen3) == {"max_nodes": 3}
    assert for_machine(table, "float32", "cpu", amx) is None and for_machine(None, "float32") is None
