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
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from .control import ControlConfig, Controller
from .drafters.base import Drafter
from .request import (Request, Settings, SpecOutput, check_prompt, controller_for, model_lock, sampling,
                      settings, sync)
from .sampling import SamplingConfig
from .target import TreeTarget, context_length

if TYPE_CHECKING:
    from .batch import BatchOutput

_sampling = sampling  # (the name the tests use)


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
    attention_mask=None,
) -> "SpecOutput | BatchOutput":
    """Generate from a transformers causal LM, speculatively when a drafter is given.

    Args:
        model: an unmodified transformers causal LM (``model(input_ids, attention_mask,
            position_ids, cache)`` interface) in eval mode.
        input_ids: ``[L]`` or ``[1, L]`` prompt token ids; or several prompts: a list of id
            sequences, or ``[B, L]`` ids (with ``attention_mask`` for padded rows, left or right, as
            transformers takes them). Several prompts decode as one batch
            (:mod:`selfspec.batch`: every row's tree in one pass, each row exact as alone) and
            return a :class:`selfspec.batch.BatchOutput`; ``seed`` then seeds row b with
            ``seed + b``; ``streamer`` and ``prefix_cache`` are for one prompt
            (:class:`selfspec.batch.Pool` takes a streamer per request).
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
        ValueError: bad sampling parameters, empty / out-of-vocabulary / over-long prompt,
            ``max_new_tokens < 1``, or a drafter built for another model.
    """
    prompts = _several(input_ids, attention_mask)
    if prompts is not None:
        from .batch import generate_batch

        if streamer is not None or prefix_cache is not None:
            raise ValueError("streamer and prefix_cache take one prompt; for several, use selfspec.batch.Pool "
                             "(a streamer per request)")
        return generate_batch(model, prompts, drafter=drafter, control=control, seed=seed, generator=generator,
                              max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              eos_token_id=eos_token_id, tools=tools, constraint=constraint,
                              generation_config=generation_config, logits_processor=logits_processor,
                              stopping_criteria=stopping_criteria, stop_strings=stop_strings, tokenizer=tokenizer)
    input_ids = _one(input_ids, attention_mask)
    run = _prepare(model, input_ids, drafter, max_new_tokens, temperature, top_k, top_p, seed, generator,
                   eos_token_id, control, prefix_cache, tools, constraint, generation_config, logits_processor,
                   stopping_criteria, stop_strings, tokenizer)
    out = decode(**run, streamer=streamer)
    out.sequences = out.sequences.to(input_ids.device if torch.is_tensor(input_ids) else "cpu")
    return out


def _several(input_ids, attention_mask):
    """The prompts of a batch call as a list of ``[L_b]`` tensors, or ``None`` for one prompt."""
    from .batch import split_prompts

    batch = (isinstance(input_ids, (list, tuple)) and len(input_ids) > 0
             and isinstance(input_ids[0], (list, tuple, torch.Tensor)))
    batch = batch or (torch.is_tensor(input_ids) and input_ids.dim() == 2 and input_ids.shape[0] > 1)
    if not batch:
        return None
    return split_prompts(input_ids, attention_mask)


def _one(input_ids, attention_mask):
    """One prompt, its padding (if any) removed."""
    if attention_mask is None:
        return input_ids
    from .batch import split_prompts

    ids = torch.as_tensor(input_ids)
    return split_prompts(ids.reshape(1, -1), torch.as_tensor(attention_mask).reshape(1, -1))[0].reshape(ids.shape[:-1] + (-1,))


