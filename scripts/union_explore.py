"""How often unions explore, and what it costs them against a member alone (a diagnostic replay,
not a benchmark: no baseline, no intervals; wall seconds per method over the whole replay).

    python scripts/union_explore.py --questions docs/prompts/adversarial.jsonl --repeats 4 \\
        --methods ngram eagle3+ngram union@explore_budget=0.02,explore_share=0:eagle3+ngram \\
        --out docs/results/r30_union_explore_adversarial

Every method (drafter specs as in ``scripts/benchmark.py``; the first is the reference) is built
once and kept across all generations, as the benchmark keeps its drafters, and generates
``--max-new-tokens`` greedy tokens from the first turn of every question, ``--repeats`` times,
the methods' order rotated from prompt to prompt. For each union: its *exploring steps* (a step
whose arm was not the best by the union's estimates: probes, and first trials of arms never
measured), by arm (plain / each member alone / the merge), probes against first trials, and its
steps per arm; for every method its total seconds, and their ratio to the reference's.
Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.chat import encode_chat  # noqa: E402
from selfspec.drafters import UnionDrafter, drafter_from_spec  # noqa: E402
from selfspec.measurement import benchmark  # noqa: E402
from selfspec.measurement.measure import warm_up_drafting, write_result  # noqa: E402
from selfspec.measurement.workloads import load_questions  # noqa: E402


def _watch(union: UnionDrafter, events: list[dict], generation: list[int]) -> None:
    """Record every exploring step of ``union`` (its pending step priced against another arm)."""
    choose = union._choose_arm

    def spy(ctx):
        arm = choose(ctx)
        state, probe, ref = union._pending[0], union._pending[5], union._pending[7]
        if ref is not None:
            events.append({"generation": generation[0], "arm": arm, "probe": bool(probe), "state": list(state)})
        return arm

    union._choose_arm = spy


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--questions", required=True)
    ap.add_argument("--methods", nargs="+", required=True, help="drafter specs; the first is the reference")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = selfspec.load_target(args.target, dtype=args.dtype)
    questions = load_questions(args.questions)
    drafters = {m: drafter_from_spec(model, m, args.target, tok) for m in args.methods}
    warm = torch.tensor([[0, 1]])
    for d in drafters.values():  # first-call costs hit no timed run (a union's statistics untouched)
        warm_up_drafting(model, warm, d)
        selfspec.generate(model, warm, drafter=d, max_new_tokens=2)
    events: dict[str, list[dict]] = {m: [] for m, d in drafters.items() if isinstance(d, UnionDrafter)}
    generation = [0]
    for m in events:
        _watch(drafters[m], events[m], generation)
    seconds = dict.fromkeys(args.methods, 0.0)
    names = list(args.methods)
    for _ in range(args.repeats):
        for q in questions:
            ids = encode_chat(tok, [{"role": "user", "content": q.turns[0]}], system=q.system)
            generation[0] += 1
            shift = generation[0] % len(names)
            for m in names[shift:] + names[:shift]:
                start = time.perf_counter()
                selfspec.generate(model, ids, drafter=drafters[m], max_new_tokens=args.max_new_tokens)
                seconds[m] += time.perf_counter() - start
    ref = args.methods[0]
    rows = []
    for m in args.methods:
        row = {"method": m, "seconds": seconds[m], "reference_over_method": seconds[ref] / seconds[m]}
        if m in events:
            union, ev = drafters[m], events[m]
            row |= {"exploring_steps": len(ev), "probes": sum(e["probe"] for e in ev),
                    "exploring_per_arm": [sum(e["arm"] == a for e in ev) for a in range(len(union.arms))],
                    "arm_steps": list(union.arm_steps), "events": ev}
        rows.append(row)
    command = "python scripts/union_explore.py " + " ".join(argv or sys.argv[1:])
    lines = [f"`{command}`", "",
             f"{len(questions)} prompts x {args.repeats} repeats = {generation[0]} generations of "
             f"{args.max_new_tokens} greedy tokens per method, methods interleaved, drafters kept across "
             f"generations; {torch.get_num_threads()} threads; seconds include prefill. Arms: plain / each member "
             "alone / the merge.", "",
             f"| method | seconds | `{ref}` / method | exploring steps (probes) | exploring steps per arm | steps per arm |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        explore = (f"{r['exploring_steps']} ({r['probes']}) | {' / '.join(map(str, r['exploring_per_arm']))} | "
                   f"{' / '.join(map(str, r['arm_steps']))}") if "arm_steps" in r else "- | - | -"
        lines.append(f"| `{r['method']}` | {r['seconds']:.2f} | {r['reference_over_method']:.3f}x | {explore} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_result(args.out, {"command": command, "provenance": benchmark.provenance(), "rows": rows}, text)


if __name__ == "__main__":
    main()
