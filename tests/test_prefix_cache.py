"""Prefix KV cache across calls: a warm call (its prompt's prefix reused) gives the cold call's
output and the same drafts, for every drafter kind and attention family; memory stays bounded;
a corrupted entry changes the output (so the identity tests do run through the reuse path)."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.decoding.prefix_cache import PrefixCache
from tiny_models import FAMILIES, tiny_model

SYSTEM = [3, 9, 27, 3, 9, 27, 3, 9, 5, 11, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]  # a shared "system prompt"


def _randomise(drafter, scale=0.5):
    """An untrained head drafts one token everywhere; random weights make its drafts vary."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.head.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale)
    return drafter


def _drafters(model):
    return {
        "plain": lambda: None,
        "ngram": lambda: selfspec.build_drafter(model, "ngram", min_ngram=1),
        "suffix": lambda: selfspec.build_drafter(model, "suffix"),
        "layerskip-kv-reuse": lambda: selfspec.build_drafter(model, "layerskip", exit_layer=1, adapter="none"),
        "layerskip-own-cache": lambda: selfspec.build_drafter(model, "layerskip", exit_layer=1, adapter="none",
                                                              kv_reuse=False),
        "eagle3": lambda: _randomise(selfspec.build_drafter(model, "eagle3", taps=[0, 1, 2], draft_vocab_size=64)),
        "medusa": lambda: selfspec.build_drafter(model, "medusa"),
    }


def _session(model, make, cache):
    """Two calls: a prompt, then the same prompt + the reply + a new user turn (an agent's next call)."""
    first = torch.tensor([SYSTEM + [7, 8, 9]])
    out1 = selfspec.generate(model, first, drafter=make(), max_new_tokens=12, control=False, prefix_cache=cache)
    second = torch.cat([out1.sequences, torch.tensor([[50, 51, 52, 7]])], 1)
    out2 = selfspec.generate(model, second, drafter=make(), max_new_tokens=16, control=False, prefix_cache=cache)
    return out1, out2


@pytest.mark.parametrize("family", FAMILIES)
def test_warm_calls_equal_cold_calls(family):
    model = tiny_model(family, vocab=64, layers=3)
    kinds = _drafters(model) if family == "llama" else {k: v for k, v in _drafters(model).items()
                                                        if k in ("plain", "ngram", "layerskip-kv-reuse")}
    for name, make in kinds.items():
        cold1, cold2 = _session(model, make, None)
        cache = PrefixCache()
        warm1, warm2 = _session(model, make, cache)
        assert torch.equal(warm1.sequences, cold1.sequences) and torch.equal(warm2.sequences, cold2.sequences), name
        # the same drafts were accepted step for step: drafter state after reuse equals a cold one
        assert warm2.stats.steps == cold2.stats.steps and warm2.stats.accepted_per_depth == cold2.stats.accepted_per_depth, name
        assert warm1.stats.prefix_reused == 0 and warm2.stats.prefix_reused == cold1.sequences.shape[1] - 1, name
        # a third call with the first prompt again reuses all but the last prompt token
        again = selfspec.generate(model, torch.tensor([SYSTEM + [7, 8, 9]]), drafter=make(), max_new_tokens=12,
                                  control=False, prefix_cache=cache)
        assert torch.equal(again.sequences, cold1.sequences) and again.stats.prefix_reused == len(SYSTEM) + 1, name


def test_reused_state_equals_a_cold_prefill_and_a_corrupted_entry_does_not():
    """The prefill's last hidden state and taps after reuse equal a cold prefill's (float64); the
    negative control corrupts the cached values and must change them (so the identity tests above
    do run through the reuse path)."""
    from selfspec.model.target import TreeTarget

    model = tiny_model("llama", vocab=64, layers=3)
    first = torch.tensor(SYSTEM + [7, 8, 9])
    second = torch.tensor(SYSTEM + [7, 8, 9, 12, 13, 14, 15])

    def prefill(ids, cache):
        target = TreeTarget(model, want_hidden=True, taps=(0, 2))
        out = target.prefill(ids, cache) if cache is not None else target.prefill(ids)
        return out, target.reused

    cold, _ = prefill(second, None)
    cache = PrefixCache()
    prefill(first, cache)
    warm, reused = prefill(second, cache)
    assert reused == len(first) - 1  # a prefill caches all but the root
    assert torch.allclose(warm.hidden, cold.hidden, atol=1e-12) and torch.allclose(warm.taps, cold.taps, atol=1e-12)
    for entry in cache.entries:
        for _, v in entry.kv:
            v.mul_(-3.0)
    bad, reused = prefill(second, cache)
    assert reused > 0 and not torch.allclose(bad.hidden, cold.hidden, atol=1e-3)


def test_memory_is_bounded_and_least_recently_used_entries_go_first():
    model = tiny_model("llama", vocab=64, layers=3)
    per_token = 3 * 2 * 2 * 8 * 8  # layers x (k, v) x kv_heads x head_dim x float64 bytes
    cache = PrefixCache(max_bytes=60 * per_token, min_tokens=4)
    prompts = [torch.tensor([[i, i + 1, 5, 6, 7, 8, 9, 10, 11, 12]]) for i in range(1, 6)]
    for p in prompts:
        selfspec.generate(model, p, max_new_tokens=6, prefix_cache=cache)
        assert cache.nbytes <= cache.max_bytes
    # each call stores prompt + output (15 tokens) over its prompt-only entry: 4 fit in 60 tokens
    assert len(cache.entries) == 4 and [int(e.tokens[0]) for e in cache.entries] == [2, 3, 4, 5]
    out = selfspec.generate(model, prompts[0], max_new_tokens=6, prefix_cache=cache)
    assert out.stats.prefix_reused == 0  # the first prompt was evicted
    assert cache.hits == 0 and cache.misses == 6


def test_a_cache_serves_one_model():
    cache = PrefixCache()
    a, b = tiny_model("llama", vocab=64), tiny_model("llama", vocab=64, seed=1)
    selfspec.generate(a, torch.tensor([SYSTEM]), max_new_tokens=2, prefix_cache=cache)
    with pytest.raises(ValueError, match="another model"):
        selfspec.generate(b, torch.tensor([SYSTEM]), max_new_tokens=2, prefix_cache=cache)
    with pytest.raises(ValueError, match="PrefixCache"):
        selfspec.generate(a, torch.tensor([SYSTEM]), max_new_tokens=2, prefix_cache={})
