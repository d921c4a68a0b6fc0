"""The public ``selfspec.generate`` and ``selfspec.stream``.

Both decode through a :class:`selfspec.batch.Pool`: one prompt is a pool of one row, several
prompts a batch; every step is the one decode step (:mod:`selfspec.decoding.step`): the drafter proposes a
tree rooted at the last committed token, the target scores the whole tree in one forward, the
pure verifier accepts a path and emits one recovered or bonus token (:mod:`selfspec.decoding.verify`), and
the KV cache keeps only the accepted path. ``drafter=None`` proposes root-only trees: plain
one-token decoding through the same step, the fair baseline for speed comparisons.

Invariants: every emitted token is distributed exactly as plain sampling from the target (greedy:
token-identical to plain greedy, up to floating-point differences between batched and sequential
kernels); generation never emits more than ``max_new_tokens``, ends right after the first EOS, and
never runs past the model's context. Arguments are checked here, before anything runs.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Iterable, Sequence

import torch

from .batch import BatchOutput, Pool, batch_pool, generate_batch, run_to_end, split_prompts
from .control import ControlConfig, Controller
from .drafters.base import Drafter
from .decoding.request import SpecOutput

#: Steps a stream's worker may run ahead of its consumer before it waits.
STREAM_AHEAD = 8


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

    Returns a :class:`~selfspec.decoding.request.SpecOutput` for one prompt and a
    :class:`~selfspec.batch.BatchOutput` for several (as ``model.generate`` returns one layout
    for either, the type follows the input: a ``[L]`` / ``[1, L]`` prompt is one, a list of
    prompts or ``[B, L]`` ids with ``B > 1`` are several).

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
        prefix_cache: a :class:`selfspec.decoding.prefix_cache.PrefixCache`: the prompt's longest cached
            token prefix is not prefilled again, and this call's prompt and output are stored in it
            (same output as without it; see that module).
        tools: the functions the caller offers (OpenAI-style or BFCL JSON-schema list), checked
            here; drafters that use them (``tools`` kind, unions holding one) draft the text a
            tool call's grammar forces. Drafting only: the output law does not change.
        constraint: a :class:`selfspec.decoding.constraint.Constraint` (e.g. ``ToolCallConstraint``): its
            token mask is applied to the target's logits at every tree node, so the output equals
            constrained plain decoding (``drafter=None`` with the same constraint) exactly.
        generation_config: a transformers ``GenerationConfig`` (see ``temperature``).
        logits_processor: transformers logits processors (a list or ``LogitsProcessorList``),
            applied at every tree node with that node's own path as ``input_ids``, so the output
            law is that of plain decoding with the same processors
            (:mod:`selfspec.decoding.logits_processing`; processors must be functions of their inputs).
        stopping_criteria: transformers stopping criteria, asked after every new token; the
            output ends at the first token where one says stop (``finish_reason`` ``"stop"``).
        stop_strings / tokenizer: stop when the text ends with one of these strings
            (transformers' ``StopStringCriteria``; needs the tokenizer).

    Raises:
        ValueError: bad sampling parameters, empty / out-of-vocabulary / over-long prompt,
            ``max_new_tokens < 1``, or a drafter built for another model.
    """
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   eos_token_id=eos_token_id, tools=tools, constraint=constraint, generation_config=generation_config,
                   logits_processor=logits_processor, stopping_criteria=stopping_criteria, stop_strings=stop_strings,
                   tokenizer=tokenizer)
    prompts = _several(input_ids, attention_mask)
    if prompts is not None:
        if streamer is not None or prefix_cache is not None:
            raise ValueError("streamer and prefix_cache take one prompt; for several, use selfspec.batch.Pool "
                             "(a streamer per request)")
        return generate_batch(model, prompts, drafter=drafter, control=control, seed=seed, generator=generator,
                              **options)
    pool, handle = _single(model, _one(input_ids, attention_mask), drafter, control, prefix_cache, streamer,
                           seed=seed, generator=generator, **options)
    run_to_end(pool)
    out = handle.result()
    out.sequences = out.sequences.to(input_ids.device if torch.is_tensor(input_ids) else "cpu")
    return out


def _single(model, input_ids, drafter, control, prefix_cache, streamer, **options):
    """A pool of one row with the prompt submitted (every argument checked), not run."""
    pool = Pool(model, drafter, control=control, max_batch=1, prefix_cache=prefix_cache)
    return pool, pool.submit(input_ids, streamer=streamer, **options)


