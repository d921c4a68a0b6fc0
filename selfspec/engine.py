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

import time
from dataclasses import dataclass
from typing import Iterable

import torch

from .adaptive import AdaptiveConfig, AdaptivePolicy
from .drafters.base import DraftContext, Drafter, Proposal
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
        finish_reason: ``"eos"``, ``"length"`` (``max_new_tokens`` reached) or ``"context"``.
    """

    sequences: torch.Tensor
    stats: SpecStats
    finish_reason: str


def generate(
    model,
    input_ids,
    *,
    drafter: Drafter | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    adaptive: "bool | AdaptiveConfig | AdaptivePolicy" = True,
    streamer=None,
    prefix_cache=None,
    tools=None,
    constraint=None,
) -> SpecOutput:
    """Generate from a transformers causal LM, speculatively when a drafter is given.

    Args:
        model: an unmodified transformers causal LM (``model(input_ids, attention_mask,
            position_ids, cache)`` interface) in eval mode.
        input_ids: ``[L]`` or ``[1, L]`` prompt token ids (batch size 1).
        drafter: from :func:`selfspec.build_drafter`; ``None`` decodes one token per step.
        max_new_tokens: most tokens to generate (>= 1).
        temperature: 0 for greedy; > 0 samples. ``top_k`` (0 = off) and ``top_p`` (1 = off) filter
            the target's law exactly as plain sampling does.
        seed / generator: randomness for sampling (give at most one); a fresh random seed if none.
        eos_token_id: stop token(s); defaults to ``model.generation_config.eos_token_id``.
        adaptive: let :class:`selfspec.adaptive.AdaptivePolicy` skip drafting (and cap its depth)
            while speculation would be slower than plain steps. ``True``: default knobs, state kept
            on the drafter (``drafter.adaptive_policy``, carried across calls); an
            :class:`AdaptiveConfig` to tune; an :class:`AdaptivePolicy` the caller keeps (and may
            share, reset or inspect); ``False``: draft every step. Never changes the law (greedy:
            never the text), but which steps draft depends on measured time, so seeded sampling
            repeats token for token only with ``adaptive=False``.
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

    Raises:
        ValueError: bad sampling parameters, empty / batched / out-of-vocabulary / over-long
            prompt, ``max_new_tokens < 1``, or a drafter built for another model.
    """
    run = _prepare(model, input_ids, drafter, max_new_tokens, temperature, top_k, top_p, seed, generator,
                   eos_token_id, adaptive, prefix_cache, tools, constraint)
    out = decode(**run, streamer=streamer)
    out.sequences = out.sequences.to(input_ids.device if torch.is_tensor(input_ids) else "cpu")
    return out


def stream(model, input_ids, **kwargs) -> "SpecStream":
    """:func:`generate` as an iterator over each step's verified tokens (``list[int]``, in order;
    their concatenation is the output). Same arguments as :func:`generate` (``streamer`` too);
    arguments are checked here, before anything runs. Generation runs in a background thread
    so the consumer's own time never counts as a decoding step (the adaptive policy and unions
    time steps); the final :class:`SpecOutput` is ``.output`` once the iterator is exhausted.
    Errors raised while generating are raised by the iterator."""
    import inspect

    try:
        bound = inspect.signature(generate).bind(model, input_ids, **kwargs)
    except TypeError as err:
        raise TypeError(f"stream() got unexpected arguments: {err}") from None
    bound.apply_defaults()
    args = dict(bound.arguments)
    streamer = args.pop("streamer")
    return SpecStream(_prepare(**args), streamer, input_ids.device if torch.is_tensor(input_ids) else torch.device("cpu"))


class SpecStream:
    """Iterator of :func:`stream`: yields each step's tokens; ``.output`` when done."""

    _END = object()

    def __init__(self, run: dict, streamer, device):
        import queue
        import threading

        self.output: SpecOutput | None = None
        self._queue: "queue.Queue" = queue.Queue()
        self._error: BaseException | None = None
        self._streamer, self._device = streamer, device
        self._prompt_seen = False  # the engine puts the prompt first, as model.generate does
        self._thread = threading.Thread(target=self._work, args=(run,), daemon=True)
        self._thread.start()

    def put(self, value: torch.Tensor) -> None:  # the engine's streamer interface
        if self._prompt_seen:
            self._queue.put(value.tolist())
        self._prompt_seen = True
        if self._streamer is not None:
            self._streamer.put(value)

    def end(self) -> None:
        if self._streamer is not None:
            self._streamer.end()

    def _work(self, run: dict) -> None:
        try:
            out = decode(**run, streamer=self)
            out.sequences = out.sequences.to(self._device)
            self.output = out
        except BaseException as exc:  # handed to the consumer
            self._error = exc
        finally:
            self._queue.put(self._END)

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


