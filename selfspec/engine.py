"""The decode loop and the public ``selfspec.generate``.

One step: the drafter proposes a tree rooted at the last committed token, the target scores the
whole tree in one forward (:class:`selfspec.target.TreeTarget`), the pure verifier accepts a path
and emits one recovered or bonus token (:mod:`selfspec.verify`), and the KV cache is compacted to
the accepted path. ``drafter=None`` proposes root-only trees: plain one-token decoding through the
same loop, the fair baseline for speed comparisons.

Invariants: every emitted token is distributed exactly as plain sampling from the target (greedy:
token-identical to plain greedy, up to floating-point differences between batched and sequential
kernels); generation never emits more than ``max_new_tokens``, ends right after the first EOS, and
never runs past the model's context. All input checks happen here, once, at the public boundary.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from .control import ControlConfig, Controller
from .drafters.base import DraftContext, Drafter
from .logits_processing import first_stop, process_tree
from .metrics import SpecStats
from .sampling import SamplingConfig
from .target import TreeTarget, context_length
from .tree import DraftTree
from .verify import verify_tree


@dataclass
class SpecOutput:
    """Result of :func:`generate`.

    Attributes:
        sequences: ``[1, L + new]`` prompt followed by the new tokens.
        stats: step counts, mean accepted length, acceptance per depth, timings.
        finish_reason: ``"eos"``, ``"stop"`` (a stopping criterion or stop string), ``"length"``
            (``max_new_tokens`` reached) or ``"context"``.
    """

    sequences: torch.Tensor
    stats: SpecStats
    finish_reason: str


def generate(
    model,
    input_ids,
    *,
    drafter: "Drafter | Sequence[Drafter] | Controller | None" = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    control: "bool | ControlConfig | None" = None,
    streamer=None,
    prefix_cache=None,
    tools=None,
    constraint=None,
    generation_config=None,
    logits_processor=None,
    stopping_criteria=None,
    stop_strings=None,
    tokenizer=None,
) -> SpecOutput:
    """Generate from a transformers causal LM, speculatively when a drafter is given.

    Args:
        model: an unmodified transformers causal LM (``model(input_ids, attention_mask,
            position_ids, cache)`` interface) in eval mode.
        input_ids: ``[L]`` or ``[1, L]`` prompt token ids (batch size 1).
        drafter: a drafter from :func:`selfspec.build_drafter`, several (their union: the
            controller runs each alone, their merge or plain steps, whichever it measures fastest),
            or a :class:`selfspec.control.Controller` that keeps what it learnt across calls;
            ``None`` decodes one token per step.
        max_new_tokens: most tokens to generate (>= 1; default: the generation config's
            ``max_new_tokens``, else 128).
        temperature: 0 for greedy; > 0 samples. ``top_k`` (0 = off) and ``top_p`` (1 = off) filter
            the target's law exactly as plain sampling does. When none of the three is given,
            sampling follows ``generation_config`` (default: the model's own
            ``model.generation_config``) as ``model.generate`` applies it (``do_sample``,
            temperature, top-k, top-p, min-p, repetition penalty, n-gram ban); when any is given,
            they define sampling (unset ones off) and the config's repetition penalty and n-gram
            ban still apply.
        seed / generator: randomness for sampling (give at most one); a fresh random seed if none.
        eos_token_id: stop token(s); defaults to ``model.generation_config.eos_token_id``.
        control: how a fresh controller decides (:class:`selfspec.control.ControlConfig`;
            ``None``: defaults; ``False``: every step drafts with every drafter and verifies their
            trees as proposed). Not with a ``Controller`` (it has its config). The controller never
            changes the law (greedy: never the text), but which steps draft depends on measured
            time, so seeded sampling repeats token for token only with ``control=False``.
        streamer: a transformers streamer (``put(ids)`` / ``end()``, e.g. ``TextStreamer``): gets
            the prompt first (as ``model.generate`` does; ``skip_prompt=True`` skips it), then each
            step's verified tokens ``[k]`` as soon as they are committed, then ``end()``.
        prefix_cache: a :class:`selfspec.prefix_cache.PrefixCache`: the prompt's longest cached
            token prefix is not prefilled again, and this call's prompt and output are stored in it
            (same output as without it; see that module).
        tools: the functions the caller offers (OpenAI-style or BFCL JSON-schema list), checked
            here; drafters that use them (``tools`` kind, unions holding one) draft the text a
            tool call's grammar forces. Drafting only: the output law does not change.
        constraint: a :class:`selfspec.constraint.Constraint` (e.g. ``ToolCallConstraint``): its
            token mask is applied to the target's logits at every tree node, so the output equals
            constrained plain decoding (``drafter=None`` with the same constraint) exactly.
        generation_config: a transformers ``GenerationConfig`` (see ``temperature``).
        logits_processor: transformers logits processors (a list or ``LogitsProcessorList``),
            applied at every tree node with that node's own path as ``input_ids``, so the output
            law is that of plain decoding with the same processors
            (:mod:`selfspec.logits_processing`; processors must be functions of their inputs).
        stopping_criteria: transformers stopping criteria, asked after every new token; the
            output ends at the first token where one says stop (``finish_reason`` ``"stop"``).
        stop_strings / tokenizer: stop when the text ends with one of these strings
            (transformers' ``StopStringCriteria``; needs the tokenizer).

    Raises:
        ValueError: bad sampling parameters, empty / batched / out-of-vocabulary / over-long
            prompt, ``max_new_tokens < 1``, or a drafter built for another model.
    """
    run = _prepare(model, input_ids, drafter, max_new_tokens, temperature, top_k, top_p, seed, generator,
                   eos_token_id, control, prefix_cache, tools, constraint, generation_config, logits_processor,
                   stopping_criteria, stop_strings, tokenizer)
    out = decode(**run, streamer=streamer)
    out.sequences = out.sequences.to(input_ids.device if torch.is_tensor(input_ids) else "cpu")
    return out


def stream(model, input_ids, **kwargs) -> "SpecStream":
    """:func:`generate` as an iterator over each step's verified tokens (``list[int]``, in order;
    their concatenation is the output). Same arguments as :func:`generate` (``streamer`` too);
    arguments are checked here, before anything runs. Generation runs in a background thread
    so the consumer's own time never counts as a decoding step (the controller times steps); the
    final :class:`SpecOutput` is ``.output`` once the iterator is exhausted. Errors raised while
    generating are raised by the iterator. ``close()`` (or leaving a ``with`` block, or dropping
    the iterator) stops the generation at the next step."""
    import inspect

    try:
        bound = inspect.signature(generate).bind(model, input_ids, **kwargs)
    except TypeError as err:
        raise TypeError(f"stream() got unexpected arguments: {err}") from None
    bound.apply_defaults()
    args = dict(bound.arguments)
    streamer = args.pop("streamer")
    return SpecStream(_prepare(**args), streamer, input_ids.device if torch.is_tensor(input_ids) else torch.device("cpu"))


class _Stopped(Exception):
    """Raised inside a stream's worker when its consumer closed or dropped the iterator."""


