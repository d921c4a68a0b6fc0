"""Self-distillation data: the target answers prompts from ../shared/data; drafters learn from it.

    selfspec distill --config configs/distill/smollm2-tasks.yaml [--out DIR] [key=value ...]

Resumable: rerun the same command after an interruption and finished shards are kept.
"""

from __future__ import annotations

import argparse

import selfspec
from selfspec.training.config import load_config
from selfspec.training.distill import DistillJob, distill


def parser() -> argparse.ArgumentParser:
    """The command line of this command (the README test parses its examples with it)."""
    ap = argparse.ArgumentParser(prog="selfspec distill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--model", default=None, help="the target (alias, folder, .gguf file or hub id): same as target=...")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. distill.batch_size=8")
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.model:
        args.overrides.append(f"target={args.model}")
    job = load_config(DistillJob, args.config, args.overrides)
    import torch

    model, tokenizer = selfspec.load_target(job.target, dtype=getattr(torch, job.dtype))
    path = distill(model, tokenizer, job.distill, job.out, target_name=job.target)
    print(f"dataset written to {path}")


if __name__ == "__main__":
    main()
