"""Calibration: a trained drafter's acceptance per depth and sibling rank, measured on held-out
prompts and stored with the checkpoint as the controller's prior.

The drafter drafts every step (``ControlConfig(fixed=True)``: its whole tree verified) over
prompts it never trained on (neither its own training data nor its lineage's, nor any benchmark
prompt), greedy and at one sampling temperature; the acceptance the controller measured is stored
in the checkpoint's ``extra.acceptance`` (``{"greedy": [[rate per rank] per depth], "sampled":
...}``). Nothing here depends on the machine: verify costs are measured on each machine on first use
(:mod:`selfspec.control.cost`).

Prompts: EAGLE-3 heads (trained on chat data) get held-out chat prompts (:func:`heldout_prompts`);
other kinds GSM8K train and HumanEval calibration prompts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

import selfspec
from selfspec.chat import encode_chat
from selfspec.checkpoint import CONFIG_FILE, CheckpointError, atomic_write_text
from selfspec.control import ControlConfig, Controller, temperature_bucket
from selfspec.model.target import context_length

from .workloads import calibration_prompts, heldout_chat_prompts


def training_datasets(meta: dict) -> list[str]:
    """The datasets a drafter of checkpoint metadata ``meta`` and its lineage trained on."""
    extra = meta.get("extra") or {}
    found = [(extra.get("training") or {}).get("dataset")] + [r.get("dataset") for r in extra.get("lineage") or []]
    return [d for entry in found if entry for d in (entry if isinstance(entry, list) else [entry])]


def training_prompts(meta: dict, configs: str | os.PathLike = "configs/distill") -> set[str]:
    """User texts the drafter was trained on, to keep them out of calibration: the prompts of its
    own training data and of every run it was continued from (``lineage``), each read from the
    distillation folder's manifest or, where that folder is absent, from the distill config in
    ``configs`` that writes it. A shard range (``folder[6:]``) keeps the whole window out except the
    prompts answered only in its shards outside the range. Refuses a dataset it cannot trace."""
    from selfspec.training.batching import shard_selection  # noqa: I001
    from selfspec.training.config import from_dict, load_config
    from selfspec.training.distill import DistillConfig, DistillJob, collect_prompts

    by_out = {}
    for path in sorted(Path(configs).glob("*.yaml")):
        job = load_config(DistillJob, path)
        by_out[os.path.normpath(job.out)] = job.distill
    texts: set[str] = set()
    for spec in training_datasets(meta):
        folder, selected = shard_selection(spec)
        manifest = folder / "manifest.json"
        if manifest.exists():
            cfg = from_dict(DistillConfig, json.loads(manifest.read_text(encoding="utf-8"))["config"])
        elif os.path.normpath(str(folder)) in by_out:
            cfg = by_out[os.path.normpath(str(folder))]
        else:
            raise CheckpointError(f"the drafter was trained on {str(folder)!r}, which has no manifest here and no "
                                  f"distill config in {configs} writes it: its prompts cannot be kept out of "
                                  "calibration (run from the folder its dataset paths are relative to)")
        held = _outside_selection(folder, selected)
        texts |= {p["user"].strip() for p in collect_prompts(cfg) if (p["source"], str(p["source_id"])) not in held}
    return texts


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


def heldout_prompts(meta: dict, n: int, kind: str = "eagle3", configs: str | os.PathLike = "configs/distill") -> list[str]:
    """Up to ``n`` calibration prompts for a drafter of ``kind`` that neither it nor its lineage
    trained on and no benchmark uses; ``ValueError`` when fewer than ``min(4, n)`` are left."""
    if kind == "eagle3":
        texts = heldout_chat_prompts(n, training_prompts(meta, configs))
    else:
        texts = calibration_prompts(n)
    if len(texts) < min(4, n):
        raise ValueError(f"only {len(texts)} calibration prompts are left that neither this drafter nor its lineage "
                         f"trained on and no benchmark uses (asked for {n}): distill from fewer prompts, or hold a "
                         "window's shards out of training (a dataset range such as folder[6:])")
    return texts


@torch.no_grad()
def measure_acceptance(model, tokenizer, drafter, texts: list[str], *, new_tokens: int = 96,
                       temperature: float = 0.7, depth: int = 8, ranks: int = 4, progress: bool = True) -> dict:
    """Acceptance per depth and sibling rank of ``drafter`` drafting every step on ``texts``,
    greedy and at ``temperature``: ``{"prompts", "new_tokens", "dtype", "temperature", "greedy":
    [[rate] * ranks] * depth, "sampled": ...}``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (the sampled measurement), got {temperature}")
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in texts]
    limit = context_length(model)
    if limit:  # prompts the model's context cannot hold with the answer are left out
        prompts = [p for p in prompts if p.shape[1] + new_tokens <= limit]
        if not prompts:
            raise ValueError(f"no calibration prompt fits the model's context of {limit} tokens with {new_tokens} new tokens")
    controller = Controller(drafter, ControlConfig(fixed=True, decay=1.0, prior_weight=1e-3))
    record = {"prompts": len(prompts), "new_tokens": new_tokens,
              "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "temperature": temperature}
    for name, t in (("greedy", 0.0), ("sampled", temperature)):
        for i, ids in enumerate(tqdm(prompts, desc=f"calibrate ({name})", disable=not progress)):
            selfspec.generate(model, ids, drafter=controller, max_new_tokens=new_tokens, temperature=t, seed=i)
        record[name] = controller.acceptance.table(0, temperature_bucket(t), depth, ranks)
    return record


def store_acceptance(checkpoint: str | os.PathLike, record: dict) -> Path:
    """Write ``record`` into the checkpoint's ``extra.acceptance`` (atomically); returns the file."""
    path = Path(checkpoint) / CONFIG_FILE
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    stored.setdefault("extra", {})["acceptance"] = record
    atomic_write_text(path, json.dumps(stored, indent=1) + "\n")
    return path


def recorded_target(meta: dict) -> str | None:
    """The target name a checkpoint's training run recorded (``extra.training.target``), if any."""
    return ((meta.get("extra") or {}).get("training") or {}).get("target")
