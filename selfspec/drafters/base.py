"""The drafter interface: propose a draft tree from the target's state; observe the result.

A drafter never loads models and never runs the decode loop. Per verification step the engine
calls ``propose(ctx)`` and, after verification, ``observe(ctx, tree, verdict)``. A new drafter is
a small class::

    class MyDrafter(Drafter):
        kind = "mine"
        def propose(self, ctx: DraftContext) -> DraftTree:
            b = TreeBuilder(ctx.root_token)
            b.add(0, guess_next(ctx.tokens))       # a point-mass child of the root
            return b.build()

registered with :func:`selfspec.drafters.register`. Sampled children must record their law and
draft distribution in the tree (see :mod:`selfspec.tree`); the verifier does the rest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..sampling import SamplingConfig
from ..tree import DraftTree
from ..verify import Verdict


@dataclass(frozen=True)
class TargetSignature:
    """What a drafter must agree on with the target it drafts for."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int

    @classmethod
    def of(cls, model) -> "TargetSignature":
        cfg = model.config.get_text_config(decoder=True)
        return cls(cfg.model_type, int(cfg.vocab_size), int(cfg.hidden_size), int(cfg.num_hidden_layers))

    def check(self, model, what: str = "drafter") -> None:
        """Raise ``ValueError`` naming each field where ``model`` differs from this signature."""
        other = TargetSignature.of(model)
        diffs = [
            f"{k}: built for {v!r}, target has {getattr(other, k)!r}"
            for k, v in asdict(self).items()
            if getattr(other, k) != v
        ]
        if diffs:
            raise ValueError(f"this {what} was built for another model ({'; '.join(diffs)})")


@dataclass
class DraftContext:
    """What the engine tells a drafter at each step.

    Attributes:
        tokens: ``[L]`` every token so far (prompt + generated); ``tokens[-1]`` is the root.
        root_hidden: ``[H]`` the target's last hidden state at the node whose prediction produced
            the root (``None`` on the first step, or when the drafter does not need it).
        max_depth: deepest draft the engine can use this step (token and context budget).
        sampling: the target's sampling parameters (drafts may use their own).
        generator: the generator for any sampled draft.
        cache: the target's KV cache (committed prefix only), given only to drafters with
            ``shares_target_cache`` when the target can resume from a layer handoff; ``None``
            otherwise (the drafter then keeps its own cache). Such a drafter may write its first
            layers' KV for every tree node into it and return a :class:`Proposal` with the handoff.
        prompt_len: how many of ``tokens`` are the prompt (the rest was generated this call).
        features: for drafters that declare ``taps``: ``[m, len(taps) * H]`` the target's taps of
            the m committed positions ``len(tokens) - 1 - m .. len(tokens) - 2`` this drafter has
            not been shown yet (every committed position is shown exactly once, in order; ``None``
            when there is none).
        merged: True when the caller (a union) merges this drafter's tree with other drafters'
            trees under one node budget: a drafter given a tree for merged steps
            (:meth:`Drafter.for_merging`) drafts that one, else its own.
        room: tokens the engine could still use below the root this step (token and context
            budget) before any adaptive depth cap; ``None``: unknown (then ``max_depth``).
    """

    tokens: torch.Tensor
    root_hidden: torch.Tensor | None
    max_depth: int
    sampling: SamplingConfig
    generator: torch.Generator
    cache: Any = None
    features: torch.Tensor | None = None
    prompt_len: int = 0
    merged: bool = False
    room: int | None = None

    @property
    def root_token(self) -> int:
        return int(self.tokens[-1])


@dataclass(frozen=True)
class Proposal:
    """A draft tree plus what the verify pass may resume from.

    Attributes:
        tree: the draft tree (rooted at ``ctx.root_token``, depth <= ``ctx.max_depth``).
        handoff: a :class:`selfspec.target.LayerHandoff` when the drafter ran the target's first
            layers over every node of ``tree`` in ``ctx.cache`` (the verify pass then runs only
            the layers above); ``None`` otherwise.
    """

    tree: DraftTree
    handoff: Any = None

    @staticmethod
    def of(proposed: "DraftTree | Proposal") -> "Proposal":
        """What :meth:`Drafter.propose` returned, as a :class:`Proposal`."""
        return proposed if isinstance(proposed, Proposal) else Proposal(proposed)


