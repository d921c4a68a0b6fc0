"""Speculative generation: the answer streamed as each step is verified.

    selfspec generate --prompt "Write a haiku about trees." [--drafter ngram|none] [--temperature 0.7]
    selfspec generate --prompt "..." --json                  one JSON object (text, tokens/s, MAT) for machines
    selfspec generate --compare                              speed against plain decoding, side by side

Defaults (``--drafter auto --dtype auto``): the drafter and target dtype measured fastest for the
model (selfspec/checkpoints/recommended.json). ``--compare`` times plain and speculative decoding side by side in
this process (see selfspec/measurement/measure.py) and, when the dtype is not float32, plain float32
decoding too (a faster dtype is not credited to speculation) with the float32 greedy identity check.
"""

from __future__ import annotations

import argparse


import selfspec
from selfspec.chat import encode_chat
from selfspec.commands.common import add_model_args, fail, load_model
from selfspec.control import ControlConfig, Controller
from selfspec.drafters import drafter_from_spec, recommended_setting, shipped_checkpoint
from selfspec.model.machine import bf16_is_fast
from selfspec.measurement.measure import compare, divergence

DEFAULT_PROMPT = (
    "Here is a tool call: {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
    "\"unit\": \"celsius\", \"days\": 3}}. Write the same JSON call again for the city of Lyon, "
    "then explain each field in one sentence."
)


