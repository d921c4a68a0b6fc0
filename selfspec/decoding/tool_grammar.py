"""Tool-call grammars: what a tool call may look like, given the tools a caller offers.

``tools`` is an OpenAI-style function list (``[{"type": "function", "function": {...}}]``) or the
bare function objects BFCL uses (``[{"name", "description", "parameters"}]``); BFCL's Python-ish
type names (``dict``, ``float``, ``tuple``, ``any``) are mapped to JSON Schema, and objects with
declared ``properties`` take no others unless they say so (``additionalProperties``), as vLLM's
structured outputs do. :func:`check_tools`
raises ``ValueError`` naming the first problem (no name, duplicate names, parameters that are not
an object schema, a schema the grammar engine rejects).

The grammar (compiled by ``llguidance``, the grammar engine vLLM and SGLang also use) accepts one
call in the compact JSON style models write: ``{"name": "<one of the tools>", "arguments": {...}}``
with ``", "`` and ``": "`` separators, properties in schema order, the arguments matching that
tool's parameter schema. :class:`ToolCallTracker` follows a model's output text: it notices where a
call starts (the latest ``{`` from which the text so far is a valid prefix of a call), advances the
grammar on every committed character, and reports the text the grammar forces next (keys,
punctuation, the rest of a tool name once the prefix is unique): free drafts.

Models wrap calls in their own markers. :class:`CallFormat` says how (the text that opens a call,
the text that closes it, the key of the arguments), :data:`CALL_FORMATS` holds the formats of the
common chat templates, and :func:`detect_call_format` picks one from a tokenizer's chat template:
Hermes / Qwen2.5 / Qwen3 / SmolLM3 write ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>``,
Llama 3.1-3.3 write bare JSON with ``"parameters"``, Mistral (v0.3 templates) writes
``[TOOL_CALLS] [{...}]``; a template with no tool markup (SmolLM2) gets bare JSON with
``"arguments"``. The markers are part of the grammar, so they are forced text too (the closing
marker after a complete call), and a call is looked for only where the model wrote the opening
marker (bare JSON: any ``{``).

llguidance was chosen over xgrammar and outlines-core by what installs here: a 3 MB wheel with no
dependencies (xgrammar pulls Triton and a TVM runtime), and an API that returns forced bytes
(``compute_ff_bytes``), which is exactly what drafting needs.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None, "list": "array",
               "str": "string", "int": "integer", "bool": "boolean"}


def _json_schema(node):
    """A copy of a parameter schema with BFCL's type names mapped to JSON Schema."""
    if isinstance(node, list):
        return [_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _json_schema(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False  # no arguments beyond the declared ones (as vLLM does)
    t = out.get("type")
    if isinstance(t, str) and t in _BFCL_TYPES:
        if _BFCL_TYPES[t] is None:
            del out["type"]
        else:
            out["type"] = _BFCL_TYPES[t]
    return out


def check_tools(tools) -> list[dict]:
    """Validate ``tools`` and return them as ``[{"name", "parameters"}]`` (JSON Schema)."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ValueError(f"tools must be a non-empty list of function definitions, got {type(tools).__name__}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] has no function name (expected {{'name': ..., 'parameters': {{...}}}})")
        if fn["name"] in seen:
            raise ValueError(f"tools[{i}]: duplicate function name {fn['name']!r}")
        seen.add(fn["name"])
        params = _json_schema(copy.deepcopy(fn.get("parameters", {"type": "object", "properties": {}})))
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"tools[{i}] ({fn['name']}): parameters must be an object schema, got {params!r:.80}")
        params.setdefault("type", "object")
        out.append({"name": fn["name"], "parameters": params})
    return out


@dataclass(frozen=True)
class CallFormat:
    """How a model writes one tool call: ``open`` + ``{"name": ..., <args_key>: {...}}`` + ``close``.

    Attributes:
        name: the format's name (a key of :data:`CALL_FORMATS`).
        open / close: literal text around the call's JSON ("" for bare JSON).
        args_key: the key holding the arguments (``"arguments"``; Llama 3 writes ``"parameters"``).
    """

    name: str
    open: str = ""
    close: str = ""
    args_key: str = "arguments"

    @property
    def marker(self) -> str:
        """The text whose appearance starts a call: the opening marker, or ``{`` for bare JSON."""
        return self.open.strip() or "{"


CALL_FORMATS: dict[str, CallFormat] = {
    "json": CallFormat("json"),
    "hermes": CallFormat("hermes", "<tool_call>\n", "\n</tool_call>"),
    "llama3": CallFormat("llama3", args_key="parameters"),
    "mistral": CallFormat("mistral", "[TOOL_CALLS] [", "]"),
}


def call_format(spec: "str | CallFormat | None", tokenizer=None) -> CallFormat:
    """``spec`` as a :class:`CallFormat`: a format, a name in :data:`CALL_FORMATS`, or ``"auto"`` /
    ``None`` (detected from ``tokenizer``'s chat template; bare JSON without a tokenizer)."""
    if isinstance(spec, CallFormat):
        return spec
    if spec in (None, "auto"):
        return detect_call_format(tokenizer) if tokenizer is not None else CALL_FORMATS["json"]
    if spec not in CALL_FORMATS:
        raise ValueError(f"unknown tool-call format {spec!r}; expected 'auto' or one of {sorted(CALL_FORMATS)}")
    return CALL_FORMATS[spec]


def detect_call_format(tokenizer) -> CallFormat:
    """The call format a tokenizer's chat template writes (see the module docstring); bare JSON
    with ``"arguments"`` when the template has no tool markup."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates (e.g. {"default": ..., "tool_use": ...})
        template = "\n".join(str(t) for t in template.values())
    elif isinstance(template, list):
        template = "\n".join(str(t.get("template", "")) for t in template)
    if "<tool_call>" in template:
        return CALL_FORMATS["hermes"]
    if "[TOOL_CALLS]" in template:
        return CALL_FORMATS["mistral"]
    if re.search(r"""["']?\\?"parameters\\?"\s*:""", template) and ("ipython" in template or "<|eom_id|>" in template):
        return CALL_FORMATS["llama3"]
    return CALL_FORMATS["json"]


def call_grammar(tools, fmt: CallFormat | None = None) -> str:
    """A Lark grammar (llguidance's dialect) of ``fmt.open`` + one call to one of ``tools`` + ``fmt.close``."""
    fmt = fmt or CALL_FORMATS["json"]
    parts = [json.dumps(fmt.open) if fmt.open else "", "call", json.dumps(fmt.close) if fmt.close else ""]
    return ("start: " + " ".join(x for x in parts if x) + "\ncall: %json "
            + json.dumps(call_schema(tools, fmt.args_key)))


def call_schema(tools, args_key: str = "arguments") -> dict:
    """JSON Schema of one call to one of ``tools``, in compact style (no free whitespace)."""
    options = [{"type": "object", "properties": {"name": {"const": t["name"]}, args_key: t["parameters"]},
                "required": ["name", args_key], "additionalProperties": False} for t in check_tools(tools)]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                                     "lenient": True}}


class ToolCallTracker:
    """Follows generated text and says what a tool-call grammar forces next.

    Args:
        tools: the caller's functions (see :func:`check_tools`).
        ll_tokenizer: an ``llguidance.LLTokenizer`` for the target's tokenizer.
        fmt: the model's call format (default: bare JSON).

    Call :meth:`update` with the whole output text so far (it must only grow), then read
    :meth:`forced`. Never raises on text that is not a call: it just forces nothing.
    """

    def __init__(self, tools, ll_tokenizer, fmt: CallFormat | None = None):
        import llguidance

        self.ll_tokenizer, self.format = ll_tokenizer, fmt or CALL_FORMATS["json"]
        grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar(tools, self.format))
        msg = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer)  # "" when valid
        if msg:
            raise ValueError(f"the tools' parameter schemas do not compile to a grammar: {msg}")
        self._fresh = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)  # copied per attempt:
        self.matcher = self._fresh.deep_copy()  # a matcher in error state does not recover on reset
        self.reset()

    def reset(self) -> None:
        self.text = ""
        self.start: int | None = None  # offset of the open call's "{" in text
        self.fed = 0  # text[:fed] has been given to the matcher (when in a call)
        self.scan = 0  # no call can start before this offset
        self.calls = 0  # calls completed

    def _feed(self, chunk: str) -> bool:
        if not chunk:
            return True
        tokens = self.ll_tokenizer.tokenize_str(chunk)
        return self.matcher.consume_tokens(tokens) and not self.matcher.is_error()

    def _try_start(self, offset: int) -> bool:
        self.matcher = self._fresh.deep_copy()
        if self._feed(self.text[offset:]):
            self.start, self.fed = offset, len(self.text)
            return True
        return False

    def update(self, text: str) -> None:
        """Advance to ``text`` (the whole output so far, extending the previous one)."""
        if not text.startswith(self.text):
            self.reset()
        self.text = text
        if self.start is not None:
            if self.matcher.is_accepting():  # the call was complete: what follows is not part of it
                self.start, self.scan, self.calls = None, self.fed, self.calls + 1
            elif not self._feed(text[self.fed:]):
                self.start, self.scan = None, self.start + 1  # the model left the grammar
            else:
                self.fed = len(text)
                if self.matcher.is_accepting():
                    self.start, self.scan, self.calls = None, len(text), self.calls + 1
        while self.start is None:  # the earliest marker from which the text is a call so far
            at = text.find(self.format.marker, self.scan)
            if at < 0 or self._try_start(at):
                break
            self.scan = at + 1  # a text that left the grammar never re-enters it

    def forced(self) -> str:
        """Text the grammar forces next ("" outside a call or where the model has a choice)."""
        if self.start is None or self.matcher.is_stopped():
            return ""
        return bytes(self.matcher.compute_ff_bytes()).decode("utf-8", errors="ignore")
