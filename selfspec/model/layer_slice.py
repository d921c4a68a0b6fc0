"""Run a chosen subset of an unmodified transformers decoder's layers.

Layer-skip drafting runs the target's first E layers (or any subset), and a verify pass that
reuses the drafter's work runs only layers E..L-1. Both go through the decoder's own ``forward``,
on a *view* of the decoder: a shallow copy of the decoder module whose ``layers`` ModuleList is
the subset (each layer keeps its ``layer_idx``, so it reads and writes its own KV-cache slot),
whose ``config`` is a copy with ``layer_types`` narrowed to match (the decoders index it by loop
position), and whose final norm is optionally the identity. The view shares every parameter and
submodule with the target but none of the target's own attributes change, so a forward of the
target running at the same time (another thread) is unaffected. Transformers' own
``assistant_early_exit`` relies on the same property (its decoders loop over ``self.layers``); no
modeling code is copied.

Invariant: ``LayerSlice(model, range(0, E), final_norm=False)`` followed by
``LayerSlice(model, range(E, L))`` fed the first slice's output as ``inputs_embeds`` computes the
decoder's ``last_hidden_state``; :func:`slices_compose` checks this once per model, and callers
reuse layer outputs only when it holds.
"""

from __future__ import annotations

import copy
import weakref
from typing import Sequence

import torch
from torch import nn

_COMPOSES: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def num_layers(model) -> int:
    return int(model.config.get_text_config(decoder=True).num_hidden_layers)


class LayerSlice:
    """A callable running ``indices`` (increasing layer numbers) of ``model``'s decoder, or, with
    ``layers``, modules standing in for them (e.g. copies carrying LoRA adapters; each keeps its
    ``layer_idx``)."""

    def __init__(self, model, indices: Sequence[int], *, final_norm: bool = True,
                 layers: Sequence[nn.Module] | None = None):
        self.decoder = model.get_decoder()
        if self.decoder is None or not isinstance(getattr(self.decoder, "layers", None), nn.ModuleList):
            raise ValueError(f"{type(model).__name__} has no decoder.layers list: layer slices are not supported")
        total = len(self.decoder.layers)
        self.indices = [int(i) for i in indices]
        if not self.indices or sorted(set(self.indices)) != self.indices or not 0 <= self.indices[0] <= self.indices[-1] < total:
            raise ValueError(f"layer indices must be increasing, distinct and within [0, {total}), got {list(indices)}")
        if not isinstance(getattr(self.decoder, "norm", None), nn.Module):
            raise ValueError(f"{type(self.decoder).__name__} has no final `norm` module: layer slices are not supported")
        if layers is not None and len(layers) != len(self.indices):
            raise ValueError(f"{len(layers)} stand-in layers for {len(self.indices)} indices")
        self.layers = nn.ModuleList(list(layers) if layers is not None else [self.decoder.layers[i] for i in self.indices])
        types = getattr(self.decoder.config, "layer_types", None)
        self.layer_types = None if types is None else [types[i] for i in self.indices]
        self.final_norm = final_norm
        self.view = decoder_view(self.decoder, self.layers, self.layer_types, final_norm)

    def __call__(self, *, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None,
                 cache=None) -> torch.Tensor:
        """``[1, m]`` ids or ``[1, m, H]`` embeddings -> ``[1, m, H]`` hidden states after the slice
        (through the final norm when ``final_norm``)."""
        out = self.view(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                        position_ids=position_ids, cache=cache, use_cache=cache is not None)
        return out.last_hidden_state


def decoder_view(decoder: nn.Module, layers: nn.ModuleList, layer_types, final_norm: bool) -> nn.Module:
    """A shallow copy of ``decoder`` running ``layers`` (sharing every parameter and submodule; the
    decoder itself is not modified)."""
    view = copy.copy(decoder)
    view._modules = dict(decoder._modules)  # (copy.copy shares the dict: setting a module would reach the target)
    view._modules["layers"] = layers
    if not final_norm:
        view._modules["norm"] = nn.Identity()
    view.config = copy.copy(decoder.config)
    if layer_types is not None:
        view.config.layer_types = list(layer_types)
    return view


@torch.no_grad()
def slices_compose(model) -> bool:
    """True when running layers ``[0]`` then ``[1..L-1]`` (via ``inputs_embeds``) reproduces the
    decoder's output (checked once per model: false e.g. for models that rescale embeddings
    outside their embedding module)."""
    if model in _COMPOSES:
        return _COMPOSES[model]
    ok = False
    total = num_layers(model)
    if total >= 2:
        try:
            device = next(model.parameters()).device
            ids = torch.tensor([[1, 2, 3, 4]], device=device) % model.config.get_text_config(decoder=True).vocab_size
            want = model.get_decoder()(input_ids=ids).last_hidden_state.float()
            h = LayerSlice(model, [0], final_norm=False)(input_ids=ids)
            have = LayerSlice(model, range(1, total))(inputs_embeds=h).float()
            scale = want.abs().max().clamp_min(1.0)
            ok = bool(((have - want).abs().max() / scale) < 1e-4)
        except (RuntimeError, ValueError, TypeError):
            ok = False
    _COMPOSES[model] = ok
    return ok
