"""Where a speculative batch spends its steps against plain batched decoding, at one batch size.

    python scripts/dev/batch_steps.py --questions selfspec/prompts/heldout/mt_bench_question.jsonl \
        --batch 8 --prompts 16 --out docs/results/batch_steps_b8

Three pools on the same prompts, in an order rotated per repeat: plain (no controller), the
controller with its batch gate held shut (every step plain, the drafters' taps recorded), and the
same with no taps recorded; the median seconds of a step of each (what a plain step costs inside a
speculative batch). Then the speculative pool as it runs (the gate deciding): how many steps
drafted, tokens per row and milliseconds per step of drafted and plain steps. Writes ``<out>.json``
and ``<out>.md``.
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
from selfspec.batch import Pool  # noqa: E402
from selfspec.checkpoint import atomic_write_text  # noqa: E402
from selfspec.control import Controller  # noqa: E402
from selfspec.drafters import drafter_from_spec  # noqa: E402
from selfspec.measurement.throughput import prompts_from  # noqa: E402
from selfspec.measurement.workloads import load_questions  # noqa: E402


def run(model, controller, prompts, batch: int, max_new_tokens: int, *, taps: bool = True) -> list[tuple[int, float]]:
    """``(rows, seconds)`` of every step of the pools that decode ``prompts`` ``batch`` at a time."""
    steps = []
    for i in range(0, len(prompts), batch):
        pool = Pool(model, controller, max_batch=batch)
        if not taps:
            pool.target.taps = ()
        for p in prompts[i: i + batch]:
            pool.submit(p, max_new_tokens=max_new_tokens)
        inner = pool._step

        def timed(inner=inner, pool=pool):
            rows, t = len(pool.running), time.perf_counter()
            out = inner()
            steps.append((rows, time.perf_counter() - t))
            return out

        pool._step = timed
        pool.run()
    return steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--drafter", default="eagle3+ngram")
    ap.add_argument("--questions", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    model, tok = selfspec.load_target(args.model, dtype=args.dtype)
    prompts = prompts_from(tok, load_questions(args.questions), args.prompts)

    def controller():
        return Controller(drafter_from_spec(model, args.drafter, target=args.model, tokenizer=tok))

    shut = controller()
    shut.gate.draft = lambda rows: False
    kinds = {"plain pool": dict(controller=None), "gate shut, taps recorded": dict(controller=shut),
             "gate shut, no taps": dict(controller=shut, taps=False)}
    for kw in kinds.values():  # untimed: kernels, packing, the verify cost curve
        run(model, kw["controller"], prompts[:2], 2, 8, taps=kw.get("taps", True))
    medians: dict[str, list[float]] = {k: [] for k in kinds}
    names = list(kinds)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            kw = kinds[name]
            steps = run(model, kw["controller"], prompts, args.batch, args.max_new_tokens, taps=kw.get("taps", True))
            medians[name].append(statistics.median(s for rows, s in steps if rows == args.batch) * 1e3)
    live = controller()
    run(model, live, prompts[: args.batch], args.batch, 8)
    mix: dict[bool, list[tuple[int, int, float]]] = {True: [], False: []}
    record = live.gate.record

    def logged(rows, drafted, tokens, seconds):
        if rows == args.batch:
            mix[drafted].append((rows, tokens, seconds))
        return record(rows, drafted, tokens, seconds)

    live.gate.record = logged
    run(model, live, prompts, args.batch, args.max_new_tokens)
    steps = {("drafted" if k else "plain"): dict(
        steps=len(v), tokens_per_row=sum(t for _, t, _ in v) / max(1, sum(r for r, _, _ in v)),
        ms_per_step=sum(s for _, _, s in v) / max(1, len(v)) * 1e3) for k, v in mix.items()}
    result = dict(command="python " + " ".join(shlex.quote(a) for a in sys.argv), args=vars(args),
                  median_step_ms=medians, gated_steps=steps)
    lines = [f"`{result['command']}`", "", f"Median milliseconds of a step with {args.batch} rows, per repeat:", "",
             "| pool | " + " | ".join(f"repeat {i + 1}" for i in range(args.repeats)) + " | mean |",
             "|---|" + "---|" * (args.repeats + 1)]
    for name, ms in medians.items():
        lines.append(f"| {name} | " + " | ".join(f"{m:.1f}" for m in ms) + f" | {statistics.mean(ms):.1f} |")
    lines += ["", f"The speculative pool as it runs ({args.drafter}, its gate deciding), steps with {args.batch} rows:", "",
              "| steps | count | tokens per row | ms per step |", "|---|---|---|---|"]
    for name, s in steps.items():
        lines.append(f"| {name} | {s['steps']} | {s['tokens_per_row']:.2f} | {s['ms_per_step']:.1f} |")
    atomic_write_text(args.out + ".json", json.dumps(result, indent=1))
    atomic_write_text(args.out + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
