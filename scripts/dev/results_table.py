"""One table of speedups over plain decoding, a column per benchmark result file.

    python scripts/dev/results_table.py docs/results/A.json docs/results/B.json ... --out docs/results/current.md

Each cell is a method's overall speedup against plain decoding in the same file (same process,
same prompts) with its 95% interval (a bootstrap over whole conversations) and its mean accepted
length. The file starts with the command that wrote it; README.md embeds it
(``scripts/render_docs.py``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def table(paths: list[str], names: list[str] | None = None) -> str:
    """The Markdown table of the files at ``paths`` (column titles ``names``, else the files' titles)."""
    files = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    names = names or [f.get("args", {}).get("title") or Path(p).stem for f, p in zip(files, paths)]
    methods: list[str] = []
    for f in files:
        methods += [m for m in f["summary"]["overall"] if m != "baseline" and m not in methods]
    lines = ["| method | " + " | ".join(names) + " |", "|---|" + "---|" * len(files)]
    for m in methods:
        cells = []
        for f in files:
            row = f["summary"]["overall"].get(m)
            if row is None:
                cells.append("-")
                continue
            ci = row.get("speedup_ci")
            ci = f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else ""
            cells.append(f"{row['speedup']:.2f}x{ci}, MAT {row['mean_accepted_length']:.2f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--names", nargs="+", default=None, help="column titles, one per file")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.names and len(args.names) != len(args.files):
        ap.error("--names needs one title per file")
    command = "python scripts/dev/results_table.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    Path(args.out).write_text(f"`{command}`\n\n" + table(args.files, args.names), encoding="utf-8")


if __name__ == "__main__":
    main()
