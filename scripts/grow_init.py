"""How to start the new rows of a grown draft vocabulary (``init_grow``), measured before training.

    python scripts/grow_init.py --config configs/eagle3_smollm2_r29_v16k.yaml --out docs/results/r29_grow_init

Builds the grown head of the config exactly as training would (``Eagle3Recipe.setup``: old rows
kept, new rows at the mean of the old ones), then evaluates it on the config's held-out answers
(``--examples`` of them) with the new rows set in turn to: the mean of the old rows (what
``Eagle3Recipe._grow`` does), zeros, the target's own LM-head rows (where a new head starts) and
those rows scaled to the old rows' mean norm. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.checkpoint import atomic_write_text  # noqa: E402
from training.config import load_any  # noqa: E402
from training.recipes import Eagle3Recipe  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="an eagle3 config with init_from and init_grow")
    ap.add_argument("--examples", type=int, default=24, help="held-out answers evaluated")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = load_any(args.config)
    if not (cfg.init_from and cfg.init_grow):
        raise SystemExit(f"{args.config} does not grow a head (init_from with init_grow: true)")
    cfg = replace(cfg, export=None, max_eval_examples=args.examples)
    cfg.run = replace(cfg.run, out_dir=tempfile.mkdtemp(prefix="grow_init_"), wandb_mode="disabled")
    recipe = Eagle3Recipe(cfg)
    recipe.setup()
    small = selfspec.load_drafter(cfg.init_from, recipe.model)
    weight = recipe.head.lm_head.weight.data  # [V_d, H], the grown head's, as training starts
    ids = recipe.head.draft_ids.cpu()
    new = torch.ones(len(ids), dtype=torch.bool)
    new[torch.searchsorted(ids, small.head.draft_ids.cpu())] = False
    old = weight[~new]
    target = recipe.model.get_output_embeddings().weight.detach().float().cpu()[ids[new]]
    starts = {"mean of the old rows (init_grow)": old.mean(0, keepdim=True).expand(int(new.sum()), -1),
              "zeros": torch.zeros_like(target),
              "the target's LM-head rows": target,
              "the target's rows at the old rows' mean norm": target * (old.norm(dim=1).mean() / target.norm(dim=1).mean())}
    rows = {}
    for name, init in starts.items():
        weight[new] = init
        m = recipe.evaluate()
        rows[name] = dict(loss=m["eval/loss"], top1=m["eval/top1_per_step"], expected_mat_chain=m["eval/expected_mat_chain"])
        print(name, json.dumps(rows[name]), flush=True)
    command = "python scripts/grow_init.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    atomic_write_text(args.out + ".json", json.dumps(dict(command=command, config=args.config, new_tokens=int(new.sum()),
                                                          eval_examples=len(recipe.eval_set), rows=rows), indent=1))
    k = len(next(iter(rows.values()))["top1"])
    lines = [f"`{command}`", "", f"The grown head of `{args.config}` before training ({int(new.sum())} new draft tokens), "
             f"on {len(recipe.eval_set)} held-out answers of `{cfg.eval_dataset}`, with the new LM-head rows started as:", "",
             "| new rows | held-out loss | " + " | ".join(f"top-1 step {j}" for j in range(k)) + " | expected MAT (greedy chain) |",
             "|---" * (k + 3) + "|"]
    lines += [f"| {name} | {r['loss']:.3f} | " + " | ".join(f"{v:.3f}" for v in r["top1"]) + f" | {r['expected_mat_chain']:.3f} |"
              for name, r in rows.items()]
    atomic_write_text(args.out + ".md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
