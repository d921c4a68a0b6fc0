"""Self-distillation data: the target answers prompts (the shipped sets, or your conversations); drafters learn from it.

    selfspec distill --config configs/distill/smollm2-tasks.yaml [key=value ...]
    selfspec distill --config configs/distill/smollm2-tasks.yaml --model Qwen/Qwen2.5-0.5B-Instruct out=runs/distill/qwen

Resumable: rerun the same command after an interruption and finished shards are kept. Several
processes (each answers its share of the shards; the main one merges them):
accelerate launch --multi_gpu --num_processes N -m selfspec.cli distill --config ...
The whole path (distil, train, calibrate, benchmark, card) is one command: selfspec train --model M --drafter eagle3.
"""

from __future__ import annotations

import argparse

from selfspec.commands.common import add_model_args, fail, load_model
from selfspec.training.config import load_config
from selfspec.training.distill import DistillJob, distill


def parser() -> argparse.ArgumentParser:
    """The command line of this command (the README test parses its examples with it)."""
    ap = argparse.ArgumentParser(prog="selfspec distill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    add_model_args(ap, default_model=None, dtype_default=None,
                   model_help="the target (alias, folder, .gguf file or hub id): same as target=...")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. distill.batch_size=8 out=runs/distill/mine")
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    with fail("distill", args):
        if args.model:
            args.overrides.append(f"target={args.model}")
        if args.dtype:
            args.overrides.append(f"dtype={args.dtype}")
        job = load_config(DistillJob, args.config, args.overrides)
        args.model, args.dtype = job.target, job.dtype
        model, tokenizer = load_model(args)
        path = distill(model, tokenizer, job.distill, job.out, target_name=job.target)
        print(f"dataset written to {path}")


if __name__ == "__main__":
    main()