class SpecStream:
    """Iterator of :func:`stream`: yields each step's tokens; ``.output`` when done."""

    _END = object()

    def __init__(self, run: dict, streamer, device):
        import queue

        self.output: SpecOutput | None = None
        self._queue: "queue.Queue" = queue.Queue()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._streamer, self._device = streamer, device
        self._prompt_seen = False  # the engine puts the prompt first, as model.generate does
        # the worker holds only a weak reference to this iterator, so dropping it stops the worker
        self._thread = threading.Thread(target=_stream_work, args=(weakref.ref(self), run, self._stop, self._queue),
                                        daemon=True)
        self._thread.start()

    def put(self, value: torch.Tensor) -> None:  # the engine's streamer interface (via _StreamProxy)
        if self._prompt_seen:
            self._queue.put(value.tolist())
        self._prompt_seen = True
        if self._streamer is not None:
            self._streamer.put(value)

    def end(self) -> None:
        if self._streamer is not None:
            self._streamer.end()

    def close(self) -> None:
        """Stop generating (at the next step) and wait for the worker to finish."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> "SpecStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self._stop.set()

    def __iter__(self) -> "SpecStream":
        return self

    def __next__(self) -> list[int]:
        item = self._queue.get()
        if item is self._END:
            self._queue.put(self._END)  # stay exhausted
            self._thread.join()
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            raise StopIteration
        return item


class _StreamProxy:
    """The engine's streamer inside a stream's worker: forwards to the iterator while it lives."""

    def __init__(self, ref, stop: threading.Event):
        self.ref, self.stop = ref, stop

    def put(self, value) -> None:
        it = self.ref()
        if it is None or self.stop.is_set():
            raise _Stopped
        it.put(value)

    def end(self) -> None:
        it = self.ref()
        if it is not None:
            it.end()


def _stream_work(ref, run: dict, stop: threading.Event, q) -> None:
    out, error = None, None
    try:
        out = decode(**run, streamer=_StreamProxy(ref, stop))
    except _Stopped:
        pass
    except BaseException as exc:  # handed to the consumer
        error = exc
    finally:
        it = ref()
        if it is not None:
            if out is not None:
                out.sequences = out.sequences.to(it._device)
                it.output = out
            it._error = error
        q.put(SpecStream._END)


def _check_constraint(constraint) -> None:
    from .constraint import Constraint

    if constraint is not None and not isinstance(constraint, Constraint):
        raise ValueError(f"constraint must be a selfspec.constraint.Constraint, got {type(constraint).__name__}")


def _prepare(model, input_ids, drafter, max_new_tokens, temperature, top_k, top_p, seed, generator,
             eos_token_id, control=None, prefix_cache=None, tools=None, constraint=None, generation_config=None,
             logits_processor=None, stopping_criteria=None, stop_strings=None, tokenizer=None) -> dict:
    """Check every argument of :func:`generate` and return ``decode``'s arguments."""
    _check_constraint(constraint)
    cfg, processors, max_new_tokens = _sampling(model, generation_config, temperature, top_k, top_p, max_new_tokens)
    processor = _processor_list(processors, logits_processor)
    stopping = _stopping(stopping_criteria, stop_strings, tokenizer)
    device = next(model.parameters()).device
    ids = _check_prompt(model, input_ids)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    controller = controller_for(drafter, control)
    if controller is not None:
        controller.check_target(model)
    if prefix_cache is not None:
        from .prefix_cache import PrefixCache

        if not isinstance(prefix_cache, PrefixCache):
            raise ValueError(f"prefix_cache must be a selfspec PrefixCache, got {type(prefix_cache).__name__}")
        prefix_cache.check_model(model)
    if tools is not None:
        from .tool_grammar import check_tools

        tools = check_tools(tools)
    gen = _make_generator(seed, generator, device)
    eos = _eos_ids(model, eos_token_id)
    needs = controller.requires if controller is not None else None
    target = TreeTarget(model, want_hidden=needs is not None and needs.hidden, taps=needs.taps if needs else ())
    limit = context_length(model) or ids.shape[0] + max_new_tokens
    return dict(target=target, ids=ids, controller=controller, cfg=cfg, gen=gen, max_new_tokens=max_new_tokens,
                eos=eos, context_limit=limit, prefix_cache=prefix_cache, constraint=constraint, tools=tools,
                lock=model_lock(model), logits_processor=processor, stopping_criteria=stopping)


