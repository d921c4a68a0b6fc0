"""How fresh unions fare on one prompt (a diagnostic of the union's arm choice at a process's
start, not a benchmark: no plain baseline; with ``--alone``, paired ratios to members alone).

    python scripts/union_cold_start.py --category writing --temperature 0.7 --unions 8 \\
        --dtype bfloat16 --variants "" "upper_z=-1000.0" --out docs/results/r33_union_cold_start

A union learns its arms' speeds across calls, so the first prompt of a process is where a few
unlucky steps weigh the most (the benchmark's first prompt, MT-Bench's first writing turn, ran at
0.81x of the head alone at T=0.7 in round 32). For each of ``--unions`` rounds, one fresh union per
variant (``UnionDrafter`` options, as in a ``union@key=value,...:a+b`` spec; ``""``: the defaults)
is warmed up as the benchmark warms up its methods (its members one by one, then a 2-token run)
and generates ``--max-new-tokens`` tokens from the first turn of the first MT-Bench question of
``--category``, ``--generations`` times in a row (the union kept; round r's generation g samples
with seed ``r * generations + g``, the same for every variant). The variants run in turn within
each round, so load on this shared machine hits them alike. Reported per variant: generations
whose mean accepted length stayed under ``--floor`` (mostly plain steps, or prompt lookup's), the
mean MAT, mean tokens/s (prefill included), and the steps per arm summed over all generations.
Also per variant: output tokens/s after the first step (the benchmark's metric), pooled over
the generations. With ``--alone SPEC ...`` (e.g. ``eagle3``) each round also runs those drafters
alone, fresh and warmed up alike, on the same seeds (rows of their own), and each variant is set
against each of them: its pooled tokens/s after the first step over the drafter's, paired by seed,
with a 95% bootstrap interval that resamples rounds (a fresh union's generations are not
independent of each other; :func:`paired_ratio`). With ``--generations 1`` every pair is a fresh
union's first generation, the start of a process; with more, later generations of a warmed union
are pooled in. At T > 0 each run samples its own text, so a ratio on one generation (the
benchmark's first turn) says little; over many seeds it says whether a fresh union loses to its
member. The runs' order rotates from round to round (each run stores its round and position).
Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.chat import encode_chat  # noqa: E402
from selfspec.measurement import benchmark  # noqa: E402
from selfspec.measurement.benchmark import bootstrap_ci, method_from_spec, warm_up_runner  # noqa: E402
from selfspec.measurement.measure import write_result  # noqa: E402
from selfspec.measurement.workloads import first_per_category  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def paired_ratio(a: list[dict], b: list[dict], resamples: int = 1000, seed: int = 0) -> tuple[float, list[float] | None]:
    """Pooled output tokens/s after the first step of generations ``a`` over those of ``b``, and its
    95% bootstrap interval (``None`` with fewer than 3 rounds). ``a[i]`` and ``b[i]`` must be
    generations with the same ``seed`` where given; each is ``{"tokens": tokens after the first
    step, "seconds": seconds after the first step}``, optionally with its ``round``: the
    interval resamples rounds with all their pairs (one fresh union's generations depend on each
    other), else single pairs. A rate with no seconds is 0 (as the benchmark's), a ratio over a
    zero rate 0, and resamples where either rate is 0 are skipped. Deterministic (seeded).

    Raises:
        ValueError: different lengths, no generations, or pairs of different seeds."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need the same positive number of generations on both sides, got {len(a)} and {len(b)}")
    if [g.get("seed") for g in a] != [g.get("seed") for g in b]:
        raise ValueError("pairs must be generations of the same seeds, in the same order")
    point = pooled_rate(a) / pooled_rate(b) if pooled_rate(b) > 0 else 0.0
    units: dict = {}
    for i, g in enumerate(a):
        units.setdefault(g.get("round", i), []).append(i)
    groups = list(units.values())

    def ratio(picked: list[int]) -> float | None:  # (picked rounds, each with all its pairs)
        pick = [i for r in picked for i in groups[r]]
        ra, rb = pooled_rate([a[i] for i in pick]), pooled_rate([b[i] for i in pick])
        return ra / rb if ra > 0 and rb > 0 else None

    return point, bootstrap_ci(len(groups), ratio, resamples, seed)


