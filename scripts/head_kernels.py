"""What a draft step costs with a drafter head's linear layers as loaded, prepacked, or in float32,
on a bf16 prepacked target, side by side in one process.

    python scripts/head_kernels.py checkpoints/smollm2-135m-instruct-eagle3 --out docs/results/r9_head_kernels

Loads the target once (bfloat16, prepacked weights, :mod:`selfspec.prepack`) and the checkpoint
three times: head linears as loaded (bf16 ``nn.Linear``), prepacked bf16
(``selfspec.prepack.prepack_linears``), and the head cast to float32. Each drafts every
step (``adaptive=False``) on held-out chat prompts, interleaved per round so load drifts hit all
three alike; the median draft seconds per speculative step (``SpecStats.draft_time_s``, catch-up
included) is kept. Writes <out>.json (command, provenance, seconds) and <out>.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.chat import encode_chat  # noqa: E402
from selfspec.drafters import load_drafter  # noqa: E402
from selfspec.measurement import benchmark  # noqa: E402
from selfspec.measurement.measure import write_result  # noqa: E402
from selfspec.measurement.workloads import heldout_chat_prompts  # noqa: E402
from selfspec.prepack import prepack_linears  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--target", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    prov = benchmark.provenance()
    model, tok = selfspec.load_target(args.target, dtype="bfloat16", prepack=True)
    setups = {name: load_drafter(args.checkpoint, model) for name in ("bf16 unpacked", "bf16 prepacked", "float32")}
    prepack_linears(setups["bf16 prepacked"].head)
    setups["float32"].head.float()
    prompts = [encode_chat(tok, t) for t in heldout_chat_prompts(SHARED, args.prompts)]
    per_step = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, drafter in setups.items():
            for ids in prompts:
                s = selfspec.generate(model, ids, drafter=drafter, max_new_tokens=args.new_tokens, adaptive=False).stats
                per_step[name].append(s.draft_time_s / max(1, s.steps - s.plain_steps))
    ms = {name: 1000 * statistics.median(v) for name, v in per_step.items()}
    command = "python scripts/head_kernels.py " + " ".join(argv or sys.argv[1:])
    tree = setups["bf16 prepacked"].config_dict()
    rows = "\n".join(f"| {name} | {v:.1f} |" for name, v in ms.items())
    text = (f"`{command}`\n\nDraft milliseconds per speculative step (median over {args.rounds} x {args.prompts} "
            f"generations, tree {tree.get('max_depth')}/{tree.get('width')}/{tree.get('max_nodes')}), bf16 prepacked "
            f"target, {torch.get_num_threads()} threads:\n\n| head linears | draft ms / step |\n|---|---|\n{rows}\n")
    print(text)
    write_result(args.out, {"command": command, "provenance": prov, "threads": torch.get_num_threads(),
                   "draft_ms_per_step": ms}, text)


if __name__ == "__main__":
    main()
