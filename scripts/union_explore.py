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
steps per arm; for every method its total seconds and their ratio to the reference's, over whole
generations (prefill and first step included) and, as the benchmark measures speed, in output
tokens/s after each generation's first step (a union's first step may pay a member's catch-up
over the whole prompt, which shows in the time to first token, not in the benchmark's speedup).
Writes <out>.json and <out>.md.

Replays of one union differ by a few points (its arm sequence follows measured step times), so a
rule judged by one replay is judged by luck. ``--combine A.json B.json ... --out C`` reads replays
of the same methods and writes each method's mean ratio to the reference over them, after the
first step and over whole generations, with a 95% Student-t interval over the replays
(:func:`combine`).

    python scripts/union_explore.py --combine runs/r36/explore_adv_after*.json --out docs/results/r36_union_explore_replays
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
from selfspec.measurement.calibration import t975  # noqa: E402
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


def _pooled(sums: list[list[float]]) -> list[float]:
    return [sum(s[0] for s in sums), sum(s[1] for s in sums)]


def _rate(sums: list[float]) -> float:
    """Tokens per second of ``[tokens, seconds]`` (0.0 without seconds)."""
    return sums[0] / sums[1] if sums[1] > 0 else 0.0


def _ratio(sums: list[float], ref: list[float]) -> float:
    """Tokens/s of ``sums`` over those of ``ref`` (0.0 when ``ref`` has none)."""
    return _rate(sums) / _rate(ref) if _rate(ref) > 0 else 0.0


