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
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from selfspec.checkpoint import atomic_write_text
from selfspec.loading import DEFAULT_TARGET

from .config import dump_config, from_dict
from .conversations import DataFile
from .distill import DistillConfig
from .tracking import REPORT_TO

STAGES = ("distill", "train", "calibrate", "bench", "card", "export")
KINDS = ("eagle3", "medusa", "layerskip")
EXPORTS = {"vllm": "eagle3", "sglang": "eagle3", "speculators": "speculators"}

#: The prompt mix distilled when no ``data`` is given: chat and tool prompts, code, math and
#: tool calls (benchmark prompts held out).
DEFAULT_SOURCES = {"chat": 3000, "tools": 1000, "gsm8k": 600, "humaneval": 164, "bfcl_simple": 300, "bfcl_multiple": 100}

#: Licenses of the packaged aliases' weights (a card carries the target's own terms).
ALIAS_LICENSES = {"smollm2-135m-instruct": "apache-2.0", "gemma3-270m": "gemma"}
ALIAS_BASE_MODELS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m"}


@dataclass
class LoadConfig:
    """How the target is loaded (:func:`selfspec.load_target`).

    Attributes:
        device: ``cpu``, ``cuda``, ... (default: cuda when available; under ``accelerate launch``
            each process's own device).
        dtype: ``auto`` (GPU: the checkpoint's dtype; CPU: bf16 where it is native and faster),
            ``float32``, ``bfloat16``, ``float16``.
        revision / trust_remote_code / attn_implementation / device_map: passed to ``from_pretrained``
            (``device_map: auto`` shards a target too large for one device, single process only).
    """

    device: str | None = None
    dtype: str = "auto"
    revision: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    device_map: str | None = None

    def kwargs(self) -> dict:
        out = {k: v for k, v in (("revision", self.revision), ("attn_implementation", self.attn_implementation),
                                 ("device_map", self.device_map)) if v}
        if self.trust_remote_code:
            out["trust_remote_code"] = True
        return out


@dataclass
class CalibrateStage:
    """Calibration settings: held-out ``prompts``, ``max_new_tokens`` each, sampled at ``temperature``."""

    prompts: int = 16
    max_new_tokens: int = 96
    temperature: float = 0.7

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.max_new_tokens < 1 or not self.temperature > 0:
            raise ValueError("calibrate.prompts and calibrate.max_new_tokens must be >= 1 and calibrate.temperature > 0")


@dataclass
class BenchStage:
    """Held-out benchmark settings.

    Attributes:
        questions: question files (a path, or a name in the shipped ``selfspec/prompts/heldout``).
        per_category: first N questions of each category.
        first_turn_only: only each conversation's first turn.
        max_new_tokens: tokens per answer.
        temperatures: one result file per temperature (0 = greedy).
    """

    questions: list[str] = field(default_factory=lambda: ["mt_bench_question.jsonl"])
    per_category: int = 2
    first_turn_only: bool = True
    max_new_tokens: int = 128
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])

    def __post_init__(self) -> None:
        if self.per_category < 1 or self.max_new_tokens < 1:
            raise ValueError("bench.per_category and bench.max_new_tokens must be >= 1")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"bench.temperatures must be a non-empty list of values >= 0, got {self.temperatures}")


@dataclass
class PipelineConfig:
    """``selfspec train --model ... --drafter ...`` (a saved copy: ``<out>/pipeline.yaml``).

    Attributes:
        recipe: always ``pipeline``.
        model: the target (alias, folder, GGUF file or hub id).
        drafter: ``eagle3``, ``medusa`` or ``layerskip``.
        data: your conversations (files, ``datasets`` folders or Hub dataset ids); empty: the shipped
            prompt mix (:data:`DEFAULT_SOURCES`).
        out: the run folder (default ``runs/<model>-<drafter>``, ``-smoke`` added for ``smoke``).
        smoke: every stage end to end on a handful of prompts and steps (:func:`smoke_defaults`).
        export: serving layouts to write (``vllm``, ``sglang``, ``speculators``).
        report_to / run_name / tags / wandb_mode: the tracked run (one across stages).
        license: the card's license (default: the alias's own terms, else ``other``).
        base_model: the card's Hub id of the target (default: the alias's, or ``model`` when it is one).
        load: how the target is loaded.
        distill: what to distil (``sources`` and ``data_files`` are filled from ``data``).
        train: values of the kind's recipe config (dotted keys or nested, e.g.
            ``{"optim": {"epochs": 2}}``), over what the pipeline derives from the model.
        calibrate / bench: those stages' settings.
    """

    recipe: str = "pipeline"
    model: str = DEFAULT_TARGET
    drafter: str = "eagle3"
    data: list[str] = field(default_factory=list)
    out: str | None = None
    smoke: bool = False
    export: list[str] = field(default_factory=list)
    report_to: str = "wandb"
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    wandb_mode: str = "offline"
    license: str | None = None
    base_model: str | None = None
    load: LoadConfig = field(default_factory=LoadConfig)
    distill: DistillConfig = field(default_factory=lambda: DistillConfig(
        sources=dict(DEFAULT_SOURCES), max_new_tokens=256, batch_size=32, max_prompt_tokens=512))
    train: dict = field(default_factory=dict)
    calibrate: CalibrateStage = field(default_factory=CalibrateStage)
    bench: BenchStage = field(default_factory=BenchStage)

    def __post_init__(self) -> None:
        if self.recipe != "pipeline":
            raise ValueError(f"this config is for recipe {self.recipe!r}, not 'pipeline'")
        if self.drafter not in KINDS:
            raise ValueError(f"--drafter must be one of {KINDS}, got {self.drafter!r}")
        if self.report_to not in REPORT_TO:
            raise ValueError(f"--report-to must be one of {REPORT_TO}, got {self.report_to!r}")
        bad = [e for e in self.export if e not in EXPORTS]
        if bad:
            raise ValueError(f"--export: unknown layouts {bad}; known: {list(EXPORTS)}")
        if self.export and self.drafter != "eagle3":
            raise ValueError(f"--export: vLLM / SGLang / speculators layouts exist for eagle3 heads, not {self.drafter!r} "
                             "(selfspec export --format medusa writes vLLM's Medusa layout)")
        if not self.model:
            raise ValueError("--model is required")