def _check_constraint(constraint) -> None:
    from .constraint import Constraint

    if constraint is not None and not isinstance(constraint, Constraint):
        raise ValueError(f"constraint must be a selfspec.constraint.Constraint, got {type(constraint).__name__}")


def _prepare(model, input_ids, drafter, max_new_tokens, temperature, top_k, top_p, seed, generator,
             eos_token_id, adaptive, prefix_cache=None, tools=None, constraint=None) -> dict:
    """Check every argument of :func:`generate` and return ``decode``'s arguments."""
    _check_constraint(constraint)
    cfg = SamplingConfig(temperature, top_k, top_p)
    device = next(model.parameters()).device
    ids = _check_prompt(model, input_ids)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if drafter is not None:
        if not isinstance(drafter, Drafter):
            raise ValueError(f"drafter must be a selfspec Drafter (see build_drafter), got {type(drafter).__name__}")
        drafter.check_target(model)
    if prefix_cache is not None:
        from .prefix_cache import PrefixCache

        if not isinstance(prefix_cache, PrefixCache):
            raise ValueError(f"prefix_cache must be a selfspec PrefixCache, got {type(prefix_cache).__name__}")
        prefix_cache.check_model(model)
    if tools is not None:
        from .tool_grammar import check_tools

        check_tools(tools)
    if drafter is not None and drafter.uses_tools:
        drafter.set_tools(tools)
    gen = _make_generator(seed, generator, device)
    eos = _eos_ids(model, eos_token_id)
    target = TreeTarget(model, want_hidden=drafter is not None and drafter.needs_hidden,
                        taps=drafter.taps if drafter is not None else ())
    limit = context_length(model) or ids.shape[0] + max_new_tokens
    policy = policy_for(drafter, adaptive)
    if policy is not None:
        policy.begin()
    return dict(target=target, ids=ids, drafter=drafter, cfg=cfg, gen=gen, max_new_tokens=max_new_tokens, eos=eos,
                context_limit=limit, policy=policy, prefix_cache=prefix_cache, constraint=constraint)


