"""A small tool-calling agent loop on the embedded model, plain vs speculative, speed per turn.

    python examples/agent_loop.py [--drafter tools+suffix+ngram] [--max-answer-tokens 64]

Each user turn runs the loop an agent framework runs:

1. **call**: the model writes one tool call. Decoding is constrained to the tool-call grammar in
   the model's own call format (:class:`selfspec.decoding.constraint.ToolCallConstraint`; SmolLM2-135M does
   not open calls on its own), so plain and speculative decoding apply the same mask and stay
   token-identical; the ``tools`` drafter drafts what the grammar forces (keys, punctuation, names).
2. **tool**: the call is parsed and run by deterministic Python functions below; the result goes
   back into the conversation as a ``tool`` message.
3. **answer**: the model answers in free text with the result in context (prompt lookup and suffix
   drafts copy from it).

Every generation runs twice, side by side in this process: plain decoding with no cache (a cold
call, as without selfspec) and speculative decoding with one persistent drafter and one
:class:`selfspec.decoding.prefix_cache.PrefixCache` for the session (the system prompt, tools and earlier
turns are not prefilled again). The table shows decode speed (tokens/s, speedup), the mean accepted
length (MAT) and time to first token for both; greedy outputs are checked identical.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.chat import encode_chat  # noqa: E402
from selfspec.decoding.constraint import ToolCallConstraint  # noqa: E402
from selfspec.drafters import drafter_from_spec  # noqa: E402
from selfspec.decoding.prefix_cache import PrefixCache  # noqa: E402
from selfspec.decoding.tree import TreeBuilder  # noqa: E402

TOOLS = [
    {"name": "get_weather", "description": "Current weather in a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "description": "City name, e.g. Paris"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}},
    {"name": "convert_currency", "description": "Convert an amount of money between currencies.",
     "parameters": {"type": "object", "properties": {
         "amount": {"type": "number"}, "from_currency": {"type": "string", "description": "ISO code, e.g. EUR"},
         "to_currency": {"type": "string", "description": "ISO code, e.g. USD"}},
         "required": ["amount", "from_currency", "to_currency"]}},
    {"name": "calculate", "description": "Evaluate an arithmetic expression.",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}},
]

SYSTEM = (
    "You are an assistant with these functions (JSON schema):\n{tools}\n"
    "To use one, reply with only the call as JSON: {{\"name\": ..., \"arguments\": {{...}}}}. "
    "When a tool message gives you its result, answer the user in one or two sentences using it."
)

TURNS = (
    "What is the weather like in Paris right now? Use celsius.",
    "How much is 120 euros in US dollars?",
    "What is 17.5 times 42, plus 3?",
    "And the weather in Tokyo, in fahrenheit?",
)

_WEATHER = {"paris": (18, "partly cloudy"), "tokyo": (24, "sunny"), "london": (12, "light rain")}
_RATES = {"EUR": 1.08, "USD": 1.0, "GBP": 1.27, "JPY": 0.0067}  # US dollars per unit (fixed)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.Pow: operator.pow}


def get_weather(city: str, unit: str = "celsius") -> dict:
    temp, sky = _WEATHER.get(city.strip().lower(), (20, "clear"))
    if unit == "fahrenheit":
        temp = round(temp * 9 / 5 + 32)
    return {"city": city, "temperature": temp, "unit": unit, "conditions": sky}


def convert_currency(amount: float, from_currency: str, to_currency: str) -> dict:
    rate = _RATES.get(from_currency.upper(), 1.0) / _RATES.get(to_currency.upper(), 1.0)
    return {"amount": amount, "from": from_currency, "to": to_currency, "result": round(amount * rate, 2)}


def calculate(expression: str) -> dict:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only arithmetic is allowed")

    try:
        return {"expression": expression, "result": ev(ast.parse(expression, mode="eval").body)}
    except (SyntaxError, ValueError, ZeroDivisionError) as err:
        return {"expression": expression, "error": str(err)}


FUNCTIONS = {"get_weather": get_weather, "convert_currency": convert_currency, "calculate": calculate}


def run_tool(call_text: str, args_key: str) -> dict:
    """Parse one call (the grammar guarantees the shape) and run it."""
    start = call_text.index("{")
    call = json.JSONDecoder().raw_decode(call_text[start:])[0]
    return FUNCTIONS[call["name"]](**call[args_key])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--drafter", default="tools+suffix+ngram", help="drafter spec (see scripts/generate.py)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-answer-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=len(TURNS))
    ap.add_argument("--out", default=None, help="also write the rows to OUT.json and a Markdown table to OUT.md")
    args = ap.parse_args(argv)
    from selfspec.measurement.benchmark import provenance

    prov = provenance()  # the code as it is when the run starts

    model, tok = selfspec.load_target(args.model, dtype=args.dtype)
    drafter = drafter_from_spec(model, args.drafter, args.model, tok)
    cache = PrefixCache()
    system = SYSTEM.format(tools=json.dumps(TOOLS, indent=1))
    messages: list[dict] = []
    rows = []
    warm = encode_chat(tok, "Hi", system=None)  # warm the kernels once, outside the timings
    selfspec.generate(model, warm, max_new_tokens=4)
    print(f"{'turn':>4} {'phase':6} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'MAT':>5} "
          f"{'TTFT plain':>10} {'TTFT spec':>9} {'reused':>6} identical")
    for turn, user in enumerate(TURNS[: args.turns], 1):
        messages.append({"role": "user", "content": user})
        for phase in ("call", "answer"):
            ids = encode_chat(tok, messages, system=system)
            gen = dict(max_new_tokens=args.max_answer_tokens if phase == "answer" else 96)
            grammar = ToolCallConstraint(TOOLS, tok, vocab=model.config.vocab_size) if phase == "call" else None
            if grammar is not None:  # the grammar engine builds its lexer lazily: not inside a timing
                grammar.masks([], TreeBuilder(int(ids[0, -1])).build(), model.config.vocab_size)
            plain = selfspec.generate(model, ids, constraint=grammar, **gen)
            spec = selfspec.generate(model, ids, drafter=drafter, tools=TOOLS, prefix_cache=cache,
                                     constraint=grammar, **gen)  # (the engine resets the constraint)
            same = torch.equal(plain.sequences, spec.sequences)
            text = tok.decode(spec.sequences[0, ids.shape[1]:], skip_special_tokens=True).strip()
            s, p = spec.stats, plain.stats
            row = dict(turn=turn, phase=phase, plain_tps=p.tokens_per_s, spec_tps=s.tokens_per_s,
                       speedup=s.tokens_per_s / p.tokens_per_s, mat=s.mean_accepted_length,
                       ttft_plain_ms=1e3 * p.first_token_s, ttft_spec_ms=1e3 * s.first_token_s,
                       prompt_tokens=ids.shape[1], reused=s.prefix_reused, new_tokens=s.new_tokens,
                       identical=same, text=text)
            rows.append(row)
            print(f"{turn:>4} {phase:6} {row['plain_tps']:11.1f} {row['spec_tps']:10.1f} {row['speedup']:6.2f}x "
                  f"{row['mat']:5.2f} {row['ttft_plain_ms']:8.0f}ms {row['ttft_spec_ms']:7.0f}ms "
                  f"{row['reused']:>6} {same}")
            print(f"       {phase}: {text[:150]!r}")
            messages.append({"role": "assistant", "content": text})
            if phase == "call":
                result = run_tool(text, grammar.format.args_key)
                print(f"       tool:   {json.dumps(result)}")
                messages.append({"role": "tool", "content": json.dumps(result)})
    tot = {k: sum(r[k] for r in rows) for k in ("new_tokens",)}
    plain_s = sum(r["new_tokens"] / r["plain_tps"] for r in rows)
    spec_s = sum(r["new_tokens"] / r["spec_tps"] for r in rows)
    print(f"session: {tot['new_tokens']} tokens, speedup {plain_s / spec_s:.2f}x (decode time), "
          f"all identical: {all(r['identical'] for r in rows)}; drafter {args.drafter}")
    if args.out:
        command = "python examples/agent_loop.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.out + ".json", "w", encoding="utf-8") as f:
            json.dump({"command": command, "drafter": args.drafter, "provenance": prov, "rows": rows}, f,
                      indent=1)
        lines = [f"`{command}`", "",
                 "| turn | phase | plain tokens/s | speculative tokens/s | speedup | MAT | TTFT plain (cold) ms "
                 "| TTFT speculative (warm) ms | prompt / reused tokens | identical |", "|" + "---|" * 10]
        lines += [f"| {r['turn']} | {r['phase']} | {r['plain_tps']:.1f} | {r['spec_tps']:.1f} | {r['speedup']:.2f}x "
                  f"| {r['mat']:.2f} | {r['ttft_plain_ms']:.0f} | {r['ttft_spec_ms']:.0f} "
                  f"| {r['prompt_tokens']} / {r['reused']} | {'yes' if r['identical'] else 'NO'} |" for r in rows]
        lines.append(f"| all | | | | {plain_s / spec_s:.2f}x | | | | | "
                     f"{'yes' if all(r['identical'] for r in rows) else 'NO'} |")
        with open(args.out + ".md", "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
