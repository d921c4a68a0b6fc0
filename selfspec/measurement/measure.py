"""Side-by-side speed measurement: speculative vs plain decoding in one process.

Convention: runs alternate (plain, speculative, plain, speculative, ...) on the same prompt so
that machine noise hits both alike; speedup = speculative decode rate / plain decode rate, each
new tokens over decode seconds summed over repeats (prefill excluded from both). With identical
outputs that is the ratio of decode times; where the outputs differ in length (sampling, or a bf16
near-tie that ends one run earlier) a time ratio would charge the longer run for its extra tokens.
A short warm-up run of each precedes the measurement. With a ``reference`` model (another copy of the target, e.g. float32 beside a
bfloat16 run) its plain decoding joins the alternation, so a speculative run in one dtype is also
measured against plain decoding in the other (``speedup_vs_reference``): a faster dtype is then
not credited to speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import SpecOutput, generate


@dataclass
class Comparison:
    """Plain and speculative runs of one prompt.

    Attributes:
        plain: the last plain run (its ``sequences`` are the reference text).
        spec: the last speculative run.
        plain_time_s / spec_time_s: decode seconds summed over repeats.
        identical: every speculative output equalled the plain output of the same repeat.
        reference: the last plain run on the reference model (``None`` without one).
        reference_time_s: its decode seconds summed over repeats.
        plain_tokens / spec_tokens / reference_tokens: new tokens summed over repeats (0: unknown,
            the speedups are then ratios of times).
    """

    plain: SpecOutput
    spec: SpecOutput
    plain_time_s: float
    spec_time_s: float
    identical: bool
    reference: SpecOutput | None = None
    reference_time_s: float = 0.0
    plain_tokens: int = 0
    spec_tokens: int = 0
    reference_tokens: int = 0

    @property
    def speedup(self) -> float:
        """Speculative tokens/s over plain tokens/s (decode time only)."""
        return _rate_ratio(self.spec_tokens, self.spec_time_s, self.plain_tokens, self.plain_time_s)

    @property
    def speedup_vs_reference(self) -> float | None:
        """Speculative decoding against plain decoding on the reference model (``None``: none)."""
        if self.reference is None:
            return None
        return _rate_ratio(self.spec_tokens, self.spec_time_s, self.reference_tokens, self.reference_time_s)


def _rate_ratio(tokens: int, seconds: float, base_tokens: int, base_seconds: float) -> float:
    """``(tokens / seconds) / (base_tokens / base_seconds)``; a time ratio when counts are unknown."""
    if seconds <= 0 or base_seconds <= 0:
        return 0.0
    if tokens <= 0 or base_tokens <= 0:
        return base_seconds / seconds
    return (tokens / seconds) / (base_tokens / base_seconds)


def pooled_speedup(comparisons: list[Comparison]) -> float:
    """The speedup over several prompts: summed speculative tokens / seconds over summed plain ones."""
    return _rate_ratio(sum(c.spec_tokens for c in comparisons), sum(c.spec_time_s for c in comparisons),
                       sum(c.plain_tokens for c in comparisons), sum(c.plain_time_s for c in comparisons))


def compare(model, input_ids: torch.Tensor, drafter, *, repeats: int = 1, warmup: bool = True, streamer=None,
            reference=None, **gen) -> Comparison:
    """Time plain and speculative generation alternately on ``input_ids`` (same ``gen`` kwargs).

    With sampling, each repeat uses the same seed for both, so outputs are comparable in law only.
    ``streamer`` (a transformers streamer) receives the first speculative run as it is generated.
    ``reference``: another copy of the target (same tokenizer) whose plain decoding is timed in
    the same alternation (plain, reference, speculative per repeat).
    """
    if reference is not None and reference.config.get_text_config(decoder=True).vocab_size != \
            model.config.get_text_config(decoder=True).vocab_size:
        raise ValueError("the reference model must be a copy of the target (its vocabulary differs)")
    if warmup:
        generate(model, input_ids, max_new_tokens=4, **_no_budget(gen))
        warm_up_drafting(model, input_ids, drafter, temperature=gen.get("temperature", 0.0), seed=gen.get("seed", 0))
        generate(model, input_ids, drafter=drafter, max_new_tokens=4, **_no_budget(gen))
        if reference is not None:
            generate(reference, input_ids, max_new_tokens=4, **_no_budget(gen))
    plain_t = spec_t = ref_t = 0.0
    plain_n = spec_n = ref_n = 0
    identical, ref = True, None
    for r in range(repeats):
        plain = generate(model, input_ids, **gen)
        if reference is not None:
            ref = generate(reference, input_ids, **gen)
            ref_t += ref.stats.decode_time_s
            ref_n += ref.stats.new_tokens
        spec = generate(model, input_ids, drafter=drafter, streamer=streamer if r == 0 else None, **gen)
        plain_t += plain.stats.decode_time_s
        spec_t += spec.stats.decode_time_s
        plain_n += plain.stats.new_tokens
        spec_n += spec.stats.new_tokens
        identical &= torch.equal(plain.sequences, spec.sequences)
    return Comparison(plain, spec, plain_t, spec_t, identical, ref, ref_t, plain_n, spec_n, ref_n)


def warm_up_drafting(model, input_ids: torch.Tensor, drafter, *, temperature: float = 0.0, seed: int = 0) -> None:
    """Untimed: each drafter (of a list or a controller) alone drafts every step of an 8-token
    generation, so the first-call costs of drafting and of verifying trees (kernel selection,
    weight packing, an int8 copy) are paid here, not inside a timed run nor in a controller's
    measurements. Drafters that learn from past outputs (``suffix``) see these 8 tokens."""
    from ..control import Controller

    if drafter is None:
        return
    members = drafter.members if isinstance(drafter, Controller) else drafter if isinstance(drafter, list) else [drafter]
    for member in members:
        generate(model, input_ids, drafter=member, max_new_tokens=8, temperature=temperature, seed=seed, control=False)


def _no_budget(gen: dict) -> dict:
    return {k: v for k, v in gen.items() if k != "max_new_tokens"}


@dataclass
class Divergence:
    """Where a speculative greedy output first left plain greedy, and why.

    Attributes:
        position: index (in new tokens) of the first differing token.
        margin: the plain pass's top-1 minus top-2 logit there.
        rounding_gap: the largest difference, over those two tokens, between the sequential
            one-token passes' logits and those of the other schedules a run may compute them by:
            one batched pass over the sequence, and the engine's own tree passes
            (:class:`~selfspec.model.target.TreeTarget`) over the generated tokens in chains of
            :data:`CHAIN_SIZES` nodes (a verify pass has that many rows, and a kernel's blocking
            rounds each row count its own way). How far this dtype's rounding moves these logits
            here, on the kernels a speculative run uses.
        ulp: the spacing of the model dtype's numbers at the top logit's magnitude (a difference
            of one ulp is the smallest rounding can make).
        explained: ``margin <= 2 * max(rounding_gap, ulp)``: a near-tie the dtype's rounding can flip.
    """

    position: int
    margin: float
    rounding_gap: float
    ulp: float = 0.0

    @property
    def explained(self) -> bool:
        return self.margin <= 2 * max(self.rounding_gap, self.ulp)


CHAIN_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)  # verify-pass row counts the rounding gap is measured at


@torch.no_grad()
def _chained_logits(prefilled, seq: torch.Tensor, prompt_len: int, size: int) -> torch.Tensor:
    """Logits ``[V]`` (float32) predicting ``seq[-1]`` (``seq``: ``[L]``, the plain output up to
    that token) as a speculative run computes them: from ``prefilled``, a
    :class:`~selfspec.model.target.TreeTarget` that prefilled ``seq[:prompt_len]`` (left untouched), the
    generated tokens passed as chains of ``size`` nodes (every node accepted), the last chain
    ending at the node that predicts ``seq[-1]``."""
    from ..decoding.tree import TreeBuilder

    target = prefilled.fork()
    last, root = seq.shape[0] - 1, prompt_len - 1  # the node at index last - 1 predicts seq[last]
    while True:
        end = min(root + size, last)  # this chain: nodes root .. end - 1
        builder, parent = TreeBuilder(int(seq[root])), 0
        for i in range(root + 1, end):
            parent = builder.add(parent, int(seq[i]))
        out = target.forward_tree(builder.build())
        if end == last:
            return out.logits[-1].float()
        target.commit([list(range(end - root))])
        root = end


@torch.no_grad()
def divergence(model, plain: torch.Tensor, spec: torch.Tensor, prompt_len: int) -> Divergence | None:
    """Diagnose the first difference of two greedy outputs ``[1, L]`` (``None`` if identical)."""
    from ..model.lm_head import lm_logits
    from ..model.kv_cache import new_cache

    a, b = plain[0].cpu(), spec[0].cpu()
    n = min(a.shape[0], b.shape[0])
    diff = (a[:n] != b[:n]).nonzero()
    if len(diff) == 0:
        return None
    pos = int(diff[0])  # absolute index of the first differing token; predicted at pos - 1
    device = next(model.parameters()).device
    decoder = model.get_decoder()
    seq = a[None, :pos].to(device)
    batched = lm_logits(model, decoder(input_ids=seq).last_hidden_state[0, -1]).float()
    cache = new_cache()
    decoder(input_ids=seq[:, : prompt_len - 1], cache=cache)
    for t in range(prompt_len - 1, pos):
        hidden = decoder(input_ids=seq[:, t: t + 1], cache=cache).last_hidden_state[0, -1]
    sequential = lm_logits(model, hidden).float()
    top = sequential.topk(2)
    pair = top.indices
    gap = float((sequential[pair] - batched[pair]).abs().max())
    from ..model.target import TreeTarget

    prefilled = TreeTarget(model)
    prefilled.prefill(a[:prompt_len])
    for size in CHAIN_SIZES:
        chained = _chained_logits(prefilled, a[:pos + 1], prompt_len, size)
        gap = max(gap, float((sequential[pair] - chained[pair]).abs().max()))
    dtype = next(model.parameters()).dtype
    top1 = float(top.values[0].abs().clamp_min(torch.finfo(dtype).tiny))
    ulp = torch.finfo(dtype).eps * 2.0 ** torch.floor(torch.log2(torch.tensor(top1))).item()
    return Divergence(pos - prompt_len, float(top.values[0] - top.values[1]), gap, float(ulp))


def write_result(out: str, payload: dict, text: str) -> None:
    """A measurement script's result: ``<out>.json`` (``payload``) and ``<out>.md`` (``text``: the
    command and its table), each written atomically (:func:`selfspec.checkpoint.atomic_write_text`)."""
    import json

    from ..checkpoint import atomic_write_text

    atomic_write_text(out + ".json", json.dumps(payload, indent=1))
    atomic_write_text(out + ".md", text)
