"""One request's decoding: its validated settings and the per-step logic of one sequence.

The decode step (:func:`selfspec.decoding.step.step`) runs the same phases on every request of a pool:

1. :meth:`Request.context`: what its controller's drafters see (``None``: a plain step, when it
   has no controller or one token of budget left);
2. the step scores every request's tree with the target in one pass;
3. :meth:`Request.settle`: the constraint mask and logits processors at every node, then the pure
   verifier with the request's own sampling settings and generator; :meth:`Request.take`: the
   new tokens (cut at EOS, stop criteria);
4. the step commits every accepted path to the target's cache;
5. :meth:`Request.advance`: stats, the drafter's features for the next step, the streamer, and
   the controller's observation.

A request whose own code (drafter, constraint, processors, stopping criteria, streamer) raises is
ended with that error (:meth:`Request.fail`); nothing else in the pool changes.

Invariant: a request's output depends only on its own prompt, settings, generator and the logits
the target gives its tree nodes, so it is the same whether it ran alone or in a batch (greedy:
token-identical, up to floating-point differences between batched and single kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..control import Controller
from ..drafters.base import DraftContext
from .arguments import Settings, check_prompt, settings
from .logits_processing import first_stop, process_tree
from .metrics import SpecStats
from .tree import DraftTree
from .verify import Verdict, verify_tree


@dataclass
class SpecOutput:
    """Result of one generation.

    Attributes:
        sequences: ``[1, L + new]`` prompt followed by the new tokens.
        stats: step counts, mean accepted length, acceptance per depth, timings.
        finish_reason: ``"eos"``, ``"stop"`` (a stopping criterion or stop string), ``"length"``
            (``max_new_tokens`` reached) or ``"context"``.
    """

    sequences: torch.Tensor
    stats: SpecStats
    finish_reason: str


class Request:
    """One sequence's decode state (the module docstring's steps).

    Args:
        ids: ``[L]`` the validated prompt on the CPU.
        controller: drafts this sequence's trees (``None``: plain steps).
        settings: sampling, stopping and budget.
        streamer: optional ``put`` / ``end`` (the prompt first, then each step's tokens).
    """

    def __init__(self, ids: torch.Tensor, controller: Controller | None, settings: Settings, streamer=None):
        self.ids, self.controller, self.s, self.streamer = ids, controller, settings, streamer
        room = settings.max_new_tokens if not settings.context_limit else \
            min(settings.max_new_tokens, max(0, settings.context_limit - ids.shape[0]))
        self.tokens = torch.empty(ids.shape[0] + room, dtype=torch.long)  # (sized by what can ever be written)
        self.tokens[: ids.shape[0]] = ids
        self.length = ids.shape[0]
        self.stats = SpecStats()
        self.finish: str | None = None
        self.root_hidden = None
        self.taps: _TapBuffer | None = None
        self.start_s = 0.0
        self.error: BaseException | None = None
        self._holds_controller = False

    @classmethod
    def create(cls, model, input_ids, controller: Controller | None = None, streamer=None, **options) -> "Request":
        """A request for ``model`` from :func:`selfspec.generate`'s per-request arguments, every
        one checked here (``ValueError`` / ``TypeError`` naming it)."""
        ids = check_prompt(model, input_ids)
        return cls(ids, controller, settings(model, ids.shape[0], **options), streamer)

    @property
    def prompt_len(self) -> int:
        return self.ids.shape[0]

    @property
    def done(self) -> bool:
        return self.finish is not None

    def begin(self, model, clock) -> None:
        """Before the prefill: hold the controller (refused while another generation holds it),
        reset its members and the constraint, stream the prompt, start the clock."""
        if self.controller is not None:
            self.controller.acquire()
            self._holds_controller = True
            self.controller.begin(model)
        if self.streamer is not None:
            self.streamer.put(self.ids[None].clone())
        if self.s.constraint is not None:
            self.s.constraint.reset()
        self.start_s = clock()

    def prefilled(self, pre, want_taps: bool, now: float, reused: int = 0) -> None:
        """After the prefill (``pre``: its :class:`~selfspec.model.target.TreeOutput`)."""
        self.root_hidden = pre.hidden[-1] if pre.hidden is not None else None
        self.taps = _TapBuffer(self.tokens.shape[0], pre.taps) if want_taps else None
        self.stats.prefill_time_s = now - self.start_s
        self.stats.prefix_reused = reused

    def budget(self) -> int:
        """Tokens this request may still emit (new-token budget and the model's context)."""
        return min(self.s.max_new_tokens - self.stats.new_tokens, self.s.context_limit - self.length)

    def check_budget(self) -> bool:
        """Whether another step can run; ends the request (``"length"`` / ``"context"``) if not."""
        if self.stats.new_tokens >= self.s.max_new_tokens:
            self.finish = "length"
        elif self.budget() < 1:
            self.finish = "context"
        return not self.done

    def context(self, cache=None, draft: bool = True) -> DraftContext | None:
        """What this step's drafters see (:meth:`propose`), or ``None`` for a plain step (no
        controller, no room for a draft, or ``draft=False``)."""
        budget = self.budget()
        if self.controller is None or budget <= 1 or not draft:
            return None
        return DraftContext(self.tokens[: self.length], self.root_hidden, budget - 1, self.s.cfg, self.s.gen, cache,
                            features=self.taps.committed(self.length - 1) if self.taps is not None else None,
                            prompt_len=self.prompt_len, tools=self.s.tools)

    def settle(self, tree: DraftTree, logits: torch.Tensor) -> Verdict:
        """Verify ``tree`` against its nodes' logits ``[n, V]`` after this request's constraint
        and processors (each node after its own path), with its own settings and generator."""
        s = self.s
        if s.constraint is not None:  # the same mask plain decoding applies, at every node's own path
            allowed = s.constraint.masks(self.tokens[self.prompt_len: self.length].tolist(), tree, logits.shape[-1])
            if not bool(allowed[0].any()):
                raise RuntimeError("the constraint allows no token after the output so far")
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        if s.logits_processor is not None:
            logits = process_tree(s.logits_processor, self.tokens[: self.length], tree, logits)
        return verify_tree(tree, logits, s.cfg, s.gen)

    def take(self, tree: DraftTree, verdict: Verdict) -> tuple[list[int], str | None]:
        """``(tokens, finish)``: the step's new tokens, cut after the first EOS or where a
        stopping criterion says stop (``finish`` then ``"eos"`` / ``"stop"``, else ``None``)."""
        new = tree.tokens[verdict.path[1:]].tolist() + [verdict.next_token]
        cut = next((i + 1 for i, t in enumerate(new) if t in self.s.eos), None)
        new, finish = new[:cut], None if cut is None else "eos"
        if self.s.stopping_criteria is not None:
            stop = first_stop(self.s.stopping_criteria, self.tokens[: self.length], new)
            if stop is not None:
                new, finish = new[:stop], "stop"
        return new, finish

    def advance(self, tree: DraftTree, verdict: Verdict, taken: tuple[list[int], str | None], plan,
                hidden, taps, draft_s: float, verify_s: float, now: float) -> list[int]:
        """Commit the step's tokens (``taken``: :meth:`take`'s), update stats and features, stream
        them, and show the step to the controller (``plan``: its
        :class:`~selfspec.control.controller.StepPlan`, ``None`` on a step it did not plan).
        ``hidden`` / ``taps``: this tree's rows of the pass (``[n, H]`` / ``[n, D]`` or ``None``);
        ``verify_s``: this row's share of the pass. Returns the committed tokens."""
        new, finish = taken
        self.tokens[self.length: self.length + len(new)] = torch.tensor(new, dtype=torch.long)
        self.length += len(new)
        stats = self.stats
        tested_next = len(tree.children[verdict.path[-1]]) > 0 and not verdict.bonus
        stats.record_step(verdict.num_accepted, tested_next, len(new), tree.num_nodes - 1)
        stats.draft_time_s += draft_s
        stats.verify_time_s += verify_s
        stats.plain_steps += tree.num_nodes == 1
        if stats.steps == 1:
            stats.first_token_s, stats.first_step_tokens = now - self.start_s, len(new)
        if hidden is not None:
            self.root_hidden = hidden[verdict.path[-1]]
        if taps is not None and self.taps is not None:
            self.taps.append(taps[verdict.path])
        if finish is not None:
            self.finish = finish
        if self.streamer is not None:
            self.streamer.put(torch.tensor(new, dtype=torch.long))
        if self.controller is not None:
            self.controller.observe(plan, tree, verdict, new, verify_s)
        return new

    def fail(self, error: BaseException) -> None:
        """End this request with ``error`` (raised by its own drafter, constraint, processors,
        stopping criteria or streamer); it leaves the pool at the step's end."""
        if self.error is None:
            self.error = error
        self.finish = "error"

    def release(self) -> None:
        """Let go of the controller (after :meth:`close` or a failure)."""
        if self._holds_controller:
            self._holds_controller = False
            self.controller.release()

    def close(self, now: float) -> SpecOutput:
        """End the generation: the controller's members see the output; the streamer ends; the
        controller is released. A failed request (:meth:`fail`) ends nothing: its error stands."""
        try:
            if self.error is None:
                if self.finish is None:
                    self.finish = "length"
                if self.controller is not None:
                    self.controller.end(self.tokens[: self.length], self.prompt_len)
                if self.streamer is not None:
                    self.streamer.end()
        except Exception as err:  # (the request's own code: its error, nobody else's)
            self.fail(err)
        finally:
            self.release()
        self.stats.wall_time_s = now - self.start_s
        return SpecOutput(self.tokens[None, : self.length].clone(), self.stats, self.finish)


class _TapBuffer:
    """The target's taps of every committed position, in one preallocated ``[capacity, D]`` tensor
    (drafters read ``committed(n)``, a view of the first n rows)."""

    def __init__(self, capacity: int, first: torch.Tensor | None):
        self.rows, self.data, self.capacity = 0, None, capacity
        if first is not None:
            self.append(first)

    def append(self, rows: torch.Tensor) -> None:
        if self.data is None:
            self.data = rows.new_empty((self.capacity, rows.shape[-1]))
        self.data[self.rows: self.rows + rows.shape[0]] = rows
        self.rows += rows.shape[0]

    def committed(self, n: int) -> torch.Tensor | None:
        if self.data is None:
            return None
        return self.data[: min(n, self.rows)]
