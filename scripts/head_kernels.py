"""What a draft step costs with a drafter head's linear layers as loaded, prepacked, in float32 or
int8 weight-only, side by side in one process.

    python scripts/head_kernels.py checkpoints/smollm2-135m-instruct-eagle3 --out docs/results/r15_head_kernels
    python scripts/head_kernels.py checkpoints/smollm2-135m-instruct-eagle3 --dtype float32 --out docs/results/r25_head_kernels_f32

``--dtype bfloat16`` (default) loads the target once (bfloat16, prepacked weights,
:mod:`selfspec.prepack`) and the checkpoint four times: head linears as loaded (bf16
``nn.Linear``), prepacked bf16 (``selfspec.prepack.prepack_linears``), the head cast to float32,
and ``head_weights="int8"`` (:mod:`selfspec.int8_linear`). ``--dtype float32`` loads a float32
target (as ``load_target`` does by default there) and compares the float32 head with
``head_weights="int8"``. The tree is the checkpoint's for that dtype in every setup. Each drafts
every step (``adaptive=False``) on held-out chat prompts (never the head's training prompts nor a
benchmark prompt), interleaved with plain decoding per prompt and round so load drifts hit all
alike. Reported per setup: the median draft seconds per speculative step
(``SpecStats.draft_time_s``, catch-up included), the mean accepted length, and the speedup over
the plain runs of the same prompts (total time ratio). Writes <out>.json (command, provenance,
seconds) and <out>.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.chat import encode_chat  # noqa: E402
from selfspec.checkpoint import read_checkpoint  # noqa: E402
from selfspec.drafters import load_drafter  # noqa: E402
from selfspec.measurement import benchmark  # noqa: E402
from selfspec.measurement.measure import write_result  # noqa: E402
from selfspec.prepack import prepack_linears  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--target", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="target dtype")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    prov = benchmark.provenance()
    from calibrate import heldout_prompts

    if args.dtype == "bfloat16":
        model, tok = selfspec.load_target(args.target, dtype="bfloat16", prepack=True)
        names = ("bf16 unpacked", "bf16 prepacked", "float32", "int8")
    else:
        model, tok = selfspec.load_target(args.target, dtype="float32")
        names = ("float32", "int8")
    setups = {name: load_drafter(args.checkpoint, model).with_options(head_weights="native") for name in names}
    if "bf16 prepacked" in setups:
        prepack_linears(setups["bf16 prepacked"].head)
    setups["float32"].head.float()
    setups["int8"] = setups["int8"].with_options(head_weights="int8")
    meta, _ = read_checkpoint(args.checkpoint)
    texts = heldout_prompts(meta, args.prompts)
    prompts = [encode_chat(tok, t) for t in texts]
    per_step = {name: [] for name in setups}
    seconds = {name: 0.0 for name in ("plain", *setups)}
    tokens, steps = {name: 0 for name in setups}, {name: 0 for name in setups}
    for ids in prompts:  # one untimed warm-up call per setup (first-call kernel set-up)
        for drafter in (None, *setups.values()):
            selfspec.generate(model, ids, drafter=drafter, max_new_tokens=8, adaptive=False)
        break
    for _ in range(args.rounds):
        for ids in prompts:
            plain = selfspec.generate(model, ids, max_new_tokens=args.new_tokens).stats
            seconds["plain"] += plain.wall_time_s / plain.new_tokens
            for name, drafter in setups.items():
                s = selfspec.generate(model, ids, drafter=drafter, max_new_tokens=args.new_tokens, adaptive=False).stats
                per_step[name].append(s.draft_time_s / max(1, s.steps - s.plain_steps))
                seconds[name] += s.wall_time_s / s.new_tokens
                tokens[name] += s.new_tokens
                steps[name] += s.steps
    ms = {name: 1000 * statistics.median(v) for name, v in per_step.items()}
    speedup = {name: seconds["plain"] / seconds[name] for name in setups}
    mat = {name: tokens[name] / steps[name] for name in setups}
    command = "python scripts/head_kernels.py " + " ".join(argv or sys.argv[1:])
    tree = setups["int8"].config_dict()
    rows = "\n".join(f"| {name} | {v:.1f} | {mat[name]:.2f} | {speedup[name]:.2f}x |" for name, v in ms.items())
    text = (f"`{command}`\n\nDraft milliseconds per speculative step (median over {args.rounds} x {args.prompts} "
            f"generations of {args.new_tokens} tokens on held-out chat prompts, tree {tree.get('max_depth')}/"
            f"{tree.get('width')}/{tree.get('max_nodes')}), mean accepted length, and speedup over plain decoding "
            f"of the same prompts (per-token time, summed over prompts), "
            f"{'bf16 prepacked' if args.dtype == 'bfloat16' else 'float32'} target, "
            f"{torch.get_num_threads()} threads:\n\n| head linears | draft ms / step | MAT | speedup |\n"
            f"|---|---|---|---|\n{rows}\n")
    print(text)
    write_result(args.out, {"command": command, "provenance": prov, "threads": torch.get_num_threads(),
                            "dtype": args.dtype, "tree": tree,
                            "draft_ms_per_step": ms, "mean_accepted_length": mat, "speedup": speedup,
                            "prompts": texts}, text)


if __name__ == "__main__":
    main()
