"""What the controller's decision costs per step, on this machine, next to the step itself.

    python scripts/dev/decision_cost.py --drafter eagle3 --questions selfspec/prompts/heldout/mt_bench_question.jsonl \
        --limit 4 --out docs/results/decision_cost

Runs ``selfspec.generate`` on the first turns of ``--limit`` questions with the controller's
``plan`` (the arm choice: Thompson draws, scoring every arm) and ``assemble`` (merge, cut,
records) timed call by call on the engine's clock, and reports the medians per step, split by
whether the step drafted, against the median seconds per plain token of the same prompts.
Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import selfspec  # noqa: E402
from selfspec.chat import encode_chat  # noqa: E402
from selfspec.checkpoint import atomic_write_text  # noqa: E402
from selfspec.control import Controller  # noqa: E402
from selfspec.drafters import drafter_from_spec  # noqa: E402
from selfspec.measurement.workloads import load_questions  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--drafter", default="eagle3")
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    model, tok = selfspec.load_target(args.model, dtype=args.dtype)
    ctl = Controller(drafter_from_spec(model, args.drafter, target=args.model, tokenizer=tok))
    timed = {"plan": [], "assemble": []}
    drafted = []
    for name in timed:
        real = getattr(ctl, name)

        def wrapper(*a, _real=real, _name=name, **k):
            t = time.perf_counter()
            out = _real(*a, **k)
            timed[_name].append(time.perf_counter() - t)
            if _name == "plan":
                drafted.append(bool(out.calls))
            return out

        setattr(ctl, name, wrapper)
    plain_s, steps = [], 0
    for q in load_questions(args.questions)[: args.limit]:
        ids = encode_chat(tok, [{"role": "user", "content": q.turns[0]}])
        opts = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
        plain = selfspec.generate(model, ids, **opts)
        plain_s.append(plain.stats.decode_time_s / max(1, plain.stats.new_tokens))
        out = selfspec.generate(model, ids, drafter=ctl, **opts)
        steps += out.stats.steps
    plans = list(zip(timed["plan"], drafted))
    row = dict(
        drafter=args.drafter, dtype=args.dtype, temperature=args.temperature, steps=steps,
        plan_plain_us=1e6 * statistics.median([t for t, d in plans if not d]) if any(not d for _, d in plans) else None,
        plan_draft_us=1e6 * statistics.median([t for t, d in plans if d]) if any(d for _, d in plans) else None,
        assemble_us=1e6 * statistics.median(timed["assemble"]) if timed["assemble"] else None,
        plain_token_ms=1e3 * statistics.median(plain_s), drafted_share=sum(drafted) / max(1, len(drafted)))
    command = "python scripts/dev/decision_cost.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))

    def us(v):
        return "-" if v is None else f"{v:.0f}"

    text = (f"`{command}`\n\n| drafter | dtype | T | steps | drafted | plan, plain step (us) | plan, drafting step (us) | "
            f"assemble (us) | plain token (ms) |\n|---|---|---|---|---|---|---|---|---|\n| {row['drafter']} | {row['dtype']} | "
            f"{row['temperature']} | {row['steps']} | {row['drafted_share']:.0%} | {us(row['plan_plain_us'])} | "
            f"{us(row['plan_draft_us'])} | {us(row['assemble_us'])} | {row['plain_token_ms']:.1f} |\n")
    atomic_write_text(args.out + ".md", text)
    atomic_write_text(args.out + ".json", json.dumps(dict(command=command, row=row), indent=1))
    print(text)


if __name__ == "__main__":
    main()
