"""The drafter contract: a drafter proposes a draft tree from the target's state and observes results.

A drafter never loads models, never runs the decode loop and never keeps a clock: the engine asks
``propose(ctx)`` (and times it), verifies, and shows every drafter the committed step through
``observe(step)``, whether or not its tree was used (the controller in :mod:`selfspec.control`
decides which drafters run). These members make the whole contract (the engine calls nothing
else, and probes nothing):

================  =================================================================================
``kind``          registry name (:func:`selfspec.drafters.register`)
``requires``      :class:`Requirements`: what the engine must provide (declared, never probed)
``config``        the drafter's typed options (a dataclass), or ``None``
``propose``       ``DraftContext -> Proposal`` (or a bare :class:`~selfspec.decoding.tree.DraftTree`)
``observe``       a committed :class:`Step` (every step, drafted or not)
``reset``         a new generation starts
``end``           a generation ended (drafters that learn from outputs keep them)
``context_key``   optional: a small int saying how promising the context looks to this drafter
``prior``         optional: measured acceptance to start the controller's acceptance model from
``check_target``  refuse a model other than the one the drafter was built for
``fork``          a twin for another sequence decoded at the same time (a batch row)
``propose_many``  optional: one call proposing for several forks (a batch's rows), e.g. one
                  batched model call per tree level; default: each fork proposes alone
``with_options``  optional: a twin with policy options changed (``spec@key=value``); default:
                  refuses every option
``config_dict``   trainable drafters: the options a checkpoint stores to rebuild it
                  (:func:`selfspec.drafters.save_drafter`); default: ``config`` as a dict
================  =================================================================================

A new drafter is one file::

    class MyDrafter(Drafter):
        kind = "mine"
        def propose(self, ctx):
            b = TreeBuilder(ctx.root_token)
            b.add(0, guess_next(ctx.tokens))       # a point-mass child of the root
            return b.build()

    register("mine", lambda model, **opts: MyDrafter(model=model))

Sampled children must record their law and draft distribution in the tree (:mod:`selfspec.decoding.tree`);
the verifier does the rest. Whatever a drafter proposes, the output law is the target's.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..decoding.sampling import SamplingConfig
from ..decoding.tree import DraftTree
from ..decoding.verify import Verdict


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


@dataclass(frozen=True)
class Requirements:
    """What a drafter needs from the engine, declared once.

    Attributes:
        hidden: ``ctx.root_hidden`` (the target's last hidden state at the root's predictor).
        taps: target hidden-state taps (transformers ``hidden_states`` indices) read from
            ``ctx.features``; the verify pass records them (:mod:`selfspec.model.taps`).
        target_cache: the drafter can run the target's first layers in the target's own cache
            (``ctx.cache``) and hand their outputs to the verify pass (:class:`Proposal` handoff).
        tools: the drafter reads the caller's tool definitions (``ctx.tools``).
        learns: the drafter keeps what earlier generations wrote (:meth:`Drafter.end`), so running
            a prompt twice is not the same work twice (the benchmark refuses ``--repeats``).
    """

    hidden: bool = False
    taps: tuple[int, ...] = ()
    target_cache: bool = False
    tools: bool = False
    learns: bool = False


@dataclass
class DraftContext:
    """What the engine tells a drafter at each step.

    Attributes:
        tokens: ``[L]`` every token so far (prompt + generated); ``tokens[-1]`` is the root.
        root_hidden: ``[H]`` the target's last hidden state at the node whose prediction produced
            the root (``None`` on the first step, or unless ``requires.hidden``).
        max_depth: deepest draft the engine can use this step.
        sampling: the target's sampling parameters (drafts may use their own).
        generator: the generator for any sampled draft.
        cache: the target's KV cache (committed prefix only), given only to a drafter with
            ``requires.target_cache`` drafting alone when the target can resume from a layer
            handoff; ``None`` otherwise (the drafter then keeps its own cache).
        features: for drafters with ``requires.taps``: ``[L - 1, len(taps) * H]`` the taps of
            every committed position ``0 .. L - 2`` (a drafter reads the rows it has not seen).
        prompt_len: how many of ``tokens`` are the prompt.
        max_nodes: most draft nodes worth verifying this step (the controller's estimate; ``None``:
            no limit). A drafter that fixes its tree's shape before drawing (sampled children)
            stays within it; point-mass trees may exceed it (the controller cuts them).
        point_mass: the caller asks for point-mass children only (a merge with another member's
            sampled tree: two sampled trees cannot merge).
        tools: the caller's validated tool definitions (``None``: none).
    """

    tokens: torch.Tensor
    root_hidden: torch.Tensor | None
    max_depth: int
    sampling: SamplingConfig
    generator: torch.Generator
    cache: Any = None
    features: torch.Tensor | None = None
    prompt_len: int = 0
    max_nodes: int | None = None
    point_mass: bool = False
    tools: list | None = None

    @property
    def root_token(self) -> int:
        return int(self.tokens[-1])


@dataclass(frozen=True)
class Proposal:
    """A draft tree plus what the verify pass may resume from.

    Attributes:
        tree: the draft tree (rooted at ``ctx.root_token``, depth <= ``ctx.max_depth``).
        handoff: a :class:`selfspec.model.target.LayerHandoff` when the drafter ran the target's first
            layers over every node of ``tree`` in ``ctx.cache`` (the verify pass then runs only
            the layers above); ``None`` otherwise.
    """

    tree: DraftTree
    handoff: Any = None

    @staticmethod
    def of(proposed: "DraftTree | Proposal") -> "Proposal":
        """What :meth:`Drafter.propose` returned, as a :class:`Proposal`."""
        return proposed if isinstance(proposed, Proposal) else Proposal(proposed)


@dataclass(frozen=True)
class Step:
    """One committed verification step, shown to every drafter.

    Attributes:
        tokens: the tokens the step committed (accepted drafts, then the recovered / bonus token).
        tree: the verified tree (this drafter's, a merge holding its nodes, or another's).
        verdict: the verifier's result on ``tree``.
        proposed: whether this drafter's tree went into ``tree``.
    """

    tokens: list[int]
    tree: DraftTree
    verdict: Verdict
    proposed: bool


class Drafter(ABC):
    """Base class of all drafters (the contract in the module docstring)."""

    kind: str = "abstract"
    requires: Requirements = Requirements()
    config: Any = None

    def __init__(self, signature: TargetSignature | None = None, model=None):
        self.signature = signature
        self.model = model

    @abstractmethod
    def propose(self, ctx: DraftContext) -> "DraftTree | Proposal":
        """Return a draft tree rooted at ``ctx.root_token`` with depth <= ``ctx.max_depth`` (or a
        :class:`Proposal` carrying it with a layer handoff); point-mass children only when
        ``ctx.point_mass``. Changes nothing in ``ctx``."""

    def observe(self, step: Step) -> None:
        """Called after every verification (default: nothing)."""

    def reset(self) -> None:
        """Called at the start of every generation."""

    def fork(self) -> "Drafter":
        """A twin that drafts for another sequence decoded beside this one (a row of a batch):
        it shares weights and anything learnt across generations, and owns its per-generation
        state. Default: a shallow copy, then :meth:`reset` (which must rebind, not mutate, that
        state); drafters whose per-generation state is mutated in place override this."""
        twin = copy.copy(self)
        twin.reset()
        return twin

    @classmethod
    def propose_many(cls, drafters: list["Drafter"], ctxs: list[DraftContext]) -> list["DraftTree | Proposal"]:
        """What ``drafters[b].propose(ctxs[b])`` returns, for every b, in one call: ``drafters``
        are forks of one drafter (a batch's rows, :meth:`fork`), each with its own context. A
        drafter that runs a model overrides this to run all rows in one call; the trees must be
        those each row would propose alone (up to floating-point rounding of the batched call).
        Default: one ``propose`` per row."""
        return [d.propose(c) for d, c in zip(drafters, ctxs)]

    def with_options(self, **options) -> "Drafter":
        """A twin drafting with policy ``options`` changed (``spec@key=value`` on the command line);
        ``ValueError`` naming the options it does not take. Default: takes none."""
        raise ValueError(f"drafters of kind {self.kind!r} take no @options (got {sorted(options)})")

    def config_dict(self) -> dict:
        """The options a checkpoint stores to rebuild this drafter (default: ``config`` as a dict;
        ``{}`` without one)."""
        return asdict(self.config) if self.config is not None else {}

    def end(self, tokens: torch.Tensor, prompt_len: int) -> None:
        """Called once when a generation ends: ``tokens`` ``[L]`` is the prompt (its first
        ``prompt_len`` tokens) and everything generated; default does nothing."""

    def context_key(self, ctx: DraftContext) -> int:
        """A cheap, deterministic summary of how promising this context looks to this drafter
        (prompt lookup: the longest n-gram that matched), from committed tokens only. The
        controller keeps acceptance per key. Default: 0 (no signal)."""
        return 0

    def prior(self) -> dict | None:
        """Measured acceptance to start from: ``{"greedy" | "sampled": [[rate per sibling rank]
        per depth]}`` (a checkpoint's ``acceptance``), or ``None`` (the controller's default)."""
        return None

    def check_target(self, model) -> None:
        """Raise ``ValueError`` when ``model`` is not the target this drafter was built for: another
        architecture or size (signature), or another model object for a drafter that holds the
        target's modules (its layers or embeddings would be read from the wrong model)."""
        if self.signature is not None:
            self.signature.check(model, what=f"{self.kind} drafter")
        if self.model is not None and model is not self.model:
            raise ValueError(f"this {self.kind} drafter was built on another model object (it reads that model's "
                             "modules); build or load it for this one")