def _several(input_ids, attention_mask):
    """The prompts of a batch call as a list of ``[L_b]`` tensors, or ``None`` for one prompt."""
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
    streamer, prefix_cache = args.pop("streamer"), args.pop("prefix_cache")
    model, drafter, control = args.pop("model"), args.pop("drafter"), args.pop("control")
    args.pop("input_ids")
    if prompts is not None:
        if streamer is not None or prefix_cache is not None:
            raise ValueError("streamer and prefix_cache take one prompt; a batch's stream yields (row, tokens)")
        pool, handles = batch_pool(model, prompts, drafter=drafter, control=control, **args)
        return SpecStream(pool, handles, None, device, batch=True)
    pool, handle = _single(model, _one(input_ids, mask), drafter, control, prefix_cache, None, **args)
    return SpecStream(pool, [handle], streamer, device, batch=False)


class _Stopped(Exception):
    """Raised inside a stream's worker when its consumer closed or dropped the iterator."""


class SpecStream:
    """Iterator of :func:`stream`: yields each step's tokens; ``.output`` when done. The worker
    runs at most :data:`STREAM_AHEAD` steps ahead of the consumer, then waits for it."""

    _END = object()

    def __init__(self, pool: Pool, handles: list, streamer, device, batch: bool):
        self.output: SpecOutput | BatchOutput | None = None
        self._queue: "queue.Queue" = queue.Queue(maxsize=STREAM_AHEAD)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._streamer, self._device = streamer, device
        pending: list = []  # what the step just committed, queued by the worker between steps
        for b, h in enumerate(handles):
            # the worker holds only a weak reference to this iterator, so dropping it stops the worker
            h.request.streamer = _StreamProxy(weakref.ref(self), self._stop, pending, b if batch else None)
        self._thread = threading.Thread(target=_stream_work, args=(weakref.ref(self), pool, handles, batch,
                                                                   self._stop, self._queue, pending), daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop generating (at the next step) and wait for the worker to finish; what was not
        read yet is dropped."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
            while True:
                try:
                    self._queue.put_nowait(self._END)
                    return
                except queue.Full:
                    self._queue.get_nowait()

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
    """A request's streamer inside a stream's worker: the prompt is skipped (the engine puts each
    row's prompt first, as ``model.generate`` does), every later put goes to the caller's
    streamer (if any) and to ``pending``, which the worker moves into the bounded queue between
    steps (outside the model's lock); raises :class:`_Stopped` once the consumer closed or
    dropped the iterator."""

    def __init__(self, ref, stop: threading.Event, pending: list, row: int | None):
        self.ref, self.stop, self.pending, self.row, self.seen_prompt = ref, stop, pending, row, False

    def put(self, value) -> None:
        it = self.ref()
        if it is None or self.stop.is_set():
            raise _Stopped
        if it._streamer is not None:
            it._streamer.put(value)
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.pending.append(value.tolist() if self.row is None else (self.row, value.tolist()))

    def end(self) -> None:
        it = self.ref()
        if it is not None and it._streamer is not None:
            it._streamer.end()


def _offer(q: "queue.Queue", item, ref, stop: threading.Event) -> None:
    """Put ``item`` on the bounded queue, waiting while it is full; :class:`_Stopped` once the
    consumer is gone."""
    while True:
        try:
            q.put(item, timeout=0.05)
            return
        except queue.Full:
            if ref() is None or stop.is_set():
                raise _Stopped from None


def _stream_work(ref, pool: Pool, handles: list, batch: bool, stop: threading.Event, q, pending: list) -> None:
    out, error = None, None
    try:
        while not pool.idle:
            pool.step()
            while pending:
                _offer(q, pending.pop(0), ref, stop)
        results = [h.result() for h in handles]
        out = BatchOutput(results, pool.stats) if batch else results[0]
    except _Stopped:
        pass
    except BaseException as exc:  # handed to the consumer
        error = exc
    finally:
        if not pool.idle:  # (the consumer left, or a pass failed: no controller stays held)
            pool.abandon(error or _Stopped())
        it = ref()
        if it is not None:
            if out is not None:
                for o in (out.outputs if batch else [out]):
                    o.sequences = o.sequences.to(it._device)
                it.output = out
            it._error = error
            del it
            try:
                _offer(q, SpecStream._END, ref, stop)
            except _Stopped:
                pass
