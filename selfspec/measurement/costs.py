"""Measurements of a target and its drafters on this machine (acceptance of heads, pass costs).

Measurements only: decisions (which tree, how deep) are the controller's
(:mod:`selfspec.control`), derived from such measurements at run time.
"""

from __future__ import annotations

import time

import torch

from ..model.kv_cache import new_cache
from ..model.lm_head import lm_logits


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
