"""Export a trained drafter checkpoint in the layout a serving engine loads.

    selfspec export selfspec/checkpoints/smollm2-135m-instruct-eagle3 --format eagle3 --out runs/export/eagle3
    selfspec export selfspec/checkpoints/smollm2-135m-instruct-medusa --format medusa --out runs/export/medusa

Then serve (GPU machines with vLLM / SGLang; the commands are in the README):
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "runs/export/eagle3", "num_speculative_tokens": 5}'
    python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path runs/export/eagle3
"""

from __future__ import annotations

import argparse

import torch

import selfspec
from selfspec.checkpoint import read_checkpoint
from selfspec.commands.common import add_model_args, fail, load_model
from selfspec.export import FORMATS, export_drafter
from selfspec.measurement.calibration import recorded_target


def parser() -> argparse.ArgumentParser:
    """The command line of this command (the README test parses its examples with it)."""
    ap = argparse.ArgumentParser(prog="selfspec export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a selfspec drafter checkpoint folder")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--out", required=True)
    add_model_args(ap, default_model=None,
                   model_help="target alias, path or hub id (default: the one recorded in training)")
    ap.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="dtype of the written weights")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder (never a checkpoint)")
    return ap


def skeleton_drafter(checkpoint: str, target: str, meta: dict, weights: dict):
    """The EAGLE-3 drafter of ``checkpoint`` on a target built from its ``config.json`` alone (meta
    tensors, no weights read): the serving layouts need none of the target's tensors. The
    checkpoint's target is checked by shape (architecture, sizes, vocabulary); its weight fingerprint
    needs the weights, so it is not checked here."""
    from dataclasses import asdict

    from transformers import AutoModelForCausalLM

    from selfspec.checkpoint import CheckpointError, TargetIdentity, adapter_state
    from selfspec.drafters.eagle3 import Eagle3Config, build_eagle3
    from selfspec.training.dry_run import target_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target_config(target))
    try:
        TargetIdentity(**meta["target"]).signature.check(model, what=f"checkpoint {checkpoint!r}")
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(str(err)) from None
    drafter = build_eagle3(model, **asdict(Eagle3Config(**meta["config"])))
    head = drafter.head.to_empty(device="cpu")
    head.load_state_dict(adapter_state(weights, "eagle3.", head.state_dict()))
    return drafter


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    with fail("export", args):
        meta, weights = read_checkpoint(args.checkpoint)
        args.model = args.model or recorded_target(meta) or selfspec.DEFAULT_TARGET
        if meta.get("kind") == "eagle3" and args.format in ("eagle3", "speculators"):
            drafter = skeleton_drafter(args.checkpoint, args.model, meta, weights)
        else:  # Medusa's layout repeats the target's LM head: the target is loaded
            model, _ = load_model(args)
            drafter = selfspec.load_drafter(args.checkpoint, model)
        out = export_drafter(drafter, args.out, args.format, dtype=getattr(torch, args.export_dtype),
                             target_path=args.model, overwrite=args.overwrite)
        print(f"wrote {args.format} layout to {out}")


if __name__ == "__main__":
    main()
