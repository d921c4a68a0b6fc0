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

import math
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


def raced_choice(measure, keys: list, prompts: list, batch: int = 4) -> tuple:
    """Choose among ``keys`` by measured speedup, measuring until the best is clearly the best.

    A race (successive elimination): every key still in it is measured on the next ``batch``
    prompts (``measure(keys, prompts) -> {key: [speedup per prompt]}``); after each batch, a key
    whose per-prompt log speedups, paired with the current leader's on the same prompts, are lower
    on average with 97.5% confidence (one-sided Student t: ``mean + t * se < 0``, t for n - 1
    degrees of freedom: 3.18 after four prompts, 2.07 after 24; a race makes several comparisons
    per batch over several batches, and four prompts say little about their spread) is out. The
    race ends when one key is left or the prompts run out; the choice is then the best
    geometric-mean speedup among those left. Pairing on the same prompts removes what the prompts
    themselves change (how much text is copied, how long the answer is); what is left is this
    machine's timing noise, which decides how many batches a close race takes. (A single
    re-measurement of near ties picked three different trees in three calibrations of round 22,
    union MAT 2.67-2.91 on MT-Bench.)

    Returns ``(chosen key, {key: geometric-mean speedup over the prompts it ran}, rounds)``;
    ``rounds`` lists per batch ``{"prompts": n so far, "left": keys still in after it}``.
    """
    if not prompts or not keys:
        raise ValueError(f"a race needs prompts and entries, got {len(prompts)} prompts and {len(keys)} entries")
    logs: dict = {k: [] for k in keys}
    left, rounds = list(keys), []
    for start in range(0, len(prompts), batch):
        got = measure(left, prompts[start:start + batch])
        for k in left:
            logs[k] += [math.log(v) for v in got[k]]
        leader = max(left, key=lambda k: _mean(logs[k]))
        left = [k for k in left if k == leader or not _clearly_worse(logs[k], logs[leader])]
        rounds.append({"prompts": len(logs[leader]), "left": list(left)})
        if len(left) == 1:
            break
    speedups = {k: math.exp(_mean(v)) for k, v in logs.items() if v}
    return max(left, key=lambda k: speedups[k]), speedups, rounds


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# one-sided 97.5% quantiles of Student's t for 1..30 degrees of freedom (1.960 in the limit)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060,
         2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` >= 1 degrees of freedom (1.960 past 30): a
    one-sided 97.5% bound, or half of a two-sided 95% interval, is ``t975(n - 1) * se``."""
    return _T975[df - 1] if df <= len(_T975) else 1.960


def _clearly_worse(a: list[float], b: list[float]) -> bool:
    """Whether paired samples ``a`` are lower than ``b`` on average, one-sided at 97.5% (Student t)."""
    diff = [x - y for x, y in zip(a, b)]
    if len(diff) < 2:
        return False
    mean = _mean(diff)
    var = sum((d - mean) ** 2 for d in diff) / (len(diff) - 1)
    return mean + t975(len(diff) - 1) * math.sqrt(var / len(diff)) < 0


def measured_runs(model, make, prompts: list[torch.Tensor], keys: list, max_new_tokens: int = 64, **gen) -> dict:
    """``{key: [Comparison per prompt]}``: ``make(key)`` builds each key's drafter once (used on
    every prompt in turn); per prompt, every key runs in turn, in an order rotated from prompt to
    prompt, and each run alternates plain and speculative decoding (see
    :func:`selfspec.measurement.measure.compare`). Interleaved so: a burst of load on a shared
    machine lasts seconds, and measured key by key it fell on every prompt of one key (round 23
    saw one entry at 1.25x on four prompts where it ran 1.53x in the race before). ``gen``: more
    arguments of ``generate`` (``temperature``, ``seed``: a sampled race)."""
    from .measure import compare

    drafters = {key: make(key) for key in keys}
    out: dict = {key: [] for key in keys}
    for i, ids in enumerate(prompts):
        for key in keys[i % len(keys):] + keys[: i % len(keys)]:
            out[key].append(compare(model, ids, drafters[key], max_new_tokens=max_new_tokens, adaptive=False,
                                    **gen))
    return out


def measured_speedups(model, make, prompts: list[torch.Tensor], keys: list, max_new_tokens: int = 64,
                      **gen) -> dict:
    """``{key: [speedup on each prompt]}`` from :func:`measured_runs`."""
    from .measure import pooled_speedup

    runs = measured_runs(model, make, prompts, keys, max_new_tokens, **gen)
    return {key: [pooled_speedup([run]) for run in runs[key]] for key in keys}


def measured_search(model, make, prompts: list[torch.Tensor], budgets: list[int],
                    max_new_tokens: int = 64) -> tuple[int, dict[int, float]]:
    """Pick the budget with the best measured speedup over ``prompts`` (pooled; runs as in
    :func:`measured_runs`, ``make(b)`` builds the drafter for budget b).

    Returns ``(best budget or 0 if nothing beats plain decoding, {budget: speedup})``.
    """
    from .measure import pooled_speedup

    runs = measured_runs(model, make, prompts, list(budgets), max_new_tokens)
    speedups = {b: pooled_speedup(runs[b]) for b in budgets}
    best = max(speedups, key=speedups.get)
    return (best if speedups[best] > 1.0 else 0), speedups


def prompt_familiarity(model, drafter, prompts: list[torch.Tensor]) -> list[tuple[int, int]]:
    """``(hits, predicted)`` of an EAGLE-3 head's familiarity read
    (:meth:`~selfspec.drafters.eagle3.Eagle3Drafter.read_familiarity`, its ``familiar_window``) on
    each prompt (``[L]`` or ``[1, L]`` token ids), from the taps a generation's first step hands
    over (a :class:`~selfspec.target.TreeTarget` prefill of the prompt, as the engine runs it)."""
    from ..target import TreeTarget

    target, out = TreeTarget(model, taps=drafter.taps), []
    for ids in prompts:
        ids = ids.reshape(-1)
        out.append(drafter.read_familiarity(ids, target.prefill(ids).taps, drafter.cfg.familiar_window))
    return out


def familiarity_floor(shares: list[float], margin: float = 0.75, step: float = 0.01) -> float:
    """The familiarity floor (``min_familiar``) for a head whose held-out chat prompts read
    ``shares`` (hits / predicted): ``margin`` times the lowest share, rounded down to a multiple
    of ``step``, so that no held-out chat prompt falls under it, with room for prompts a little
    less familiar than any of them (round 42: lowest held-out chat share 0.079 over 236 prompts,
    the adversarial prompts' 0.000-0.032; floor 0.05). 0 (off) without shares."""
    if not shares:
        return 0.0
    return math.floor(margin * min(shares) / step + 1e-9) * step