def _sampling(model, generation_config, temperature, top_k, top_p, max_new_tokens):
    """``(SamplingConfig, processors, max_new_tokens)`` from the explicit arguments and the
    generation config (see :func:`generate`)."""
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


def _processor_list(processors: list, given):
    if given is None and not processors:
        return None
    from transformers import LogitsProcessorList

    given = list(given) if given is not None else []
    for p in given:
        if not callable(p):
            raise ValueError(f"logits_processor entries must be transformers LogitsProcessors, got {type(p).__name__}")
    return LogitsProcessorList(processors + given)


def _stopping(criteria, stop_strings, tokenizer):
    if criteria is None and not stop_strings:
        return None
    from transformers import StoppingCriteriaList

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


def decode(
    target,
    ids: torch.Tensor,
    controller: Controller | None,
    cfg: SamplingConfig,
    gen: torch.Generator,
    max_new_tokens: int,
    eos: set[int],
    context_limit: int,
    clock=time.perf_counter,
    streamer=None,
    prefix_cache=None,
    constraint=None,
    tools=None,
    lock=None,
    logits_processor=None,
    stopping_criteria=None,
) -> SpecOutput:
    """The speculative loop over an already validated prompt.

    ``target`` is anything with ``prefill``, ``forward_tree``, ``commit`` and ``prefix_len`` like
    :class:`TreeTarget` (tests plug in cheap table-driven targets). ``ids``: ``[L]`` on the CPU.
    ``controller`` (optional) proposes each step's tree from seconds read off
    ``clock`` (tests inject a deterministic one); ``None``: plain steps. ``streamer`` (optional,
    ``put`` / ``end``) gets the prompt ``[1, L]``, then each step's new tokens ``[k]``, then
    ``end()``. ``prefix_cache`` (optional): reuse and store the target's committed state across
    calls (:mod:`selfspec.prefix_cache`). ``constraint`` (optional): a token mask applied at every
    tree node before verification (:mod:`selfspec.constraint`). ``lock`` (optional): held for the
    whole generation (:func:`model_lock`). ``logits_processor`` / ``stopping_criteria`` (optional):
    applied per tree node / after every new token (:mod:`selfspec.logits_processing`).
    """
    with lock if lock is not None else contextlib.nullcontext():
        return _decode(target, ids, controller, cfg, gen, max_new_tokens, eos, context_limit, clock, streamer,
                       prefix_cache, constraint, tools, logits_processor, stopping_criteria)


