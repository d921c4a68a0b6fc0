"""Regenerate the result tables embedded in Markdown docs from the benchmark result files.

    python scripts/render_docs.py [README.md docs/results.md ...]   (default: both)
    python scripts/render_docs.py --check                              (exit 1 if a table is stale)

A block between ``<!-- BEGIN docs/results/NAME.md -->`` and ``<!-- END -->`` is replaced by the
content of ``docs/results/NAME.md``, which ``scripts/benchmark.py`` writes from ``NAME.json``
(command + table); so a number in the docs always has its result file and command behind it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(<!-- BEGIN (\S+) -->\n)(.*?)(<!-- END -->)", re.S)


def render(text: str) -> str:
    def fill(m: re.Match) -> str:
        source = ROOT / m.group(2)
        if not source.exists():
            raise FileNotFoundError(f"{m.group(2)} (named in a docs block) does not exist")
        return m.group(1) + source.read_text(encoding="utf-8").rstrip("\n") + "\n" + m.group(4)
    return BLOCK.sub(fill, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", default=["README.md", "docs/results.md"])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    stale = []
    for name in args.files:
        path = ROOT / name
        old = path.read_text(encoding="utf-8")
        new = render(old)
        if new != old:
            stale.append(name)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"stale result tables in {stale}: run python scripts/render_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
