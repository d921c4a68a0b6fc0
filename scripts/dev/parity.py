"""Parity of two code versions: each method's speedup over its own plain decoding, old against new.

    python scripts/dev/parity.py runs/old.json runs/new.json [more old new pairs ...] --out docs/results/NAME

Each result file is one ``selfspec bench`` run of one version (the same command in each checkout,
on the same machine). Per method present in every file, the statistic is
``speedup_new / speedup_old`` where each speedup is the method's output tokens/s over the
``baseline`` (plain decoding) tokens/s of the same file; several pairs are pooled (their
conversations together). The 95% interval resamples whole conversations (every turn of a
question, in both versions together). Writes ``<out>.md`` (command and table) and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from selfspec.checkpoint import atomic_write_text  # noqa: E402
from selfspec.measurement.benchmark import _rate, bootstrap_ci, from_rows  # noqa: E402


def _conversations(records) -> dict:
    out: dict = {}
    for r in records:
        out.setdefault(r.question_id, []).append(r)
    return out


def compare(pairs: list[tuple[list, list]], method: str) -> dict:
    """``{ratio, ci, speedup_old, speedup_new, mat_old, mat_new, conversations}``."""
    units = []  # (old records of one conversation, new records of it)
    for old, new in pairs:
        co, cn = _conversations(old), _conversations(new)
        units += [(co[q], cn[q]) for q in co if q in cn]

    def speedup(records) -> float | None:
        m = _rate([r for r in records if r.method == method])
        b = _rate([r for r in records if r.method == "baseline"])
        return m / b if m > 0 and b > 0 else None

    def mat(records) -> float:
        picked = [r for r in records if r.method == method]
        return sum(r.new_tokens for r in picked) / max(1, sum(r.steps for r in picked))

    def ratio(picked: list[int]) -> float | None:
        so = speedup([r for i in picked for r in units[i][0]])
        sn = speedup([r for i in picked for r in units[i][1]])
        return sn / so if so and sn else None

    every = list(range(len(units)))
    old_all = [r for i in every for r in units[i][0]]
    new_all = [r for i in every for r in units[i][1]]
    return dict(method=method, ratio=ratio(every), ci=bootstrap_ci(len(units), ratio), conversations=len(units),
                speedup_old=speedup(old_all), speedup_new=speedup(new_all), mat_old=mat(old_all), mat_new=mat(new_all))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="old new [old new ...] result files")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if len(args.files) % 2:
        raise SystemExit("give result files in old/new pairs")
    loaded = [from_rows(json.load(open(f, encoding="utf-8"))["records"]) for f in args.files]
    pairs = list(zip(loaded[0::2], loaded[1::2]))
    methods = [m for m in dict.fromkeys(r.method for r in loaded[0]) if m != "baseline"
               and all(any(r.method == m for r in records) for records in loaded)]
    rows = [compare(pairs, m) for m in methods]
    command = "python scripts/dev/parity.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    lines = [f"`{command}`", "", "| method | speedup old | speedup new | new / old | 95% CI | MAT old | MAT new | "
             "conversations |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = "-" if r["ci"] is None else "{:.2f}-{:.2f}".format(*r["ci"])
        lines.append(f"| {r['method']} | {r['speedup_old']:.2f}x | {r['speedup_new']:.2f}x | {r['ratio']:.3f} | {ci} | "
                     f"{r['mat_old']:.2f} | {r['mat_new']:.2f} | {r['conversations']} |")
    text = "\n".join(lines) + "\n"
    atomic_write_text(args.out + ".md", text)
    atomic_write_text(args.out + ".json", json.dumps(dict(command=command, files=args.files, rows=rows), indent=1))
    print(text)


if __name__ == "__main__":
    main()
