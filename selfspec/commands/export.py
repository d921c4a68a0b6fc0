"""Export a trained drafter checkpoint in the layout a serving engine loads.

    selfspec export checkpoints/smollm2-135m-instruct-eagle3 --format eagle3 --out exports/eagle3
    selfspec export checkpoints/smollm2-135m-instruct-medusa --format medusa --out exports/medusa

Then serve (GPU machines with vLLM / SGLang; the commands are in the README):
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "exports/eagle3", "num_speculative_tokens": 5}'
    python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path exports/eagle3
"""

from __future__ import annotations

import argparse
import json
import os


import torch

import selfspec
from selfspec.export import FORMATS, export_drafter


def parser() -> argparse.ArgumentParser:
    """The command line of this command (the README test parses its examples with it)."""
    ap = argparse.ArgumentParser(prog="selfspec export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a selfspec drafter checkpoint folder")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", "--target", dest="target", default=None,
                    help="target alias, path or hub id (default: the one recorded in training)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder (never a checkpoint)")
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    meta = json.loads(open(os.path.join(args.checkpoint, "drafter.json"), encoding="utf-8").read())
    target = args.target or meta.get("extra", {}).get("training", {}).get("target") or selfspec.DEFAULT_TARGET
    model, _ = selfspec.load_target(target, dtype="float32")  # (the export casts to --dtype)
    drafter = selfspec.load_drafter(args.checkpoint, model)
    out = export_drafter(drafter, args.out, args.format, dtype=getattr(torch, args.dtype), target_path=target,
                         overwrite=args.overwrite)
    print(f"wrote {args.format} layout to {out}")


if __name__ == "__main__":
    main()
