"""Run a chosen subset of an unmodified transformers decoder's layers.

Layer-skip drafting runs the target's first E layers (or any subset), and a verify pass that
reuses the drafter's work runs only layers E..L-1. Both go through the model's own ``forward``:
for one call, :class:`LayerSlice` swaps the decoder's ``layers`` ModuleList for the subset (each
layer keeps its ``layer_idx``, so it reads and writes its own KV-cache slot), narrows
``config.layer_types`` to match (the decoders index it by loop position), and optionally replaces
the final norm by the identity; everything is restored before returning. This is the mechanism
transformers' own ``assistant_early_exit`` relies on (its decoders loop over
``self.layers[: config.num_hidden_layers]``); no modeling code is copied.

Invariant: ``LayerSlice(model, range(0, E), final_norm=False)`` followed by
``LayerSlice(model, range(E, L))`` fed the first slice's output as ``inputs_embeds`` computes the
decoder's ``last_hidden_state``; :func:`slices_compose` checks this once per model, and callers
reuse layer outputs only when it holds.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
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

    @contextmanager
    def _swapped(self):
        dec, cfg = self.decoder, self.decoder.config
        saved = dec.layers, getattr(cfg, "layer_types", None), dec.norm
        try:
            dec.layers = self.layers
            if self.layer_types is not None:
                cfg.layer_types = self.layer_types
            if not self.final_norm:
                dec.norm = nn.Identity()
            yield dec
        finally:
            dec.layers, dec.norm = saved[0], saved[2]
            if self.layer_types is not None:
                cfg.layer_types = saved[1]

    def __call__(self, *, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None,
                 cache=None) -> torch.Tensor:
        """``[1, m]`` ids or ``[1, m, H]`` embeddings -> ``[1, m, H]`` hidden states after the slice
        (through the final norm when ``final_norm``)."""
        with self._swapped() as dec:
            out = dec(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                      position_ids=position_ids, cache=cache, use_cache=cache is not None)
        return out.last_hidden_state


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
