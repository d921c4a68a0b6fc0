"""Benchmark selfspec drafters against plain decoding on Spec-Bench-format or BFCL prompt files.

    python scripts/benchmark.py --questions ../shared/data/mt_bench_question.jsonl --limit 10 \
        --methods ngram --out runs/bench

Writes <out>.json (per-run records and the summary) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import selfspec  # noqa: E402
from selfspec import benchmark  # noqa: E402
from selfspec.drafters import drafter_from_spec  # noqa: E402
from selfspec.workloads import load_questions, take_per_category  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", action="append", required=True, help="question file (repeatable)")
    ap.add_argument("--model", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--methods", nargs="+", default=["ngram"], help="drafter specs: ngram, ngram:max_nodes=8, medusa (shipped checkpoint), a checkpoint folder")
    ap.add_argument("--limit", type=int, default=None, help="questions per file")
    ap.add_argument("--per-category", type=int, default=None, help="first N questions of each category")
    ap.add_argument("--first-turn-only", action="store_true")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default=None, help="output path prefix (writes .json and .md)")
    ap.add_argument("--resummarise", action="store_true",
                    help="recompute <out>.json's summary and <out>.md from its stored records, run nothing")
    args = ap.parse_args(argv)
    if args.resummarise:
        with open(args.out + ".json") as f:
            stored = json.load(f)
        records = benchmark.from_rows(stored["records"])
        write(args.out, stored["args"], records, stored.get("command", ""))
        return

    model, tokenizer = selfspec.load_target(args.model)
    questions = []
    for path in args.questions:
        qs = load_questions(path)
        if args.per_category:
            qs = take_per_category(qs, args.per_category)
        qs = qs[: args.limit]
        if args.first_turn_only:
            qs = [q.__class__(q.question_id, q.category, q.turns[:1], q.system) for q in qs]
        questions += qs
    methods = {spec: drafter_from_spec(model, spec, args.model) for spec in args.methods}
    records = benchmark.run(model, tokenizer, questions, methods, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature)
    command = "python scripts/benchmark.py " + " ".join(argv or sys.argv[1:])
    if args.out:
        write(args.out, vars(args), records, command)
    else:
        print(benchmark.markdown_table(benchmark.summarise(records)))


def write(out: str, args: dict, records, command: str) -> None:
    """Write <out>.json (args, command, summary, records) and <out>.md (command + table)."""
    summary = benchmark.summarise(records)
    table = benchmark.markdown_table(summary)
    print(table)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"args": args, "command": command, "summary": summary, "records": benchmark.as_rows(records)}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(f"`{command}`\n\n{table}\n")


if __name__ == "__main__":
    main()
