"""Union of drafters: several deterministic draft trees merged into one trie, budgeted by value.

Each member proposes a tree for the same root. Every member node gets a *value*: the estimated
probability that verification accepts it, i.e. the product along its path of the member's measured
acceptance rate at that (depth, sibling rank), where the rate of (member, depth d, rank r) is the
share of steps in which the member's rank-r child of an accepted depth-(d-1) node was accepted
(a count decayed over the steps that ask the member, with a Beta(1, 0.5) prior: a new union
starts optimistic, at 2/3, verifies what its members propose and learns within a few steps). Nodes proposed by several
members take the best value. The union keeps the highest-value nodes (ancestors first; a path
value never exceeds its parent's) while the value is at least ``min_value`` and within
``max_nodes`` (default: the largest ``cfg.max_nodes`` of the members, e.g. a head's calibrated
tree, where a member without a ``cfg`` counts as 16: prompt lookup keeps its options in ``config``,
so ``eagle3+ngram`` budgets 16 nodes, as every union result so far was measured): weak
nodes of one member no longer crowd out a strong member's draft, and nodes
that would rarely be accepted are not verified at all, so the union does not pay for them. A
member whose best depth-1 node is worth less than ``min_value`` is not even asked for its tree in
a merged step (its own arm's probes re-measure it).

A merge still pays every member's drafting time and verify budget, so it can lose to one of its
members alone (a weak member's heads cost milliseconds every step on a CPU), and a member can lose
to plain decoding. The union therefore chooses per step among *arms*: **plain** (a root-only tree:
no drafting, one token), each member alone, and the merge of all, by measured output tokens per
second of the steps each arm ran (time from one proposal to the next, as decayed sums of tokens and
seconds). It is *self-paced* (:attr:`Drafter.self_paced`): the engine's adaptive policy only caps
its depth and never backs it off, because one shared back-off would punish a paying member for a
slow one's steps; the plain arm does that job per context state instead. Which arm wins depends
on the context: prompt lookup alone is best while the output copies its context (extraction, code
edits), a trained head (or plain steps) where nothing matches. Members say how promising a context
looks through :meth:`~selfspec.drafters.base.Drafter.context_key` (prompt lookup: the longest
n-gram that matched, and whether it runs on for 8 or 16 tokens: a copy); the *context state* is the tuple of all members' keys, and each arm's speed
is kept under the keys of its own members only: plain steps once, a member alone per its own key
(prompt lookup with a 4-gram match is as fast whatever the head's key says), the merge per state.
A member alone is tried as soon as its own key is new and no merged step has measured it there (a
member has few keys, so this exploration is bounded); the merge, new in a state, borrows its speed
over all states. A member may declare the key under which it drafts nothing
(:attr:`~selfspec.drafters.base.Drafter.empty_key`: prompt lookup without a match); with
``skip_idle=True`` the union then runs, in such a state, neither that member alone (a plain step at
a drafter's cost) nor a merge left with fewer than two members that draft (one member's merged tree
at a merge's cost), and does not ask it for a tree (:meth:`UnionDrafter.live_arms`; off by default:
it did not pay where measured, round 37). A member may also declare the key under which it
*abstains* for the rest of the generation (:attr:`~selfspec.drafters.base.Drafter.abstain_key`:
an EAGLE-3 head whose read of the prompt found it unfamiliar, ``min_familiar``); the union then
leaves it out of every arm there whatever ``skip_idle`` says (on the adversarial prompts a fresh
union otherwise explored such a head where prompt lookup was idle, 1-3 tokens a step at up to
twice a plain step's time, up to 16 times in one generation; round 42). At most one step in
``probe_every`` probes another arm, so all estimates stay current. Probes are scheduled per
arm and its members' keys, like its speed (plain steps once for all states): an arm whose probe
finds it still more than 10% slower than the best is probed half as often (down to every
``16 * probe_every`` steps; at once that rarely when it runs at less than half the best; back to
every ``probe_every`` once within 10%), so exploring clearly losing arms costs little even in short
generations. A member's step that drafted nothing is a plain step and also measures the plain arm.
An arm that never ran is not tried blindly: the merge runs first,
and its steps price every other arm: a member alone at the tokens the merge credits it with (see
below) and plain steps at one token, each at a merged step's seconds less the timed drafting of
the members it leaves out. Only where no merged step has measured a member's own key is that member
tried alone (on short generations such blind trials were most of a union's loss to its best member).
Arms are compared on the same steps where possible (*paired estimates*, see
:meth:`UnionDrafter._own_estimate`): a merged step credits each member with what it alone would
have accepted there, and the merge's speed is its paired gain over its best member; comparing arms
only on the different stretches each ran made a merge look faster than prompt lookup alone by
luck. An arm whose estimate is under half the best is probed only every ``16 * probe_every`` steps
(a probe costs most there; never probing it would freeze an estimate one unlucky step made).
A simpler arm within 5% of the fastest estimate is preferred to it (estimates are noisy, and the
luckiest arm would otherwise be chosen: a merge must be clearly faster than a member alone).
A member's tokens per step carry one pseudo-step at what the *value model* below expects of its
latest tree under that key (one plus the sum of its nodes' acceptance probabilities), and an arm
whose tokens rest on fewer than ``min_samples`` steps, and whose model says it could still be the
best, is due every ``probe_every // 4`` steps instead of ``probe_every``, and never waits longer
after a losing probe. Accepted lengths vary from 1 to 5 step to step: on the demo's prompt a good
head's first step accepted nothing, its arm was priced below plain steps on that one step and was
not tried again for 32 steps, a quarter of the generation. The model pools every tested node over
all keys, so a member that is never right is not explored again under each new key.
The model learns from the same unlucky steps, though: at T=0.7 a head's first steps of a reply (a
title, the first words) are often all wrong, its measured tokens per step and its model both said
about one token a step, below plain steps at its cost, and on the probe schedule (one probe in 16
steps, each of weight one against ten) a fresh union ran plain steps for most of MT-Bench's first
writing turn (0.81x of the head alone in round 32; in 11 of 16 fresh unions there). So a member
alone is also due every ``probe_every // 4`` steps while it *could* still be the best: while its
upper estimate (:meth:`UnionDrafter._upper_estimate`: its tokens per step ``upper_z`` standard
errors higher, the spread measured over its steps, its seconds with what switching to it costs
now) beats the fastest arm's estimate. Such probes may spend ``promising_budget`` times the
exploration budget below; a member that is never right has a small spread and does not qualify.
So in every state the union runs what its best member
with its own policy would run there (that member, or plain steps), up to the probes. Members not
asked in a step are told to ``skip`` it (so feature-reading drafters stay in sync). Which arm
drafts depends only on committed tokens and measured past steps, never on the current draws, so
every step stays exact.

A member that skipped steps first catches up on them (:meth:`~selfspec.drafters.base.Drafter.sync`:
an EAGLE-3 head runs its layer over every position it skipped), which is timed apart from its
drafting: it is charged per position synced, for as many positions as the step emitted, which is
what the member syncs in a step of its own (a generation's first call, which runs the head over
the whole prompt, included). Charged whole, a probe after a long stretch of other
arms' steps paid for that whole stretch (a head that paid alone, 1.2x over plain steps, was
measured slower than plain steps inside the union), so the longer a member was left out, the worse
it looked, and the less it was probed.

That per-position charge prices an arm as it runs step after step; switching to it after a
stretch of other arms' steps costs its whole catch-up first. With ``switch_cost=True`` the arm
choice adds a *switching cost* (:meth:`UnionDrafter._with_switching`): each member's catch-up over the positions
it is behind (seconds per position measured on its catch-ups of at least ``long_catch_up``
positions; prompt lookup's is free), spread over the steps the current context state is expected
to last (the mean of its completed runs of consecutive steps). On the adversarial prompts an
EAGLE-3 head that barely beat plain steps where prompt lookup found no match was switched to at a
generation's start, paying its catch-up over the prompt for a step or two; where a state lasts,
as in prose, the cost spreads thin. Measured side by side in round 31 (docs/benchmarks.md) it did
not pay: level or up to 2% slower on the adversarial prompts, MT-Bench and BFCL, every interval
including or touching 1.00x; so it is off by default (``switch_cost=True`` turns it on). The
statistics it reads are kept either way. Probes are budgeted by their real cost, catch-up whole
(below).

A member's first call in the process counts at most as much as the rest of its step (the verify
pass and the other members' drafting), in the step's time and as the member's drafting time. A
first call pays one-off costs (kernel selection, weight packing: about half a second for an
EAGLE-3 head in bf16 here, ten verify passes), and one such step would price its arm, and every
arm modeled from it, far too slow for a long time (an arm under half the best is probed rarely).
A capped first call still errs on the slow side, which the arm's next steps correct.

At T > 0 one member may keep sampling in merged steps, the *anchor* (the first member that
samples, :meth:`~selfspec.drafters.base.Drafter.may_sample`, e.g. an EAGLE-3 head): its tree is
kept as drafted, sampled children and their recorded laws, and the other members' point-mass nodes
are *grafted* on it, each after every child its parent already has, by value within the node
budget (:meth:`UnionDrafter._graft`, which says why this is exact). Other members that can sample
draft point masses in merged steps (:meth:`~selfspec.drafters.base.Drafter.point_mass_when_merged`):
two sampled trees cannot merge, a sampled child's law being tied to its own siblings. A member
that drafts alone and samples has its tree passed through as drafted: the member-alone arm is the
member as it runs on its own. (Until round 25 the union asked for point-mass trees in every step;
at T=0.7 its head arm then accepted less than the head alone, and the union ran plain steps where
the head paid: ``scripts/union_arms.py``. In round 25 the head sampled alone but drafted point
masses in merged steps, so at T=0.7 a merge paid only where prompt lookup's nodes made up for the
head's weaker point-mass nodes.) The anchor's sampled nodes count in its acceptance rates like
point-mass ones (at T > 0 they are what it drafts, alone or merged).

A member asked in a merged step is told so (``ctx.merged``): a member built by
:meth:`~selfspec.drafters.base.Drafter.for_merging` (an EAGLE-3 head with a tree calibrated inside
the union) drafts that tree there, and its own tree in the steps it drafts alone. (With one tree for
both, the member-alone arm ran the union's tree, 5/3/8, where the head alone runs 4/2/6: measured
slower alone. On MT-Bench's writing turns, where nothing is copied, the union ran 0.90x of its
best member in one run with one tree and 1.06x in the next with two; per-category runs here are
noisy, so this is a sign, not a proof.)

Exploring costs time: a probe runs an arm estimated slower than the best, and its step also pays
its members' whole catch-up (an EAGLE-3 layer over every position it skipped; the prompt, the first
time in a generation), which the arm's estimate spreads over the positions it syncs. In short
generations where one member always wins (prompt lookup on copy-heavy text), probes on the
schedule alone lost about a step per generation. Probes are therefore rationed: the *regret* of
every exploring step (its real seconds less what the best arm's estimate would take for its
tokens) is kept as a decayed sum, and no probe runs while it exceeds the exploration budget below
(:meth:`UnionDrafter._may_explore`; from a fresh union's first step on, as if it had run for the
decay horizon at that step's pace). Nor does a probe run when fewer tokens are
left in the generation than the deepest draft a member made: its step would be cut short, cost as
much, and price its arm by a truncated draft. (Since round 39 prompt lookup's grown chains make
that up to 32 tokens: no probe runs in a generation's last 32 once a chain grew that deep; the
round-39 measurements include this.)

*Shadow guesses* (``shadow=True``, off by default) make exploring a member that can name its first
token cheaply (:attr:`~selfspec.drafters.base.Drafter.guesses_first`: an EAGLE-3 head, by its
catch-up and one draft LM head, no draft layer call, no tree, nothing verified) cost a fraction of
a probe. A probe of such a member alone is a shadow instead while fewer than ``min_samples`` of its
first guesses were tested in the context state, or while its value model, with those guesses,
says it cannot beat the best arm there: the best arm runs, the member catches up and guesses, and
the step's first new token tests the guess (the member's own steps test their rank-0 depth-1 child
too). For that decision only, the member's expected tokens beyond the first in a state are scaled
by how often its first guess is right there against over its own steps, never up
(:meth:`UnionDrafter._guessed_tokens`); the estimates the union runs its arms by are unchanged
(scaled into them, the guesses priced the merge too and the union ran the head less where it
paid). The tree is never changed by a guess, so exactness is untouched. On the adversarial
prompts (round 38) a head step where prompt lookup finds no match cost 12-20 ms more than a plain
step (33-41 ms); a shadow guess 2-7 ms, mostly the catch-up over the positions the head skipped
(2.2 ms after 7, 7.2 ms after 243), which a probe pays on top.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ..tree import DraftTree, Law, TreeBuilder
from ..verify import Verdict
from .base import DraftContext, Drafter, Proposal


class UnionDrafter(Drafter):
    """Merges the trees of ``members`` (point-mass children, grafted on the sampling anchor's
    tree at T > 0) by measured value.

    Args:
        members: the drafters (the first that samples is the anchor; the others' sampled trees
            are asked for as point-mass trees in merged steps).
        max_nodes: node budget of a merged tree (default: the largest member ``cfg.max_nodes``,
            16 for a member without a ``cfg``; see the module docstring).
        min_value: merged nodes whose estimated acceptance is below it are not verified.
        decay: decay of a member's acceptance counts per step that asks it.
        probe_every: at most one step in this many probes an arm other than the best; each arm
            is due every this many steps (less often while it keeps losing, see above).
        rate_decay: per-step decay of an arm's token and second sums (its tokens/s is their ratio).
        explore_budget: share of the recent decode time that probes may lose against the best
            arm's estimate (their *regret*, catch-up included) whatever the union earned; past
            it (and past ``explore_share`` of the profit), no probe runs until the share decays
            back (see :meth:`_may_explore`).
        explore_share: share of the union's recent *profit* (seconds saved against its best
            single member, see the module docstring) that probes may lose on top of
            ``explore_budget``.
        clock: seconds as a float (default ``time.perf_counter``; tests inject a step clock).
        sampled_merge: keep the first member that samples (:meth:`Drafter.may_sample`) sampling
            in merged steps, other members' point-mass nodes grafted after its children (default);
            ``False``: every member drafts point masses in merged steps (the union until round 26).
        switch_cost: choose each step's arm with what switching to it costs (its members'
            catch-up over the positions they skipped, spread over the steps the context state is
            expected to last; :meth:`_with_switching`); default ``False``: by the arms' estimates
            alone (measured as fast or faster in round 31; see the module docstring).
        upper_z: standard errors above a member's measured tokens per step at which it *could*
            still be the best arm (:meth:`_upper_estimate`); such an arm is probed every
            ``probe_every // 4`` steps. Any value <= 0 turns this off (as until round 32, but with
            the budget's stationary start, which is not an option).
        promising_budget: exploration budget, in multiples of ``explore_budget``, for probes of
            arms that could still be the best (others stop at ``explore_budget``).
        skip_idle: in a context state where a member's key is its ``empty_key`` (it would draft
            nothing), run neither it alone nor a merge that leaves fewer than two other members
            (:meth:`live_arms`), and keep a member alone's speed apart where another member is
            idle (:meth:`arm_key`). Default ``False`` (every arm in every state): measured side by
            side in round 37 it was level on the adversarial prompts, MT-Bench greedy and BFCL,
            and under the union without it at T=0.7 in two runs (0.95x, CI 0.87-1.03, with
            ``lower_z=1``; 0.96x, CI 0.83-1.11, without).
        lower_z: standard errors below a member's measured tokens per step at which it must still
            beat a simpler arm (plain steps) to be run rather than it (:meth:`_lower_estimate`,
            :meth:`_best`); any value <= 0 turns this off. Default 0 (off): measured in round 37
            with ``lower_z=1`` (and ``skip_idle=True``) against the union without either, level on
            the adversarial prompts, MT-Bench greedy and BFCL, 0.95x at T=0.7 (CI 0.87-1.03).
        shadow: a probe of a member alone that can name its first token cheaply
            (:attr:`~Drafter.guesses_first`, an EAGLE-3 head) is a *shadow guess* while fewer than
            ``min_samples`` of its first guesses were tested in the context state or its value
            model says it cannot beat the best arm there: the best arm runs and the member only
            guesses; how often its first guess is right in the state scales what its value model
            expects of it there, for that decision only (:meth:`_guessed_tokens`; see the module
            docstring). Default ``False``.
    """

    kind = "union"
    self_paced = True  # picks plain steps itself, per context state (the plain arm)

    def __init__(self, members: list[Drafter], max_nodes: int | None = None, min_value: float = 0.05,
                 decay: float = 0.98, probe_every: int = 16, rate_decay: float = 0.9,
                 explore_budget: float = 0.005, explore_share: float = 0.05, clock=time.perf_counter,
                 sampled_merge: bool = True, switch_cost: bool = False, upper_z: float = 2.0,
                 promising_budget: float = 2.0, skip_idle: bool = False, lower_z: float = 0.0,
                 shadow: bool = False):
        if not members:
            raise ValueError("a union drafter needs at least one member")
        if max_nodes is None:  # never verify more nodes than the largest member would on its own
            max_nodes = max(int(getattr(getattr(m, "cfg", None), "max_nodes", 16)) for m in members)
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        if not 0.0 <= min_value < 1.0 or not 0.0 < decay <= 1.0 or not 0.0 < rate_decay <= 1.0:
            raise ValueError(f"min_value must be in [0, 1), decay and rate_decay in (0, 1], got "
                             f"{min_value}, {decay}, {rate_decay}")
        if probe_every < 2:
            raise ValueError(f"probe_every must be >= 2, got {probe_every}")
        if promising_budget < 1.0:
            raise ValueError(f"promising_budget must be >= 1 (a multiple of explore_budget), got {promising_budget}")
        if not 0.0 <= explore_budget <= 1.0 or not 0.0 <= explore_share <= 1.0:
            raise ValueError(f"explore_budget and explore_share must be in [0, 1], got {explore_budget}, "
                             f"{explore_share}")
        super().__init__(members[0].signature)
        # the sampling anchor (see the module's docstring): its sampled trees merge as drafted
        self.anchor = next((i for i, m in enumerate(members) if m.may_sample()), None) if sampled_merge else None
        members = [m if i == self.anchor else m.point_mass_when_merged() for i, m in enumerate(members)]
        self.members, self.max_nodes, self.min_value, self.decay = members, max_nodes, min_value, decay
        self.needs_hidden = any(m.needs_hidden for m in members)
        self.uses_tools = any(m.uses_tools for m in members)
        self.learns_from_outputs = any(m.learns_from_outputs for m in members)
        taps = {m.taps for m in members if m.taps}
        if len(taps) > 1:
            raise ValueError(f"union members read different target taps {sorted(taps)}")
        self.taps = taps.pop() if taps else ()
        self.hits: dict[tuple[int, int, int], float] = {}  # (member, depth, rank) -> decayed hits
        self.tests: dict[tuple[int, int, int], float] = {}
        self._sources: list[list[tuple[int, int, int]]] = []  # union node -> its (member, depth, rank)s
        # (member, its context key) -> its latest tree there, as (parent index, depth, rank) per node
        self.shapes: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        # arms: plain (no member), each member alone, then all merged (tuples of member indices)
        self.arms: list[tuple[int, ...]] = [()] + [(i,) for i in range(len(members))]
        if len(members) > 1:
            self.arms.append(tuple(range(len(members))))
        # decayed [tokens, seconds] per (arm, the keys of the arm's members) and per arm over all keys
        self.sums: dict[tuple[int, tuple[int, ...]], list[float]] = {}
        self.pooled_sums: list[list[float] | None] = [None] * len(self.arms)
        # the two factors of an arm's speed, kept apart (see `estimates`): decayed [tokens, steps]
        # over the arm's own steps *and* the merged steps it took part in (what it alone would have
        # accepted there: paired with the merge on the same steps), and [seconds, steps] of its own
        # steps only
        self.token_sums: dict[tuple[int, tuple[int, ...]], list[float]] = {}
        self.token_squares: dict[tuple[int, tuple[int, ...]], float] = {}  # decayed sums of squared tokens
        self.second_sums: dict[tuple[int, tuple[int, ...]], list[float]] = {}
        self.pooled_seconds: list[list[float] | None] = [None] * len(self.arms)
        # per (context state, member): decayed [merge's tokens, the member's alone] over merged steps
        self.paired: dict[tuple[tuple[int, ...], int], list[float]] = {}
        self.state_steps: dict[tuple[int, ...], int] = {}
        self.arm_steps = [0] * len(self.arms)  # how many steps each arm ran (diagnostics)
        self.plain_steps = 0  # plain steps measured (own or empty drafts), ever
        self.probe_every, self.rate_decay, self.clock = probe_every, rate_decay, clock
        self.probe_margin, self.max_probe_wait, self.select_margin = 0.1, 16 * probe_every, 0.05
        self.min_samples = 3.0  # own steps (decayed count) before a losing probe lengthens the wait
        self.upper_z, self.promising_budget = float(upper_z), float(promising_budget)  # see `_upper_estimate`
        self.skip_idle = skip_idle  # see `live_arms`
        self.lower_z = float(lower_z)  # see `_lower_estimate`
        # shadow guesses (see `_guessed_tokens`): per (member, context state) decayed [hits, tests] of the
        # member's first guess, from shadows and its own steps; per member the same over its own
        # steps only (decayed like its acceptance counts); this step's guesses (member -> (token,
        # from a step of its own)); the member to shadow this step and what the shadow cost
        self.shadow = shadow
        self.guess_sums: dict[tuple[int, tuple[int, ...]], list[float]] = {}
        self.guess_pooled: dict[int, list[float]] = {}
        self._guesses: dict[int, tuple[int, bool]] = {}
        self._shadow_member: int | None = None
        self._shadow_seconds = 0.0
        self.shadows = 0  # shadow guesses taken (diagnostics)
        self._arm_keys: dict = {}  # (arm, state) -> arm_key
        # expected_tokens per (member, key), valid while `_counts` (bumped whenever a member's
        # counts or latest tree change) is what it was when computed
        self._counts, self._expected = 0, {}
        self.draft_seconds: list[list[float] | None] = [None] * len(members)  # decayed [seconds, calls]
        self.warm = [False] * len(members)  # has a step with the member's call been timed?
        self._seen: list[int | None] = [None] * len(members)  # committed length at its last call
        # the pending step's member calls: (member, sync seconds, positions synced, propose seconds, first)
        self._calls: list[tuple[int, float, int, float, bool]] = []
        self.probe_wait: dict[tuple, int] = {}  # (arm, its members' keys) -> steps between its probes
        self.last_probe: dict = {}  # (arm, keys) -> step of its last probe; None -> of the last probe
        self.steps = 0  # steps decided so far (over all generations)
        # exploration's cost: decayed [regret seconds, seconds] over all steps; and what it may spend:
        # decayed seconds each member alone would have taken, then the union's own (see `profit`)
        self.explore_budget, self.explore_share, self.explore_decay = explore_budget, explore_share, 0.99
        self.regret = [0.0, 0.0]
        self.alone: list[float] | None = None  # decayed seconds of each member alone, then the union's
        self.deepest = 0  # the deepest node any member drafted (no probe runs with less room left)
        # switching costs (see `_switch_seconds`): decayed [catch-up seconds, positions] per member
        # over catch-ups of at least `long_catch_up` positions, and per context state decayed
        # [steps, runs] of its completed runs of consecutive steps; the current run
        self.long_catch_up, self.switch_cost = 32, switch_cost
        self.catch_up: list[list[float] | None] = [None] * len(members)
        self.stay: dict[tuple[int, ...], list[float]] = {}
        self._run: tuple[tuple[int, ...] | None, int] = (None, 0)
        self._state: tuple[int, ...] = ()
        self._arm, self._pending, self._asked = len(self.arms) - 1, None, set()

    def idle_members(self, state: tuple[int, ...]) -> set[int]:
        """Members whose key in context ``state`` is their :attr:`~Drafter.abstain_key` (they draft
        nothing for the rest of the generation: an EAGLE-3 head that read the prompt as
        unfamiliar), and with ``skip_idle=True`` those whose key is their
        :attr:`~Drafter.empty_key` (they would draft nothing this step: prompt lookup without a
        match)."""
        return {m for m, member in enumerate(self.members)
                if (member.abstain_key is not None and state[m] == member.abstain_key)
                or (self.skip_idle and member.empty_key is not None and state[m] == member.empty_key)}

    def live_arms(self, state: tuple[int, ...]) -> list[int]:
        """The arms worth running in context ``state``: plain steps; each member alone unless idle
        (:meth:`idle_members`: its step would be a plain step at a higher cost); a merge with at
        least two members that are not idle (else it is one member's tree, or plain steps, at a
        merge's cost: with prompt lookup idle, ``eagle3+ngram``'s merge is the head drafting its
        merged tree, which on the adversarial prompts the union ran as its best arm 14 times in
        12 generations, at 1.2 tokens a step where plain steps were faster, round 37). Its idle
        members are not asked in a merged step. With ``skip_idle=False`` (the default), every
        arm but those of a member that abstains (:attr:`~Drafter.abstain_key`)."""
        idle = self.idle_members(state)
        return [a for a, arm in enumerate(self.arms)
                if not arm or (len(arm) == 1 and arm[0] not in idle) or len(set(arm) - idle) >= 2]

    def arm_key(self, arm: int, state: tuple[int, ...]) -> tuple:
        """The part of context ``state`` an arm's speed is kept under: its own members' keys, and
        for a member alone whether each other member that declares an ``empty_key`` is idle
        (:meth:`idle_members`; not with ``skip_idle=False``). A head alone runs where prompt
        lookup finds no match, and the merge where it does; a head's acceptance differs between
        the two (where the output copies its context, the head is right more often too: on
        MT-Bench and the adversarial prompts, round 37), so its speed with prompt lookup idle is
        measured there, not borrowed from merged steps elsewhere."""
        key = self._arm_keys.get((arm, state))
        if key is None:  # (asked some twenty times a step: kept per (arm, state); states are few)
            key = tuple(state[m] for m in self.arms[arm])
            if len(self.arms[arm]) == 1 and self.skip_idle:
                key += tuple(state[m] == member.empty_key for m, member in enumerate(self.members)
                             if m not in self.arms[arm] and member.empty_key is not None)
            self._arm_keys[(arm, state)] = key
        return key

    @property
    def rates(self) -> dict[tuple[int, ...], list[float | None]]:
        """Estimated tokens/s of each arm (``None``: no tokens measured under this state's keys),
        per context state seen."""
        return {state: [self._own_estimate(a, state) for a in range(len(self.arms))] for state in self.state_steps}

    @property
    def pooled(self) -> list[float | None]:
        """Measured tokens/s of each arm over all context states."""
        return [_ratio(s) for s in self.pooled_sums]

    @property
    def arm_rate(self) -> list[float | None]:
        """Measured tokens/s of each arm in the context state of the latest step."""
        return self.rates.get(self._state, [None] * len(self.arms))

    def check_target(self, model) -> None:
        for m in self.members:
            m.check_target(model)

    def reset(self) -> None:
        self._pending = None  # a new generation: no step to time across the gap
        self._end_run()
        self._calls, self._seen = [], [None] * len(self.members)
        for m in self.members:
            m.reset()

    def end(self, tokens: torch.Tensor, prompt_len: int) -> None:
        for m in self.members:
            m.end(tokens, prompt_len)

    def set_tools(self, tools) -> None:
        for m in self.members:
            if m.uses_tools:
                m.set_tools(tools)

    def _record(self, arm: int, state: tuple[int, ...], tokens: int, seconds: float) -> None:
        self.plain_steps += arm == 0
        key, d = (arm, self.arm_key(arm, state)), self.rate_decay
        old = self.sums.get(key) or [0.0, 0.0]
        self.sums[key] = [d * old[0] + tokens, d * old[1] + seconds]
        old = self.pooled_sums[arm] or [0.0, 0.0]
        self.pooled_sums[arm] = [d * old[0] + tokens, d * old[1] + seconds]
        self._count_tokens(key, tokens)
        _accumulate(self.second_sums, key, seconds, d)
        old = self.pooled_seconds[arm] or [0.0, 0.0]
        self.pooled_seconds[arm] = [d * old[0] + seconds, d * old[1] + 1.0]

    def _choose_arm(self, ctx: DraftContext) -> int:
        """Close the timing of the previous step, then pick this step's arm."""
        # the committed length at the previous step's start (a member called there is current)
        since = self._pending[3] if self._pending is not None else ctx.tokens.shape[0]
        if self._pending is not None:
            state, arm, start, length, tokens, probe, empty, ref, base = self._pending
            now = self.clock()
            if ctx.tokens.shape[0] == length + tokens and now > start:  # nothing ran in between
                seconds, real = self._charge_calls(now - start, tokens)
                seconds -= self._shadow_seconds  # a shadow guess is exploration, not the arm's cost
                self._explore(real, tokens, ref, base)
                self.regret[0] += self._shadow_seconds
                self._record(arm, state, tokens, seconds)
                if empty and arm != 0:  # an empty draft is a plain step: it measures the plain arm too
                    self._record(0, state, tokens, seconds)
                if probe:  # a probed arm that still loses is probed less often (at once the least
                    guess = self.estimates(state)  # often when it is worse than half the best)
                    key = (arm, self.arm_key(arm, state))
                    self.probe_wait[key] = self._next_wait(guess, arm, self.probe_wait.get(key, self.probe_every),
                                                           (self.second_sums.get(key) or [0.0, 0.0])[1])
        self._shadow_seconds, self._shadow_member = 0.0, None
        start = self.clock()  # the state's own cost counts towards the step it decides
        state = self._state = tuple(m.context_key(ctx) for m in self.members)
        if state != self._run[0]:
            self._end_run()
        self._run = (state, self._run[1] + 1)
        keys = [(a, self.arm_key(a, state)) for a in range(len(self.arms))]
        measured = [k in self.sums for k in keys]
        self.state_steps[state] = self.state_steps.get(state, 0) + 1
        self.steps += 1
        # an arm that a member's key says drafts nothing more than a simpler arm does is not run
        # here (see `live_arms`): its estimate is left out, so it is never tried, chosen or probed.
        # First try what was never run or priced (see `_modeled_seconds`), and a member alone whose
        # own key no step has measured yet (few keys per member); the merge, new in this state,
        # borrows its speed over all states; plain steps, where a member is idle, until min_samples
        # of them are measured (for all states: their modeled price, a merged step's less drafting,
        # overstates them by the merged tree's verify cost, and the idle member's empty drafts
        # measured them before `live_arms`; one slow first step must not price them for long).
        # Not where every member that declares an empty key drafts (a head that abstains leaves
        # arms out in every state: plain steps tried where prompt lookup matches cost its chain)
        live = self.live_arms(state)
        guess = [r if a in live else None for a, r in enumerate(self.estimates(state))]
        unknown = [a for a, r in enumerate(guess) if a in live
                   and (r is None or (len(self.arms[a]) == 1 and keys[a] not in self.token_sums)
                        or (a == 0 and self.plain_steps < self.min_samples and len(live) < len(self.arms)
                            and any(member.empty_key is not None and state[m] == member.empty_key
                                    for m, member in enumerate(self.members))))]
        unknown.sort(key=lambda a: -len(self.arms[a]))  # the merge first: its steps measure every member
        best = self._best(self._with_switching(guess, state, since) if self.switch_cost else guess, state)
        probe = False
        if unknown:
            arm = unknown[0]
        else:
            # at most one probe per probe_every steps; an arm is due after its own wait, counted
            # per (arm, its members' keys): plain steps are probed once for all states, a member
            # per its own key, the merge per state (unmeasured first, then the longest due)
            samples = [self._samples(a, state) for a in range(len(self.arms))]
            for a in live:  # keys seen for the first time: an arm whose borrowed
                if a != best and not measured[a] and keys[a] not in self.probe_wait:  # estimate loses
                    wait = self._next_wait(guess, a, self.probe_every, samples[a])  # clearly waits from now on, as if
                    if wait > self.probe_every:  # just probed (else each new state's merge is due at once)
                        self.probe_wait[keys[a]], self.last_probe[keys[a]] = wait, self.steps
            # (where the arm's estimate is under half the best only every max_probe_wait steps: a
            # probe there costs the most, but never probing it would freeze an estimate that one
            # unlucky step made)
            # An arm whose tokens per step rest on fewer than min_samples steps is due every
            # probe_every // 4 steps (and may follow another probe that soon) until they do; and so is
            # a member alone whose measured tokens per step could still make it the best (the upper
            # end of their spread, see `_upper_estimate`)
            top = guess[best] or 0.0
            fastest = max((r or 0.0) for r in guess)  # (the best may be a simpler arm a little slower)
            quick = max(1, self.probe_every // 4)
            could = [False] * len(self.arms)
            if self.steps >= self.last_probe.get(None, 0) + quick:  # (else no arm can be due: not computed)
                could = [(self._upper_estimate(a, state, since) or 0.0) > fastest for a in range(len(self.arms))]
            few = [(samples[a] < self.min_samples and (self._model_estimate(a, state) or 0.0) > top) or could[a]
                   for a in range(len(self.arms))]
            due = [a for a in live if a != best
                   and self.steps >= self.last_probe.get(None, 0) + (quick if few[a] else self.probe_every)
                   and self.steps >= self.last_probe.get(keys[a], 0) + (
                       quick if few[a] else self.probe_wait.get(keys[a], self.probe_every)
                       if (guess[a] or 0.0) >= 0.5 * (guess[best] or 0.0) else self.max_probe_wait)]
            due.sort(key=lambda a: (not few[a], measured[a], self.last_probe.get(keys[a], 0)))
            if due and not self._may_explore():  # exploration has spent its share of the time; arms
                # that could still be the best may spend promising_budget times as much
                due = [a for a in due if could[a]] if self._may_explore(self.promising_budget) else []
            room = ctx.max_depth if ctx.room is None else ctx.room  # (not the adaptive cap)
            if room < self.deepest:  # near the end of a generation a probe is cut short: its
                due = []  # step would price its arm by a truncated draft (and cost as much)
            arm, probe = (due[0], True) if due else (best, False)
            if probe:
                self.last_probe[keys[arm]] = self.last_probe[None] = self.steps
                if self.shadow and len(self.arms[arm]) == 1 and self.members[self.arms[arm][0]].guesses_first and (
                        self._guess_tests(self.arms[arm][0], state) < self.min_samples
                        or (self._model_estimate(arm, state) or 0.0) < top):
                    # a member alone that can name its first guess cheaply is shadowed (the best
                    # arm runs, the member only guesses) while few guesses were tested here or its
                    # value model, scaled down by them (`_guessed_tokens`), says it cannot beat
                    # the best arm (probes due by its upper estimate included); guesses never scale
                    # it up: such a member is re-measured here by merged steps and its guesses
                    self._shadow_member, arm, probe = self.arms[arm][0], best, False
        # an exploring step (a probe, a first trial) is priced against the best arm's estimate; every
        # step against each member alone (or plain steps, where faster: a member alone backs off)
        ref = guess[best] if arm != best and guess[best] else None
        base = None  # (a member whose key says it drafts nothing runs plain steps alone)
        alone = [guess[0] if 1 + m not in live else guess[1 + m] for m in range(len(self.members))]
        if guess[0] and all(alone):
            base = tuple(max(guess[0], r) for r in alone)
        self._pending = (state, arm, start, ctx.tokens.shape[0], 0, probe, False, ref, base)
        self._calls = []
        self.arm_steps[arm] += 1
        return arm

    def _explore(self, seconds: float, tokens: int, ref: float | None, base: tuple[float, ...] | None = None) -> None:
        """Account a closed step's time; for an exploring step its *regret*: its real seconds
        less what the best arm (by the estimate it was chosen against, ``ref`` tokens/s) would have
        taken for the same tokens. A probe's real cost includes its members' whole catch-up (an
        EAGLE-3 layer over every position it skipped: the prompt, the first time in a generation),
        which the arm's speed estimate deliberately spreads thin. And for every step the seconds
        each member alone would have taken for its tokens (``base[m]`` tokens/s: the member's
        estimate in the step's state, or plain steps' where faster, as a member alone backs off
        to them): :attr:`profit` is then the least of those sums less the real seconds, what the
        union saved against its best member over the recent steps, exploration included. All
        sums decay per step; the regret never goes below zero (a lucky probe pays back debt, it
        banks no credit)."""
        d = self.explore_decay
        regret = seconds - tokens / ref if ref else 0.0
        if self.regret[1] <= 0.0:  # the first step: decode time as if the union had run at its pace
            self.regret[1] = seconds / (1.0 - d)  # for the whole decay horizon (stationary: see `_may_explore`)
        self.regret = [max(0.0, d * self.regret[0] + regret), d * self.regret[1] + seconds]
        if base is not None:
            old = self.alone or [0.0] * (len(base) + 1)
            self.alone = [d * o + t for o, t in zip(old, [tokens / r for r in base] + [seconds])]

    @property
    def profit(self) -> float:
        """Decayed seconds the union saved against its best member alone over the recent steps
        (by the members' estimates; steps before every member had one are left out); can be
        negative."""
        return 0.0 if self.alone is None else min(self.alone[:-1]) - self.alone[-1]

    def _may_explore(self, scale: float = 1.0) -> bool:
        """Whether a probe may run now: exploration's recent regret is within ``scale`` times
        ``explore_budget`` of the recent decode time plus ``explore_share`` of the recent profit
        (``scale``: ``promising_budget`` for an arm that could still be the best). Probes are how
        estimates stay current, but where every other arm is clearly worse (a head that is never
        right on copy-heavy text, in short generations that pay its catch-up over the prompt at
        each probe), each one is pure cost: this bounds that cost to about the floor's share of
        the time where the union earns nothing over its best member, whatever the probe schedule
        says, and lets it explore more where its choices pay. The decayed decode time starts at
        the stationary value of the first step's real seconds (over the decay horizon; at least
        the stationary value of later steps, a first step's one-off costs included), not at zero:
        from zero, a fresh union's budget was a few milliseconds over its first hundred steps, one
        losing probe (about 9 ms: a head at T=0.7 that accepted nothing) stopped every probe for
        up to about 60 steps, and the union ran plain steps where the head paid (MT-Bench's first
        writing turn, round 32). A union is new once per process; its start is where exploring
        pays most."""
        return self.regret[0] <= scale * self.explore_budget * self.regret[1] + self.explore_share * max(0.0, self.profit)

    def _charge_calls(self, seconds: float, tokens: int) -> tuple[float, float]:
        """The seconds a step that emitted ``tokens`` is charged, and its members' drafting times
        (see the module docstring): a member's ``sync`` over positions it skipped is charged per
        position, for as many positions as the step emitted (what it syncs in a step of its own);
        a member's first call counts at most as much as the rest of the step. Returns the charged
        seconds and the step's *real* ones (catch-up whole, first calls capped alike: what an
        exploring step cost, see :meth:`_explore`)."""
        rest = seconds - sum(sync + took for _, sync, _, took, cold in self._calls if cold)
        charged = real = rest
        for m, sync, positions, took, cold in self._calls:
            synced = sync * min(1.0, tokens / max(1, positions))  # catch-up: per position, as below
            if cold:  # one-off costs: at most the rest of the step (a first call whose step is
                cost = min(synced + took, rest)  # never timed, e.g. the last of a generation, leaves
                charged += cost  # the member's next call counted as a first call)
                real += min(sync + took, rest)
                self.draft_seconds[m], self.warm[m] = [cost, 1.0], True
            else:
                cost = took + synced
                charged -= sync + took - cost
                if positions >= self.long_catch_up:  # a catch-up long enough to price per position
                    old, d = self.catch_up[m] or [0.0, 0.0], self.rate_decay
                    self.catch_up[m] = [d * old[0] + sync, d * old[1] + positions]
                old, d = self.draft_seconds[m] or [0.0, 0.0], self.rate_decay
                self.draft_seconds[m] = [d * old[0] + cost, d * old[1] + 1.0]
        return charged, real

    def _end_run(self) -> None:
        """Fold the current run of consecutive steps in one context state into its mean. A run that
        a generation's end cut short counts as it ran: a switch there had only those steps to pay
        back its catch-up."""
        state, steps = self._run
        if state is not None and steps:
            old, d = self.stay.get(state) or [0.0, 0.0], self.rate_decay
            self.stay[state] = [d * old[0] + steps, d * old[1] + 1.0]
        self._run = (None, 0)

    def _switch_seconds(self, arm: int, state: tuple[int, ...], since: int) -> float:
        """What switching to ``arm`` now costs per step it would run: its members' catch-up over the
        positions they are behind beyond the last step's (a member last called at position p, or
        never in this generation, p = 0, runs its layer over ``since - p`` positions more than a
        member called in the last step, which started at ``since``; the prompt, at a generation's
        first call) at each one's measured seconds per position, spread over the steps the context
        ``state`` is expected to last (the mean of its completed runs; one step while none is
        measured). ``0.0`` for an arm whose members were called in the last step (their
        per-position catch-up is in the arm's step seconds already) or catch up at no measured
        cost (prompt lookup)."""
        behind = 0.0
        for m in self.arms[arm]:
            rate = self.catch_up[m]
            if rate is not None and rate[1] > 0:
                behind += rate[0] / rate[1] * max(0, since - (self._seen[m] or 0))
        if behind <= 0.0:
            return 0.0
        stay = self.stay.get(state)
        return behind / max(1.0, stay[0] / stay[1] if stay else 1.0)

    def _with_switching(self, guess: list[float | None], state: tuple[int, ...], since: int) -> list[float | None]:
        """Arm estimates for choosing the step's arm: each arm's tokens per step over its seconds per
        step plus what switching to it costs (:meth:`_switch_seconds`). The arm estimates price a
        member's catch-up per position, as when it runs step after step; but a member the union
        left out for a stretch first catches up on all of it, and where the state does not last
        (an EAGLE-3 head whose estimate barely beats plain steps between prompt lookup's stretches),
        each switch cost more than its steps gained."""
        out = list(guess)
        for a, rate in enumerate(guess):
            extra = self._switch_seconds(a, state, since) if rate else 0.0
            if extra > 0.0:
                seconds = self._step_seconds(a, state)
                if seconds:
                    out[a] = rate * seconds / (seconds + extra)
        return out

    def _next_wait(self, guess: list[float | None], arm: int, wait: int, samples: float = float("inf")) -> int:
        """Steps until ``arm`` is probed again under the keys it was estimated for: ``probe_every``
        while its estimate rests on fewer than ``min_samples`` steps (a drafter's accepted length
        varies from 1 to 5 step to step, and one unlucky step must not lengthen its wait); then the
        longest wait when its estimate is under half the best other arm's, twice ``wait`` when it
        is more than ``probe_margin`` below it, else ``probe_every``."""
        best = max((r or 0.0) for a, r in enumerate(guess) if a != arm)
        rate = guess[arm] or 0.0
        if samples < self.min_samples:
            return self.probe_every
        if rate < 0.5 * best:
            return self.max_probe_wait
        if rate < (1 - self.probe_margin) * best:
            return min(self.max_probe_wait, 2 * wait)
        return self.probe_every

    def _samples(self, arm: int, state: tuple[int, ...]) -> float:
        """Steps (decayed count) behind ``arm``'s token estimate in ``state``: its own and paired
        steps under its members' keys (a merge: its own steps in the state); plain steps need none."""
        if arm == 0:
            return float("inf")
        sums = self.second_sums if len(self.arms[arm]) > 1 else self.token_sums
        return (sums.get((arm, self.arm_key(arm, state))) or [0.0, 0.0])[1]

    def _best(self, guess: list[float | None], state: tuple[int, ...] | None = None) -> int:
        """The arm to run: the fastest estimate, unless a simpler arm (fewer members: plain, then
        one member, then the merge) is within ``select_margin`` of it, or (with ``lower_z > 0``),
        where the fastest is a member alone whose tokens rest on at least ``min_samples`` steps in
        ``state``, at or above its lower estimate (:meth:`_lower_estimate`). Estimates are noisy,
        and the arm that measured luckiest is the one chosen next (a winner's curse); a merge that
        is not clearly faster than a member alone costs more than it returns. (On the adversarial
        prompts an EAGLE-3 head where prompt lookup found no match runs at about plain steps'
        speed, above it after a lucky probe; the lower bound against plain steps did not change
        the union's speed there, and cost it at T=0.7 by point estimate, round 37: off by
        default.)"""
        top_arm = max(range(len(guess)), key=lambda a: guess[a] or 0.0)
        top = guess[top_arm] or 0.0
        bar = (1 - self.select_margin) * top
        low = self._lower_estimate(top_arm, state) if state is not None else None
        if low is not None:
            bar = min(bar, low)
        near = [a for a, r in enumerate(guess) if (r or 0.0) >= bar]
        return min(near, key=lambda a: (len(self.arms[a]), -(guess[a] or 0.0)))

    def estimates(self, state: tuple[int, ...]) -> list[float | None]:
        """Estimated tokens/s of each arm in context ``state`` (under the keys of its own members,
        else the arm's speed over all states, else ``None``)."""
        pooled = self.pooled
        own = [self._own_estimate(a, state) for a in range(len(self.arms))]
        return [r if r is not None else pooled[a] for a, r in enumerate(own)]

    def _own_estimate(self, arm: int, state: tuple[int, ...]) -> float | None:
        """Tokens per step over seconds per step of ``arm`` under its members' keys in ``state``.

        Tokens per step count the arm's own steps and, for a member alone, the merged steps it took
        part in under the same key, at what it alone would have accepted there (the accepted path's
        longest prefix of its own nodes, plus the next token; its nodes dropped from the merge
        make this a lower bound). Those are paired with the merge on the same steps, so the two
        arms are compared on equal luck, not on different stretches of text: where a member alone
        accepts what the merge accepts, the merge's extra drafting and verify cost decide, as they
        should. Seconds per step come from the arm's own steps only (over all states while it has
        none under this key): a step's cost varies far less than its accepted length."""
        seconds = self._step_seconds(arm, state)
        if seconds is None:
            return None
        per_step = self._tokens_per_step(arm, state)
        if arm == 0:
            per_step = 1.0  # a plain step emits one token
        if len(self.arms[arm]) > 1:  # the merge: its paired gain over its best member alone
            members = [(self._own_estimate(1 + m, state) or 0.0, m) for m in self.arms[arm]
                       if (state, m) in self.paired]
            if members:
                m = max(members)[1]
                ratio = self.paired[(state, m)]
                per_step = ratio[0] / ratio[1] * self._tokens_per_step(1 + m, state)
        return None if per_step is None else per_step / seconds

    def _step_seconds(self, arm: int, state: tuple[int, ...]) -> float | None:
        """Seconds per step of ``arm``: its own steps under its members' keys, else over all
        states, else modeled from merged steps (``None``: nothing to go by)."""
        key = (arm, self.arm_key(arm, state))
        seconds = self.second_sums.get(key) or self.pooled_seconds[arm] or self._modeled_seconds(arm, state)
        return None if seconds is None or seconds[0] <= 0 else seconds[0] / seconds[1]

    def _model_estimate(self, arm: int, state: tuple[int, ...]) -> float | None:
        """Tokens/s of a member alone by its value model alone (:meth:`expected_tokens` over its
        seconds per step; with shadow guesses :meth:`_guessed_tokens`); ``None`` for plain steps
        and the merge. While an arm's own tokens rest on
        few steps, this says whether it could still be the best: the model pools every node the
        member had tested, over all keys, so a member that is never right is not explored again in
        each new key."""
        if len(self.arms[arm]) != 1:
            return None
        m = self.arms[arm][0]
        expected, seconds = self._guessed_tokens(m, state), self._step_seconds(arm, state)
        return None if expected is None or seconds is None else expected / seconds

    def _count_tokens(self, key: tuple[int, tuple[int, ...]], tokens: float) -> None:
        """One step's ``tokens`` for an arm under its keys (its own step, or a merged step's credit):
        decayed sum and count, and sum of squares (for :meth:`_upper_estimate`)."""
        _accumulate(self.token_sums, key, tokens, self.rate_decay)
        self.token_squares[key] = self.rate_decay * self.token_squares.get(key, 0.0) + tokens * tokens

    def _upper_estimate(self, arm: int, state: tuple[int, ...], since: int | None = None) -> float | None:
        """Tokens/s of a member alone if its tokens per step were ``upper_z`` standard errors above
        :meth:`_tokens_per_step`, over its seconds per step plus, given ``since`` (the committed
        length at the last step's start), what switching to it now costs per step
        (:meth:`_switch_seconds`). ``None`` for plain steps, the merge, or an arm with no steps.

        The spread is that of its measured steps (own and paired, decayed like their sum), with
        one pseudo-step at the variance of a geometric accepted length of the mean its value model
        expects, ``e``: ``e * (e - 1)`` (a head at 1.7 tokens a step spreads about a token either
        way; prompt lookup without a match drafts nothing and spreads none), so that two equal
        first steps do not claim certainty. While this beats the fastest arm's estimate the arm
        *could* still be the best and is probed every ``probe_every // 4`` steps (see the module
        docstring), as the head's own adaptive policy keeps drafting while the upper confidence
        bound of its gain (2 standard errors) is above its bar; a head that is never right has a
        small spread and is not kept exploring. The counts decay (``rate_decay``: about ten steps
        at most), so the band does not narrow with time: it stays about two thirds of a step's
        spread wide, and a member whose estimate is within about 0.75x of the fastest arm's (a head
        at T=0.7) stays due every few steps for as long as that holds, its probes bounded by
        ``promising_budget`` times the exploration budget (1% of the decode time by default). That
        is the price of tracking a member whose acceptance changes with the text; measured side by
        side in round 33 against the union without it, no difference was significant on MT-Bench
        (greedy and T=0.7), BFCL or the adversarial prompts (point estimates 0.96x-1.02x;
        docs/benchmarks.md, "Round 33")."""
        return self._bound_estimate(arm, state, self.upper_z, since)

    def _lower_estimate(self, arm: int, state: tuple[int, ...]) -> float | None:
        """Tokens/s of a member alone if its tokens per step were ``lower_z`` standard errors
        below :meth:`_tokens_per_step` (the spread of :meth:`_upper_estimate`); ``None`` for plain
        steps, the merge, an arm with no steps, or one whose tokens rest on fewer than
        ``min_samples`` steps. :meth:`_best` runs a member alone rather than a simpler arm (plain
        steps) only where this beats the simpler arm's estimate."""
        key = (arm, self.arm_key(arm, state))
        if self.lower_z <= 0 or (self.token_sums.get(key) or [0.0, 0.0])[1] < self.min_samples:
            return None
        return self._bound_estimate(arm, state, -self.lower_z)

    def _bound_estimate(self, arm: int, state: tuple[int, ...], z: float, since: int | None = None) -> float | None:
        """Tokens/s of a member alone at its tokens per step plus ``z`` standard errors (see
        :meth:`_upper_estimate`), over its seconds per step plus, given ``since``, what switching
        to it costs now."""
        if len(self.arms[arm]) != 1:
            return None
        key = (arm, self.arm_key(arm, state))
        tokens, seconds = self.token_sums.get(key), self._step_seconds(arm, state)
        per_step = self._tokens_per_step(arm, state)
        if tokens is None or tokens[1] <= 0 or seconds is None or per_step is None:
            return None
        mean = tokens[0] / tokens[1]
        spread = max(0.0, self.token_squares.get(key, 0.0) - tokens[1] * mean * mean)
        m = self.arms[arm][0]
        expected = self.expected_tokens(m, state[m]) or 1.0  # the pseudo-step: a geometric spread
        variance = (spread + expected * (expected - 1.0)) / (tokens[1] + 1.0)
        if since is not None:  # what switching to it now costs per step (its catch-up, see `_switch_seconds`)
            seconds += self._switch_seconds(arm, state, since)
        return max(0.0, per_step + z * (variance / (tokens[1] + 1.0)) ** 0.5) / seconds

    def _tokens_per_step(self, arm: int, state: tuple[int, ...]) -> float | None:
        """Measured tokens per step of ``arm`` under its members' keys, with one pseudo-step at
        what its value model expects (a member alone: see :meth:`expected_tokens`). Accepted
        lengths vary from 1 to 5 step to step, and the first steps decide which arm runs next: one
        unlucky step must not price a good head below plain steps (it then ran plain steps for
        half of a short generation). The model itself learns from every tested node, so the
        pseudo-step moves towards the measured rate as the counts grow; its weight is one step
        against up to ``1 / (1 - rate_decay)`` measured ones."""
        key = (arm, self.arm_key(arm, state))
        tokens = self.token_sums.get(key)
        if tokens is None or tokens[1] <= 0:
            return None
        prior = self.expected_tokens(self.arms[arm][0], state[self.arms[arm][0]]) if len(self.arms[arm]) == 1 else None
        if prior is None:
            return tokens[0] / tokens[1]
        return (tokens[0] + prior) / (tokens[1] + 1.0)

    def _guess_tests(self, member: int, state: tuple[int, ...]) -> float:
        """Decayed count of ``member``'s first guesses tested in context ``state``."""
        return (self.guess_sums.get((member, state)) or [0.0, 0.0])[1]

    def _guessed_tokens(self, member: int, state: tuple[int, ...]) -> float | None:
        """What the value model expects a step of ``member`` alone to emit in context ``state``
        (:meth:`expected_tokens` under its key); with ``shadow=True``, for a member that
        :attr:`~Drafter.guesses_first` and whose first guesses were tested in this state, its
        tokens beyond the first scaled by how often its first guess is right here against over
        its own steps, ``1 + (E - 1) * min(1, p_state / p_own)`` (``p_own`` with the prior of
        :meth:`rate`, ``p_state`` with one pseudo-guess at ``p_own``; never up).

        This decides exploration only (:meth:`_model_estimate`: whether the member alone is
        probed or shadowed, see the module docstring), never the estimates the union runs its
        arms by: scaled into a member's tokens per step it also priced the merge (its paired gain
        times the member's tokens), and the union ran the head less where it paid (round 38,
        MT-Bench and BFCL). The state is the tuple of all members' keys: a head's acceptance
        where prompt lookup finds no match is not its acceptance where the output copies its
        context (round 37)."""
        expected = self.expected_tokens(member, state[member])
        if expected is None or not self.shadow or not self.members[member].guesses_first:
            return expected
        here = self.guess_sums.get((member, state))
        if here is None or here[1] <= 0:
            return expected
        own = self.guess_pooled.get(member) or [0.0, 0.0]
        p_own = (own[0] + 1.0) / (own[1] + 1.5)  # (the prior of `rate`)
        p_here = (here[0] + p_own) / (here[1] + 1.0)
        return 1.0 + (expected - 1.0) * min(1.0, p_here / p_own)

    def expected_tokens(self, member: int, key: int) -> float | None:
        """Tokens a step of ``member`` alone is expected to emit under its context key ``key``,
        by the value model: one plus the sum over its latest tree there of each node's acceptance
        probability (the product of its path's measured rates; siblings are exclusive events, so
        the sum is the expected accepted length). ``None`` before it drafted under that key."""
        cached = self._expected.get((member, key))
        if cached is not None and cached[0] == self._counts:
            return cached[1]
        shape = self.shapes.get((member, key))
        if shape is None:
            return None
        value, total = [1.0], 1.0
        for parent, depth, rank in shape:
            value.append(value[parent] * self.rate(member, depth, rank))
            total += value[-1]
        self._expected[(member, key)] = (self._counts, total)
        return total

    def _modeled_seconds(self, arm: int, state: tuple[int, ...]) -> list[float] | None:
        """``[seconds, 1]`` of one step of an arm that never ran: a merged step's seconds less the
        drafting time of the members the arm leaves out (each member's ``propose`` is timed in
        every step that asks it). Its verify pass is over a smaller tree, so this overestimates the
        arm's step a little: an arm is never preferred on a model, only spared a forced trial; its
        own steps (probes, or where it is best) replace the model."""
        merge = len(self.arms) - 1
        if len(self.arms[merge]) < 2:
            return None
        ms = self.second_sums.get((merge, self.arm_key(merge, state))) or self.pooled_seconds[merge]
        if ms is None or ms[1] <= 0:
            return None
        step = ms[0] / ms[1]
        idle = self.idle_members(state)  # (not asked in merged steps here: their drafting is not in them)
        left_out = [m for m in self.arms[merge] if m not in self.arms[arm] and m not in idle]
        if any(self.draft_seconds[m] is None for m in left_out):
            return None
        drafting = sum(self.draft_seconds[m][0] / self.draft_seconds[m][1] for m in left_out)
        return [max(step - drafting, 0.05 * step), 1.0]

    def _best_first(self, member: int) -> float:
        """The highest value a depth-1 node of ``member`` can get (its best measured rank there;
        the prior, 2/3, while none is measured). Deeper nodes are worth less, so below
        ``min_value`` none of its nodes would be kept: asking it would only cost time. Such a member
        is re-measured by its own arm's probes (its counts decay only in steps that ask it)."""
        ranks = [r for (m, d, r) in self.tests if m == member and d == 1] or [0]
        return max(self.rate(member, 1, r) for r in ranks)

    def rate(self, member: int, depth: int, rank: int) -> float:
        """Measured acceptance of the member's rank-``rank`` child at ``depth`` (given its parent
        was accepted), with a Beta(1, 0.5) prior. The counts decay in the steps that ask the
        member, not in others: they describe its latest drafts, however long ago. (Decayed per
        step, a head that is never right on copy-heavy text drifted back to the prior during every
        stretch of prompt-lookup steps, and the union then ran it again at each generation's start,
        paying its catch-up over the prompt.)"""
        key = (member, depth, rank)
        return (self.hits.get(key, 0.0) + 1.0) / (self.tests.get(key, 0.0) + 1.5)

    def propose(self, ctx: DraftContext) -> DraftTree:
        self._arm = self._choose_arm(ctx)
        chosen = set(self.arms[self._arm])
        if len(chosen) > 1:  # a member none of whose depth-1 nodes would pass the value floor is not asked,
            idle = self.idle_members(self._state)  # nor one whose key says it drafts nothing
            chosen = {m for m in chosen if self._best_first(m) >= self.min_value and m not in idle} or chosen
        self._asked = chosen
        self._guesses = {}
        for m, member in enumerate(self.members):
            if m == self._shadow_member and m not in chosen:
                t0 = self.clock()
                guess = member.first_guess(ctx)  # (catches the member up: it is not told to skip)
                self._seen[m] = ctx.tokens.shape[0]
                if guess is not None:
                    self._guesses[m] = (guess, False)
                    self.shadows += 1
                self._shadow_seconds = self.clock() - t0
            elif m not in chosen:
                member.skip(ctx)
        # candidate trie: key (union parent key, token) -> [value, sources]; the root's key is ()
        trie: dict[tuple, list] = {}
        anchored = None  # the anchor's sampled tree and its nodes' trie keys (merged as drafted)
        # members of a merge draft their tree for merged steps (Drafter.for_merging); alone, their own
        mctx = replace(ctx, merged=True) if len(chosen) > 1 else ctx
        for m, member in enumerate(self.members):
            if m not in chosen:
                continue
            t0 = self.clock()
            member.sync(ctx)  # catching up on skipped steps: timed apart (a cost of switching)
            t1 = self.clock()
            proposal = Proposal.of(member.propose(mctx))
            if self.shadow and member.guesses_first and member.last_guess is not None:
                self._guesses[m] = (member.last_guess, True)
            seen, self._seen[m] = self._seen[m], ctx.tokens.shape[0]
            positions = ctx.tokens.shape[0] - (seen or 0)
            self._calls.append((m, t1 - t0, positions, self.clock() - t1, not self.warm[m]))
            if proposal.handoff is not None:  # (never: a union gets no target cache to write in)
                raise ValueError(f"{member.kind} handed off target layers, which a merged tree cannot use")
            tree = proposal.tree
            sampled = bool((tree.laws[1:] != Law.POINT).any())
            if sampled and m != self.anchor and len(chosen) > 1:
                raise ValueError(f"{member.kind} drafted sampled children in a union whose sampling "
                                 f"member is another one; only one member's sampled tree can merge")
            tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
            key, value, seen = {0: ()}, {0: 1.0}, {}
            shape = self.shapes[(m, self._state[m])] = []
            self._counts += 1
            if len(chosen) == 1 and not sampled:
                # a member alone: its tree passes through as drafted (below; the member as it runs
                # on its own, beyond the merge's node budget too: prompt lookup's grown chains), so
                # only its shape is needed (no trie of values)
                depths = [0] * tree.num_nodes
                for i in range(1, tree.num_nodes):
                    p = parents[i]
                    rank = seen.get(p, 0)
                    seen[p], depths[i] = rank + 1, depths[p] + 1
                    shape.append((p, depths[i], rank))
                self.deepest = max(self.deepest, max(depths))
                continue
            for i in range(1, tree.num_nodes):
                p = parents[i]
                rank = seen.get(p, 0)
                seen[p] = rank + 1
                depth = len(key[p]) + 1
                shape.append((p, depth, rank))
                self.deepest = max(self.deepest, depth)
                key[i] = key[p] + (tokens[i],)
                value[i] = value[p] * self.rate(m, depth, rank)
                entry = trie.setdefault(key[i], [0.0, []])
                entry[0] = max(entry[0], value[i])
                entry[1].append((m, depth, rank))
            if sampled or m == self.anchor:
                anchored = (tree, [key[i] for i in range(tree.num_nodes)], m, shape)
        if not chosen:  # the plain arm: one token, no drafting
            return DraftTree.root_only(ctx.root_token)
        floor = self.min_value if len(chosen) > 1 else 0.0  # a member alone drafts its own tree
        sampled = anchored is not None and bool((anchored[0].laws[1:] != Law.POINT).any())
        if len(chosen) == 1 and not sampled:
            # a member alone: its tree as drafted (the trie would rebuild its nodes in another
            # order, or cut them to the merge's budget; a step of prompt lookup alone should cost
            # what it costs alone)
            (only,) = chosen  # (not the loop's last `m`: that runs over every member)
            self._sources = [[]] + [[(only, depth, rank)] for _, depth, rank in shape]
            return tree
        if sampled:
            return self._graft(trie, *anchored, budget=self.max_nodes if len(chosen) > 1 else 0, floor=floor)
        ranked = sorted(trie.items(), key=lambda kv: (-kv[1][0], len(kv[0])))
        builder, index = TreeBuilder(ctx.root_token), {(): 0}
        self._sources = [[]]
        kept = [k for k, (v, _) in ranked if v >= floor][: self.max_nodes]
        for k in sorted(kept, key=len):  # parents first; a parent's value >= its child's
            if k[:-1] in index:
                index[k] = builder.add(index[k[:-1]], k[-1])
                self._sources.append(trie[k][1])
        return builder.build()

    def _graft(self, trie: dict[tuple, list], tree: DraftTree, keys: list[tuple], m: int,
               shape: list[tuple[int, int, int]], budget: int, floor: float) -> DraftTree:
        """The anchor's sampled ``tree`` as drafted (tokens, laws, recorded draft laws; node i
        keeps index i), then the other members' point-mass nodes of ``trie`` not already in it,
        highest value first while at least ``floor`` and the tree holds at most ``budget`` draft
        nodes (0: none; ``budget`` is the union's ``max_nodes``), each appended after every
        child its parent already has.

        Exact at any temperature: at a node, the verifier tests the anchor's children first,
        each against the law it was drawn from given its earlier siblings, exactly as in the
        anchor's own tree; a grafted point-mass child x comes after them and is accepted with the
        residual's r(x), a valid proposal whatever the earlier siblings were (which ones are
        grafted depends on the anchor's draws only through the tokens drawn: a token already
        drawn is not grafted again, its residual is 0). Which nodes are grafted never depends on
        a verification coin.

        ``keys[i]`` is node i's token path from the root; ``shape[i - 1]`` its (parent, depth,
        rank). Node sources: the anchor's (m, depth, rank) for its nodes, plus every member that
        proposed the same path; a graft, its proposers."""
        builder, index = TreeBuilder(tree.tokens[0].item()), {(): 0}
        self._sources = [[]]
        tokens, parents, laws = tree.tokens.tolist(), tree.parents.tolist(), tree.laws.tolist()
        rows = tree.draft_row.tolist() if tree.draft_row is not None else [-1] * tree.num_nodes
        for i in range(1, tree.num_nodes):
            builder.add(parents[i], tokens[i], Law(laws[i]))
            first = index.setdefault(keys[i], i) == i  # (with replacement: a token drawn twice)
            others = [src for src in trie[keys[i]][1] if src[0] != m] if first else []
            self._sources.append([(m, *shape[i - 1][1:])] + others)
        for i, row in enumerate(rows):
            if row >= 0:
                builder.set_draft_probs(i, tree.draft_probs[row])
        room = budget - (tree.num_nodes - 1)
        if room > 0:
            ranked = sorted((kv for kv in trie.items() if kv[0] not in index and kv[1][0] >= floor),
                            key=lambda kv: (-kv[1][0], len(kv[0])))
            for k, (_, sources) in sorted(ranked[:room], key=lambda kv: len(kv[0])):  # parents first
                if k[:-1] in index:
                    index[k] = builder.add(index[k[:-1]], k[-1])
                    self._sources.append(sources)
        return builder.build()

    def observe(self, ctx: DraftContext, tree: DraftTree, verdict: Verdict) -> None:
        """Update each member's acceptance rates: every proposed node whose parent was accepted was
        tested; it was a hit if it is on the accepted path."""
        if self._pending is not None:
            state, arm, start, length, _, probe, _, ref, base = self._pending
            self._pending = (state, arm, start, length, verdict.num_accepted + 1, probe, tree.num_nodes == 1, ref,
                             base)
        self._counts += 1  # (the asked members' counts change below)
        for key in self.tests:  # only the asked members' counts decay: see `rate`
            if key[0] in self._asked:
                self.tests[key] *= self.decay
                self.hits[key] = self.hits.get(key, 0.0) * self.decay
        accepted = set(verdict.path)
        if self._guesses and self._pending is not None:  # each first guess against the first token
            first = int(tree.tokens[verdict.path[1]]) if verdict.num_accepted else int(verdict.next_token)
            for m, (guess, own) in self._guesses.items():
                _accumulate(self.guess_sums, (m, self._pending[0]), float(guess == first), self.rate_decay)
                if own:  # (decayed like the member's acceptance counts: per step that asks it)
                    _accumulate(self.guess_pooled, m, float(guess == first), self.decay)
        if len(self._asked) > 1 and self._pending is not None:  # a merged step: what each member
            state = self._pending[0]  # alone would have accepted on it (paired estimate, above)
            for m in self._asked:
                alone = next((i for i, node in enumerate(verdict.path[1:])
                              if node >= len(self._sources) or all(src[0] != m for src in self._sources[node])),
                             verdict.num_accepted)
                self._count_tokens((1 + m, self.arm_key(1 + m, state)), alone + 1.0)
                old, d = self.paired.get((state, m)) or [0.0, 0.0], self.rate_decay
                self.paired[(state, m)] = [d * old[0] + verdict.num_accepted + 1.0, d * old[1] + alone + 1.0]
        parents = tree.parents.tolist()
        for node in range(1, min(tree.num_nodes, len(self._sources))):
            if parents[node] in accepted:
                for src in self._sources[node]:
                    self.tests[src] = self.tests.get(src, 0.0) + 1.0
                    if node in accepted:
                        self.hits[src] = self.hits.get(src, 0.0) + 1.0
        for m in sorted(self._asked):
            self.members[m].observe(ctx, tree, verdict)


def _accumulate(sums: dict, key, value: float, decay: float) -> None:
    """Decayed ``[sum of values, count]`` under ``key``."""
    old = sums.get(key) or [0.0, 0.0]
    sums[key] = [decay * old[0] + value, decay * old[1] + 1.0]


def _ratio(sums: list[float] | None) -> float | None:
    return None if sums is None or sums[1] <= 0 else sums[0] / sums[1]