def pooled_rate(gens: list[dict]) -> float:
    """Output tokens/s after the first step pooled over ``gens`` (0 without seconds), as the
    benchmark's ``_rate``."""
    seconds = sum(g["seconds"] for g in gens)
    return sum(g["tokens"] for g in gens) / seconds if seconds > 0 else 0.0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--questions", default=str(SHARED / "mt_bench_question.jsonl"))
    ap.add_argument("--category", required=True)
    ap.add_argument("--members", default="eagle3+ngram")
    ap.add_argument("--variants", nargs="+", default=[""], help="UnionDrafter options per variant ('' = defaults)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--unions", type=int, default=8, help="fresh unions per variant")
    ap.add_argument("--generations", type=int, default=2, help="generations per fresh union")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--floor", type=float, default=1.35, help="a generation under this MAT counts as benched")
    ap.add_argument("--alone", nargs="*", default=[], help="drafter specs run alone on the same seeds "
                    "(e.g. eagle3): every variant is set against each of them")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.unions < 1 or args.generations < 1:
        raise SystemExit("--unions and --generations must be >= 1")
    if len(args.members.split("+")) < 2:
        raise SystemExit(f"--members must name at least two drafters joined by '+', got {args.members!r}")
    if len(set(args.variants)) != len(args.variants):
        raise SystemExit(f"--variants repeats a variant: {args.variants}")
    torch.set_grad_enabled(False)
    model, tok = selfspec.load_target(args.target, dtype=args.dtype)
    try:
        question = first_per_category(args.questions, [args.category])[args.category]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    ids = encode_chat(tok, [{"role": "user", "content": question.turns[0]}])
    specs = [f"union@{v}:{args.members}" if v else args.members for v in args.variants]
    if set(args.alone) & set(specs) or len(set(args.alone)) != len(args.alone):
        raise SystemExit(f"--alone must name drafters other than the unions, once each: {args.alone}")
    runs: dict[str, list[dict]] = {s: [] for s in specs + list(args.alone)}
    order = list(runs)
    for r in range(args.unions):
        shift = r % len(order)  # rotated: no spec always runs first in a round
        for position, spec in enumerate(order[shift:] + order[:shift]):
            method = method_from_spec(model, spec, args.target, tokenizer=tok)
            drafter = getattr(method, "drafter", None)
            warm_up_runner(model, method, temperature=args.temperature, seed=0)
            for g in range(args.generations):
                before = list(getattr(drafter, "arm_steps", []))
                seed = r * args.generations + g
                out = method(model, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=seed)
                runs[spec].append({"round": r, "position": position, "seed": seed, "mat": out.new_tokens / out.steps,
                                   "tokens_per_s": out.new_tokens / out.wall_time_s,
                                   "tokens": out.new_tokens - out.first_tokens, "seconds": out.wall_time_s - out.ttft_s,
                                   "arm_steps": [a - b for a, b in zip(getattr(drafter, "arm_steps", []), before)]})
            print(spec, runs[spec][-args.generations:], flush=True)
    for gens in runs.values():  # pair by seed
        gens.sort(key=lambda g: g["seed"])
    names = ["plain"] + args.members.split("+") + ["merge"]
    rows = []
    for spec, gens in runs.items():
        row = {"spec": spec, "generations": len(gens), "benched": sum(g["mat"] < args.floor for g in gens),
               "mean_mat": sum(g["mat"] for g in gens) / len(gens),
               "mean_tokens_per_s": sum(g["tokens_per_s"] for g in gens) / len(gens),
               "tokens_per_s_after_first": pooled_rate(gens),
               "arm_steps": [sum(g["arm_steps"][i] for g in gens) for i in range(len(names))] if spec in specs else None,
               "against": {}}
        if spec in specs:
            for ref in args.alone:
                point, ci = paired_ratio(gens, runs[ref])
                row["against"][ref] = {"ratio": point, "ci": ci}
        rows.append(row)
    def against(r: dict) -> str:  # noqa: E306  (each drafter alone: ratio and interval, or '-')
        cells = []
        for ref in args.alone:
            got = r["against"].get(ref)
            cells.append("-" if got is None else f"{got['ratio']:.2f}x" + (
                f" ({got['ci'][0]:.2f}-{got['ci'][1]:.2f})" if got["ci"] else ""))
        return "".join(f" {c} |" for c in cells)

    command = "python scripts/union_cold_start.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    table = "\n".join(f"| `{r['spec']}` | {r['benched']} of {r['generations']} | {r['mean_mat']:.2f} | "
                      f"{r['mean_tokens_per_s']:.1f} | {r['tokens_per_s_after_first']:.1f} | "
                      f"{' / '.join(map(str, r['arm_steps'])) if r['arm_steps'] is not None else '-'} |{against(r)}"
                      for r in rows)
    refs = "".join(f" method / `{ref}` (95% CI) |" for ref in args.alone)
    text = (f"`{command}`\n\n{args.unions} fresh unions per variant, {args.generations} generation{'s' if args.generations > 1 else ''} each "
            f"({args.max_new_tokens} new tokens, T={args.temperature:g}, seeds 0-{args.unions * args.generations - 1}, the first turn of MT-Bench's first "
            f"{args.category} question; {torch.get_num_threads()} threads; mean tokens/s include prefill, "
            f"tokens/s after the first step are pooled over the generations"
            + (", as are the ratios to each drafter alone (fresh per round, same seeds)" if args.alone else "")
            + f"):\n\n| method | generations under MAT {args.floor:g} | mean MAT | mean tokens/s | tokens/s after the first step | steps per arm "
            f"({' / '.join(names)}) |{refs}\n|---|---|---|---|---|---|{'---|' * len(args.alone)}\n{table}\n")
    print(text)
    write_result(args.out, {"command": command, "provenance": benchmark.provenance(), "arms": names, "rows": rows,
                            "runs": runs}, text)


if __name__ == "__main__":
    main()
