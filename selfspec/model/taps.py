"""Reading the target's intermediate hidden states ("taps") during a pass it runs anyway.

A tap k is transformers' ``hidden_states[k]``: the input of decoder layer k (``k = 0`` the
embeddings), and ``k = L`` the last layer's output before the final norm. Feature-reading drafters
(EAGLE-3) need the taps of every committed position; the verify pass computes them anyway, so
:func:`capture_taps` records them with forward pre-hooks on the layers (and on the final norm for
``k = L``) for the duration of one call and removes the hooks afterwards: the model is never left
modified. A hook records only the calls of the thread that installed it, so another thread's
forward of the same model meanwhile neither reads nor fills the record. Hooks cost one reference
per tap; ``output_hidden_states`` would keep all L + 1 states.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Sequence

import torch


class TapRecord:
    """Filled by :func:`capture_taps`: ``get()`` -> ``[B, n, len(taps) * H]`` in tap order."""

    def __init__(self, taps: Sequence[int]):
        self.taps = list(taps)
        self.seen: dict[int, torch.Tensor] = {}

    def get(self) -> torch.Tensor:
        missing = [k for k in self.taps if k not in self.seen]
        if missing:
            raise RuntimeError(f"taps {missing} were not computed by this pass (layers skipped?)")
        return torch.cat([self.seen[k] for k in self.taps], dim=-1)


@contextmanager
def capture_taps(model, taps: Sequence[int]):
    """Record the taps of every decoder call inside the block (the last call wins)."""
    record = TapRecord(taps)
    if not taps:
        yield record
        return
    decoder = model.get_decoder()
    layers = decoder.layers
    total = len(layers)
    handles, owner = [], threading.get_ident()

    def hook_for(k):
        def hook(module, args, kwargs):
            if threading.get_ident() == owner:
                record.seen[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    try:
        for k in sorted(set(taps)):
            if not 0 <= k <= total:
                raise ValueError(f"tap {k} outside [0, {total}] for a target with {total} layers")
            module = layers[k] if k < total else decoder.norm
            handles.append(module.register_forward_pre_hook(hook_for(k), with_kwargs=True))
        yield record
    finally:
        for h in handles:
            h.remove()
