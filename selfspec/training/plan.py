"""``selfspec train --model M --drafter K --dry-run``: the pipeline's plan before anything runs.

Each stage's estimated time and memory per process are planning numbers from parameter counts and
an assumed sustained throughput (never measurements); the plan says whether the target needs
sharding and prints the one launch line for any number of processes.
"""

from __future__ import annotations

from pathlib import Path

from .pipeline_config import PipelineConfig, train_config

#: How much slower one sequence decodes than batched generation, per token (a decode step reads every
#: weight for one row): calibration and the benchmark run at batch 1 (docs/training.md: measured).
ONE_ROW_SLOWDOWN = 3

#: Share of the assumed training throughput that batched generation (distillation) sustains: its
#: decode steps read every weight for a few rows, so they are bound by memory, not arithmetic
#: (docs/training.md: the measured ratio on the development CPU).
GENERATION_SHARE = 0.2


def default_tflops(device: str | None = None) -> float:
    """The throughput a plan assumes per process: 200 TFLOP/s on a GPU (bf16 on an H100-class card
    at about 40% of peak), 0.1 on a CPU (docs/training.md compares plans with measured runs)."""
    import torch

    gpu = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    return 200.0 if gpu else 0.1


def device_memory_gib(cfg: PipelineConfig) -> float | None:
    """Memory of the accelerator the run would use, or ``None`` on a CPU."""
    import torch

    device = torch.device(cfg.load.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(device.index or 0).total_memory / 1024 ** 3


def plan(cfg: PipelineConfig, processes: int = 1, tflops: float | None = None) -> list[dict]:
    """Each stage with its estimated time and memory (planning numbers, not measurements): tokens
    generated or trained on times 2 (inference) or 6 (training) FLOPs per parameter, at ``tflops``
    per process (default 200 on a GPU, 0.1 on a CPU; docs/training.md compares plans with measured runs)."""

    from .dry_run import estimate, target_config

    tflops = tflops or default_tflops(cfg.load.device)
    config = target_config(cfg.model)
    text = config.get_text_config(decoder=True)
    params = _param_count(config)
    dtype_bytes = 4 if cfg.load.dtype == "float32" else 2
    weights = params * dtype_bytes / 1024 ** 3
    prompts = sum(cfg.distill.sources.values()) + sum(f.limit or 1000 for f in cfg.distill.data_files)
    answer = cfg.distill.max_new_tokens * 0.75  # answers stop early on average
    distill_tokens = prompts * answer
    kv = 2 * text.num_hidden_layers * text.hidden_size * dtype_bytes * cfg.distill.batch_size * \
        (cfg.distill.max_prompt_tokens + cfg.distill.max_new_tokens) / 1024 ** 3
    rate = tflops * GENERATION_SHARE * 1e12 * processes / (2 * params)  # generated tokens per second
    rows = [dict(stage="distill", what=f"{prompts:,} prompts x ~{answer:.0f} new tokens", hours=distill_tokens / rate / 3600,
                 memory_gib=weights + kv)]
    tcfg = train_config(cfg, Path(cfg.out), text_config=text)
    tokens = int(prompts * (answer + 200))
    est = estimate(tcfg, processes, tflops, tokens=tokens)
    rows.append(dict(stage="train", what=f"~{tokens:,} tokens x {tcfg.optim.epochs} epochs, "
                     f"{est['trainable_params'] / 1e6:.1f}M trainable", hours=est.get("hours", 0.0),
                     memory_gib=est["memory_per_process"]["total_gib"]))
    calib = 2 * cfg.calibrate.prompts * cfg.calibrate.max_new_tokens
    rows.append(dict(stage="calibrate", what=f"{cfg.calibrate.prompts} prompts x 2 temperatures",
                     hours=calib / rate * ONE_ROW_SLOWDOWN / 3600,
                     memory_gib=weights))
    questions = 8 * cfg.bench.per_category * len(cfg.bench.questions)
    bench = questions * cfg.bench.max_new_tokens * 5 * len(cfg.bench.temperatures)
    rows.append(dict(stage="bench", what=f"~{questions} questions x 5 methods x {len(cfg.bench.temperatures)} temperature(s)",
                     hours=bench / rate * ONE_ROW_SLOWDOWN / 3600, memory_gib=weights))
    rows.append(dict(stage="card", what="model card, recommended.json", hours=0.0, memory_gib=0.0))
    if cfg.export:
        rows.append(dict(stage="export", what=", ".join(cfg.export), hours=0.0, memory_gib=0.0))
    for r in rows:
        r["hours"] = round(r["hours"], 3)
        r["memory_gib"] = round(r["memory_gib"], 2)
    return rows


def _param_count(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def launch_line(argv: list[str], processes: int) -> str:
    """The command that runs this pipeline on ``processes`` processes (one launch line everywhere)."""
    args = " ".join(a for a in argv if a != "--dry-run")
    if processes <= 1:
        return f"selfspec train {args}"
    return f"accelerate launch --multi_gpu --num_processes {processes} -m selfspec.cli train {args}"


def dry_run_text(cfg: PipelineConfig, argv: list[str], processes: int, tflops: float | None) -> str:
    rows = plan(cfg, processes, tflops)
    lines = [f"plan: {cfg.drafter} head for {cfg.model} -> {cfg.out}" + (" (smoke)" if cfg.smoke else ""), "",
             "| stage | what | est. hours | est. memory GiB per process |", "|---|---|---|---|"]
    lines += [f"| {r['stage']} | {r['what']} | {r['hours']:.2f} | {r['memory_gib']:.1f} |" for r in rows]
    need, have = max(r["memory_gib"] for r in rows), device_memory_gib(cfg)
    if cfg.load.device_map:
        shard = f"device_map={cfg.load.device_map} (the target spread over this machine's devices, one process)"
    elif have is None:
        shard = f"none (CPU: {need:.1f} GiB of memory at the largest stage)"
    elif need <= 0.9 * have:
        shard = f"none ({need:.1f} GiB at the largest stage fits one {have:.0f} GiB device per process)"
    else:
        shard = (f"needed: {need:.1f} GiB at the largest stage exceeds one {have:.0f} GiB device; rerun with "
                 "--device-map auto (one process) or more processes for training")
    lines += ["", f"sharding of the target: {shard}",
              "estimates from parameter counts and an assumed throughput, not measurements",
              "command: " + launch_line(argv, processes)]
    return "\n".join(lines) + "\n"