def _decode(target, ids, controller, cfg, gen, max_new_tokens, eos, context_limit, clock, streamer, prefix_cache,
            constraint, tools, processor=None, stopping=None) -> SpecOutput:
    stats = SpecStats()
    if controller is not None:  # members reset; the verify cost curve of the target's model, if not known yet
        controller.begin(getattr(target, "model", None))
    if streamer is not None:
        streamer.put(ids[None].clone())
    share = controller is not None and controller.requires.target_cache and getattr(target, "supports_handoff", False)
    start = clock()
    tokens = torch.empty(ids.shape[0] + max_new_tokens, dtype=torch.long)
    tokens[: ids.shape[0]] = ids
    length = ids.shape[0]
    if constraint is not None:
        constraint.reset()
    pre = target.prefill(ids, prefix_cache) if prefix_cache is not None else target.prefill(ids)
    stats.prefix_reused = getattr(target, "reused", 0)
    root_hidden = pre.hidden[-1] if pre.hidden is not None else None
    taps = _TapBuffer(tokens.shape[0], pre.taps) if getattr(target, "taps", ()) else None
    _sync(target)
    stats.prefill_time_s = clock() - start
    finish = "length"
    while stats.new_tokens < max_new_tokens:
        budget = min(max_new_tokens - stats.new_tokens, context_limit - length)
        if budget < 1:
            finish = "context"
            break
        t0 = clock()
        handoff = None
        if controller is not None and budget > 1:
            ctx = DraftContext(tokens[:length], root_hidden, budget - 1, cfg, gen, target.cache if share else None,
                               features=taps.committed(length - 1) if taps is not None else None,
                               prompt_len=ids.shape[0], tools=tools)
            proposal = controller.propose(ctx, clock)
            tree, handoff = proposal.tree, proposal.handoff
        else:
            tree = DraftTree.root_only(int(tokens[length - 1]))
        t1 = clock()
        prefix = target.prefix_len
        scored = target.forward_tree(tree, handoff) if handoff is not None else target.forward_tree(tree)
        logits = scored.logits
        if constraint is not None:  # the same mask plain decoding applies, at every node's own path
            allowed = constraint.masks(tokens[ids.shape[0]:length].tolist(), tree, logits.shape[-1])
            if not bool(allowed[0].any()):
                raise RuntimeError("the constraint allows no token after the output so far")
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        if processor is not None:  # each node's logits processed after its own path, as plain decoding would
            logits = process_tree(processor, tokens[:length], tree, logits)
        verdict = verify_tree(tree, logits, cfg, gen)
        target.commit(verdict.path, prefix)
        _sync(target)
        t2 = clock()
        new = tree.tokens[verdict.path[1:]].tolist() + [verdict.next_token]
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), None)
        new = new[:cut]
        stop = first_stop(stopping, tokens[:length], new) if stopping is not None else None
        if stop is not None:
            new, cut = new[:stop], stop
        tokens[length : length + len(new)] = torch.tensor(new)
        length += len(new)
        if streamer is not None:
            streamer.put(torch.tensor(new))
        tested_next = len(tree.children[verdict.path[-1]]) > 0 and not verdict.bonus
        stats.record_step(verdict.num_accepted, tested_next, len(new), tree.num_nodes - 1)
        stats.draft_time_s += t1 - t0
        stats.verify_time_s += t2 - t1
        stats.plain_steps += tree.num_nodes == 1
        if stats.steps == 1:
            stats.first_token_s, stats.first_step_tokens = t2 - start, len(new)
        if scored.hidden is not None:
            root_hidden = scored.hidden[verdict.path[-1]]
        if scored.taps is not None and taps is not None:
            taps.append(scored.taps[verdict.path])
        if controller is not None:
            controller.observe(tree, verdict, new, t2 - t1)
        if cut is not None:
            finish = "stop" if stop is not None else "eos"
            break
    if prefix_cache is not None:  # the committed state of prompt + output, for the next call
        keep = min(length - 1, target.prefix_len)
        prefix_cache.store(tokens[:keep], target.cache, None if taps is None else taps.committed(keep), target.taps)
    if controller is not None:
        controller.end(tokens[:length], ids.shape[0])
    if streamer is not None:
        streamer.end()
    stats.wall_time_s = clock() - start
    return SpecOutput(tokens[None, :length].clone(), stats, finish)


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


def _check_prompt(model, input_ids) -> torch.Tensor:
    """Validate and return the prompt as a CPU ``[L]`` LongTensor."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"selfspec.generate decodes one sequence at a time; got a batch of {ids.shape[0]}")
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


def _make_generator(seed, generator, device) -> torch.Generator:
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
        gen.manual_seed(int(seed))
    return gen


def _eos_ids(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        gen_cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(gen_cfg, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


def _sync(target) -> None:
    device = getattr(target, "device", None)
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