def parser() -> argparse.ArgumentParser:
    """The command line of this command (the README test parses its examples with it)."""
    ap = argparse.ArgumentParser(prog="selfspec generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--drafter", default="auto",
                    help="auto (the drafter measured fastest for the model, selfspec/checkpoints/recommended.json; "
                         "else a shipped head + prompt lookup, else ngram), eagle3, medusa, layerskip, ngram[:opts], a+b unions, "
                         "a checkpoint folder, none")
    add_model_args(ap)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", action="store_true",
                    help="time plain and speculative decoding side by side (and plain float32), check greedy identity")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the streamed text")
    ap.add_argument("--repeats", type=int, default=1, help="--compare: alternating plain/speculative runs to time")
    ap.add_argument("--system", default=None, help="optional system message")
    ap.add_argument("--fixed", action="store_true",
                    help="draft every step with every drafter and verify whole trees (no controller decisions)")
    ap.add_argument("--stream", action="store_true", help="--compare: print the speculative run's text as it is verified")
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    with fail("generate", args):
        for name in ("max_new_tokens", "repeats"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        run(args)


def run(args) -> None:
    drafter_spec, dtype = args.drafter, args.dtype
    if drafter_spec == "auto":  # the setting measured fastest for this model, else a shipped head + ngram
        shipped = [k for k in ("eagle3", "medusa") if shipped_checkpoint(args.model, k).is_dir()]
        setting = recommended_setting(args.model)
        drafter_spec = setting[0] if setting else (f"{shipped[0]}+ngram" if shipped else "ngram")
        dtype = demo_dtype(args.dtype, setting[1] if setting else None)
    say = (lambda *a, **k: None) if args.json else print
    say(f"loading {args.model} ...", flush=True)
    model, tokenizer = load_model(args, dtype=dtype)
    dtype_name = str(next(model.parameters()).dtype).removeprefix("torch.")
    say(f"target dtype {dtype_name}, drafter {drafter_spec}", flush=True)
    ids = encode_chat(tokenizer, args.prompt, system=args.system).to(next(model.parameters()).device)
    drafter = drafter_from_spec(model, drafter_spec, args.model, tokenizer)
    if drafter is not None:  # one controller for every run here: it learns across them
        drafter = Controller(drafter, ControlConfig(fixed=args.fixed))
    gen = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
               top_p=args.top_p, seed=args.seed)
    if not args.compare:
        return answer(model, tokenizer, ids, drafter, drafter_spec, dtype_name, gen, args.json)
    reference = None
    if dtype_name != "float32":  # time plain float32 decoding too: speculation is not credited with the dtype
        reference, _ = load_model(args, dtype="float32")
    streamer = None
    if args.stream:
        from transformers import TextStreamer

        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        print(f"plain run, then the speculative run ({drafter_spec}) streamed as it is verified:\n" + "=" * 72,
              flush=True)
    result = compare(model, ids, drafter, repeats=args.repeats, streamer=streamer, reference=reference, **gen)
    spec_name = drafter_spec
    spec, plain = result.spec, result.plain
    text = tokenizer.decode(spec.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    print("=" * 72 if args.stream else "\n" + "=" * 72 + f"\n{text}\n" + "=" * 72)
    print(f"prompt tokens        {ids.shape[1]}")
    print(f"new tokens           plain {plain.stats.new_tokens}, speculative {spec.stats.new_tokens}")
    print(f"plain decoding       {plain.stats.tokens_per_s:7.1f} tokens/s   ({dtype_name})")
    if result.reference is not None:
        print(f"plain decoding       {result.reference.stats.tokens_per_s:7.1f} tokens/s   (float32)")
    print(f"selfspec             {spec.stats.tokens_per_s:7.1f} tokens/s   (drafter: {spec_name}, {dtype_name})")
    print(f"speedup              {result.speedup:7.2f}x   (against plain {dtype_name}; decode tokens/s, "
          f"{args.repeats} alternating run(s))")
    if result.reference is not None:
        print(f"speedup              {result.speedup_vs_reference:7.2f}x   (against plain float32)")
    print(f"mean accepted length {spec.stats.mean_accepted_length:7.2f}   (tokens per target pass, plain = 1)")
    acc = ", ".join(f"{a:.2f}" for a in spec.stats.acceptance_per_depth[:6])
    print(f"acceptance per depth [{acc}]")
    if drafter is not None and not args.fixed:
        print(f"controller           {spec.stats.plain_steps} of {spec.stats.steps} steps ran plain (drafting did "
              f"not pay there); verify cost curve {drafter.cost.source}")
    if args.temperature == 0:
        same = "the same as" if result.identical else "not the same as"
        print(f"greedy check         the speculative text is {same} plain greedy decoding ({dtype_name})")
        why = divergence(model, plain.sequences, spec.sequences, ids.shape[1])
        if why is not None:
            print(f"  they part at new token {why.position}, where the two best tokens are {why.margin:.4f} apart in "
                  f"the plain run's logits; in {dtype_name} a tree pass and a one-token pass round the same "
                  f"numbers differently (by up to {why.rounding_gap:.4f} here), so a near-tie can fall either way "
                  f"({'that is what happened' if why.explained else 'NOT explained by rounding: please report a bug'}).")
        if reference is not None and drafter is not None:  # the same comparison where rounding cannot part them
            exact = drafter_from_spec(reference, drafter_spec, args.model, tokenizer)
            out = selfspec.generate(reference, ids, drafter=exact, **gen)
            plain32 = result.reference.sequences
            same32 = out.sequences.shape == plain32.shape and bool((out.sequences == plain32).all())
            print(f"greedy check         in float32: {'identical' if same32 else 'DIFFERENT (a bug: please report)'} "
                  "to plain float32 greedy decoding")

def answer(model, tokenizer, ids, drafter, spec: str, dtype: str, gen: dict, as_json: bool) -> None:
    """Generate once: stream the text (or print one JSON object), then the run's speed and MAT."""
    import json
    import sys

    chunks = selfspec.stream(model, ids, drafter=drafter, **gen)
    tokens: list[int] = []
    shown = ""
    for step in chunks:
        tokens += step
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if not as_json:
            print(text[len(shown):], end="", flush=True)
        shown = text
    stats = chunks.output.stats
    if as_json:
        print(json.dumps({"text": shown, "new_tokens": stats.new_tokens, "tokens_per_s": round(stats.tokens_per_s, 2),
                          "mean_accepted_length": round(stats.mean_accepted_length, 3), "drafter": spec, "dtype": dtype}))
        return
    print(f"\n\n{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s, mean accepted length "
          f"{stats.mean_accepted_length:.2f} ({spec}, {dtype}); --compare times plain decoding beside it",
          file=sys.stderr)


def demo_dtype(requested: str, recommended: str | None) -> str:
    """The target dtype to load: ``requested`` unless it is ``auto``; then the recommendation's
    dtype where this hardware runs it natively (it was measured on such hardware), else
    ``load_target``'s own ``auto`` (bfloat16 where a plain step measures 20% faster in it, or at most 5%
    slower with a tree pass 20% faster)."""
    if requested != "auto":
        return requested
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if recommended == "float32" or (recommended == "bfloat16" and bf16_is_fast(device)):
        return recommended
    return "auto"


if __name__ == "__main__":
    main()
