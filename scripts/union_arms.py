"""Which arms a union runs, prompt after prompt, against its member alone (a diagnostic, not a
benchmark: one run per prompt, no repeats, no interval).

    python scripts/union_arms.py --categories writing roleplay math stem --temperatures 0.7 0 \\
        --out docs/results/r25_union_arms

For each temperature, one union (``--union``, default ``eagle3+ngram``) and one member
(``--member``, default ``eagle3``) are built and kept across the prompts, as the benchmark keeps
its drafters (the union's measured speeds and probe schedule carry from prompt to prompt), and
both generate ``--max-new-tokens`` tokens from the first turn of the first MT-Bench question of
each category, in the order given, with the same seed. ``--fresh`` builds a new union per prompt
instead. Reported per prompt: the steps the union ran per arm (plain, each member alone, the
merge), its mean accepted length and tokens/s, the member's, and its merged trees: mean draft
nodes, of them sampled (at T > 0, the sampling anchor's), and the merged steps with point-mass
grafts from other members. ``--force-merge`` runs the merge in every step (to see what merged
trees hold where the union would not choose them; the union's speed is then not its own).
Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.chat import encode_chat  # noqa: E402
from selfspec.drafters import drafter_from_spec  # noqa: E402
from selfspec.measurement import benchmark  # noqa: E402
from selfspec.measurement.measure import write_result  # noqa: E402
from selfspec.measurement.workloads import first_per_category  # noqa: E402
from selfspec.tree import Law  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--questions", default=str(SHARED / "mt_bench_question.jsonl"))
    ap.add_argument("--categories", nargs="+", required=True)
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.7])
    ap.add_argument("--union", default="eagle3+ngram")
    ap.add_argument("--member", default="eagle3")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fresh", action="store_true", help="a new union for every prompt")
    ap.add_argument("--force-merge", action="store_true", help="run the union's merge in every step")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = selfspec.load_target(args.target, dtype=args.dtype)
    try:
        questions = first_per_category(args.questions, args.categories)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    rows = []
    for temp in args.temperatures:
        union = member = None
        for cat in args.categories:
            if union is None or args.fresh:
                union = drafter_from_spec(model, args.union, args.target, tok)
                merged = _watch_merges(union, args.force_merge)
            if member is None:
                member = drafter_from_spec(model, args.member, args.target, tok)
            ids = encode_chat(tok, questions[cat].turns[0])
            before = list(union.arm_steps)
            merged.clear()
            u = selfspec.generate(model, ids, drafter=union, max_new_tokens=args.max_new_tokens,
                                  temperature=temp, seed=args.seed).stats
            m = selfspec.generate(model, ids, drafter=member, max_new_tokens=args.max_new_tokens,
                                  temperature=temp, seed=args.seed).stats
            rows.append({"temperature": temp, "category": cat,
                         "union_arm_steps": [a - b for a, b in zip(union.arm_steps, before)],
                         "union_mat": u.new_tokens / u.steps, "union_tokens_per_s": u.new_tokens / u.wall_time_s,
                         "member_mat": m.new_tokens / m.steps, "member_tokens_per_s": m.new_tokens / m.wall_time_s,
                         "member_plain_steps": m.plain_steps,
                         "merged_steps": len(merged),
                         "merged_mean_nodes": sum(n for n, _, _ in merged) / max(1, len(merged)),
                         "merged_mean_sampled": sum(k for _, k, _ in merged) / max(1, len(merged)),
                         "merged_steps_with_grafts": sum(g for _, _, g in merged)})
            print(rows[-1], flush=True)
    names = ["plain"] + args.union.split("+") + ["merge"]
    command = "python scripts/union_arms.py " + " ".join(argv or sys.argv[1:])
    table = "\n".join(
        f"| {r['temperature']:g} | {r['category']} | {' / '.join(map(str, r['union_arm_steps']))} | "
        f"{r['union_mat']:.2f} | {r['union_tokens_per_s']:.1f} | {r['member_mat']:.2f} | "
        f"{r['member_tokens_per_s']:.1f} | {r['merged_mean_nodes']:.2f} ({r['merged_mean_sampled']:.2f}) | "
        f"{r['merged_steps_with_grafts']} of {r['merged_steps']} |" for r in rows)
    text = (f"`{command}`\n\nOne run per prompt ({args.max_new_tokens} new tokens, seed {args.seed}, "
            f"{'a new union per prompt' if args.fresh else 'one union kept across the prompts, in this order'}; "
            f"{'the merge forced in every step, steps per arm are what the union would have chosen; ' if args.force_merge else ''}"
            f"{torch.get_num_threads()} threads; tokens/s include prefill):\n\n"
            f"| T | category | `{args.union}` steps per arm ({' / '.join(names)}) | union MAT | union tokens/s | "
            f"`{args.member}` MAT | `{args.member}` tokens/s | merged tree: draft nodes (sampled) | "
            f"merged steps with grafts |\n|---|---|---|---|---|---|---|---|---|\n{table}\n")
    print(text)
    write_result(args.out, {"command": command, "provenance": benchmark.provenance(), "arms": names,
                            "rows": rows}, text)


def _watch_merges(union, force: bool) -> list[tuple[int, int, bool]]:
    """Record (draft nodes, sampled nodes, has grafts) of each merged tree ``union`` proposes;
    with ``force``, every step runs the merge (the union still does its bookkeeping first)."""
    merged: list[tuple[int, int, bool]] = []
    propose, choose, merge = union.propose, union._choose_arm, len(union.arms) - 1

    def spy(ctx):
        tree = propose(ctx)
        if union._arm == merge and len(union._asked) > 1:
            grafts = any(src and all(m != union.anchor for m, _, _ in src) for src in union._sources[1:tree.num_nodes])
            merged.append((tree.num_nodes - 1, int((tree.laws[1:] != Law.POINT).sum()),
                           union.anchor is not None and grafts and bool((tree.laws[1:] != Law.POINT).any())))
        return tree

    union.propose = spy
    if force:
        union._choose_arm = lambda ctx: (choose(ctx), merge)[1]
    return merged


if __name__ == "__main__":
    main()