def decode(
    target,
    ids: torch.Tensor,
    drafter: Drafter | None,
    cfg: SamplingConfig,
    gen: torch.Generator,
    max_new_tokens: int,
    eos: set[int],
    context_limit: int,
    policy: AdaptivePolicy | None = None,
    clock=time.perf_counter,
    streamer=None,
    prefix_cache=None,
    constraint=None,
) -> SpecOutput:
    """The speculative loop over an already validated prompt.

    ``target`` is anything with ``prefill``, ``forward_tree``, ``commit`` and ``prefix_len`` like
    :class:`TreeTarget` (tests plug in cheap table-driven targets). ``ids``: ``[L]`` on the CPU.
    ``policy`` (optional) decides per step whether to draft and how deep, from step times read
    off ``clock`` (seconds; tests inject a deterministic one); for a ``self_paced`` drafter it only
    caps the depth. ``streamer`` (optional, ``put`` / ``end``) gets the prompt ``[1, L]``, then each
    step's new tokens ``[k]``, then ``end()``. ``prefix_cache`` (optional): reuse and store the
    target's committed state across calls (:mod:`selfspec.prefix_cache`). ``constraint``
    (optional): a token mask applied at every tree node before verification
    (:mod:`selfspec.constraint`).
    """
    stats = SpecStats()
    if streamer is not None:
        streamer.put(ids[None].clone())
    share = drafter is not None and drafter.shares_target_cache and getattr(target, "supports_handoff", False)
    start = clock()
    tokens = torch.empty(ids.shape[0] + max_new_tokens, dtype=torch.long)
    tokens[: ids.shape[0]] = ids
    length = ids.shape[0]
    if drafter is not None:
        drafter.reset()
    if constraint is not None:
        constraint.reset()
    pre = target.prefill(ids, prefix_cache) if prefix_cache is not None else target.prefill(ids)
    stats.prefix_reused = getattr(target, "reused", 0)
    root_hidden = pre.hidden[-1] if pre.hidden is not None else None
    features = pre.taps  # taps of committed positions the drafter has not seen yet
    all_taps = [pre.taps] if prefix_cache is not None and pre.taps is not None else None
    _sync(target)
    stats.prefill_time_s = clock() - start
    finish = "length"
    while stats.new_tokens < max_new_tokens:
        budget = min(max_new_tokens - stats.new_tokens, context_limit - length)
        if budget < 1:
            finish = "context"
            break
        t0 = clock()
        speculate = drafter is not None and budget > 1 and (policy is None or drafter.self_paced or policy.speculate())
        depth = policy.max_depth(budget - 1) if policy is not None else budget - 1
        ctx = DraftContext(tokens[:length], root_hidden, depth, cfg, gen, target.cache if share else None,
                           features=features if speculate else None, prompt_len=ids.shape[0], room=budget - 1)
        proposal = _checked(Proposal.of(drafter.propose(ctx)), ctx) if speculate else None
        tree = proposal.tree if speculate else DraftTree.root_only(int(tokens[length - 1]))
        if speculate:
            features = None
        t1 = clock()
        prefix = target.prefix_len
        handoff = proposal.handoff if speculate else None
        scored = target.forward_tree(tree, handoff) if handoff is not None else target.forward_tree(tree)
        logits = scored.logits
        if constraint is not None:  # the same mask plain decoding applies, at every node's own path
            allowed = constraint.masks(tokens[ids.shape[0]:length].tolist(), tree, logits.shape[-1])
            if not bool(allowed[0].any()):
                raise RuntimeError("the constraint allows no token after the output so far")
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        verdict = verify_tree(tree, logits, cfg, gen)
        target.commit(verdict.path, prefix)
        _sync(target)
        t2 = clock()
        new = tree.tokens[verdict.path[1:]].tolist() + [verdict.next_token]
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), None)
        new = new[:cut]
        tokens[length : length + len(new)] = torch.tensor(new)
        length += len(new)
        if streamer is not None:
            streamer.put(torch.tensor(new))
        tested_next = len(tree.children[verdict.path[-1]]) > 0 and not verdict.bonus
        stats.record_step(verdict.num_accepted, tested_next, len(new), tree.num_nodes - 1)
        stats.draft_time_s += t1 - t0
        stats.verify_time_s += t2 - t1
        if stats.steps == 1:
            stats.first_token_s, stats.first_step_tokens = t2 - start, len(new)
        if policy is not None:
            drafted = speculate and tree.num_nodes > 1  # an empty draft costs (about) a plain step
            policy.record(drafted, t2 - t0, len(new), verdict.num_accepted, tested_next)
            stats.plain_steps += not drafted
            stats.fallbacks = policy.fallbacks
        if speculate:
            drafter.observe(ctx, tree, verdict)
        if scored.hidden is not None:
            root_hidden = scored.hidden[verdict.path[-1]]
        if scored.taps is not None:
            new_taps = scored.taps[verdict.path]
            features = new_taps if features is None else torch.cat([features, new_taps])
            if all_taps is not None:
                all_taps.append(new_taps)
        if cut is not None:
            finish = "eos"
            break
    if prefix_cache is not None:  # the committed state of prompt + output, for the next call
        keep = min(length - 1, target.prefix_len)
        prefix_cache.store(tokens[:keep], target.cache, None if all_taps is None else torch.cat(all_taps),
                           target.taps)
    if drafter is not None:
        drafter.end(tokens[:length], ids.shape[0])
    if streamer is not None:
        streamer.end()
    stats.wall_time_s = clock() - start
    return SpecOutput(tokens[None, :length].clone(), stats, finish)


def policy_for(drafter: Drafter, adaptive: "bool | AdaptiveConfig | AdaptivePolicy") -> AdaptivePolicy | None:
    """The adaptive state a call with ``adaptive`` uses: ``None`` when off (``False`` or no
    drafter); the caller's own :class:`AdaptivePolicy` as given; otherwise the drafter's
    :attr:`~selfspec.drafters.base.Drafter.adaptive_policy`, kept across calls and replaced by a
    fresh one when the config changes."""
    if drafter is None or adaptive is False:
        return None
    if isinstance(adaptive, AdaptivePolicy):
        return adaptive
    if adaptive is not True and not isinstance(adaptive, AdaptiveConfig):
        raise ValueError(f"adaptive must be a bool, an AdaptiveConfig or an AdaptivePolicy, got {type(adaptive).__name__}")
    cfg = adaptive if isinstance(adaptive, AdaptiveConfig) else AdaptiveConfig()
    if drafter.adaptive_policy is None or drafter.adaptive_policy.cfg != cfg:
        drafter.adaptive_policy = AdaptivePolicy(cfg)
    return drafter.adaptive_policy


def _checked(proposal: Proposal, ctx: DraftContext) -> Proposal:
    tree = proposal.tree
    if not isinstance(tree, DraftTree):
        raise ValueError(f"drafter returned {type(tree).__name__}, expected a DraftTree or a Proposal")
    if int(tree.tokens[0]) != ctx.root_token:
        raise ValueError(f"drafter returned a tree rooted at {int(tree.tokens[0])}, expected {ctx.root_token}")
    if proposal.handoff is not None:
        if ctx.cache is None:
            raise ValueError("drafter returned a layer handoff without being given the target's cache")
        if tree.depth > ctx.max_depth:
            raise ValueError(f"drafter returned a tree of depth {tree.depth} > max_depth {ctx.max_depth} with a layer handoff")
        return proposal
    return Proposal(tree.prune_depth(ctx.max_depth))


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