def t_interval(values: list[float]) -> list[float] | None:
    """Two-sided 95% Student-t interval of the mean of ``values`` (``None`` for fewer than 2)."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    half = t975(n - 1) * sd / n ** 0.5
    return [mean - half, mean + half]


def combine(results: list[dict]) -> list[dict]:
    """Per method of several replays (result dicts of this script with the same methods, in the
    same order): its ratio to the reference (the first method) after the first step and over whole
    generations, each as the mean over the replays with :func:`t_interval`, and its mean exploring
    steps (unions). Replays written before the after-first-step column count over whole
    generations only (``after_first`` then ``None``); ``later_passes``, the ratio after the first step
    over the replays' second and later passes over the prompts (a union has then met every kind of
    text once), ``None`` for replays without it."""
    if not results:
        raise ValueError("nothing to combine")
    methods = [r["method"] for r in results[0]["rows"]]
    for res in results[1:]:
        if [r["method"] for r in res["rows"]] != methods:
            raise ValueError(f"replays of different methods: {methods} and {[r['method'] for r in res['rows']]}")
    out = []
    for i, m in enumerate(methods):
        rows = [res["rows"][i] for res in results]
        whole = [r["reference_over_method"] for r in rows]
        after = [r["after_first_over_reference"] for r in rows if "after_first_over_reference" in r]
        later = [r["later_passes_over_reference"] for r in rows if "later_passes_over_reference" in r]
        row = {"method": m, "replays": len(rows),
               "whole": {"mean": sum(whole) / len(whole), "ci": t_interval(whole), "values": whole},
               "after_first": ({"mean": sum(after) / len(after), "ci": t_interval(after), "values": after}
                               if len(after) == len(rows) else None),
               "later_passes": ({"mean": sum(later) / len(later), "ci": t_interval(later), "values": later}
                                if len(later) == len(rows) else None)}
        if all("exploring_steps" in r for r in rows):
            row["exploring_steps"] = sum(r["exploring_steps"] for r in rows) / len(rows)
        out.append(row)
    return out


def _combined_table(rows: list[dict], command: str) -> str:
    def cell(v):  # noqa: E306
        if v is None:
            return "-"
        ci = f" ({v['ci'][0]:.3f}-{v['ci'][1]:.3f})" if v["ci"] else ""
        return f"{v['mean']:.3f}x{ci}"

    ref = rows[0]["method"]
    lines = [f"`{command}`", "", f"{rows[0]['replays']} replays; per method its mean ratio to `{ref}` over them with "
             "a 95% Student-t interval: method / reference in output tokens/s after each generation's first step "
             "(the benchmark's speed), and reference / method in seconds over whole generations.", "",
             f"| method | replays | method / `{ref}` after the first step | the same, passes 2+ over the prompts | "
             f"`{ref}` / method, whole generations | exploring steps per replay |", "|---|---|---|---|---|---|"]
    for r in rows:
        steps = f"{r['exploring_steps']:.1f}" if "exploring_steps" in r else "-"
        lines.append(f"| `{r['method']}` | {r['replays']} | {cell(r['after_first'])} | {cell(r.get('later_passes'))} | "
                     f"{cell(r['whole'])} | {steps} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--questions")
    ap.add_argument("--methods", nargs="+", help="drafter specs; the first is the reference")
    ap.add_argument("--combine", nargs="+", metavar="RESULT_JSON",
                    help="combine replays written by this script (same methods) instead of running one")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    command = "python scripts/union_explore.py " + " ".join(argv or sys.argv[1:])
    if args.combine:
        import json

        from pathlib import Path

        rows = combine([json.loads(Path(f).read_text(encoding="utf-8")) for f in args.combine])
        text = _combined_table(rows, command)
        print(text)
        write_result(args.out, {"command": command, "replays": args.combine, "rows": rows}, text)
        return
    if not args.questions or not args.methods:
        ap.error("--questions and --methods are required unless --combine is given")
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
    # [tokens, seconds] after each generation's first step, per method and pass over the prompts
    passes = {m: [[0.0, 0.0] for _ in range(args.repeats)] for m in args.methods}
    names = list(args.methods)
    for r in range(args.repeats):
        for q in questions:
            ids = encode_chat(tok, [{"role": "user", "content": q.turns[0]}], system=q.system)
            generation[0] += 1
            shift = generation[0] % len(names)
            for m in names[shift:] + names[:shift]:
                start = time.perf_counter()
                out = selfspec.generate(model, ids, drafter=drafters[m], max_new_tokens=args.max_new_tokens)
                seconds[m] += time.perf_counter() - start
                s = out.stats
                passes[m][r][0] += s.new_tokens - s.first_step_tokens
                passes[m][r][1] += s.wall_time_s - s.first_token_s
    ref = args.methods[0]
    rows = []
    for m in args.methods:
        after, ref_after = _pooled(passes[m]), _pooled(passes[ref])
        row = {"method": m, "seconds": seconds[m], "reference_over_method": seconds[ref] / seconds[m],
               "tokens_per_s_after_first": _rate(after), "after_first_over_reference": _ratio(after, ref_after),
               "after_first_by_pass": [_ratio(p, q) for p, q in zip(passes[m], passes[ref])]}
        if args.repeats > 1:  # after the first pass over the prompts (a union has seen every kind of text)
            row["later_passes_over_reference"] = _ratio(_pooled(passes[m][1:]), _pooled(passes[ref][1:]))
        if m in events:
            union, ev = drafters[m], events[m]
            row |= {"exploring_steps": len(ev), "probes": sum(e["probe"] for e in ev),
                    "exploring_per_arm": [sum(e["arm"] == a for e in ev) for a in range(len(union.arms))],
                    "arm_steps": list(union.arm_steps), "events": ev}
        rows.append(row)
    lines = [f"`{command}`", "",
             f"{len(questions)} prompts x {args.repeats} repeats = {generation[0]} generations of "
             f"{args.max_new_tokens} greedy tokens per method, methods interleaved, drafters kept across "
             f"generations; {torch.get_num_threads()} threads; seconds include prefill. Arms: plain / each member "
             "alone / the merge.", "",
             f"| method | seconds | `{ref}` / method | tokens/s after the first step | method / `{ref}` there | "
             "per pass over the prompts | exploring steps (probes) | exploring steps per arm | steps per arm |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        explore = (f"{r['exploring_steps']} ({r['probes']}) | {' / '.join(map(str, r['exploring_per_arm']))} | "
                   f"{' / '.join(map(str, r['arm_steps']))}") if "arm_steps" in r else "- | - | -"
        by_pass = " / ".join(f"{v:.3f}" for v in r["after_first_by_pass"])
        lines.append(f"| `{r['method']}` | {r['seconds']:.2f} | {r['reference_over_method']:.3f}x | "
                     f"{r['tokens_per_s_after_first']:.1f} | {r['after_first_over_reference']:.3f}x | {by_pass} | "
                     f"{explore} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_result(args.out, {"command": command, "provenance": benchmark.provenance(), "rows": rows}, text)


if __name__ == "__main__":
    main()
