"""Sampling parameters and the one logits-processing function both sides of the verifier use.

Invariant: plain decoding (``drafter=None``) and speculative decoding turn a node's logits into its
target law ``p`` through :func:`target_probs` and nothing else, so the verifier compares the draft
against exactly the distribution plain sampling would use. Processing order follows transformers'
sampling warpers: temperature, then top-k, then top-p. ``temperature == 0`` means greedy: the law is
a point mass on ``argmax`` (first maximum on ties, like ``torch.argmax`` in plain greedy), and
top-k / top-p are ignored, as in ``model.generate(do_sample=False)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """Validated sampling parameters.

    Attributes:
        temperature: 0 for greedy, otherwise > 0 (logits are divided by it).
        top_k: keep the k most likely tokens; 0 disables.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 disables.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def prob_dtype(logits: torch.Tensor) -> torch.dtype:
    """Probabilities are computed in float32 at least (float64 when the model runs in float64)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Turn raw logits into the law plain sampling draws from.

    Args:
        logits: ``[..., V]`` raw logits of any float dtype.
        cfg: sampling parameters.

    Returns:
        ``[..., V]`` probabilities in :func:`prob_dtype`, each row summing to 1. Greedy rows are
        one-hot on the first argmax.
    """
    x = logits.to(prob_dtype(logits))
    if cfg.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(x.dtype)
    # shifted first, and divided by at least the dtype's smallest normal number, so any positive temperature
    # gives finite logits (below that, every gap overflows to -inf either way: the same law)
    x = (x - x.amax(-1, keepdim=True)) / max(cfg.temperature, torch.finfo(x.dtype).tiny)
    vocab = x.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = mass_before >= cfg.top_p  # the most likely token always survives
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, -math.inf)
    return x.softmax(-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` ``[b, V]`` (``[b]`` on ``probs``' device), by inverting the
    cumulative distribution at one uniform number per row.

    The law is ``probs`` (rows need not be normalised) up to float64 rounding of the running sum:
    the interval of token i is ``[c_{i-1}, c_i)`` with ``c`` the float64 cumulative sum, so a
    zero-probability token has an empty interval; an index that lands on one anyway through
    rounding is moved to the nearest earlier token of positive mass, so none is ever returned. ``torch.multinomial``
    draws the same law but spends one random number per vocabulary entry where this spends one
    per row, so it is much slower for a large vocabulary (the measurement is in docs/decisions.md).
    """
    rows = probs.reshape(-1, probs.shape[-1]).to(torch.float64)
    cdf = rows.cumsum(-1)  # [b, V]
    total = cdf[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()) or bool((rows < 0).any()):
        raise ValueError("cannot draw from a row whose probabilities are negative, not finite or all zero")
    u = torch.rand(rows.shape[0], 1, dtype=torch.float64, generator=generator, device=generator.device)
    x = u.to(cdf.device) * cdf[:, -1:]  # in [0, total): the first c_i > x has p_i > 0
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_max(rows.shape[-1] - 1)
    # x rounded up to the total, or a parallel scan (CUDA) whose sum moved across a zero entry by
    # an ulp: snap to the last token of positive mass at or before the index (never past it)
    zero = rows.gather(-1, idx[:, None]).squeeze(-1) <= 0
    if bool(zero.any()):
        ar = torch.arange(rows.shape[-1], device=rows.device)
        last = torch.where(rows > 0, ar, -1).cummax(-1).values.gather(-1, idx[:, None]).squeeze(-1)
        idx = torch.where(zero, torch.where(last >= 0, last, (rows > 0).to(torch.long).argmax(-1)), idx)
    return idx.reshape(probs.shape[:-1])


def draw_without_replacement(probs: torch.Tensor, count: int, generator: torch.Generator) -> list[int]:
    """``count`` distinct tokens from ``probs`` ``[V]``: each draw is :func:`draw` from the mass
    not drawn yet, which is the law of sampling without replacement (``torch.multinomial`` with
    ``replacement=False``). ``count`` must not exceed the number of tokens of positive mass."""
    if count > int((probs > 0).sum()):
        raise ValueError(f"cannot draw {count} distinct tokens from a law with {int((probs > 0).sum())} in its support")
    left, out = probs.to(torch.float64).clone(), []
    for _ in range(count):
        t = int(draw(left[None], generator)[0])
        out.append(t)
        left[t] = 0.0
    return out


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from ``probs`` ``[V]`` with an explicit generator (:func:`draw`)."""
    return int(draw(probs[None], generator)[0])
