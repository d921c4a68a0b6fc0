"""Training-free layer-skip: choose the exit layer from measured acceptance and measured cost.

In the spirit of Draft & Verify / SWIFT, but for an early exit: on a few calibration prompts the
target writes its greedy continuation; one forward with every layer's output gives, for each exit
layer E, the share of positions where ``argmax head(norm(h_E))`` equals the token the target wrote
(``alpha_E``, the greedy acceptance rate of a one-token draft). The machine's costs are measured
too: a drafting level with E layers and a verify pass over n tokens. Under the independence model a
chain of depth D accepts ``sum_{d<=D} alpha^d`` tokens per step (bonus included) and costs
``D * draft(E) + verify(D + 1)``; the expected speedup against plain decoding (one verify of one
token per token) picks (E, D). The best candidates are then timed for real by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .costs import median_seconds
from ..model.layer_slice import LayerSlice, num_layers
from ..model.lm_head import lm_logits


@dataclass
class ExitCandidate:
    """One (exit layer, depth) choice with its measured acceptance and modelled speedup."""

    exit_layer: int
    depth: int
    acceptance: float
    expected_mat: float
    step_cost_s: float
    expected_speedup: float


@torch.no_grad()
def exit_acceptance(model, sequences: list[tuple[torch.Tensor, int]]) -> list[float]:
    """Greedy acceptance of the plain early exit after each layer.

    Args:
        sequences: ``(tokens [L], start)`` pairs: the target's own greedy text from ``start`` on.

    Returns:
        ``alpha[E]`` for ``E = 1 .. L-1`` at index ``E - 1``.
    """
    total = num_layers(model)
    device = next(model.parameters()).device
    norm = model.get_decoder().norm
    hits, count = torch.zeros(total - 1), 0
    for tokens, start in sequences:
        out = model(tokens[None].to(device), output_hidden_states=True)
        want = tokens[start + 1:].to(device)  # what the target wrote after each position
        for e in range(1, total):
            h = out.hidden_states[e][0, start:-1]  # output of layer e - 1
            hits[e - 1] += float((lm_logits(model, norm(h)).argmax(-1) == want).sum())
        count += want.numel()
    return (hits / max(count, 1)).tolist()


@torch.no_grad()
def level_costs(model, exits: list[int], tokens: int = 3, repeats: int = 5, context: int = 256) -> dict[int, float]:
    """Seconds of one drafting level (``tokens`` new tokens, a ``context``-token cache, LM head
    included) for each exit layer, measured on this machine (median of ``repeats``)."""
    from ..model.kv_cache import new_cache

    device = next(model.parameters()).device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.arange(context + tokens, device=device)[None] % vocab
    norm = model.get_decoder().norm
    costs = {}
    for e in exits:
        body = LayerSlice(model, range(e), final_norm=False)
        cache = new_cache()
        body(input_ids=ids[:, :context], cache=cache)
        costs[e] = median_seconds(lambda: lm_logits(model, norm(body(input_ids=ids[:, context:], cache=cache)[0])),
                                  repeats, lambda: cache.crop(-tokens))
    return costs


def rank_exits(acceptance: list[float], level: dict[int, float], verify: dict[int, float],
               max_depth: int = 6) -> list[ExitCandidate]:
    """Every (E, D) with a measured cost, best expected speedup first.

    With KV reuse the verify pass skips E of L layers for the drafted nodes; the model here
    ignores that saving (a conservative choice) and charges ``verify(D + 1)``.
    """
    plain = verify[1]
    out = []
    for e, draft in level.items():
        a = acceptance[e - 1]
        for d in range(1, max_depth + 1):
            if d + 1 not in verify:
                continue
            mat = sum(a ** k for k in range(d + 1))
            cost = d * draft + verify[d + 1]
            out.append(ExitCandidate(e, d, a, mat, cost, mat * plain / cost))
    return sorted(out, key=lambda c: -c.expected_speedup)
