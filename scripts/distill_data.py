"""Self-distillation data: the target answers prompts from ../shared/data; drafters learn from it.

    python scripts/distill_data.py --config configs/distill_smollm2.yaml [--out DIR] [key=value ...]

Resumable: rerun the same command after an interruption and finished shards are kept.
"""

from __future__ import annotations

import argparse
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import selfspec  # noqa: E402
from selfspec.training.config import load_config  # noqa: E402
from selfspec.training.distill import DistillJob, distill  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. distill.batch_size=8")
    args = ap.parse_args(argv)
    job = load_config(DistillJob, args.config, args.overrides)
    import torch

    model, tokenizer = selfspec.load_target(job.target, dtype=getattr(torch, job.dtype))
    path = distill(model, tokenizer, job.distill, job.out, target_name=job.target)
    print(f"dataset written to {path}")


if __name__ == "__main__":
    main()
