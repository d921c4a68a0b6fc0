"""Measure a drafter checkpoint's acceptance on held-out prompts and store it with the drafter.

    selfspec calibrate selfspec/checkpoints/smollm2-135m-instruct-eagle3 --prompts 4 --dry-run

Runs the drafter on every step over prompts it never trained on (:mod:`selfspec.measurement.calibration`),
greedy and at ``--temperature``, and stores the acceptance per depth and sibling rank in the
checkpoint's ``extra.acceptance``, the prior a fresh controller starts from. The target defaults to
the one the checkpoint's training run recorded. Run it from the repository root when the drafter's
dataset paths are relative to it.
"""

from __future__ import annotations

import argparse
import json

import torch

from selfspec.checkpoint import read_checkpoint
from selfspec.commands.common import add_model_args, fail, load_model
from selfspec.drafters import load_drafter
from selfspec.measurement.calibration import heldout_prompts, measure_acceptance, recorded_target, store_acceptance


def parser() -> argparse.ArgumentParser:
    """The command line of this command (the README test parses its examples with it)."""
    ap = argparse.ArgumentParser(prog="selfspec calibrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    add_model_args(ap, default_model=None, model_help="the target (default: the one the checkpoint was trained for)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts")
    ap.add_argument("--max-new-tokens", "--new-tokens", dest="max_new_tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled measurement")
    ap.add_argument("--depth", type=int, default=8, help="deepest level stored")
    ap.add_argument("--ranks", type=int, default=4, help="sibling ranks stored per level")
    ap.add_argument("--dry-run", action="store_true", help="print the measurement, leave the checkpoint as it is")
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    with fail("calibrate", args):
        if args.prompts < 1:
            raise ValueError(f"--prompts must be >= 1, got {args.prompts}")
        if args.temperature <= 0:
            raise ValueError(f"--temperature must be > 0, got {args.temperature}")
        meta, _ = read_checkpoint(args.checkpoint)
        args.model = args.model or recorded_target(meta)
        if not args.model:
            raise ValueError(f"--model: {args.checkpoint} records no target; name it")
        texts = heldout_prompts(meta, args.prompts, meta["kind"])
        model, tok = load_model(args)
        drafter = load_drafter(args.checkpoint, model)
        with torch.no_grad():
            record = measure_acceptance(model, tok, drafter, texts, new_tokens=args.max_new_tokens,
                                        temperature=args.temperature, depth=args.depth, ranks=args.ranks)
        for name in ("greedy", "sampled"):
            print(name, json.dumps(record[name]))
        if not args.dry_run:
            print(f"stored in {store_acceptance(args.checkpoint, record)}")


if __name__ == "__main__":
    main()
