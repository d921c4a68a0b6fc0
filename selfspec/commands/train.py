"""Train a drafter (EAGLE-3 head, Medusa heads or a layer-skip exit adapter) on a frozen target
from self-distilled data.

    selfspec train --config configs/eagle3/smollm2.yaml [--resume] [optim.lr=3e-4 ...]
    selfspec train --config configs/medusa/smollm2.yaml
    selfspec train --config configs/layerskip/smollm2.yaml

On GPUs: accelerate launch [--num_processes N] scripts/train_heads.py --config configs/medusa/qwen2.5-7b.yaml
(CPU processes: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 ..., gloo; plain
`accelerate launch --cpu --num_processes 2` starts ONE process unless MPI is set up). The global batch
is the same for any N.
Plan first: --dry-run [--processes N] prints the memory and time estimate and the exact launch command.
Interrupted? Rerun the same command with --resume: training continues from the last checkpoint
(with any number of processes). Without --resume, a run folder holding a checkpoint is refused.
"""

from __future__ import annotations

import argparse


from selfspec.training import recipes
from selfspec.training.jobs import load_any


def parser() -> argparse.ArgumentParser:
    """The command line of this command (the README test parses its examples with it)."""
    ap = argparse.ArgumentParser(prog="selfspec train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="YAML config (configs/*.yaml)")
    ap.add_argument("--resume", action="store_true", help="continue from <run.out_dir>/checkpoint")
    ap.add_argument("--allow-config-change", action="store_true",
                    help="with --resume: accept a config other than the run's stored config.yaml")
    ap.add_argument("--dry-run", action="store_true", help="print the memory and time estimate and the launch "
                    "command, then exit (nothing is loaded or trained)")
    ap.add_argument("--processes", type=int, default=1, help="processes (GPUs) for --dry-run's estimate and command")
    ap.add_argument("--tflops", type=float, default=200.0, help="assumed sustained TFLOP/s per process (--dry-run)")
    ap.add_argument("--model", default=None, help="the target (alias, folder, .gguf file or hub id): same as target=...")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 run.wandb_mode=disabled")
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.model:
        args.overrides.append(f"target={args.model}")
    cfg = load_any(args.config, args.overrides, default_recipe="train_heads")
    if args.dry_run:
        from selfspec.training.dry_run import report

        print(report(args.config, cfg, args.overrides, args.processes, args.tflops), end="")
        return
    summary = recipes.run(cfg, resume=args.resume, allow_config_change=args.allow_config_change)
    m = summary["metrics"]
    if not m:  # not the main process: the main one reports
        return
    print(f"steps {summary['steps']}; held-out " + "; ".join(  # whatever the kind's evaluation measured
        f"{k.split('/', 1)[1]} {_fmt(v)}" for k, v in m.items() if k.startswith("eval/") and not k[-1].isdigit()))
    if summary.get("tree") is not None:
        print(f"tree: {summary['tree']}")


def _fmt(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