def stream(model, input_ids, **kwargs) -> "SpecStream":
    """:func:`generate` as an iterator over each step's verified tokens (``list[int]``, in order;
    their concatenation is the output); for several prompts (a batch, as :func:`generate` takes
    them), over ``(row, tokens)`` pairs as each row commits them, and ``.output`` is a
    :class:`~selfspec.batch.BatchOutput`. Same arguments as :func:`generate` (``streamer`` too);
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
    device = input_ids.device if torch.is_tensor(input_ids) else torch.device("cpu")
    mask = args.pop("attention_mask")
    prompts = _several(args["input_ids"], mask)
    if prompts is not None:
        from .batch import batch_pool

        if args["streamer"] is not None or args["prefix_cache"] is not None:
            raise ValueError("streamer and prefix_cache take one prompt; a batch's stream yields (row, tokens)")
        for name in ("model", "input_ids", "streamer", "prefix_cache"):
            args.pop(name)
        return SpecStream(dict(pool=batch_pool(model, prompts, **args)), None, device)
    args["input_ids"] = _one(args["input_ids"], mask)
    streamer = args.pop("streamer")
    return SpecStream(_prepare(**args), streamer, device)


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
        self._prompt_seen: set = set()  # the engine puts each row's prompt first, as model.generate does
        # the worker holds only a weak reference to this iterator, so dropping it stops the worker
        self._thread = threading.Thread(target=_stream_work, args=(weakref.ref(self), run, self._stop, self._queue),
                                        daemon=True)
        self._thread.start()

    def put(self, value: torch.Tensor, row: int | None = None) -> None:  # the engine's streamer interface
        if row in self._prompt_seen:
            self._queue.put(value.tolist() if row is None else (row, value.tolist()))
        self._prompt_seen.add(row)
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

    def __init__(self, ref, stop: threading.Event, row: int | None = None):
        self.ref, self.stop, self.row = ref, stop, row

    def put(self, value) -> None:
        it = self.ref()
        if it is None or self.stop.is_set():
            raise _Stopped
        it.put(value, self.row)

    def end(self) -> None:
        it = self.ref()
        if it is not None:
            it.end()


def _stream_work(ref, run: dict, stop: threading.Event, q) -> None:
    out, error = None, None
    try:
        if "pool" in run:
            from .batch import BatchOutput

            pool, handles = run["pool"]
            for b, h in enumerate(handles):
                h.request.streamer = _StreamProxy(ref, stop, b)
            pool.run()
            out = BatchOutput([h.output for h in handles], pool.stats)
        else:
            out = decode(**run, streamer=_StreamProxy(ref, stop))
    except _Stopped:
        pass
    except BaseException as exc:  # handed to the consumer
        error = exc
    finally:
        it = ref()
        if it is not None:
            if out is not None:
                if hasattr(out, "outputs"):
                    for o in out.outputs:
                        o.sequences = o.sequences.to(it._device)
                else:
                    out.sequences = out.sequences.to(it._device)
                it.output = out
            it._error = error
        q.put(SpecStream._END)


def _prepare(model, input_ids, drafter, max_new_tokens, temperature, top_k, top_p, seed, generator,
             eos_token_id, control=None, prefix_cache=None, tools=None, constraint=None, generation_config=None,
             logits_processor=None, stopping_criteria=None, stop_strings=None, tokenizer=None) -> dict:
    """Check every argument of :func:`generate` and return ``decode``'s arguments."""
    s = settings(model, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                 generator=generator, eos_token_id=eos_token_id, generation_config=generation_config,
                 logits_processor=logits_processor, stopping_criteria=stopping_criteria, stop_strings=stop_strings,
                 tokenizer=tokenizer, constraint=constraint, tools=tools)
    ids = check_prompt(model, input_ids)
    controller = controller_for(drafter, control)
    if controller is not None:
        controller.check_target(model)
    if prefix_cache is not None:
        from .prefix_cache import PrefixCache

        if not isinstance(prefix_cache, PrefixCache):
            raise ValueError(f"prefix_cache must be a selfspec PrefixCache, got {type(prefix_cache).__name__}")
        prefix_cache.check_model(model)
    needs = controller.requires if controller is not None else None
    target = TreeTarget(model, want_hidden=needs is not None and needs.hidden, taps=needs.taps if needs else ())
    limit = context_length(model) or ids.shape[0] + s.max_new_tokens
    return dict(target=target, ids=ids, controller=controller, cfg=s.cfg, gen=s.gen, max_new_tokens=s.max_new_tokens,
                eos=s.eos, context_limit=limit, prefix_cache=prefix_cache, constraint=s.constraint, tools=s.tools,
                lock=model_lock(model), logits_processor=s.logits_processor, stopping_criteria=s.stopping_criteria)


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
    req = Request(ids, controller, Settings(cfg, gen, max_new_tokens, eos, context_limit, processor, stopping,
                                            constraint, tools), streamer)
    req.begin(getattr(target, "model", None), clock)
    share = controller is not None and controller.requires.target_cache and getattr(target, "supports_handoff", False)
    pre = target.prefill(ids, prefix_cache) if prefix_cache is not None else target.prefill(ids)
    sync(getattr(target, "device", None))
    req.prefilled(pre, bool(getattr(target, "taps", ())), clock(), getattr(target, "reused", 0))
    while req.check_budget():
        t0 = clock()
        tree, handoff = req.propose(clock, target.cache if share else None)
        t1 = clock()
        prefix = target.prefix_len
        scored = target.forward_tree(tree, handoff) if handoff is not None else target.forward_tree(tree)
        verdict = req.settle(tree, scored.logits)
        target.commit(verdict.path, prefix)
        sync(getattr(target, "device", None))
        t2 = clock()
        req.advance(tree, verdict, scored.hidden, scored.taps, t1 - t0, t2 - t1, t2, t2 - t1)
    if prefix_cache is not None:  # the committed state of prompt + output, for the next call
        keep = min(req.length - 1, target.prefix_len)
        taps = req.taps
        prefix_cache.store(req.tokens[:keep], target.cache, None if taps is None else taps.committed(keep), target.taps)
    return req.close(clock())
