"""Prefix KV cache across calls: a new prompt's longest cached token prefix is not prefilled again.

Agents call a model many times with the same system prompt, tool schemas and earlier turns. A
:class:`PrefixCache` keeps, per earlier call, the target's keys/values of its committed tokens
(the prompt after prefill, and prompt + output when the call ends) and, when the drafter reads
target taps (EAGLE-3), those taps too, so the drafter is shown every position exactly as in a cold
call without a target pass. ``generate(..., prefix_cache=cache)`` looks up the longest entry
sharing a token prefix with the new prompt, starts the target's cache from a copy of its first
``m`` positions and prefills only the rest (at least the prompt's second-to-last token, whose
pass yields the hidden state the first draft needs).

Memory is bounded: entries are evicted least recently used while their bytes exceed
``max_bytes``; an entry whose tokens are a prefix of a newer one is dropped (the newer one covers
it). Entries are copies, never views of a live cache, so drafters that write into the target's
cache (layer-skip KV reuse) or compact it cannot change them. Drafters' own caches (layer-skip's
drafting layers without KV reuse, EAGLE-3's draft layer) are rebuilt from the committed tokens and
the cached taps at their first proposal, as after any reset.

Exactness: position ``i``'s keys/values depend only on tokens ``0..i``, so a reused prefix holds
the values a cold prefill computes, up to floating-point differences between kernels of
different shapes (bit-identical output in float64; in low precision, the same near-tie caveat as
tree passes). A cache serves one model: using it with another
raises ``ValueError``.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class PrefixEntry:
    """Cached state of ``tokens`` (``[n]``): per layer ``(keys, values)`` ``[1, kv_heads, n, d]``;
    ``taps`` ``[n, D]`` of tap indices ``taps_key`` (``None`` if not recorded)."""

    tokens: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    taps: torch.Tensor | None
    taps_key: tuple[int, ...]
    nbytes: int
    used: int = 0


@dataclass
class PrefixHit:
    """What :meth:`PrefixCache.lookup` found: ``length`` reusable positions and their state."""

    length: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    taps: torch.Tensor | None

    def cache(self) -> DynamicCache:
        """A fresh ``DynamicCache`` holding copies of the first ``length`` positions."""
        m = self.length
        return DynamicCache([(k[..., :m, :].clone(), v[..., :m, :].clone()) for k, v in self.kv])


class PrefixCache:
    """Least-recently-used store of committed-token KV for one model, bounded in bytes.

    Args:
        max_bytes: most bytes of keys, values and taps held (default 1 GiB).
        min_tokens: shortest prefix worth reusing (shorter matches are prefilled as usual).
    """

    def __init__(self, max_bytes: int = 1 << 30, min_tokens: int = 16):
        if max_bytes < 0 or min_tokens < 1:
            raise ValueError(f"need max_bytes >= 0 and min_tokens >= 1, got {max_bytes}, {min_tokens}")
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.entries: list[PrefixEntry] = []
        self.hits = self.misses = 0
        self.reused_tokens = 0
        self._model_ref = None
        self._clock = itertools.count(1)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def check_model(self, model) -> None:
        """Bind the cache to ``model`` on first use; refuse any other model afterwards."""
        if self._model_ref is None:
            self._model_ref = weakref.ref(model)
        elif self._model_ref() is not model:
            raise ValueError("this PrefixCache holds keys/values of another model; use one cache per model")

    def lookup(self, ids: torch.Tensor, taps_key: tuple[int, ...] = ()) -> PrefixHit | None:
        """The longest cached prefix of ``ids`` (``[L]``) that leaves at least one prompt token
        before the root to prefill (so at most ``L - 2`` positions), with taps when ``taps_key``
        asks for them; ``None`` below ``min_tokens``."""
        limit = ids.shape[0] - 2
        best, best_m = None, 0
        for e in self.entries:
            if taps_key and (e.taps is None or e.taps_key != taps_key):
                continue
            n = min(limit, e.tokens.shape[0])
            if n <= best_m:
                continue
            differ = (e.tokens[:n] != ids[:n]).nonzero()
            m = n if differ.numel() == 0 else int(differ[0])
            if m > best_m:
                best, best_m = e, m
        if best is None or best_m < self.min_tokens:
            self.misses += 1
            return None
        best.used = next(self._clock)
        self.hits += 1
        self.reused_tokens += best_m
        return PrefixHit(best_m, best.kv, best.taps[:best_m] if taps_key else None)

    def store(self, tokens: torch.Tensor, cache: DynamicCache, taps: torch.Tensor | None = None,
              taps_key: tuple[int, ...] = ()) -> None:
        """Keep a copy of the first ``len(tokens)`` cached positions (and their ``taps``)."""
        n = tokens.shape[0]
        if n < self.min_tokens or self.max_bytes == 0:
            return
        kv = [(layer.keys[..., :n, :].clone(), layer.values[..., :n, :].clone()) for layer in cache.layers
              if getattr(layer, "is_initialized", False)]
        if any(k.shape[-2] < n for k, _ in kv):
            raise ValueError(f"the cache holds fewer than the {n} positions to store")
        taps = None if taps is None else taps[:n].clone()
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        nbytes += 0 if taps is None else taps.numel() * taps.element_size()
        tokens = tokens.detach().to("cpu", torch.long).clone()
        # an entry this one extends (same tokens, same or no taps) is covered by it
        self.entries = [e for e in self.entries if not (
            e.tokens.shape[0] <= n and torch.equal(e.tokens, tokens[: e.tokens.shape[0]])
            and (e.taps is None or (taps is not None and e.taps_key == taps_key)))]
        if any(e.tokens.shape[0] >= n and torch.equal(e.tokens[:n], tokens)
               and (taps is None or (e.taps is not None and e.taps_key == taps_key)) for e in self.entries):
            return  # already covered by a longer entry
        self.entries.append(PrefixEntry(tokens, kv, taps, tuple(taps_key), nbytes, next(self._clock)))
        while self.nbytes > self.max_bytes and self.entries:
            self.entries.remove(min(self.entries, key=lambda e: e.used))
