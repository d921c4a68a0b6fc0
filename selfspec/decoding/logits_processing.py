"""transformers' logits processors, stopping criteria and generation configs, applied so that
speculation keeps the output law.

Processors: plain decoding applies a processor to the logits after the sequence so far. A tree
pass scores n nodes at once, each after its *own* path (the committed tokens, then the drafted
tokens from the root down to that node); :func:`process_tree` applies the processors to every
node's logits with that node's path as ``input_ids``, so each node's law is exactly the law plain
decoding with the same processors would sample from after that path, and the verifier's
rejection rule keeps the output law (greedy: the output) of plain processed decoding. This holds
for any processor that is a function of ``(input_ids, scores)`` (repetition penalty, n-gram
bans, min-p, temperature / top-k / top-p warpers, ...); a processor with state of its own across
calls (one that counts its calls, or draws random numbers) would see tree nodes as extra steps,
and is not supported.

Order: processors run on the raw logits (after a constraint mask, before selfspec's own
temperature / top-k / top-p), as transformers runs its processors before its warpers. From a
``GenerationConfig`` (:func:`from_generation_config`) the warpers come as processors too, in
transformers' order, and selfspec's own sampling is then the plain softmax (temperature 1), so the
law is the one ``model.generate`` samples from.

Stopping: after each step's tokens are committed, :func:`first_stop` asks the criteria after each
new token in turn and keeps the output up to the first token where any says stop (the text plain
decoding with the same criteria stops at).
"""

from __future__ import annotations

import torch

from .sampling import SamplingConfig
from .tree import DraftTree


def process_tree(processor, committed: torch.Tensor, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` logits of ``tree``'s nodes -> ``[n, V]`` processed scores (float32, or float64 for
    float64 logits): row i is ``processor(committed + path to node i, logits[i])``. ``committed``:
    ``[L]`` every token so far (its last is the root). Nodes of one depth share a path length and
    are processed in one batched call."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = logits.to(dtype)
    out = torch.empty_like(scores)
    committed = committed.to(logits.device)
    paths = [tree.path_to(i) for i in range(tree.num_nodes)]
    by_depth: dict[int, list[int]] = {}
    for i, p in enumerate(paths):
        by_depth.setdefault(len(p), []).append(i)
    tokens = tree.tokens.to(logits.device)
    for nodes in by_depth.values():
        ids = torch.stack([torch.cat([committed, tokens[paths[i][1:]]]) for i in nodes])  # [m, L + depth]
        processed = processor(ids, scores[nodes].clone())
        if processed.shape != (len(nodes), scores.shape[-1]):
            raise ValueError(f"a logits processor returned shape {tuple(processed.shape)}, expected "
                             f"{(len(nodes), scores.shape[-1])}")
        out[nodes] = processed.to(dtype)
    return out


def first_stop(criteria, committed: torch.Tensor, new: list[int]) -> int | None:
    """How many of the step's ``new`` tokens to keep: the first ``j + 1`` such that ``criteria``
    (a transformers ``StoppingCriteria`` / list, called with ``input_ids [1, L + j + 1]`` and
    ``scores=None``) says stop after them; ``None`` when none does."""
    for j in range(len(new)):
        ids = torch.cat([committed, torch.tensor(new[: j + 1], dtype=committed.dtype)])[None]
        done = criteria(ids, None)
        if bool(torch.as_tensor(done).any()):
            return j + 1
    return None


def penalties(gc) -> list:
    """The processors of ``gc`` that are not sampling parameters: repetition penalty and n-gram ban."""
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    out = []
    if getattr(gc, "repetition_penalty", None) not in (None, 1.0):
        out.append(RepetitionPenaltyLogitsProcessor(gc.repetition_penalty))
    if getattr(gc, "no_repeat_ngram_size", None):
        out.append(NoRepeatNGramLogitsProcessor(gc.no_repeat_ngram_size))
    return out


def from_generation_config(gc) -> tuple[SamplingConfig, list]:
    """``(sampling, processors)`` that sample what ``model.generate(generation_config=gc)`` samples:
    greedy, or (``do_sample``) the plain softmax of logits processed by transformers' own
    processors and warpers in its order (repetition penalty, n-gram ban, then temperature, top-k,
    top-p, min-p)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    unsupported = [name for name in ("num_beams", "num_beam_groups") if (getattr(gc, name, 1) or 1) > 1]
    unsupported += [name for name in ("typical_p", "epsilon_cutoff", "eta_cutoff")
                    if getattr(gc, name, None) not in (None, 1.0, 0.0)]
    if getattr(gc, "num_return_sequences", 1) not in (None, 1):
        unsupported.append("num_return_sequences")
    if unsupported:
        raise ValueError(f"generation_config sets {unsupported}, which selfspec does not support (pass "
                         "temperature=, top_k=, top_p= to sample or decode greedily without it)")
    processors = penalties(gc)
    if not gc.do_sample:
        return SamplingConfig(0.0), processors
    if gc.temperature is not None and gc.temperature != 1.0:
        if gc.temperature <= 0:
            raise ValueError(f"generation_config.temperature must be > 0 with do_sample, got {gc.temperature}")
        processors.append(TemperatureLogitsWarper(gc.temperature))
    if gc.top_k:
        processors.append(TopKLogitsWarper(gc.top_k))
    if gc.top_p is not None and not 0 < gc.top_p <= 1.0:
        raise ValueError(f"generation_config.top_p must be in (0, 1], got {gc.top_p}")
    if gc.top_p is not None and gc.top_p < 1.0:
        processors.append(TopPLogitsWarper(gc.top_p))
    if getattr(gc, "min_p", None):
        processors.append(MinPLogitsWarper(gc.min_p))
    return SamplingConfig(1.0), processors
