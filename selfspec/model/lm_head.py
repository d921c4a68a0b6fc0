"""Logits from last hidden states with the target's own output embeddings.

Why not just call the model: on CPU, ``nn.Linear`` computes ``h @ W.T``, and for the few rows of
a draft tree (2-16) MKL's kernel for that layout is several times slower than ``W @ h.T`` on the
same numbers (the measurement is in docs/decisions.md). The LM head is the largest matrix of a
small model, so selfspec runs the unmodified decoder and applies the head itself. To stay exact
for any architecture, the shortcut is used only after :func:`head_matches_forward` has checked,
once per model, that it reproduces the model's own ``forward`` logits (final soft-capping
included); otherwise the full forward runs.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..kernels.skinny_linear import SkinnyLinear

_CHECKED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def lm_logits(model, hidden: torch.Tensor, head: nn.Module | None = None) -> torch.Tensor:
    """``[..., H]`` -> ``[..., V]`` logits through ``head`` (default: the model's output
    embeddings), plus the model's final logit soft-capping if its config has one."""
    head = head if head is not None else model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        # (models split over devices; a float32 trainable head over a bf16 target's LM head)
        flat = hidden.reshape(-1, hidden.shape[-1]).to(head.weight.device, head.weight.dtype)
        if type(head) is nn.Linear or isinstance(head, SkinnyLinear):
            logits = (head.weight @ flat.T).T  # [N, V]: the fast layout for few rows
            if head.bias is not None:
                logits = logits + head.bias
        else:  # e.g. selfspec.kernels.prepack.PrepackedLinear: its own kernel is the fast one
            logits = head(flat)
        logits = logits.reshape(*hidden.shape[:-1], -1)
    else:
        logits = head(hidden)
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.no_grad()
def head_matches_forward(model) -> bool:
    """True when ``lm_logits(decoder(x))`` equals ``model(x).logits`` (checked once per model)."""
    if model in _CHECKED:
        return _CHECKED[model]
    ok = False
    decoder = getattr(model, "get_decoder", lambda: None)()
    if decoder is not None and model.get_output_embeddings() is not None:
        device = next(model.parameters()).device
        ids = torch.tensor([[1, 2, 3]], device=device) % model.config.get_text_config(decoder=True).vocab_size
        try:
            want = model(input_ids=ids).logits.float()
            have = lm_logits(model, decoder(input_ids=ids).last_hidden_state).float().to(want.device)
            scale = want.abs().max().clamp_min(1.0)
            ok = have.shape == want.shape and bool(((have - want).abs().max() / scale) < 1e-4)
        except RuntimeError:  # e.g. a head placement the shortcut cannot follow: use the full forward
            ok = False
    _CHECKED[model] = ok
    return ok
