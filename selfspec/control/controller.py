"""The controller: which drafters run each step, and how big the verified tree is.

*Arms*: plain steps (no drafting, one token), each member alone, and (with several members) the
merge of all. A single drafter is the two-arm case (plain or draft). Each step the controller

1. reads the *context state*, every member's :meth:`~selfspec.drafters.base.Drafter.context_key`;
2. scores every arm by Thompson sampling: one draw per acceptance cell from the
   :class:`~selfspec.control.acceptance.AcceptanceModel`, applied to the arm's latest tree in this
   state, sized by the sizing rule (:func:`~selfspec.control.merge.size_tree`), gives expected
   tokens per second against the :class:`~selfspec.control.cost.CostModel` (drafting and verify
   seconds, timed by the engine's clock), at the depth that pays. An arm never run is tried
   first. Draws come from the controller's own ``random.Random(seed)``, never the sampling
   generator;
3. asks the chosen arm's members for trees (the first member may sample; the others are asked
   for point masses in a merge), merges them (:func:`~selfspec.control.merge.merge`) and cuts
   the point-mass nodes that do not pay by the same draws, so a node the means would cut is
   still tested now and then (a tree carrying a layer handoff is verified as drafted: its KV is
   already written);
4. after verification, records which nodes were tested and accepted, and the step's seconds.

Exactness: the arm, the tree shape and the cut depend on committed tokens, past measurements and
the controller's own generator, never on the coins of this step's verification, and drawn
sampled nodes are never cut (see :mod:`selfspec.control.merge`); each step is an exact
speculative (or plain) step, so any sequence of them keeps the target's law.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any
from typing import Sequence

from ..drafters.base import DraftContext, Drafter, Proposal, Requirements, Step
from ..decoding.tree import DraftTree
from ..decoding.verify import Verdict
from .acceptance import AcceptanceModel, temperature_bucket
from .cost import CostModel, verify_curve
from .gate import BatchGate
from .merge import member_sources, merge, node_values, size_tree, subtree, pinned, take_order


#: Weight of the newest step in the moving average of tokens a step commits (``Controller.usual``).
USUAL_EMA = 0.1
#: A continued chain's expected tokens below which deeper levels are not weighed.
VALUE_FLOOR = 1e-3


@dataclass
class StepPlan:
    """One step's decision, passed from :meth:`Controller.plan` to :meth:`~Controller.assemble`,
    :meth:`~Controller.offer`, :meth:`~Controller.cut` and :meth:`~Controller.observe`.

    Attributes:
        arm: index into ``Controller.arms``.
        state: every member's context key this step.
        ctx: the step's context.
        calls: ``(member, its context)`` for each member asked (none on the plain arm).
        draws: this step's Thompson draws per acceptance cell (filled as read).
        rows: sequences sharing this step's target pass.
        tree: the assembled tree (``None`` before :meth:`~Controller.assemble`); ``sources`` its
            nodes' acceptance cells; ``draft_s`` drafting seconds; ``drafted`` nodes before the
            cut; ``handoff`` the layer handoff, if any; ``order`` what :meth:`~Controller.offer`
            ranked.
    """

    arm: int
    state: tuple
    ctx: DraftContext
    calls: list
    draws: dict
    rows: int = 1
    tree: DraftTree | None = None
    sources: list = field(default_factory=list)
    draft_s: float = 0.0
    drafted: int = 1
    handoff: Any = None
    order: tuple | None = None


@dataclass(frozen=True)
class ControlConfig:
    """Knobs of the :class:`Controller`.

    Attributes:
        decay: weight kept by a member's acceptance counts per step it drafts (forgetting).
        prior_weight: pseudo-tests behind a prior (a member's measured acceptance, or a pooled
            estimate behind one context key).
        max_nodes: most draft nodes a verified tree holds (the sizing rule decides below it).
        seed: seed of the controller's own generator (arm draws).
        fixed: every step drafts with every member and verifies the trees as proposed (no arm
            choice, no cut): for tests and for measuring drafters' raw trees.
        batch_gate: in a batch, run plain steps while speculative steps measure slower
            (:mod:`selfspec.control.gate`).
    """

    decay: float = 0.99
    prior_weight: float = 2.0
    max_nodes: int = 64
    seed: int = 0
    fixed: bool = False
    batch_gate: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.decay <= 1 or self.prior_weight <= 0 or self.max_nodes < 1:
            raise ValueError(f"invalid control config {self}: need 0 < decay <= 1, prior_weight > 0, max_nodes >= 1")


class Controller:
    """Decides, per step, plain or which drafters, and the tree size (module docstring).

    Keep one across ``generate`` calls to keep what it learnt (acceptance, costs)."""

    def __init__(self, drafters: "Drafter | Sequence[Drafter]", config: ControlConfig | None = None,
                 cost: CostModel | None = None):
        members = [drafters] if isinstance(drafters, Drafter) else list(drafters)
        if not members or not all(isinstance(m, Drafter) for m in members):
            raise ValueError("a controller needs one or more selfspec Drafters")
        taps = {m.requires.taps for m in members if m.requires.taps}
        if len(taps) > 1:
            raise ValueError(f"drafters read different target taps {sorted(taps)}")
        self.members, self.config, self.cost = members, config or ControlConfig(), cost
        self.requires = Requirements(
            hidden=any(m.requires.hidden for m in members), taps=taps.pop() if taps else (),
            target_cache=len(members) == 1 and members[0].requires.target_cache,
            tools=any(m.requires.tools for m in members), learns=any(m.requires.learns for m in members))
        n = len(members)
        self.arms: list[tuple[int, ...]] = [()] + [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])
        self.acceptance = AcceptanceModel([m.prior() for m in members], prior_weight=self.config.prior_weight,
                                          decay=self.config.decay)
        self.rng = random.Random(self.config.seed)
        self.shapes: dict[tuple, tuple[DraftTree, list]] = {}  # (arm, its members' keys) -> latest tree
        self.seen = [0] * n  # context length at each member's latest call this generation
        self.usual = 1.0  # tokens a step commits (moving average)
        self.arm_steps = [0] * len(self.arms)
        self.trace: list[dict] | None = None  # set to [] to record one dict per step
        self.gate = BatchGate()  # what batches measured (selfspec.batch), shared by forks
        self._in_use = threading.Lock()

    def fork(self, seed: int) -> "Controller":
        """A controller for another sequence decoded beside this one (a batch row): its members
        are the members' forks, its arm draws its own ``random.Random(seed)``; the acceptance and
        cost models are shared, so rows learn from each other and weigh the same passes."""
        twin = Controller([m.fork() for m in self.members], replace(self.config, seed=seed), cost=self.cost)
        twin.acceptance, twin.gate = self.acceptance, self.gate
        return twin

    # ------------------------------------------------------------------ lifecycle
    def check_target(self, model) -> None:
        for m in self.members:
            m.check_target(model)

    def acquire(self) -> None:
        """Mark this controller in use by one generation (released by :meth:`release`): a
        controller holds one generation's state (its members' caches, the step being decided),
        so a second concurrent generation is refused rather than corrupting the first."""
        if not self._in_use.acquire(blocking=False):
            raise RuntimeError("this Controller is in use by another generation; give each concurrent generation "
                               "its own (controller.fork(seed)) or its own drafters")

    def release(self) -> None:
        if self._in_use.locked():
            self._in_use.release()

    def begin(self, model=None) -> None:
        """A generation starts: members reset; the cost model is this machine's verify curve for
        ``model`` (cached or measured now) unless one was given."""
        for m in self.members:
            m.reset()
        self.seen = [0] * len(self.members)
        if self.cost is None:
            self.cost = self.measured_cost(model)

    @staticmethod
    def measured_cost(model) -> CostModel:
        """A cost model from this machine's verify curve for ``model`` (cached or measured now)."""
        if model is None:
            raise ValueError("a controller without a cost model needs the target model to measure one "
                             "(give cost=CostModel(...) for targets that are not transformers models)")
        curve, source = verify_curve(model)
        return CostModel(curve, source=source)

    def end(self, tokens, prompt_len: int) -> None:
        for m in self.members:
            m.end(tokens, prompt_len)

    def state(self) -> dict:
        """A copy of what the controller learnt (acceptance counts, costs, latest trees, its
        generator), for :meth:`load_state` (e.g. to run a prompt twice from the same state)."""
        return copy.deepcopy(dict(counts=self.acceptance.counts, pooled=self.acceptance.pooled, shapes=self.shapes,
                                  cost=None if self.cost is None else vars(self.cost), rng=self.rng.getstate(),
                                  usual=self.usual))

    def load_state(self, state: dict) -> None:
        state = copy.deepcopy(state)
        self.acceptance.counts, self.acceptance.pooled, self.shapes = state["counts"], state["pooled"], state["shapes"]
        if state["cost"] is not None:
            self.cost = CostModel.__new__(CostModel)
            vars(self.cost).update(state["cost"])
        self.rng.setstate(state["rng"])
        self.usual = state["usual"]

    # ------------------------------------------------------------------ one step
    def choose(self, ctx: DraftContext, draws: dict | None = None,
               rows: int = 1) -> tuple[int, tuple[int, ...], int | None, int | None]:
        """``(arm index, context state, node budget, depth cap)`` for this step (Thompson
        sampling, module docstring; ``draws``: this step's acceptance draws, filled as cells are
        read; ``rows``: sequences sharing the pass). The cap is the depth that pays best
        (:meth:`_score`); the budget is the sized tree's nodes plus one, so sampled trees can grow
        back (``None``: the arm has no tree yet, or ``fixed``)."""
        state = tuple(m.context_key(ctx) for m in self.members)
        if self.config.fixed:
            return len(self.arms) - 1, state, None, None
        bucket = temperature_bucket(ctx.sampling.temperature)
        rate = self._rate({} if draws is None else draws)
        best, best_score, budget, cap = 0, 1.0 / self.cost.verify(1, rows), None, None
        for a in range(len(self.arms) - 1, 0, -1):  # the merge first: it measures every member
            arm = self.arms[a]
            shape = self._shape(arm, state, bucket)
            if shape is None:
                return a, state, None, None
            score, nodes, depth = self._score(arm, shape, rate, rows)
            if score > best_score:
                best, best_score, budget, cap = a, score, nodes + 1, depth
        return best, state, budget, cap

    def _rate(self, draws: dict):
        """This step's Thompson draw of a cell's acceptance (each cell drawn once, kept in ``draws``)."""
        def rate(cell) -> float:
            if cell not in draws:
                draws[cell] = self.acceptance.draw(cell, self.rng)
            return draws[cell]
        return rate

    def _score(self, arm: tuple[int, ...], shape, rate, rows: int = 1) -> tuple[float, int, int]:
        """``(tokens per second, draft nodes, depth)`` of ``arm``'s tree ``shape`` sized with the
        acceptance ``rate`` per cell, at the depth that pays best (each level costs each member
        one drafting call). Levels deeper than the shape are weighed too (its best deepest node's
        chain continued, valued by that drafter's cells further down), so trees grow where the
        drawn acceptance says more levels pay. A member's catch-up over the steps it
        did not draft is not charged: it is owed whenever the member drafts again, and charging it
        to one step made a member look the worse the longer it had been left out, so it was never
        tried again."""
        tree, sources = shape
        verify = partial(self.cost.verify, rows=rows)
        per_level = sum(self.cost.draft(m) for m in arm)
        values = node_values(tree, sources, rate)
        kept, _ = size_tree(tree, values, verify, per_level * max(1, tree.depth), self.config.max_nodes)
        depths = tree.depths.tolist()
        gain = [0.0] * (tree.depth + 2)
        count = [0] * (tree.depth + 2)
        for i in kept[1:]:
            gain[depths[i]] += values[i]
            count[depths[i]] += 1
        deepest = max((i for i in kept[1:] if depths[i] == tree.depth), key=lambda i: values[i], default=None)
        if deepest is not None and sources[deepest]:  # levels below the shape: its best chain, continued
            m, key, d, _, bucket = sources[deepest][0]
            value, gain, count = values[deepest], gain[:-1], count[:-1]
            while value > VALUE_FLOOR and len(gain) <= self.config.max_nodes:
                value *= rate((m, key, len(gain), 0, bucket))
                gain.append(value)
                count.append(1)
        best, tokens, n = (1.0 / verify(1), 0, 0), 1.0, 0
        for d in range(1, len(gain)):
            tokens, n = tokens + gain[d], n + count[d]
            r = tokens / (per_level * d + verify(n + 1))
            if r > best[0]:
                best = (r, n, d)
        return best

    def propose(self, ctx: DraftContext, clock=time.perf_counter, rows: int = 1) -> "StepPlan":
        """:meth:`plan`, every planned member's ``propose`` timed on ``clock`` (the engine's),
        then :meth:`assemble`: this step's plan with its tree (root-only on the plain arm)."""
        plan = self.plan(ctx, rows)
        results = []
        for m, mctx in plan.calls:
            t0 = clock()
            proposal = Proposal.of(self.members[m].propose(mctx))
            results.append((proposal, clock() - t0))
        return self.assemble(plan, results)

    def plan(self, ctx: DraftContext, rows: int = 1) -> "StepPlan":
        """This step's choice (:meth:`choose`) as a :class:`StepPlan`: the members it asks, each
        with its context (none on the plain arm). The caller runs them (a batch runs every row's
        calls to one member together, :meth:`~selfspec.drafters.base.Drafter.propose_many`) and
        hands the results to :meth:`assemble`."""
        draws: dict = {}
        a, state, budget, cap = self.choose(ctx, draws, rows)
        arm = self.arms[a]
        calls = [(m, replace(ctx, point_mass=len(arm) > 1 and m != arm[0], max_nodes=budget,
                             max_depth=ctx.max_depth if cap is None else min(ctx.max_depth, cap),
                             cache=ctx.cache if len(arm) == 1 and self.members[m].requires.target_cache else None))
                 for m in arm]
        return StepPlan(a, state, ctx, calls, draws, rows)

    def assemble(self, plan: "StepPlan", results: list[tuple[Proposal, float]]) -> "StepPlan":
        """The planned members' proposals with each one's drafting seconds (in ``plan.calls``'
        order) merged, cut by this step's draws and recorded: ``plan`` with its tree filled in."""
        ctx, arm = plan.ctx, self.arms[plan.arm]
        bucket = temperature_bucket(ctx.sampling.temperature)
        if len(results) != len(arm):
            raise ValueError(f"assemble got {len(results)} proposals for an arm of {len(arm)} members")
        parts, spent, handoff = [], 0.0, None
        for (m, mctx), (proposal, seconds) in zip(plan.calls, results):
            proposal = Proposal.of(proposal)
            spent += seconds
            tree = _checked_tree(proposal, mctx)
            self.cost.record_draft(m, seconds, self._behind(m, ctx), round(self.usual), tree.depth)
            self.seen[m] = ctx.tokens.shape[0]
            handoff = proposal.handoff
            parts.append((tree, member_sources(tree, m, plan.state[m], bucket)))
            self.shapes[((m,), (plan.state[m],))] = parts[-1]
        if not parts:
            tree, sources, drafted = DraftTree.root_only(ctx.root_token), [[]], 1
        else:
            tree, sources = merge(parts) if len(parts) > 1 else parts[0]
            drafted = tree.num_nodes
            if len(parts) > 1:
                self.shapes[(arm, plan.state)] = (tree, sources)
            if handoff is None and not self.config.fixed:  # cut by this step's draws: nodes the
                values = node_values(tree, sources, self._rate(plan.draws))  # means would cut get tested too
                keep, _ = size_tree(tree, values, partial(self.cost.verify, rows=plan.rows), spent,
                                    self.config.max_nodes, cut_sampled=False)
                tree, sources = subtree(tree, keep), [sources[i] for i in keep]
        self.arm_steps[plan.arm] += 1
        plan.tree, plan.sources, plan.draft_s, plan.drafted, plan.handoff = tree, sources, spent, drafted, handoff
        return plan

    def offer(self, plan: "StepPlan") -> tuple[list[float], list[float]] | None:
        """An assembled plan's tree as a batch weighs it (:func:`~selfspec.control.budget.node_budget`):
        ``(values of the nodes that cannot be cut, values of the others in the order the sizing
        rule takes them)``, by this step's acceptance draws; ``None`` when nothing may be cut (no
        tree, a layer handoff, ``fixed``)."""
        tree = plan.tree
        if plan.handoff is not None or self.config.fixed or tree is None or tree.num_nodes == 1:
            return None
        values = node_values(tree, plan.sources, self._rate(plan.draws))
        sampled = pinned(tree)
        rest = set(range(1, tree.num_nodes)) - set(sampled)
        plan.order = sampled, take_order(tree, values, [0] + sampled, rest, len(rest))
        return [values[i] for i in sampled], [values[i] for i in plan.order[1]]

    def cut(self, plan: "StepPlan", n: int) -> DraftTree:
        """Cut ``plan``'s tree (after :meth:`offer`) to ``n`` draft nodes: its uncuttable ones,
        then the others in :meth:`offer`'s order. Returns the tree to verify."""
        sampled, order = plan.order
        keep = sorted([0] + sampled + order[: max(0, n - len(sampled))])
        plan.tree, plan.sources = subtree(plan.tree, keep), [plan.sources[i] for i in keep]
        return plan.tree

    def observe(self, plan: "StepPlan | None", tree: DraftTree, verdict: Verdict, tokens: list[int],
                verify_s: float | None = None) -> None:
        """Record the verified step: ``tree`` (``plan``'s tree, or a root-only tree when ``plan``
        is ``None``: a plain step the controller was not asked about), ``tokens`` committed;
        ``verify_s`` (the row's share of the pass) goes into the trace only: the caller records
        passes in the cost model."""
        self.usual += USUAL_EMA * (len(tokens) - self.usual)
        proposed = set(self.arms[plan.arm]) if plan is not None else set()
        if plan is not None:
            on_path, parents = set(verdict.path), tree.parents.tolist()
            outcomes: dict[int, list] = {m: [] for m in proposed}
            for i in range(1, tree.num_nodes):
                if parents[i] in on_path:
                    for cell in plan.sources[i]:
                        outcomes[cell[0]].append((cell, i in on_path))
            for m, cells in outcomes.items():
                self.acceptance.record(m, cells)
            if self.trace is not None:
                self.trace.append(dict(arm=self.arms[plan.arm], state=plan.state, drafted=plan.drafted,
                                       nodes=tree.num_nodes, accepted=verdict.num_accepted, draft_s=plan.draft_s,
                                       verify_s=verify_s))
        for m, member in enumerate(self.members):
            member.observe(Step(tokens, tree, verdict, m in proposed))

    def _behind(self, m: int, ctx: DraftContext) -> int:
        """Positions member ``m`` has to catch up on before drafting from ``ctx``."""
        return ctx.tokens.shape[0] - self.seen[m]

    def _shape(self, arm: tuple[int, ...], state: tuple[int, ...], bucket: int):
        """The arm's latest tree in this state (a merge never run here: its members' latest trees
        merged), re-keyed to this temperature bucket; ``None``: never run."""
        keys = tuple(state[m] for m in arm)
        shape = self.shapes.get((arm, keys))
        if shape is None and len(arm) > 1:
            parts = [self.shapes.get(((m,), (state[m],))) for m in arm]
            if any(p is None for p in parts):
                return None
            try:
                shape = merge([(t, s) for t, s in parts])
            except ValueError:  # a stale sampled tree in second place: count it as point masses
                return None
        if shape is None:
            return None
        tree, sources = shape
        return tree, [[c[:4] + (bucket,) for c in cells] for cells in sources]


def _checked_tree(proposal: Proposal, ctx: DraftContext) -> DraftTree:
    """The proposal's tree, checked against ``ctx`` and cut to ``ctx.max_depth`` (a tree with a
    layer handoff cannot be cut: its nodes' KV is written)."""
    tree = proposal.tree
    if not isinstance(tree, DraftTree):
        raise ValueError(f"drafter returned {type(tree).__name__}, expected a DraftTree or a Proposal")
    if int(tree.tokens[0]) != ctx.root_token:
        raise ValueError(f"drafter returned a tree rooted at {int(tree.tokens[0])}, expected {ctx.root_token}")
    if ctx.point_mass and bool((tree.laws[1:] != 0).any()):
        raise ValueError("drafter returned sampled children where point masses were asked for")
    if proposal.handoff is not None:
        if ctx.cache is None:
            raise ValueError("drafter returned a layer handoff without being given the target's cache")
        if tree.depth > ctx.max_depth:
            raise ValueError(f"drafter returned a tree of depth {tree.depth} > max_depth {ctx.max_depth} with a layer handoff")
        return tree
    return tree.prune_depth(ctx.max_depth)
