"""From a model to an evaluated, calibrated head in one command: ``selfspec train --model M --drafter K``.

Stages, in order (:data:`STAGES`):

1. ``distill``: the target answers the prompts (the shipped mix, or ``data``: files, ``datasets``
   folders or Hub dataset ids; multi-turn, tools), shard by shard (:mod:`selfspec.training.distill`);
   data-parallel under ``accelerate launch``.
2. ``train``: the kind's recipe (:mod:`selfspec.training.recipes`) on those answers, its shape from
   the model (taps, hidden sizes) and, for EAGLE-3, a draft vocabulary sized from the answers' token
   counts (:func:`draft_vocab_size`); resumes from its checkpoint.
3. ``calibrate``: acceptance per depth on held-out chat prompts, stored with the drafter
   (:mod:`selfspec.measurement.calibration`).
4. ``bench``: the head, prompt lookup and their union against plain decoding on held-out prompts
   (MT-Bench first turns by default: never distilled), one result file per temperature.
5. ``card``: the drafter's model card and ``recommended.json`` (the fastest measured setting).
6. ``export``: the serving layouts asked for (``vllm``, ``sglang``, ``speculators``).

Run folder (``out``)::

    pipeline.yaml      the config that ran (rerun it: selfspec train --config <out>/pipeline.yaml)
    manifest.json      per stage: its key and whether it finished
    distill/ train/    the stages' own folders (shards; checkpoint, logs, curves)
    drafter/           the head (a selfspec checkpoint) with README.md and results/
    recommended.json   export-<format>/

Invariants: a stage runs only when the stages before it finished; its key is a hash of the model's
identity, the stage's settings and the keys before it, so a finished stage is skipped and a stage
whose key changed is refused (another ``--out``), never silently mixed; a rerun of the same command
continues where an interrupted one stopped. Only the main process writes outside ``distill/`` and
``train/``; the other processes of a launch take part in distillation and training only.
"""


from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from selfspec.checkpoint import atomic_write_text

from .config import dump_config
from .pipeline_config import (STAGES, PipelineConfig, draft_vocab_size, load_pipeline, prepare, smoke_defaults,
                              stage_keys, train_config, digest)
from .plan import dry_run_text, plan
from .processes import process_state
from .stages import STAGE_FUNCTIONS


class Manifest:
    """``<out>/manifest.json``: each stage's key and state, written atomically."""

    def __init__(self, out: Path):
        self.path = out / "manifest.json"
        self.data = json.loads(self.path.read_text(encoding="utf-8")) if self.path.exists() else {"stages": {}}

    def check(self, stage: str, key: str) -> bool:
        """True when ``stage`` finished with ``key``; ``ValueError`` when it ran with another key."""
        entry = self.data["stages"].get(stage)
        if entry is None:
            return False
        if entry["key"] != key:
            raise ValueError(f"{self.path.parent} holds a run whose stage {stage!r} ran with other settings or another "
                             f"model; rerun with its own config ({self.path.parent / 'pipeline.yaml'}) or choose another --out")
        return bool(entry.get("done"))

    def mark(self, stage: str, key: str, done: bool, **info) -> None:
        self.data["stages"][stage] = {"key": key, "done": done} | info
        atomic_write_text(self.path, json.dumps(self.data, indent=1))


def run(cfg: PipelineConfig, argv: list[str] | None = None, log=print) -> dict:
    """Run every stage of ``cfg`` (already :func:`prepare`d) that has not finished; returns the
    run's summary (``out``, the bench rows, the recommended setting)."""
    import torch

    import selfspec
    from selfspec.model.fingerprint import target_fingerprint

    state = process_state()
    out = Path(cfg.out)
    device = cfg.load.device or (str(state.device) if state.num_processes > 1 else None)
    manifest = Manifest(out)
    dtype = cfg.load.dtype
    if dtype == "auto" and manifest.data.get("dtype"):  # "auto" is decided once per run folder (a timing probe on a CPU)
        dtype = manifest.data["dtype"]
    model, tokenizer = selfspec.load_target(cfg.model, dtype=dtype, device=device, **cfg.load.kwargs())
    manifest.data["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    identity = digest(cfg.model, cfg.load.revision, target_fingerprint(model), str(next(model.parameters()).dtype))
    keys = stage_keys(cfg, identity)
    for stage in STAGES:  # refuse a changed run before anything is written
        if stage != "export" or cfg.export:
            manifest.check(stage, keys[stage])
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        _write_config(out, cfg)
    state.wait_for_everyone()
    tracking = _tracking(out, cfg) if state.is_main_process else None
    if tracking and cfg.report_to != "none":
        where = out / ("wandb" if cfg.report_to == "wandb" else "selfspec")
        log(f"tracking: {cfg.report_to} run {tracking['name']!r} (id {tracking['run_id']}) in {where}")
    summary: dict = {"out": str(out)}
    for stage in STAGES:
        if stage == "export" and not cfg.export:
            continue
        done = manifest.check(stage, keys[stage])
        state.wait_for_everyone()
        if done:
            log(f"[{stage}] done earlier: skipped")
            continue
        main_only = stage not in ("distill", "train")
        if state.is_main_process:
            manifest.mark(stage, keys[stage], False)
        started = time.time()
        if not main_only or state.is_main_process:
            log(f"[{stage}] running")
            with torch.set_grad_enabled(stage == "train"):  # (restored after: the caller's mode is its own)
                result = STAGE_FUNCTIONS[stage](cfg, out, model, tokenizer, tracking) or {}
            summary |= result
        state.wait_for_everyone()
        if state.is_main_process:
            manifest.mark(stage, keys[stage], True, seconds=round(time.time() - started, 1))
    if state.is_main_process:
        summary["recommended"] = json.loads((out / "recommended.json").read_text(encoding="utf-8"))
        log(f"done: {out} (drafter in {out / 'drafter'}, card {out / 'drafter' / 'README.md'})")
    state.wait_for_everyone()
    if state.num_processes > 1:
        state.destroy_process_group()
    return summary


def _write_config(out: Path, cfg: PipelineConfig) -> None:
    atomic_write_text(out / "pipeline.yaml", "# selfspec train --config " + str(out / "pipeline.yaml") +
                      " reruns this pipeline (finished stages are skipped)\n" + dump_config(cfg))


def _tracking(out: Path, cfg: PipelineConfig) -> dict:
    """The tracked run's settings, with an id kept in the run folder so every stage and rerun log to it."""
    path = out / "tracking.json"
    if path.exists():
        info = json.loads(path.read_text(encoding="utf-8"))
    else:
        info = {"run_id": hashlib.sha256(f"{out.resolve()}{time.time()}".encode()).hexdigest()[:12]}
        atomic_write_text(path, json.dumps(info))
    return {"report_to": cfg.report_to, "out": out, "name": cfg.run_name or out.name, "tags": list(cfg.tags),
            "run_id": info["run_id"], "wandb_mode": cfg.wandb_mode}


__all__ = ["Manifest", "PipelineConfig", "STAGES", "draft_vocab_size", "dry_run_text", "load_pipeline", "plan",
           "prepare", "run", "smoke_defaults", "stage_keys", "train_config"]
