"""Hardware-aware trees: choose the draft tree that maximises tokens per second on this machine.

Sequoia-style: the expected accepted length of a tree comes from measured acceptance per depth
and rank (``acc[d][r]``: the rank-r candidate of depth d+1 is the target's token; independence
model of :mod:`selfspec.tree_search`), its cost from the target's verify time for n nodes measured
here plus the drafter's own cost. On a CPU the verify cost grows quickly and not monotonically with
n (see docs/benchmarks.md), so the best tree is small and its size is picked from the measured
curve, not from a GPU rule of thumb::

    budget* = argmax_b  MAT(best_tree(acc, b)) / (verify(b + 1) + draft)     (b = 0: plain decoding)

Drafters without a static tree (layer-skip, n-gram) are calibrated by measuring real tokens/s
against plain decoding for a few node budgets (:func:`measured_search`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..kv_cache import new_cache
from ..lm_head import lm_logits
from ..tree_search import best_tree, expected_accepted_length


@dataclass
class TreeChoice:
    """One candidate node budget with its modelled value."""

    budget: int
    tree: list[list[int]]
    expected_mat: float
    step_cost_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.expected_mat / self.step_cost_s


def choose_tree(acc: list[list[float]], verify_cost: dict[int, float], draft_cost_s: float = 0.0,
                max_depth: int | None = None) -> tuple[TreeChoice, list[TreeChoice]]:
    """Best tree for measured acceptance ``acc`` ``[D][R]`` and costs.

    Args:
        acc: ``acc[d][r]`` probability that depth d+1's rank-r candidate is the target's token.
        verify_cost: seconds of a verify pass over n nodes (root included), for n = 1 .. N.
        draft_cost_s: seconds the drafter spends per speculative step.
        max_depth: deepest tree allowed (default ``len(acc)``).

    Returns:
        ``(best, every candidate)``; ``best.budget == 0`` means plain decoding is faster.
    """
    plain = TreeChoice(0, [], 1.0, verify_cost[1])
    options = [plain]
    for n in sorted(verify_cost):
        if n < 2:
            continue
        tree = best_tree(acc, n - 1, max_depth)
        mat = expected_accepted_length(tree.paths, acc)
        options.append(TreeChoice(n - 1, tree.to_list(), mat, verify_cost[n] + draft_cost_s))
    return max(options, key=lambda c: c.tokens_per_s), options


def median_seconds(run, repeats: int, after=None) -> float:
    """Median wall seconds of ``run()`` over ``repeats`` calls after one warm-up call
    (``after()``, untimed, runs after each call: e.g. to crop a cache back)."""
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
        if after is not None:
            after()
    return sorted(times[1:])[repeats // 2]


@torch.no_grad()
def verify_costs(model, sizes: list[int], repeats: int = 5, context: int = 256) -> dict[int, float]:
    """Median seconds of one target pass (decoder + LM head) over n new tokens with a
    ``context``-token cache, for each n in ``sizes``, measured on this machine."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    decoder = model.get_decoder()
    costs = {}
    for n in sizes:
        ids = torch.arange(context + n, device=device)[None] % vocab
        cache = new_cache()
        decoder(input_ids=ids[:, :context], cache=cache)
        costs[n] = median_seconds(
            lambda: lm_logits(model, decoder(input_ids=ids[:, context:], cache=cache).last_hidden_state[0]),
            repeats, lambda: cache.crop(-n))
    return costs


@torch.no_grad()
def heads_accuracy(model, drafter, sequences: list[tuple[torch.Tensor, int]], ranks: int) -> list[list[float]]:
    """``acc[k][r]`` of Medusa heads on the target's own text.

    Args:
        sequences: ``(tokens [L], start)``: the target's greedy text from ``start`` on; head k+1 at
            position t is scored against token ``t + k + 2``.
    """
    K = drafter.heads.cfg.num_heads
    hits, counts = torch.zeros(K, ranks), torch.zeros(K)
    device = next(model.parameters()).device
    for tokens, start in sequences:
        h = model.get_decoder()(input_ids=tokens[None].to(device)).last_hidden_state[0, start:]
        top = drafter.heads.logits(model, h.to(drafter._dtype())).topk(ranks, dim=-1).indices.cpu()  # [T, K, R]
        for k in range(K):
            src = torch.arange(start, tokens.shape[0]) + k + 2
            ok = src < tokens.shape[0]
            if ok.any():
                hits[k] += (top[ok, k] == tokens[src[ok]][:, None]).float().sum(0)
                counts[k] += ok.sum()
    return (hits / counts.clamp_min(1)[:, None]).tolist()


@torch.no_grad()
def heads_draft_cost(model, drafter, repeats: int = 20) -> float:
    """Median seconds of one Medusa proposal (all heads + top-k + tree fill)."""
    from ..drafters.base import DraftContext
    from ..sampling import SamplingConfig

    hidden = model.config.get_text_config(decoder=True).hidden_size
    ctx = DraftContext(torch.tensor([1, 2]), torch.randn(hidden, dtype=drafter._dtype()), 64, SamplingConfig(0.0),
                       torch.Generator())
    return median_seconds(lambda: drafter.propose(ctx), repeats)


def refined_choice(measure, keys: list, prompts: list, first: int = 4, tolerance: float = 0.05) -> tuple:
    """Choose among ``keys`` by measured speedup, measuring longer where the first measurement ties.

    ``measure(keys, prompts)`` returns ``{key: speedup}`` over ``prompts``. All keys are measured on
    ``prompts[:first]``; the keys within ``tolerance`` (relative) of the best are measured again on
    ``prompts[first:2 * first]`` (when there are any), and the choice is the best mean of their two
    estimates. A tie on four prompts is within this machine's noise (rounds 14 and 15 saw 2-3%
    between a chain of 3 and a 4-deep tree flip between runs).

    Returns ``(chosen key, first speedups, second speedups or {})``.
    """
    speedups = measure(keys, prompts[:first])
    best = max(speedups, key=speedups.get)
    finalists = [k for k in keys if speedups[k] >= (1.0 - tolerance) * speedups[best]]
    rest = prompts[first: 2 * first]
    if len(finalists) < 2 or not rest:
        return best, speedups, {}
    second = measure(finalists, rest)
    chosen = max(finalists, key=lambda k: (speedups[k] + second[k]) / 2)
    return chosen, speedups, second


def measured_search(model, make, prompts: list[torch.Tensor], budgets: list[int],
                    max_new_tokens: int = 64) -> tuple[int, dict[int, float]]:
    """Pick the budget with the best measured speedup: ``make(b)`` builds the drafter for budget b,
    then plain and speculative runs alternate on ``prompts`` (see :func:`selfspec.measure.compare`).

    Returns ``(best budget or 0 if nothing beats plain decoding, {budget: speedup})``.
    """
    from .measure import compare, pooled_speedup

    speedups = {}
    for b in budgets:
        drafter = make(b)
        speedups[b] = pooled_speedup([compare(model, ids, drafter, max_new_tokens=max_new_tokens, adaptive=False)
                                      for ids in prompts])
    best = max(speedups, key=speedups.get)
    return (best if speedups[best] > 1.0 else 0), speedups
