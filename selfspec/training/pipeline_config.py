"""The one-command training path's typed config (``<run>/pipeline.yaml`` is a saved copy) and what
is derived from it before anything runs: the run folder, ``--smoke`` sizes, each stage's key, the
kind's recipe config and an EAGLE-3 draft vocabulary sized from the answers.

Invariant: a stage's key is a hash of the model's identity, the stage's own settings and the keys
of the stages before it, so a change anywhere re-keys that stage and every later one.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from selfspec.model.loading import DEFAULT_TARGET

from .config import from_dict
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


def digest(*parts) -> str:
    """A short sha256 of ``parts`` (JSON, keys sorted): the stage keys and the model's identity."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stage_keys(cfg: PipelineConfig, identity: str) -> dict[str, str]:
    """Each stage's key: the model's ``identity``, the stage's settings and the keys before it."""
    keys, before = {}, identity
    settings = {"distill": asdict(cfg.distill) | {"dtype": cfg.load.dtype}, "train": cfg.train,
                "calibrate": asdict(cfg.calibrate), "bench": asdict(cfg.bench),
                "card": {"license": cfg.license, "base_model": cfg.base_model}, "export": sorted(cfg.export)}
    for stage in STAGES:
        extra = cfg.drafter if stage == "train" else None
        keys[stage] = before = digest(before, stage, settings[stage], extra)
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
    from .recipes.eagle3 import token_counts

    counts = token_counts(examples, vocab)
    total = max(1, int(counts.sum()))
    cumulative = counts.sort(descending=True).values.cumsum(0)
    size = 1024
    while size < vocab and float(cumulative[size - 1]) / total < coverage:
        size *= 2
    return min(size, vocab)
