"""The pipeline's stages (:mod:`selfspec.training.pipeline`): one function per stage, each taking
``(cfg, out, model, tokenizer, tracking)`` and returning what it adds to the run's summary.

Invariants: a stage writes only inside the run folder ``out``; ``distill`` and ``train`` run on every
process of a launch, the others on the main process only (the runner decides); the tracked run is
opened and closed by each stage that logs, always under the same id.
"""

from __future__ import annotations

import json
from pathlib import Path

from selfspec.checkpoint import atomic_write_text

from .pipeline_config import EXPORTS, train_config
from .processes import process_state


def _tracker(tracking: dict | None, config: dict | None = None):
    from .tracking import Tracker

    t = tracking or {"report_to": "none", "out": Path(".")}
    return Tracker(t["report_to"], t["out"], name=t.get("name"), tags=t.get("tags"), run_id=t.get("run_id"),
                   config=config, wandb_mode=t.get("wandb_mode", "offline"))


def _distill(cfg, out, model, tokenizer, tracking):
    from .distill import distill

    distill(model, tokenizer, cfg.distill, out / "distill", target_name=cfg.model)
    state = process_state()
    if state.is_main_process:
        prov = json.loads((out / "distill" / "provenance.json").read_text(encoding="utf-8"))
        t = _tracker(tracking)
        t.log({"distill/examples": prov["examples"], "distill/response_tokens": prov["response_tokens"]})
        t.close()
    return {}


def _train(cfg, out, model, tokenizer, tracking):
    from . import recipes
    from .batching import load_distilled

    examples = load_distilled(str(out / "distill"))
    tcfg = train_config(cfg, out, model, examples)
    if tracking:
        tcfg.run.run_id = tracking["run_id"]
    resume = (Path(tcfg.run.out_dir) / "checkpoint").exists()
    tcfg.overwrite_export = True  # drafter/ is this run's own output (a stage rerun after a crash replaces it)
    summary = recipes.run(tcfg, resume=resume, allow_config_change=False, keep_processes=True, model=model,
                          tokenizer=tokenizer)
    return {"train": {k: v for k, v in (summary.get("metrics") or {}).items() if k.startswith("eval/")}}


def _calibrate(cfg, out, model, tokenizer, tracking):
    import selfspec
    from selfspec.checkpoint import read_checkpoint
    from selfspec.measurement.calibration import heldout_prompts, measure_acceptance, store_acceptance

    meta, _ = read_checkpoint(out / "drafter")
    texts = heldout_prompts(meta, cfg.calibrate.prompts, cfg.drafter)
    drafter = selfspec.load_drafter(str(out / "drafter"), model)
    record = measure_acceptance(model, tokenizer, drafter, texts, new_tokens=cfg.calibrate.max_new_tokens,
                                temperature=cfg.calibrate.temperature)
    store_acceptance(out / "drafter", record)
    t = _tracker(tracking)
    for name in ("greedy", "sampled"):
        for depth, ranks in enumerate(record[name]):
            t.log({f"calibrate/{name}_acceptance_rank0": ranks[0]}, step=depth + 1, axis="calibrate/depth")
    t.close()
    return {"calibration": {k: record[k] for k in ("greedy", "sampled")}}


def _bench(cfg, out, model, tokenizer, tracking):
    from selfspec import prompts
    from selfspec.measurement import benchmark
    from selfspec.measurement.workloads import load_questions, take_per_category

    questions = []
    for name in cfg.bench.questions:
        path = Path(name) if Path(name).exists() else prompts.heldout(name)
        qs = take_per_category(load_questions(path), cfg.bench.per_category)
        if cfg.bench.first_turn_only:
            qs = [q.__class__(q.question_id, q.category, q.turns[:1], q.system, q.meta) for q in qs]
        questions += qs
    questions = _fitting(questions, model, tokenizer, cfg.bench.max_new_tokens)
    head = str(out / "drafter")
    specs = {cfg.drafter: head, "ngram": "ngram", f"{cfg.drafter}+ngram": f"{head}+ngram"}
    results = out / "drafter" / "results"
    rows, t = {}, _tracker(tracking)
    for temperature in cfg.bench.temperatures:
        methods = {name: benchmark.method_from_spec(model, spec, cfg.model, tokenizer) for name, spec in specs.items()}
        if temperature == 0:
            methods["hf-prompt-lookup"] = benchmark.method_from_spec(model, "hf-prompt-lookup", cfg.model)
        records = benchmark.run(model, tokenizer, questions, methods, max_new_tokens=cfg.bench.max_new_tokens,
                                temperature=temperature)
        name = "bench_greedy" if temperature == 0 else f"bench_t{temperature:g}".replace(".", "")
        command = f"selfspec train --config {out / 'pipeline.yaml'} (stage bench, T={temperature:g})"
        summary = benchmark.write_report(str(results / name), {"temperature": temperature, "model": cfg.model,
                                                               "max_new_tokens": cfg.bench.max_new_tokens},
                                         records, command, f"{cfg.model}: {cfg.drafter} head, T={temperature:g}")
        overall = summary["overall"]
        rows[name] = {m: {k: overall[m][k] for k in ("speedup", "speedup_ci", "mean_accepted_length",
                                                     "acceptance_per_depth", "tokens_per_s")} for m in overall}
        t.table(f"bench/{name}", ["method", "speedup", "MAT", "tokens/s"],
                [[m, round(v["speedup"], 3), round(v["mean_accepted_length"], 3), round(v["tokens_per_s"], 1)]
                 for m, v in overall.items()])
        t.image(f"bench/{name}_speedup", results / f"{name}_speedup.png")
    t.close()
    atomic_write_text(out / "bench.json", json.dumps(rows, indent=1))
    return {"bench": rows}


def _fitting(questions: list, model, tokenizer, new_tokens: int) -> list:
    """The questions whose first turn and answer fit the model's context (all, when it states none)."""
    from selfspec.chat import encode_chat

    from selfspec.model.target import context_length

    limit = context_length(model)
    if not limit:
        return questions
    kept = [q for q in questions if encode_chat(tokenizer, q.turns[0], system=q.system).shape[1] + new_tokens <= limit]
    if not kept:
        raise ValueError(f"bench: no question fits the model's context of {limit} tokens with {new_tokens} new tokens")
    return kept


def _card(cfg, out, model, tokenizer, tracking):
    from .card import recommended_entry, write_card

    bench = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    entry = recommended_entry(cfg, out, bench, str(next(model.parameters()).dtype).removeprefix("torch."))
    atomic_write_text(out / "recommended.json", json.dumps({cfg.model: entry}, indent=1))
    write_card(cfg, out, bench)
    t = _tracker(tracking)
    t.image("train/curves", out / "train" / "training_curves.png")
    t.close()
    return {}


def _export(cfg, out, model, tokenizer, tracking):
    import torch

    import selfspec
    from selfspec.export import export_drafter

    drafter = selfspec.load_drafter(str(out / "drafter"), model)
    written = {}
    for layout in cfg.export:
        folder = out / f"export-{layout}"
        written[layout] = str(export_drafter(drafter, folder, EXPORTS[layout], dtype=torch.bfloat16,
                                             target_path=cfg.model, overwrite=folder.exists()))
    return {"exports": written}


STAGE_FUNCTIONS = {"distill": _distill, "train": _train, "calibrate": _calibrate, "bench": _bench, "card": _card,
                   "export": _export}
