"""The controller: acceptance and cost models, merge and sizing rule, arm choice in virtual time."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.control import AcceptanceModel, ControlConfig, Controller, CostModel, verify_curve
from selfspec.control.merge import member_sources, merge, node_values, size_tree, subtree
from selfspec.drafters.base import DraftContext
from stubs import decode
from selfspec.measurement.exit_search import rank_exits
from selfspec.decoding.sampling import SamplingConfig
from selfspec.decoding.tree import DraftTree, Law, TreeBuilder
from stubs import OracleDrafter, ScriptedDrafter, TimedTarget, VirtualClock as Clock, fixed, table_target


CURVE = CostModel({1: 1.0, 64: 1.0 + 0.15 * 63})  # what TimedTarget costs, as a measured curve


def chain(tokens: list[int], law: Law = Law.POINT) -> DraftTree:
    b = TreeBuilder(0)
    node = 0
    for t in tokens:
        node = b.add(node, t, law)
    return b.build()


def reference_text(n: int) -> list[int]:
    return decode(table_target(), torch.tensor([1, 2]), None, SamplingConfig(0.0), torch.Generator(), n, set(),
                  1000).sequences[0].tolist()


# ---------------------------------------------------------------- acceptance model
def test_acceptance_starts_from_the_measured_prior_and_learns_per_key():
    model = AcceptanceModel([{"greedy": [[0.8, 0.1], [0.6]]}, None], prior_weight=4.0, decay=1.0)
    assert model.mean((0, 0, 1, 0, 0)) == pytest.approx(0.8)
    assert model.mean((0, 0, 2, 1, 0)) == pytest.approx((1 - 0.6) * 0.5)  # beyond the measured ranks
    assert model.mean((1, 0, 1, 0, 0)) == pytest.approx(0.5)  # no measurement: the default
    model.record(0, [((0, 7, 1, 0, 0), False)] * 40)  # key 7: never right
    assert model.mean((0, 7, 1, 0, 0)) < 0.15
    other = model.mean((0, 3, 1, 0, 0))  # another key borrows the pooled estimate, shrunk towards it
    assert model.mean((0, 7, 1, 0, 0)) < other < 0.8
    decaying = AcceptanceModel([None], prior_weight=2.0, decay=0.5)
    decaying.record(0, [((0, 0, 1, 0, 0), True)] * 10)
    for _ in range(10):
        decaying.record(0, [])  # steps of the member without a test of that cell: counts fade
    assert decaying.counts[(0, 0, 1, 0, 0)][1] < 0.02


# ---------------------------------------------------------------- sizing rule and merge
def test_sizing_keeps_fewer_nodes_when_nodes_cost_more():
    tree = chain([1, 2, 3, 4, 5, 6, 7, 8])
    values = [1.0] + [0.8 ** d for d in range(1, 9)]
    cheap, _ = size_tree(tree, values, lambda n: 1.0 + 0.01 * n, 0.0, 64)
    steep, _ = size_tree(tree, values, lambda n: 1.0 + 0.3 * n, 0.0, 64)
    hopeless, _ = size_tree(tree, values, lambda n: 1.0 + 10.0 * (n > 1), 0.0, 64)
    assert len(cheap) == 9 and 1 < len(steep) < len(cheap) and hopeless == [0]


def test_sizing_reads_the_measured_curve_not_a_rule():
    """A non-monotonic curve (as measured on CPUs): 5 nodes cost less than 3, so the rule jumps
    over the expensive sizes."""
    curve = {1: 1.0, 2: 1.3, 3: 1.5, 4: 1.5, 5: 1.1, 6: 1.6, 7: 1.7}
    tree = chain([1, 2, 3, 4, 5, 6])
    kept, rate = size_tree(tree, [1.0] + [0.6] * 6, lambda n: curve[n], 0.0, 64)
    assert len(kept) == 5 and rate == pytest.approx((1 + 4 * 0.6) / 1.1)


def test_sizing_never_cuts_drawn_sampled_nodes_and_keeps_sibling_order():
    b = TreeBuilder(0)
    b.set_draft_probs(0, torch.full((6,), 1 / 6))
    first = b.add(0, 1, Law.WOR)
    b.add(0, 2, Law.WOR)
    b.add(first, 3)  # a point mass under a sampled node
    tree = b.build()
    values = [1.0, 0.01, 0.9, 0.005]  # the second sampled child looks better than the first
    kept, _ = size_tree(tree, values, lambda n: 1.0 + 0.5 * n, 0.0, 64, cut_sampled=False)
    assert kept == [0, 1, 2]  # every drawn node stays; only the point mass goes
    kept, _ = size_tree(tree, values, lambda n: 1.0 + 0.01 * n, 0.0, 64)
    assert 2 not in kept or 1 in kept  # (estimating) a sampled child only after its earlier sibling
    assert subtree(tree, [0, 1]).num_nodes == 2


def test_merge_dedups_point_masses_and_grafts_after_the_anchors_children():
    a, b = chain([1, 2, 3]), chain([1, 2, 4])
    tree, sources = merge([(a, member_sources(a, 0, 0, 0)), (b, member_sources(b, 1, 5, 0))])
    assert tree.num_nodes == 5 and [len(s) for s in sources] == [0, 2, 2, 1, 1]
    assert sources[4] == [(1, 5, 3, 0, 0)]
    builder = TreeBuilder(0)
    builder.set_draft_probs(0, torch.full((6,), 1 / 6))
    builder.add(0, 2, Law.WOR)
    anchor = builder.build()
    tree, sources = merge([(anchor, member_sources(anchor, 0, 0, 1)), (a, member_sources(a, 1, 0, 1))])
    assert tree.laws.tolist()[:2] == [Law.POINT, Law.WOR] and tree.tokens.tolist() == [0, 2, 1, 2, 3]
    assert tree.children[0] == (1, 2)  # the graft comes after the anchor's sampled child
    values = node_values(tree, sources, lambda cell: 0.5)
    assert values[1] == 0.5 and values[3] == 0.25 and values[4] == 0.125
    with pytest.raises(ValueError, match="first member"):
        merge([(a, member_sources(a, 0, 0, 1)), (anchor, member_sources(anchor, 1, 0, 1))])


# ---------------------------------------------------------------- cost model
def test_cost_model_interpolates_scales_online_and_keeps_catch_up_apart():
    cost = CostModel({1: 1.0, 3: 2.0, 8: 4.0})
    assert cost.verify(2) == pytest.approx(1.5) and cost.verify(16) == pytest.approx(8.0)
    for _ in range(50):
        cost.record_verify(3, 4.0)  # twice the curve: the scale follows
    assert cost.verify(3) == pytest.approx(4.0, rel=0.05)
    cost.record_draft(0, 0.3, behind=200, usual=2)  # a first call over a whole prompt: catch-up
    for _ in range(5):
        cost.record_draft(0, 0.02, behind=2, usual=2, levels=2)
    assert cost.draft(0) == pytest.approx(0.01) and cost.draft(0, behind=100) > cost.draft(0)


def test_verify_curve_is_measured_once_per_machine_and_cached(tmp_path, monkeypatch):
    from selfspec.control import cost as cost_mod
    from tiny_models import tiny_model

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_mod, "_CURVES", {})
    model = tiny_model("llama", dtype=torch.float32)
    curve, source = verify_curve(model, context=16, repeats=1)
    assert source == "measured now" and min(curve) == 1 and all(s > 0 for s in curve.values())
    stored = json.loads((tmp_path / "verify_cost.json").read_text())
    (key,) = stored
    assert "float32" in key and "torch" in key and "|t" in key  # dtype, torch and threads in the key
    monkeypatch.setattr(cost_mod, "_CURVES", {})
    assert verify_curve(model)[1].startswith("cached in")
    monkeypatch.setattr(cost_mod, "machine_key", lambda m: "another machine")
    monkeypatch.setattr(cost_mod, "_CURVES", {})
    assert verify_curve(model, context=16, repeats=1)[1] == "measured now"  # never another machine's curve


# ---------------------------------------------------------------- arm choice, in virtual time
def _speed(drafters, reference, *, new=300, config=None, per_node=0.15, draft_cost=None):
    """Tokens per virtual second over ``new`` greedy tokens after ``[1, 2]`` (``None``: plain)."""
    clock = Clock()
    target = TimedTarget(clock, per_node=per_node)
    if draft_cost:
        for d, seconds in zip(drafters, draft_cost):
            _charge(d, clock, seconds)
    ctl = None if drafters is None else Controller(drafters, config, cost=CostModel({1: 1.0, 64: 1.0 + per_node * 63}))
    out = decode(target, torch.tensor([1, 2]), ctl, SamplingConfig(0.0), torch.Generator(), new, set(), 1000,
                 clock=clock)
    assert out.sequences[0].tolist() == reference[: 2 + new]
    return out.stats.new_tokens / clock.now, ctl


def _charge(drafter, clock, seconds):
    propose = drafter.propose

    def timed(ctx):
        clock.spend(seconds)
        return propose(ctx)

    drafter.propose = timed


def test_a_drafter_that_never_pays_is_stopped():
    """A slow drafter that is never right: the controller runs plain steps (at least 0.97x of
    plain decoding in virtual time); drafting every step instead is far slower (negative control)."""
    ref = reference_text(320)
    plain, _ = _speed(None, ref)
    wrong = lambda: OracleDrafter(ref, 6, depth=3, corrupt=lambda pos, tok: (tok + 1) % 6)  # noqa: E731
    ctl_speed, ctl = _speed([wrong()], ref, draft_cost=[0.3])
    always, _ = _speed([wrong()], ref, config=ControlConfig(fixed=True), draft_cost=[0.3])
    assert ctl_speed >= 0.97 * plain, (ctl_speed, plain, ctl.arm_steps)
    assert always < 0.8 * plain


def test_a_drafter_that_pays_runs_and_its_trees_are_sized():
    ref = reference_text(320)
    plain, _ = _speed(None, ref)
    good, ctl = _speed([OracleDrafter(ref, 6, depth=6, sibling=True)], ref, draft_cost=[0.05])
    assert good > 1.8 * plain, (good, plain)
    assert ctl.arm_steps[1] > 0.9 * sum(ctl.arm_steps)
    wrong, right = ctl.acceptance.mean((0, 0, 1, 0, 0)), ctl.acceptance.mean((0, 0, 1, 1, 0))
    assert wrong < 0.5 < 0.9 < right  # the wrong first siblings are learnt ...
    clock = Clock()
    ctl.trace = []
    decode(TimedTarget(clock), torch.tensor([1, 2]), ctl, SamplingConfig(0.0), torch.Generator(), 60, set(), 1000,
           clock=clock)
    assert any(t["nodes"] < t["drafted"] for t in ctl.trace)  # ... and cut before verification


@pytest.mark.parametrize("head_keys", [1, 5])
def test_a_union_is_at_least_as_fast_as_its_best_member(head_keys):
    """A slow head that is never right and a lookup-like member right only in alternate stretches
    (its context key says where; elsewhere it drafts nothing); with ``head_keys`` 5 the head's key
    changes every token, so states multiply. The union must keep up with the lookup member alone."""
    ref = reference_text(420)

    class SlowWrong(OracleDrafter):
        def context_key(self, ctx):
            return ctx.tokens.shape[0] % head_keys

    class Lookup(OracleDrafter):
        def context_key(self, ctx):
            return int((ctx.tokens.shape[0] // 40) % 2 == 0)

        def propose(self, ctx):
            return super().propose(ctx) if self.context_key(ctx) else DraftTree.root_only(ctx.root_token)

    def members():
        return [SlowWrong(ref, 6, depth=3, sibling=False, corrupt=lambda pos, tok: (tok + 1) % 6),
                Lookup(ref, 6, depth=4, sibling=False)]

    plain, _ = _speed(None, ref, new=400)
    slow, _ = _speed(members()[:1], ref, new=400, draft_cost=[0.3])
    lookup, _ = _speed(members()[1:], ref, new=400, draft_cost=[0.01])
    union, ctl = _speed(members(), ref, new=400, draft_cost=[0.3, 0.01])
    merged, _ = _speed(members(), ref, new=400, draft_cost=[0.3, 0.01], config=ControlConfig(fixed=True))
    best = max(slow, lookup)
    assert lookup > 1.3 * plain and slow < 1.0 * plain  # the race is meaningful
    assert union >= 0.95 * best, (union, best, ctl.arm_steps)
    assert merged < 0.95 * best  # negative control: always merging fails the same bound


def test_choices_never_touch_the_sampling_generator():
    """Arm draws come from the controller's own generator: choosing leaves the sampling generator's
    state as it was."""
    ctl = Controller([ScriptedDrafter(6, point=2, sampled=0)], cost=CURVE)
    gen = torch.Generator().manual_seed(11)
    before = gen.get_state().clone()
    ctx = DraftContext(torch.tensor([1, 2, 3]), None, 4, SamplingConfig(1.0), gen)
    for _ in range(5):
        ctl.choose(ctx)
    assert torch.equal(gen.get_state(), before)


def test_state_round_trip_repeats_the_same_choices():
    ref = reference_text(80)
    _, ctl = _speed([OracleDrafter(ref, 6, depth=3)], ref, new=60)
    saved = ctl.state()
    ctx = DraftContext(torch.tensor(ref[:10]), None, 4, SamplingConfig(0.0), torch.Generator())
    first = [ctl.choose(ctx)[0] for _ in range(8)]
    ctl.load_state(saved)
    assert [ctl.choose(ctx)[0] for _ in range(8)] == first


def test_fixed_runs_every_member_every_step():
    ref = reference_text(40)
    ctl = fixed([OracleDrafter(ref, 6, depth=2), OracleDrafter(ref, 6, depth=3)])
    decode(table_target(), torch.tensor([1, 2]), ctl, SamplingConfig(0.0), torch.Generator(), 30, set(), 1000)
    assert ctl.arm_steps[:-1] == [0, 0, 0] and ctl.arm_steps[-1] > 0


def test_exit_ranking_trades_acceptance_for_cost():
    acceptance = [0.1, 0.3, 0.6, 0.8]  # exits after 1..4 layers
    level = {1: 0.05, 2: 0.1, 3: 0.15, 4: 0.9}  # the deepest exit costs almost a full pass
    verify = {k: 1.0 + 0.05 * (k - 1) for k in range(1, 9)}
    ranked = rank_exits(acceptance, level, verify, max_depth=4)
    assert ranked[0].exit_layer == 3
    assert ranked[0].expected_speedup == max(c.expected_speedup for c in ranked)


def test_a_cut_keeps_what_each_sampled_node_was_drawn_given():
    """Sampled nodes under a point-mass node, after a point-mass sibling: a cut after drafting
    keeps them, their ancestors and their earlier siblings, however little those are worth."""
    b = TreeBuilder(0)
    a = b.add(0, 1)  # point mass
    p = b.add(a, 2)  # point mass before the sampled siblings
    b.set_draft_probs(a, torch.full((8,), 1 / 8, dtype=torch.float64))
    s1, s2 = b.add(a, 3, Law.WOR), b.add(a, 4, Law.WOR)
    other = b.add(0, 5)  # point mass, cuttable
    tree = b.build()
    values = [1.0, 1e-6, 1e-6, 1e-6, 1e-6, 1e-6]
    keep, _ = size_tree(tree, values, lambda n: 1.0 + n, 0.0, 64, cut_sampled=False)
    assert keep == [0, a, p, s1, s2] and other not in keep
    subtree(tree, keep)  # a valid tree