def default_out(cfg: PipelineConfig) -> str:
    """``runs/<model>-<drafter>[-smoke]``, the model named by its last path part."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(cfg.model.rstrip("/")).name.removesuffix(".gguf")).strip("-").lower()
    return f"runs/{name or 'model'}-{cfg.drafter}" + ("-smoke" if cfg.smoke else "")


def smoke_defaults(kind: str) -> dict:
    """The sizes of a ``--smoke`` run (a few prompts and steps per stage: what CI and a newcomer run
    first), as config values that the file's and the command line's own values override."""
    train = {"optim": {"epochs": 1.0, "warmup_steps": 1}, "tokens_per_batch": 256, "max_len": 96,
             "eval_fraction": 0.25, "max_eval_examples": 2, "run": {"log_every": 1, "eval_every": 2, "ckpt_every": 2}}
    train |= {"ttt_steps": 2} if kind == "eagle3" else {}
    return {"distill": {"sources": {"chat": 8}, "max_new_tokens": 16, "batch_size": 4, "shard_size": 4,
                        "max_prompt_tokens": 192},
            "train": train, "calibrate": {"prompts": 2, "max_new_tokens": 8},
            "bench": {"per_category": 1, "max_new_tokens": 12, "temperatures": [0.0]}}


#: Conversations a ``--smoke`` run takes from each of your data files.
SMOKE_LIMIT = 8


def prepare(cfg: PipelineConfig) -> PipelineConfig:
    """Fill in what the command line leaves implicit: ``out`` and the data files (your data replaces
    the shipped prompt mix)."""
    if cfg.data:
        files = [DataFile(path=p) for p in cfg.data if p not in {f.path for f in cfg.distill.data_files}]
        cfg = replace(cfg, distill=replace(cfg.distill, sources={}, data_files=cfg.distill.data_files + files))
    if cfg.smoke:
        files = [replace(f, limit=min(f.limit or SMOKE_LIMIT, SMOKE_LIMIT)) for f in cfg.distill.data_files]
        cfg = replace(cfg, distill=replace(cfg.distill, data_files=files))
    if not cfg.out:
        cfg = replace(cfg, out=default_out(cfg))
    cfg.distill.check_files()
    return replace(cfg, data=[])  # now in distill.data_files


def load_pipeline(path: str | None, overrides: list[str]) -> PipelineConfig:
    """A pipeline config from a YAML file (``recipe: pipeline``) and dotted overrides; ``smoke``
    sizes (:func:`smoke_defaults`) fill whatever neither sets."""
    import yaml

    from .config import apply_overrides

    data = (yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}) if path else {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: not a mapping of config keys")
    data = apply_overrides(data, overrides)
    if data.get("smoke") in (True, "true"):
        sources = (data.get("distill") or {}).get("sources")
        data = _merge(smoke_defaults(str(data.get("drafter", "eagle3"))), data)
        if sources is not None:  # a mapping of sources is replaced, never merged (an empty one means none)
            data["distill"]["sources"] = sources
    return from_dict(PipelineConfig, data)


def _merge(base: dict, over: dict) -> dict:
    """``over`` merged into ``base`` (nested dicts merged, dotted keys expanded)."""
    out = json.loads(json.dumps(base))
    for key, value in over.items():
        node, parts = out, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = _merge(node[parts[-1]], value)
        else:
            node[parts[-1]] = value
    return out


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- the plan
def stage_keys(cfg: PipelineConfig, identity: str) -> dict[str, str]:
    """Each stage's key: the model's ``identity``, the stage's settings and the keys before it."""
    keys, before = {}, identity
    settings = {"distill": asdict(cfg.distill) | {"dtype": cfg.load.dtype}, "train": cfg.train,
                "calibrate": asdict(cfg.calibrate), "bench": asdict(cfg.bench),
                "card": {"license": cfg.license, "base_model": cfg.base_model}, "export": sorted(cfg.export)}
    for stage in STAGES:
        extra = cfg.drafter if stage == "train" else None
        keys[stage] = before = _key(before, stage, settings[stage], extra)
    return keys


