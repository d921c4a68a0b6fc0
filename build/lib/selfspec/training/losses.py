"""Losses and metrics for Medusa-style heads.

Head k (1-based) is weighted ``decay ** (k - 1)``: later heads are harder and matter less, since
a draft token is only useful when every shallower one was accepted.

* ``"ce"``: cross-entropy of head k's logits against the token the target actually wrote
  (self-distilled hard labels);
* ``"kl"``: KL(p_target || q_head) against the target's full next-token law at that position
  (soft labels, computed from the cached hidden state of the earlier position).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .features import IGNORE


def head_loss(logits: torch.Tensor, labels: torch.Tensor, decay: float,
              target_logits: torch.Tensor | None = None,
              counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted loss over heads.

    Args:
        logits: ``[B, K, V]`` head logits.
        labels: ``[B, K]`` token ids or ``IGNORE``.
        decay: per-head weight decay.
        target_logits: ``[B, K, V]`` the target's logits for the same tokens (KL loss) or ``None`` (CE).
        counts: ``[K]`` valid labels per head to divide by (default: those of ``labels``; a larger
            batch's counts give these positions' share of that batch's loss).

    Returns:
        ``(total, per_head [K])`` losses averaged over valid positions.
    """
    valid = labels != IGNORE  # [B, K]
    if target_logits is None:
        per = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().clamp_min(0), reduction="none")
    else:
        logq = logits.float().log_softmax(-1)
        logp = target_logits.float().log_softmax(-1)
        per = (logp.exp() * (logp - logq)).sum(-1).flatten()
    per = per.view(labels.shape) * valid
    counts = (valid.sum(0) if counts is None else counts.to(valid.device)).clamp_min(1)
    per_head = per.sum(0) / counts
    weights = decay ** torch.arange(labels.shape[1], device=labels.device, dtype=per_head.dtype)
    return (per_head * weights).sum() / weights.sum(), per_head.detach()


@torch.no_grad()
def rank_hits(logits: torch.Tensor, labels: torch.Tensor, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts for rank-wise accuracy: ``hits[k, r]`` = label was head k's rank-r candidate.

    Returns ``(hits [K, ranks], valid [K])``.
    """
    top = logits.topk(ranks, dim=-1).indices  # [B, K, R]
    valid = labels != IGNORE
    hit = (top == labels[..., None]) & valid[..., None]
    return hit.sum(0), valid.sum(0)
