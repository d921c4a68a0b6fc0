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

import threading
import weakref
from dataclasses import dataclass
import torch

from ..control import ControlConfig, Controller
from ..drafters.base import DraftContext, Drafter
from .logits_processing import first_stop, process_tree
from .metrics import SpecStats
from .sampling import SamplingConfig
from ..model.target import context_length
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


@dataclass
class Settings:
    """A request's validated decoding settings (built by :func:`settings`).

    Attributes:
        cfg: the target's sampling law; ``gen``: the request's own generator.
        max_new_tokens: most tokens to emit; ``eos``: stop token ids.
        context_limit: most positions prompt + output may fill.
        logits_processor / stopping_criteria: transformers lists (or ``None``); ``constraint``: a
            :class:`~selfspec.decoding.constraint.Constraint`; ``tools``: validated tool definitions.
    """

    cfg: SamplingConfig
    gen: torch.Generator
    max_new_tokens: int
    eos: set[int]
    context_limit: int
    logits_processor: object = None
    stopping_criteria: object = None
    constraint: object = None
    tools: list | None = None


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


# ---------------------------------------------------------------------- argument checks
def settings(model, prompt_len: int, *, max_new_tokens=None, temperature=None, top_k=None, top_p=None, seed=None,
             generator=None, eos_token_id=None, generation_config=None, logits_processor=None, stopping_criteria=None,
             stop_strings=None, tokenizer=None, constraint=None, tools=None) -> Settings:
    """Check one request's decoding arguments (see :func:`selfspec.generate`) for a prompt of
    ``prompt_len`` tokens and return them validated; every error is a ``ValueError`` naming the
    argument."""
    check_constraint(constraint)
    cfg, processors, max_new_tokens = sampling(model, generation_config, temperature, top_k, top_p, max_new_tokens)
    processor = processor_list(processors, logits_processor)
    stopping = stopping_list(stopping_criteria, stop_strings, tokenizer)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if tools is not None:
        from .tool_grammar import check_tools

        tools = check_tools(tools)
    device = next(model.parameters()).device
    limit = context_length(model) or prompt_len + max_new_tokens
    return Settings(cfg, make_generator(seed, generator, device), max_new_tokens, eos_ids(model, eos_token_id),
                    limit, processor, stopping, constraint, tools)


def check_constraint(constraint) -> None:
    from .constraint import Constraint

    if constraint is not None and not isinstance(constraint, Constraint):
        raise ValueError(f"constraint must be a selfspec.decoding.constraint.Constraint, got {type(constraint).__name__}")


def sampling(model, generation_config, temperature, top_k, top_p, max_new_tokens):
    """``(SamplingConfig, processors, max_new_tokens)`` from the explicit arguments and the
    generation config (see :func:`selfspec.generate`)."""
    from .logits_processing import from_generation_config, penalties

    gc = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    if generation_config is not None and not hasattr(generation_config, "do_sample"):
        raise ValueError(f"generation_config must be a transformers GenerationConfig, got {type(generation_config).__name__}")
    if max_new_tokens is None:
        max_new_tokens = getattr(gc, "max_new_tokens", None) or 128
    if gc is None:
        return SamplingConfig(temperature or 0.0, top_k or 0, 1.0 if top_p is None else top_p), [], max_new_tokens
    if temperature is None and top_k is None and top_p is None:
        from_config, processors = from_generation_config(gc)
        return from_config, processors, max_new_tokens
    cfg = SamplingConfig(0.0 if temperature is None else temperature, top_k or 0, 1.0 if top_p is None else top_p)
    return cfg, penalties(gc), max_new_tokens


def processor_list(processors: list, given):
    if given is None and not processors:
        return None
    from transformers import LogitsProcessorList

    given = list(given) if given is not None else []
    for p in given:
        if not callable(p):
            raise ValueError(f"logits_processor entries must be transformers LogitsProcessors, got {type(p).__name__}")
    return LogitsProcessorList(processors + given)


