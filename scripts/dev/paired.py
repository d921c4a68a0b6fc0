"""Two methods of one benchmark result file compared on the turns both ran (paired), per category.

    python scripts/paired.py docs/results/r29_mtbench_greedy_bf16_amx.json eagle3 runs/eagle3-r22-shipped

Prints ``rate(A) / rate(B)`` (output tokens/s after the first step, as the tables' speedup) with
its 95% paired-bootstrap interval (``selfspec.measurement.benchmark.ratio_ci``), and each method's
MAT, overall and per category: e.g. a retrained head against the head it replaces, run side by
side in one process (a method may be any checkpoint folder); and on how many turns the two wrote
the same tokens in their kept runs (``same text``; ``-`` for results stored before output digests
were kept). Greedy in float32 every turn is the same text; in bf16 two
methods can part at a near-tie and then write different texts (one may fall into a repeated
sentence that any drafter guesses): a ratio over different texts measures the texts as much as
the methods.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from selfspec.checkpoint import atomic_write_text  # noqa: E402
from selfspec.measurement.benchmark import _fraction, _rate, _units, from_rows, ratio_ci, same_text  # noqa: E402


def compare(records, a: str, b: str) -> dict:
    """``{ratio, ci, mat_a, mat_b, units, same_text}`` of ``a`` against ``b`` over the units both
    ran (``same_text``: see :func:`selfspec.measurement.benchmark.same_text`)."""
    units = [u for u in _units(records).values() if a in u and b in u]
    if not units:
        raise SystemExit(f"no turn was run by both {a!r} and {b!r}")
    ra, rb = _rate([u[a] for u in units]), _rate([u[b] for u in units])

    def mat(m):
        return sum(u[m].new_tokens for u in units) / max(1, sum(u[m].steps for u in units))

    return dict(ratio=ra / rb if ra and rb else 0.0, ci=ratio_ci(records, a, b),
                mat_a=mat(a), mat_b=mat(b), units=len(units), same_text=same_text(records, a, b))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a benchmark result file (<out>.json)")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--out", help="also write the table, with this command above it, to OUT.md")
    args = ap.parse_args(argv)
    records = from_rows(json.loads(open(args.result, encoding="utf-8").read())["records"])
    cats = ["overall"] + sorted({r.category for r in records})
    lines = [f"| category | {args.a} / {args.b} | 95% CI | MAT {args.a} | MAT {args.b} | turns | same text |",
             "|---|---|---|---|---|---|---|"]
    for cat in cats:
        part = [r for r in records if cat == "overall" or r.category == cat]
        c = compare(part, args.a, args.b)
        ci = "-" if not c["ci"] else "{:.2f}-{:.2f}".format(*c["ci"])
        lines.append(f"| {cat} | {c['ratio']:.2f}x | {ci} | {c['mat_a']:.2f} | {c['mat_b']:.2f} | {c['units']} | "
                     f"{_fraction(c['same_text'])} |")
    print("\n".join(lines))
    if args.out:
        given = argv if argv is not None else sys.argv[1:]
        command = "python scripts/paired.py " + " ".join(shlex.quote(a) for a in given)
        atomic_write_text(args.out + ".md", f"`{command}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
