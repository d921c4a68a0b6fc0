"""Re-pick a drafter checkpoint's static tree for another node budget from its recorded
held-out head accuracies (no data, no model needed).

    python scripts/set_tree.py checkpoints/smollm2-135m-instruct-medusa --budget 7
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from selfspec.checkpoint import CONFIG_FILE, atomic_write_text, read_checkpoint  # noqa: E402
from selfspec.tree_search import best_tree, expected_accepted_length  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--budget", type=int, required=True, help="draft nodes (root excluded)")
    args = ap.parse_args(argv)
    meta, _ = read_checkpoint(args.checkpoint)
    acc = meta.get("extra", {}).get("eval", {}).get("eval/rank_accuracy")
    if acc is None:
        raise SystemExit(f"{args.checkpoint} records no held-out accuracies (eval/rank_accuracy)")
    tree = best_tree(acc, args.budget, max_depth=meta["config"]["num_heads"])
    meta["config"]["tree"] = tree.to_list()
    meta["extra"]["tree_budget"] = args.budget
    meta["extra"]["expected_mat"] = expected_accepted_length(tree.paths, acc)
    atomic_write_text(Path(args.checkpoint) / CONFIG_FILE, json.dumps(meta, indent=1))
    print(f"tree ({args.budget} nodes, expected MAT {meta['extra']['expected_mat']:.2f}): {tree.to_list()}")


if __name__ == "__main__":
    main()
