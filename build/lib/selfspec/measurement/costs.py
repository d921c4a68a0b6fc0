"""Measurements of a target and its drafters on this machine (acceptance of heads, pass costs).

Measurements only: decisions (which tree, how deep) are the controller's
(:mod:`selfspec.control`), derived from such measurements at run time.
"""

from __future__ import annotations

import time

import torch

from ..kv_cache import new_cache
from ..lm_head import lm_logits


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
