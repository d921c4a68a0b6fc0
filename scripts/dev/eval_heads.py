"""Held-out acceptance of EAGLE-3 heads on one training config's evaluation split, side by side.

    python scripts/eval_heads.py --config configs/eagle3/smollm2-continue.yaml \
        --out docs/results/r12_eagle3_heldout HEAD_DIR [HEAD_DIR ...]

Each head is loaded as that config's ``init_from``, in its own shape (draft vocabulary size and MLP
width from its ``drafter.json``; ``load_drafter`` refuses a foreign target), and evaluated by the
recipe's own ``evaluate`` (teacher-forced top-1 agreement with the target and T=1 acceptance per
unrolled step) on the config's held-out answers: its ``eval_dataset`` (a prompt
window no head trained on) or else its split of ``dataset`` (held out from a head only when that
data is newer than the head). Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from selfspec.checkpoint import atomic_write_text  # noqa: E402
from selfspec.training.jobs import load_any  # noqa: E402
from selfspec.training.recipes import Eagle3Recipe  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="an eagle3 train_heads config (its dataset and split)")
    ap.add_argument("--out", required=True, help="output path prefix (.json, .md)")
    ap.add_argument("heads", nargs="+", help="eagle3 drafter folders")
    args = ap.parse_args(argv)
    base = load_any(args.config)
    model, rows = None, {}
    for path in args.heads:
        shape = json.loads((Path(path) / "drafter.json").read_text())["config"]
        cfg = replace(base, init_from=path, export=None, init_grow=False,  # each head in its own shape
                      eagle3=replace(base.eagle3, draft_vocab_size=shape["draft_vocab_size"],
                                     intermediate_size=shape.get("intermediate_size")))
        cfg.run = replace(cfg.run, out_dir=tempfile.mkdtemp(prefix="eval_heads_"), wandb_mode="disabled")
        recipe = Eagle3Recipe(cfg, model=model)
        recipe.setup()
        model = recipe.model
        m = recipe.evaluate()
        rows[path] = dict(top1=m["eval/top1_per_step"], accept_t1=m["eval/accept_t1_per_step"],
                          expected_mat_chain=m["eval/expected_mat_chain"], eval_examples=len(recipe.eval_set),
                          vocab_coverage=recipe.vocab_coverage, lineage=recipe.lineage)
        print(path, json.dumps(rows[path]["top1"]), f"{rows[path]['expected_mat_chain']:.3f}", flush=True)
    command = "python scripts/eval_heads.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    atomic_write_text(args.out + ".json", json.dumps(dict(command=command, config=args.config,
                                                          dataset=base.dataset, eval_dataset=base.eval_dataset, heads=rows), indent=1))
    k = len(next(iter(rows.values()))["top1"])
    held = (f"Held-out answers of `{base.eval_dataset}` (a prompt window no head trained on; "
            if base.eval_dataset else "Held-out split of " + " + ".join(
                f"`{d}`" for d in (base.dataset if isinstance(base.dataset, list) else [base.dataset])) + " (")
    lines = [f"`{command}`", "", f"{held}{next(iter(rows.values()))['eval_examples']} "
             "answers), teacher-forced, per unrolled step j (drafting depth j + 1):", "",
             "| head | " + " | ".join(f"top-1 step {j}" for j in range(k)) + " | "
             + " | ".join(f"T=1 accept step {j}" for j in range(k)) + " | expected MAT (greedy chain) | vocabulary coverage |",
             "|---" * (2 * k + 3) + "|"]
    for path, r in rows.items():
        lines.append(f"| `{path}` | " + " | ".join(f"{v:.3f}" for v in r["top1"]) + " | "
                     + " | ".join(f"{v:.3f}" for v in r["accept_t1"]) + f" | {r['expected_mat_chain']:.3f} | "
                     f"{r['vocab_coverage']:.3f} |")
    atomic_write_text(args.out + ".md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