def train_config(cfg: PipelineConfig, run: Path, model=None, examples: list[dict] | None = None, text_config=None):
    """The kind's typed recipe config for this run: derived from the model (or, before it is loaded,
    its ``text_config``) and data, then ``cfg.train``."""
    from .recipes import config_class

    data = {"recipe": "train_heads", "kind": cfg.drafter, "target": cfg.model, "dataset": str(run / "distill"),
            "export": str(run / "drafter"),
            "run": {"out_dir": str(run / "train"), "report_to": cfg.report_to, "run_name": cfg.run_name or run.name,
                    "tags": list(cfg.tags), "wandb_mode": cfg.wandb_mode, "run_id": None}}
    if model is not None:
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        data["target_dtype"] = dtype if dtype in ("float32", "bfloat16", "float16") else "float32"
    text = model.config.get_text_config(decoder=True) if model is not None else text_config
    if cfg.drafter == "eagle3":
        data["export_dtype"] = "bfloat16"
        if text is not None and examples is not None:
            data["eagle3"] = {"draft_vocab_size": draft_vocab_size(examples, text.vocab_size)}
        elif text is not None:  # the plan, before any answer exists: the recipe's default size, within the vocabulary
            data["eagle3"] = {"draft_vocab_size": min(text.vocab_size, 8192)}
    elif cfg.drafter == "medusa":
        data["features"] = "online"
    elif cfg.drafter == "layerskip":
        data["features"] = "online"
        if text is not None:
            data["layerskip"] = {"exit_layer": max(1, text.num_hidden_layers // 3)}
    data = _merge(data, cfg.train)
    return from_dict(config_class(cfg.drafter), data)


def draft_vocab_size(examples: list[dict], vocab: int, coverage: float = 0.99) -> int:
    """The smallest power of two (1,024 at least, the vocabulary at most) whose most frequent
    response tokens cover ``coverage`` of the answers' tokens: the head's vocabulary follows the
    text it will draft, not a fixed size."""
    import torch

    counts = torch.zeros(vocab, dtype=torch.long)
    for ex in examples:
        ids = torch.tensor(ex["response_ids"], dtype=torch.long)
        counts += torch.bincount(ids[ids < vocab], minlength=vocab)
    total = max(1, int(counts.sum()))
    cumulative = counts.sort(descending=True).values.cumsum(0)
    size = 1024
    while size < vocab and float(cumulative[size - 1]) / total < coverage:
        size *= 2
    return min(size, vocab)


#: How much slower one sequence decodes than a batch of them, per token, in the plan (a decode step
#: reads every weight for one row): calibration and the benchmark run at batch 1.
ONE_ROW_SLOWDOWN = 8


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
    import torch

    from .dry_run import estimate, target_config

    gpu = torch.cuda.is_available() if cfg.load.device is None else cfg.load.device.startswith("cuda")
    tflops = tflops or (200.0 if gpu else 0.1)
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
    rate = tflops * 1e12 * processes / (2 * params)
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


# ---------------------------------------------------------------------------------------------- running
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
    from selfspec.fingerprint import target_fingerprint

    state = _state()
    out = Path(cfg.out)
    device = cfg.load.device or (str(state.device) if state.num_processes > 1 else None)
    manifest = Manifest(out)
    dtype = cfg.load.dtype
    if dtype == "auto" and manifest.data.get("dtype"):  # "auto" is decided once per run folder (a timing probe on a CPU)
        dtype = manifest.data["dtype"]
    model, tokenizer = selfspec.load_target(cfg.model, dtype=dtype, device=device, **cfg.load.kwargs())
    manifest.data["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    identity = _key(cfg.model, cfg.load.revision, target_fingerprint(model), str(next(model.parameters()).dtype))
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


def _state():
    from .processes import process_state

    return process_state()


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


def _tracker(tracking: dict | None, config: dict | None = None):
    from .tracking import Tracker

    t = tracking or {"report_to": "none", "out": Path(".")}
    return Tracker(t["report_to"], t["out"], name=t.get("name"), tags=t.get("tags"), run_id=t.get("run_id"),
                   config=config, wandb_mode=t.get("wandb_mode", "offline"))


def _distill(cfg, out, model, tokenizer, tracking):
    from .distill import distill

    distill(model, tokenizer, cfg.distill, out / "distill", target_name=cfg.model)
    state = _state()
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
            t.log({f"calibrate/{name}_acceptance_rank0": ranks[0]}, step=depth + 1)
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
        methods = {name: benchmark.method_from_spec(model, spec, cfg.model, False, tokenizer) for name, spec in specs.items()}
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

    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
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

__all__ = ["PipelineConfig", "STAGES", "draft_vocab_size", "dry_run_text", "load_pipeline", "plan", "prepare", "run",
           "smoke_defaults", "train_config"]