class Drafter(ABC):
    """Base class of all drafters. Subclasses set ``kind`` and implement :meth:`propose`."""

    kind: str = "abstract"
    #: True when :meth:`propose` reads ``ctx.root_hidden`` (the engine then keeps hidden states).
    needs_hidden: bool = False
    #: True when :meth:`propose` can run the target's own first layers in the target's cache and
    #: hand their outputs to the verify pass (``DraftContext.cache`` in, :class:`Proposal` out).
    shares_target_cache: bool = False
    #: Target hidden-state taps (transformers' ``hidden_states`` indices) that :meth:`propose` reads
    #: from ``ctx.features``; the verify pass records them (:mod:`selfspec.taps`). Empty: none.
    taps: tuple[int, ...] = ()
    #: True when the drafter decides per step itself whether drafting pays (returning a root-only
    #: tree for a plain step, e.g. a union's plain arm): the engine's adaptive policy then only caps
    #: the draft depth and never backs it off.
    self_paced: bool = False
    #: The adaptive state (a :class:`selfspec.adaptive.AdaptivePolicy`) that ``generate(...,
    #: adaptive=True)`` uses with this drafter and keeps across calls; ``None`` until first used.
    #: Pass ``adaptive=AdaptivePolicy(...)`` to keep the state yourself instead.
    adaptive_policy = None
    #: Tree options to use as a member of a union (:func:`selfspec.drafters.drafter_from_spec`
    #: ``a+b``): a checkpoint's tree calibrated inside a union for the target's dtype
    #: (``scripts/calibrate.py --within``), set by ``load_drafter``; ``None``: the drafter's own.
    union_options: dict | None = None
    #: True when the drafter uses the caller's tool definitions (``generate(..., tools=...)``,
    #: handed over by :meth:`set_tools` before the call).
    uses_tools: bool = False
    #: True when the drafter keeps what earlier generations wrote (:meth:`end`) and drafts from it
    #: later (a suffix index of past outputs): running the same prompt twice is then not the same
    #: work twice (the benchmark refuses ``--repeats`` for such drafters).
    learns_from_outputs: bool = False
    #: The :meth:`context_key` under which :meth:`propose` drafts nothing, whatever else holds
    #: (prompt lookup: 0, no n-gram matched); ``None``: no key promises that. A union with
    #: ``skip_idle=True`` does not run such a member alone in such a state (a plain step at a
    #: drafter's cost), nor a merge left with fewer than two drafting members, and does not ask it
    #: for a tree there.
    empty_key: int | None = None
    #: The context key under which this drafter drafts nothing for the rest of the generation,
    #: a decision it took from the committed context (an EAGLE-3 head that read the prompt's last
    #: pairs and found them unfamiliar, ``min_familiar``): a union leaves it out of every arm while
    #: its key says so (not run alone, not merged, not asked for a tree), whatever ``skip_idle``
    #: says, since no step of it can pay there and exploring it would cost steps.
    abstain_key: int | None = None
    #: True when :meth:`first_guess` names, at a small part of a step's drafting cost, the token
    #: this drafter would rank first at depth 1 (an EAGLE-3 head: its catch-up and one draft LM
    #: head, no tree): a union with ``shadow=True`` then measures where the drafter's first guess
    #: is right without running a step of it (its *shadow guesses*).
    guesses_first: bool = False
    #: The token :meth:`propose` ranked first at depth 1 in its latest call (drafters with
    #: ``guesses_first``; ``None`` when it drafted nothing).
    last_guess: int | None = None

    def __init__(self, signature: TargetSignature | None = None):
        self.signature = signature

    def may_sample(self) -> bool:
        """True when :meth:`propose` drafts sampled children (``Law.IID`` / ``Law.WOR``) at T > 0,
        as its options say (``cfg.sampled``); a union keeps one such member sampling (its
        *anchor*) and asks the others for point masses (:meth:`point_mass_when_merged`)."""
        return bool(getattr(getattr(self, "cfg", None), "sampled", False))

    def point_mass_when_merged(self) -> "Drafter":
        """This drafter as a union member that is not the union's sampling anchor. A union merges
        one member's sampled tree (kept as drafted, children first) with other members'
        *point-mass* nodes grafted after them; two sampled trees cannot merge (a sampled child's
        recorded law is tied to its siblings). So in merged steps (``ctx.merged``) such a member
        must draft point-mass children. Default: a drafter that samples drafts point-mass trees
        in every step (:meth:`with_options`). A drafter that shapes its tree per call overrides
        this and keeps sampling in the steps it drafts alone, where the union passes its tree
        through unmerged (at T > 0 a sampled child is accepted with probability 1 - TV(p, q), a
        point-mass child x with p(x) only)."""
        if self.may_sample():
            return self.with_options(sampled=False)
        return self

    def for_merging(self, options: dict) -> "Drafter":
        """This drafter as a union member whose trees in *merged* steps (``ctx.merged``) use the
        tree ``options`` (:attr:`union_options`: calibrated inside a union, where one node budget
        is shared with other members). Default: :meth:`with_options` -- one tree for every step.
        A drafter that can shape its tree per call overrides this and keeps its own tree for the
        steps it drafts alone (a union's member-alone arm then runs what the drafter runs on its
        own, as it should)."""
        return self.with_options(**options)

    def for_sampling(self, options: dict) -> "Drafter":
        """This drafter with the tree ``options`` for the steps it drafts alone at temperature > 0
        (a checkpoint's tree calibrated at T > 0, ``scripts/calibrate.py --temperature``) and its
        own tree for greedy steps: at T > 0 a sampled child is accepted with probability
        1 - TV(p, q) instead of 0 or 1, so a wider tree can pay where it does not at T = 0.
        Default: refused (a drafter without per-call tree shapes cannot hold two trees)."""
        raise ValueError(f"{self.kind} drafters have no separate tree for sampled steps")

    def check_target(self, model) -> None:
        """Raise ``ValueError`` when this drafter was built for another model."""
        if self.signature is not None:
            self.signature.check(model, what=f"{self.kind} drafter")

    def reset(self) -> None:
        """Called at the start of every generation."""

    def set_tools(self, tools) -> None:
        """The caller's tools for the coming call(s) (validated), for drafters with ``uses_tools``."""

    def end(self, tokens: torch.Tensor, prompt_len: int) -> None:
        """Called once when a generation ends: ``tokens`` ``[L]`` is the prompt (its first
        ``prompt_len`` tokens) and everything generated (drafters that learn across calls, e.g. a
        suffix index of past outputs, keep what they need); default does nothing."""

    @abstractmethod
    def propose(self, ctx: DraftContext) -> "DraftTree | Proposal":
        """Return a draft tree rooted at ``ctx.root_token`` with depth <= ``ctx.max_depth`` (or a
        :class:`Proposal` carrying it with a layer handoff). Returns what it proposes and changes
        nothing in ``ctx``."""

    def observe(self, ctx: DraftContext, tree: DraftTree, verdict: Verdict) -> None:
        """Called after each verification (for adaptive drafters); default does nothing."""

    def context_key(self, ctx: DraftContext) -> int:
        """A cheap, deterministic summary of how promising this context looks to this drafter
        (e.g. prompt lookup: the longest n-gram that matched), computed from committed tokens only.
        A union measures each arm's speed per combination of its members' keys, so it can prefer a
        member exactly where that member pays. Default: 0 (no signal)."""
        return 0

    def skip(self, ctx: DraftContext) -> None:
        """Called instead of :meth:`propose` when a caller (a union) does not need this drafter's
        tree this step: a drafter that must see every step (e.g. the taps in ``ctx.features``)
        catches up here; default does nothing."""

    def first_guess(self, ctx: DraftContext) -> int | None:
        """The token this drafter would rank first at depth 1 after ``ctx.root_token`` (its rank-0
        child in a greedy tree), without drafting a tree; ``None`` when it would draft nothing.
        Brings the drafter's state up to ``ctx`` like :meth:`sync` (the caller must not also
        :meth:`skip` this step). Only for drafters with :attr:`guesses_first`."""
        raise NotImplementedError(f"{self.kind} drafters do not guess their first token apart from a tree")

    def sync(self, ctx: DraftContext) -> None:
        """Bring this drafter's own state (a draft KV cache) up to the committed tokens of ``ctx``
        and the steps it skipped, before :meth:`propose` of the same step (which then finds nothing
        left to catch up). :meth:`propose` must work without it; a union calls it first and times
        it apart, because after skipped steps it is a one-off cost of switching to this drafter,
        not a cost of its drafting. Default does nothing."""
