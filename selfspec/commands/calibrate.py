"""Measure a drafter checkpoint's acceptance on held-out prompts and store it with the drafter.

    selfspec calibrate checkpoints/smollm2-135m-instruct-eagle3 [--prompts 16] [--dry-run]

Runs the drafter on every step (``ControlConfig(fixed=True)``: its whole tree verified) over
held-out chat prompts (never the drafter's training prompts, nor its lineage's, nor a benchmark
set; other kinds: GSM8K train + HumanEval calibration prompts), greedy and at ``--temperature``,
and stores the acceptance the controller measured per depth and sibling rank in the checkpoint's
``extra.acceptance`` (``{"greedy": [[rate per rank] per depth], "sampled": ...}``). A fresh
controller starts from it (the prior of its acceptance model). Nothing here is a decision and
nothing depends on the machine: the verify cost is measured on each machine on first use
(:mod:`selfspec.control.cost`), and the controller sizes trees from both.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


import torch
from tqdm import tqdm

import selfspec
from selfspec.chat import encode_chat
from selfspec.checkpoint import CONFIG_FILE, atomic_write_text, read_checkpoint
from selfspec.control import ControlConfig, Controller, temperature_bucket
from selfspec.drafters import load_drafter
from selfspec.measurement.workloads import calibration_prompts, heldout_chat_prompts

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def training_prompts(meta: dict) -> set[str]:
    """User texts the drafter was trained on, to keep them out of calibration: the prompts of its
    own training data and of every run it was continued from (``lineage``), each read from the
    distillation folder's manifest or, where that folder is absent (``runs/`` of another
    session), from the distill config in configs/ that wrote it. A shard range (``folder[6:]``)
    keeps the whole window out except the prompts answered only in its shards outside the range
    (window d's first six shards, which no head trained on, are the only held-out chat prompts
    left once every chat prompt has been distilled). Refuses a dataset it cannot trace."""
    from selfspec.training.batching import shard_selection  # noqa: I001
    from selfspec.training.jobs import load_any
    from selfspec.training.distill import DistillConfig, collect_prompts

    extra = meta.get("extra") or {}
    datasets = [(extra.get("training") or {}).get("dataset")] + [r.get("dataset") for r in extra.get("lineage") or []]
    datasets = [d for entry in datasets for d in (entry if isinstance(entry, list) else [entry])]  # lists of windows
    configs = {}
    for path in sorted((Path(__file__).resolve().parents[2] / "configs" / "distill").glob("*.yaml")):
        job = load_any(path)
        configs[os.path.normpath(job.out)] = job.distill
    texts: set[str] = set()
    for spec in filter(None, datasets):
        folder, selected = shard_selection(spec)
        dataset = str(folder)
        manifest = folder / "manifest.json"
        if manifest.exists():
            cfg = DistillConfig(**json.loads(manifest.read_text(encoding="utf-8"))["config"])
        elif os.path.normpath(dataset) in configs:
            cfg = configs[os.path.normpath(dataset)]
            cfg = DistillConfig(**(cfg.__dict__ | {"data_dir": str(SHARED)}))
        else:
            raise SystemExit(f"the drafter was trained on {dataset!r}, which has no manifest here and no distill "
                             "config in configs/ writes it: its prompts cannot be kept out of calibration")
        # the window's prompts, less those answered only in shards outside the selection (a
        # window's held-out shards, e.g. window d's first six): every other prompt of the window
        # is kept out, answered in the selected shards or not (a range may have grown later)
        held = _outside_selection(folder, selected)
        texts |= {p["user"].strip() for p in collect_prompts(cfg) if (p["source"], str(p["source_id"])) not in held}
    return texts


def heldout_prompts(meta: dict, n: int) -> list[str]:
    """Up to ``n`` chat prompts that neither the drafter of ``meta`` nor its lineage trained on
    and no benchmark uses (:func:`training_prompts`); a clear error when fewer than
    ``min(4, n)`` are left (calibration and the EAGLE-3 cost scripts share it)."""
    texts = heldout_chat_prompts(SHARED, n, training_prompts(meta))
    _enough(texts, n)
    return texts


def _enough(texts: list[str], n: int) -> None:
    if len(texts) < min(4, n):
        raise SystemExit(f"only {len(texts)} calibration prompts are left that neither this drafter nor its lineage "
                         f"trained on and no benchmark uses (asked for {n}): distill from fewer prompts, or hold a "
                         "window's shards out of training (a dataset range such as folder[6:]); run from the "
                         "repository root, where the dataset paths resolve")


def _outside_selection(folder: Path, selected: slice | None) -> set[tuple[str, str]]:
    """``(source, source_id)`` of the records answered in ``folder``'s shards outside the shard
    range ``selected`` and in none inside it; empty without a range, without the shards here, or
    unless the shard files are numbered 0..n-1 without a gap (training selects by position in
    file-name order: with a shard missing here, positions would shift and a trained shard could
    look held out)."""
    shards = sorted((folder / "shards").glob("*.jsonl")) if selected is not None else []
    if not shards or [f.stem for f in shards] != [f"{i:05d}" for i in range(len(shards))]:
        return set()
    from selfspec.training.batching import shard_records

    chosen = set(shards[selected])

    def ids(files) -> set[tuple[str, str]]:
        return {(rec["source"], str(rec["source_id"])) for rec in shard_records(files)}

    return ids([f for f in shards if f not in chosen]) - ids(chosen)


def parser() -> argparse.ArgumentParser:
    """The command line of this command (the README test parses its examples with it)."""
    ap = argparse.ArgumentParser(prog="selfspec calibrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--model", "--target", dest="target", default=selfspec.DEFAULT_TARGET,
                    help="the target: alias, local folder, .gguf file or hub id")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts")
    ap.add_argument("--dtype", default="auto", help="target dtype: float32, bfloat16 or auto")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled measurement")
    ap.add_argument("--depth", type=int, default=8, help="deepest level stored")
    ap.add_argument("--ranks", type=int, default=4, help="sibling ranks stored per level")
    ap.add_argument("--dry-run", action="store_true", help="print the measurement, leave the checkpoint as it is")
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.prompts < 1 or args.temperature <= 0:
        raise SystemExit("--prompts must be >= 1 and --temperature > 0")
    torch.set_grad_enabled(False)
    model, tok = selfspec.load_target(args.target, dtype=args.dtype)
    drafter = load_drafter(args.checkpoint, model)
    meta, _ = read_checkpoint(args.checkpoint)
    texts = heldout_prompts(meta, args.prompts) if drafter.kind == "eagle3" else calibration_prompts(SHARED, args.prompts)
    _enough(texts, args.prompts)
    prompts = [encode_chat(tok, [{"role": "user", "content": p}]) for p in texts]
    controller = Controller(drafter, ControlConfig(fixed=True, decay=1.0, prior_weight=1e-3))
    record = {"prompts": len(prompts), "new_tokens": args.new_tokens,
              "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "temperature": args.temperature}
    for name, temperature in (("greedy", 0.0), ("sampled", args.temperature)):
        for i, ids in enumerate(tqdm(prompts, desc=f"acceptance, {name}")):
            selfspec.generate(model, ids, drafter=controller, max_new_tokens=args.new_tokens,
                              temperature=temperature, seed=i)
        record[name] = controller.acceptance.table(0, temperature_bucket(temperature), args.depth, args.ranks)
        print(name, json.dumps(record[name]))
    if args.dry_run:
        return
    path = Path(args.checkpoint) / CONFIG_FILE
    stored = json.loads(path.read_text(encoding="utf-8"))
    stored.setdefault("extra", {})["acceptance"] = record
    atomic_write_text(path, json.dumps(stored, indent=1) + "\n")
    print(f"stored in {path}")


if __name__ == "__main__":
    main()
