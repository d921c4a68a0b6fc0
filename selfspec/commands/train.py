"""Train a drafter for a target: the whole path in one command, or one recipe from a config.

    selfspec train --model smollm2-135m-instruct --drafter eagle3 --smoke
    selfspec train --model smollm2-135m-instruct --drafter eagle3 --dry-run
    selfspec train --model Qwen/Qwen2.5-0.5B-Instruct --drafter eagle3 --data my_chats.jsonl --export vllm

With --drafter (eagle3, medusa or layerskip) it runs every stage into --out (default
runs/<model>-<drafter>): self-distillation, training, calibration, a held-out benchmark against plain
decoding and prompt lookup, the model card and recommended.json, and the --export layouts. Rerun the
same command after an interruption: finished stages are skipped, the others resume. --dry-run prints
the plan (each stage's estimated time and memory) and the launch line; several GPUs:

    accelerate launch --multi_gpu --num_processes 8 -m selfspec.cli train --model M --drafter eagle3

A config gives full control: the run folder's pipeline.yaml (rerun with --config), or one recipe
(configs/<kind>/<model>.yaml: selfspec train --config configs/eagle3/smollm2.yaml [--resume]
[optim.lr=3e-4 ...]). Dotted overrides apply to either (pipeline: train.optim.epochs=2,
distill.sources.chat=500, bench.temperatures=[0]).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from selfspec.commands.common import add_model_args, fail


def parser() -> argparse.ArgumentParser:
    """The command line of this command (the README test parses its examples with it)."""
    ap = argparse.ArgumentParser(prog="selfspec train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="a pipeline.yaml or a recipe config (configs/<kind>/*.yaml)")
    add_model_args(ap, default_model=None, model_help="the target: alias, local folder, .gguf file or hub id")
    ap.add_argument("--drafter", choices=["eagle3", "medusa", "layerskip"], default=None,
                    help="run the whole path for this drafter kind")
    ap.add_argument("--data", nargs="+", default=None,
                    help="your conversations: .jsonl / .json / .parquet files, datasets folders or Hub dataset ids "
                         "(default: the shipped prompt mix)")
    ap.add_argument("--out", default=None, help="run folder (default runs/<model>-<drafter>[-smoke])")
    ap.add_argument("--smoke", action="store_true", help="every stage on a handful of prompts and steps")
    ap.add_argument("--export", nargs="+", default=None, choices=["vllm", "sglang", "speculators"],
                    help="serving layouts to write into the run folder")
    ap.add_argument("--report-to", default=None, choices=["wandb", "tensorboard", "none"],
                    help="experiment tracking (wandb runs offline unless WANDB_MODE says otherwise)")
    ap.add_argument("--run-name", default=None, help="the tracked run's name")
    ap.add_argument("--tags", nargs="+", default=None, help="the tracked run's tags")
    ap.add_argument("--device-map", default=None, help="shard the target with from_pretrained's device_map (e.g. auto)")
    ap.add_argument("--license", default=None, help="the card's license (default: the target's own, where known)")
    ap.add_argument("--resume", action="store_true", help="recipe configs: continue from <run.out_dir>/checkpoint")
    ap.add_argument("--allow-config-change", action="store_true",
                    help="with --resume: accept a config other than the run's stored config.yaml")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (time, memory, launch line), run nothing")
    ap.add_argument("--processes", type=int, default=1, help="processes (GPUs) for --dry-run's estimate and command")
    ap.add_argument("--tflops", type=float, default=None,
                    help="assumed sustained TFLOP/s per process for --dry-run (default 200 on a GPU, 0.1 on a CPU)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 or train.optim.epochs=2")
    return ap


def _is_pipeline(path: str | None) -> bool:
    if path is None:
        return False
    if not Path(path).is_file():
        raise FileNotFoundError(f"--config: no file {path!r}")
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    return isinstance(data, dict) and data.get("recipe") == "pipeline"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    with fail("train", args):
        if args.processes < 1:
            raise ValueError(f"--processes must be >= 1, got {args.processes}")
        if args.drafter or _is_pipeline(args.config):
            return pipeline_main(args, argv)
        if args.config is None:
            raise ValueError("--drafter or --config is required (selfspec train --model M --drafter eagle3)")
        return recipe_main(args)


def pipeline_main(args, argv: list[str]) -> None:
    from selfspec.training import pipeline

    over = list(args.overrides)
    flags = {"model": args.model, "drafter": args.drafter, "out": args.out, "report_to": args.report_to,
             "run_name": args.run_name, "license": args.license, "load.device": args.device,
             "load.revision": args.revision, "load.attn_implementation": args.attn_implementation,
             "load.device_map": args.device_map}
    if args.dtype != "auto" or not args.config:
        flags["load.dtype"] = args.dtype
    over += [f"{k}={v}" for k, v in flags.items() if v is not None]
    for key, values in (("data", args.data), ("export", args.export), ("tags", args.tags)):
        if values:
            over.append(f"{key}=" + yaml.safe_dump(list(values), default_flow_style=True).strip())
    if args.smoke:
        over.append("smoke=true")
    if args.trust_remote_code:
        over.append("load.trust_remote_code=true")
    cfg = pipeline.prepare(pipeline.load_pipeline(args.config, over))
    if args.dry_run:
        print(pipeline.dry_run_text(cfg, argv, args.processes, args.tflops), end="")
        return
    summary = pipeline.run(cfg, argv)
    rec = summary.get("recommended")
    if rec:
        entry = next(iter(rec.values()))
        print(f"recommended: {entry['drafter']} ({entry['dtype']}): {entry['why']}")


def recipe_main(args) -> None:
    from selfspec.training import recipes
    from selfspec.training.jobs import load_any

    if args.model:
        args.overrides.append(f"target={args.model}")
    cfg = load_any(args.config, args.overrides, default_recipe="train_heads")
    if getattr(cfg, "recipe", None) == "distill":
        raise ValueError(f"--config {args.config} is a distillation config: run selfspec distill --config {args.config}")
    if args.dry_run:
        from selfspec.training.dry_run import report

        from selfspec.training.plan import default_tflops

        print(report(args.config, cfg, args.overrides, args.processes, args.tflops or default_tflops(args.device)),
              end="")
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
