"""Training-free layer-skip drafter: pick the exit layer and chain depth on this machine.

    python scripts/pick_exit_layer.py [--target smollm2-135m-instruct] [--prompts 8] [--out FOLDER]

Calibration prompts come from GSM8K (train split) and HumanEval (the shipped sets), never from the
benchmark sets. The target writes its greedy continuation of each; the acceptance of the plain
early exit after every layer is measured in one pass, the cost of a drafting level and of a verify
pass is timed here, and the best (exit layer, depth) under the independence model are then run for
real against plain decoding. The winner is saved as a weight-free layer-skip checkpoint (``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.chat import encode_chat  # noqa: E402
from selfspec.drafters import build_drafter, save_drafter  # noqa: E402
from selfspec.measurement.costs import verify_costs  # noqa: E402
from selfspec.measurement.exit_search import exit_acceptance, level_costs, rank_exits  # noqa: E402
from selfspec.measurement.measure import compare, pooled_speedup  # noqa: E402
from selfspec.measurement.workloads import calibration_prompts  # noqa: E402



def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--target", dest="target", default=selfspec.DEFAULT_TARGET,
                    help="the target: alias, local folder, .gguf file or hub id")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--max-depth", type=int, default=6)
    ap.add_argument("--try", dest="tries", type=int, default=3, help="candidates timed for real")
    ap.add_argument("--out", default=None, help="checkpoint folder for the chosen training-free drafter")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = selfspec.load_target(args.target, dtype="float32")  # (as measured and stored before dtype="auto")
    prompts = [encode_chat(tok, [{"role": "user", "content": p}]) for p in calibration_prompts(args.prompts)]
    seqs = []
    for ids in prompts:
        out = selfspec.generate(model, ids, max_new_tokens=args.new_tokens)
        seqs.append((out.sequences[0], ids.shape[-1] - 1))
    alpha = exit_acceptance(model, seqs)
    exits = list(range(1, len(alpha) + 1))
    level = level_costs(model, exits)
    verify = verify_costs(model, list(range(1, args.max_depth + 2)))
    ranked = rank_exits(alpha, level, verify, args.max_depth)
    print("exit  acceptance  level_ms")
    for e in exits:
        print(f"{e:4d}  {alpha[e - 1]:10.3f}  {level[e] * 1e3:8.1f}")
    print(f"verify ms per n tokens: { {n: round(v * 1e3, 1) for n, v in verify.items()} }")
    measured = []
    for cand in ranked[: args.tries]:
        drafter = build_drafter(model, "layerskip", exit_layer=cand.exit_layer, adapter="none",
                                max_depth=cand.depth, width=1, branch=1, max_nodes=cand.depth, min_score=0.0)
        speed = pooled_speedup([compare(model, ids, drafter, max_new_tokens=64, control=False) for ids in prompts[:3]])
        measured.append((speed, cand))
        print(f"E={cand.exit_layer} D={cand.depth}: acceptance {cand.acceptance:.3f}, expected MAT "
              f"{cand.expected_mat:.2f}, expected speedup {cand.expected_speedup:.2f}x, measured {speed:.2f}x")
    speed, best = max(measured, key=lambda m: m[0])
    verdict = "beats" if speed > 1 else "does NOT beat"
    print(f"chosen: exit_layer={best.exit_layer} max_depth={best.depth} ({speed:.2f}x: {verdict} plain decoding)")
    if args.out:
        drafter = build_drafter(model, "layerskip", exit_layer=best.exit_layer, adapter="none", max_depth=best.depth,
                                width=1, branch=1, max_nodes=best.depth, min_score=0.0)
        save_drafter(drafter, args.out, tokenizer=tok, extra={
            "training_free": True, "acceptance_per_exit": alpha, "level_cost_s": level, "verify_cost_s": verify,
            "measured_speedup": speed})
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