def stopping_list(criteria, stop_strings, tokenizer):
    if criteria is None and not stop_strings:
        return None
    from transformers import StoppingCriteriaList

    if criteria is not None:
        if callable(criteria) and not isinstance(criteria, (list, tuple)):
            criteria = [criteria]
        if isinstance(criteria, (str, bytes)) or not isinstance(criteria, (list, tuple)):
            raise ValueError(f"stopping_criteria must be a list of transformers StoppingCriteria, got "
                             f"{type(criteria).__name__}")
        for c in criteria:
            if not callable(c):
                raise ValueError(f"stopping_criteria entries must be callables (StoppingCriteria), got {type(c).__name__}")
    if stop_strings is not None and not isinstance(stop_strings, str) and \
            not all(isinstance(x, str) for x in stop_strings):
        raise ValueError("stop_strings must be a string or a list of strings")
    out = StoppingCriteriaList(list(criteria) if criteria is not None else [])
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings need tokenizer= (the target's tokenizer)")
        from transformers.generation.stopping_criteria import StopStringCriteria

        out.append(StopStringCriteria(tokenizer, [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)))
    return out


def controller_for(drafter, control) -> Controller | None:
    """The controller a call uses: the caller's own, a fresh one over the given drafter(s), or
    ``None`` (plain decoding)."""
    if isinstance(drafter, Controller):
        if control is not None:
            raise ValueError("give control= only with drafters, not with a Controller (it has its own config)")
        return drafter
    if control is not None and control is not False and not isinstance(control, ControlConfig):
        raise ValueError(f"control must be None, False or a ControlConfig, got {type(control).__name__}")
    if drafter is None:
        return None
    members = list(drafter) if isinstance(drafter, (list, tuple)) else [drafter]
    for m in members:
        if not isinstance(m, Drafter):
            raise ValueError(f"drafter must be a selfspec Drafter (see build_drafter), a list of them or a "
                             f"Controller, got {type(m).__name__}")
    config = ControlConfig(fixed=True) if control is False else control
    return Controller(members, config)


_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model) -> threading.RLock:
    """One lock per model object: generations on a shared model run one at a time (their tree
    passes, tap hooks and layer slices touch the model), so concurrent callers get the outputs
    of sequential runs."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


def as_token_ids(input_ids, name: str = "input_ids") -> torch.Tensor:
    """``input_ids`` (a tensor, a numpy array, or a list of ints) as an integer tensor, or a
    ``TypeError`` / ``ValueError`` naming ``name``: text, ``None``, floats and ragged lists are refused
    before torch sees them."""
    if input_ids is None:
        raise TypeError(f"{name} is None: give token ids (tokenizer(text, return_tensors='pt').input_ids)")
    if isinstance(input_ids, (str, bytes)) or (isinstance(input_ids, (list, tuple)) and input_ids
                                               and isinstance(input_ids[0], (str, bytes))):
        raise TypeError(f"{name} must be token ids, not text: tokenize it first "
                        "(tokenizer(text, return_tensors='pt').input_ids, or selfspec.chat.encode_chat)")
    if torch.is_tensor(input_ids):
        if input_ids.device.type == "meta":
            raise ValueError(f"{name} is on the meta device (no values): give real token ids")
        ids = input_ids
    else:
        try:
            ids = torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"{name} must be a rectangular array of integer token ids: {err}") from None
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be integer token ids, got dtype {ids.dtype}")
    return ids


def check_prompt(model, input_ids) -> torch.Tensor:
    """Validate and return one prompt as a CPU ``[L]`` LongTensor."""
    ids = as_token_ids(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"expected one prompt, got a batch of {ids.shape[0]}")
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must have shape [L] or [1, L], got {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. the BOS token)")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}); the prompt holds {lo if lo < 0 else hi}")
    limit = context_length(model)
    if limit is not None and ids.shape[0] >= limit:
        raise ValueError(
            f"the prompt has {ids.shape[0]} tokens but the model's context holds {limit}: "
            "nothing can be generated; shorten the prompt"
        )
    return ids.to("cpu", torch.long)


def make_generator(seed, generator, device) -> torch.Generator:
    if seed is not None and generator is not None:
        raise ValueError("give either seed or generator, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if generator.device.type != torch.device(device).type:
            raise ValueError(f"generator is on {generator.device} but the model runs on {device}")
        return generator
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(check_seed(seed))
    return gen


def check_seed(seed) -> int:
    """``seed`` as an int in ``[0, 2**63)`` (numpy integers too), else an error naming it."""
    import numbers

    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer, got {seed!r} ({type(seed).__name__})")
    if not 0 <= int(seed) < 2 ** 63:
        raise ValueError(f"seed must lie in [0, 2**63), got {seed}")
    return int(seed)


def eos_ids(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        gen_cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(gen_cfg, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    import numbers

    scalar = isinstance(eos_token_id, numbers.Number) or (torch.is_tensor(eos_token_id) and eos_token_id.dim() == 0)
    values = [eos_token_id] if scalar else eos_token_id
    try:
        values = list(values)
    except TypeError:
        raise TypeError(f"eos_token_id must be a token id or a list of them, got {eos_token_id!r}") from None
    vocab = model.config.get_text_config(decoder=True).vocab_size
    out = set()
    for t in values:
        t = t.item() if torch.is_tensor(t) else t
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"eos_token_id must hold integer token ids, got {t!r} ({type(t).__name__})")
        if not 0 <= int(t) < vocab:
            raise ValueError(f"eos_token_id {t} is outside the vocabulary [0, {vocab})")
        out.add(int(t))
    return out
