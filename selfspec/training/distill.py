"""Self-distillation data: the target answers prompts, drafters learn the target's own outputs.

Pipeline: prompts from the shared prompt sets are rendered with the target's chat template, the
target answers them with batched ``model.generate`` (greedy for most, sampled for a share), and
the (prompt ids, response ids) pairs are stored as a ``datasets`` dataset on disk with a
``provenance.json`` (target fingerprint, config, counts, wall time).

Sources: GSM8K train, HumanEval, BFCL (past the held-out records), the shared chat/instruction
prompt set (``chat``: ``chat_prompts.jsonl``, first user turn) and tool-calling prompt set
(``tools``: ``tool_prompts.jsonl.gz``, tools rendered into the system message the way the benchmark
renders BFCL's). All prompts are shuffled together with a fixed seed, so every prefix of the shards
is a representative mix (training may start on a partial run).

Resumable: answers are written shard by shard (atomically, fsynced); a rerun skips finished shards.
The output folder is keyed by a manifest (target fingerprint + config): a rerun with another target
or config refuses to mix its answers with the old shards. Held out by default: MT-Bench (the
benchmark's prompts), the first ``holdout`` BFCL records of each file and every prompt whose text
equals a benchmark prompt, so benchmark numbers are not measured on training prompts.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfspec.chat import encode_chat
from selfspec.loading import DEFAULT_TARGET
from selfspec.fingerprint import target_fingerprint
from selfspec.measurement.workloads import benchmark_prompts, load_bfcl, tool_system_message

from selfspec.checkpoint import atomic_write_text


@dataclass
class DistillConfig:
    """What to distil and how.

    Attributes:
        sources: number of prompts per source (gsm8k, bfcl_simple, bfcl_multiple, humaneval,
            mt_bench, chat, tools). A source listed with 0 takes none but still draws its seeded
            order, so the orders of the sources after it stay those of a run that took some
            (needed for ``skip`` windows); an unlisted source draws nothing.
        data_dir: folder holding the shared prompt sets.
        holdout: the first N records of each BFCL file are never used (benchmark prompts).
        max_new_tokens: answer length cap.
        batch_size: prompts generated together (left-padded).
        shard_size: prompts per resumable shard.
        sampled_every: every k-th prompt is answered by sampling (0 = greedy only).
        temperature / top_p: sampling parameters of sampled answers.
        seed: seeds prompt selection and sampling.
        skip: per source, how many prompts of its seeded order to pass over before taking
            ``sources[name]``: with the same seed, ``skip={"chat": 3000}`` takes the next window of
            chat prompts after a run that took 3000, so a new run adds answers to new prompts only.
        max_prompt_tokens: prompts longer than this (after the chat template) are skipped.
    """

    sources: dict[str, int] = field(
        default_factory=lambda: {"gsm8k": 240, "bfcl_simple": 200, "bfcl_multiple": 100, "humaneval": 80}
    )
    data_dir: str = "../shared/data"
    holdout: int = 100
    max_new_tokens: int = 192
    batch_size: int = 16
    shard_size: int = 64
    sampled_every: int = 4
    temperature: float = 0.7
    top_p: float = 0.95
    seed: int = 0
    max_prompt_tokens: int = 1024
    skip: dict[str, int] = field(default_factory=dict)


@dataclass
class DistillJob:
    """``selfspec distill`` config: which target, where to write, what to distil."""

    recipe: str = "distill"
    target: str = DEFAULT_TARGET
    out: str = "runs/distill/smollm2"
    dtype: str = "float32"
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        if self.recipe != "distill":
            raise ValueError(f"this config is for recipe {self.recipe!r}, not 'distill'")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


KNOWN_SOURCES = ("gsm8k", "bfcl_simple", "bfcl_multiple", "humaneval", "mt_bench", "chat", "tools")


def collect_prompts(cfg: DistillConfig) -> list[dict]:
    """``[{source, source_id, system, user}]`` in a fixed, seeded order (all sources shuffled
    together), without any benchmark prompt."""
    unknown = (set(cfg.sources) | set(cfg.skip)) - set(KNOWN_SOURCES)
    if unknown:
        raise ValueError(f"unknown distillation sources {sorted(unknown)}; known: {list(KNOWN_SOURCES)}")
    data = Path(cfg.data_dir)
    g = torch.Generator().manual_seed(cfg.seed)
    out: list[dict] = []

    def take(records: list, n: int, source: str) -> list:
        order = torch.randperm(len(records), generator=g).tolist()
        start = cfg.skip.get(source, 0)
        if n and start and start >= len(records):
            raise ValueError(f"source {source!r} has {len(records)} prompts: skipping {start} leaves none")
        return [records[i] for i in order[start:start + n]]

    n = cfg.sources
    if "gsm8k" in n:
        with open(data / "gsm8k" / "train.jsonl", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        out += [dict(source="gsm8k", source_id=str(i), system=None, user=r["question"])
                for i, r in enumerate(take(rows, n["gsm8k"], "gsm8k"))]
    for key, name in (("bfcl_simple", "BFCL_v4_simple_python.json"), ("bfcl_multiple", "BFCL_v4_multiple.json")):
        if key in n:
            qs = load_bfcl(data / "bfcl" / name)[cfg.holdout:]
            out += [dict(source=key, source_id=q.question_id, system=q.system, user=q.turns[0]) for q in take(qs, n[key], key)]
    if "humaneval" in n:
        with gzip.open(data / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        out += [dict(source="humaneval", source_id=r["task_id"], system=None,
                     user=f"Complete this Python function:\n```python\n{r['prompt']}```")
                for r in take(rows, n["humaneval"], "humaneval")]
    if "mt_bench" in n:
        with open(data / "mt_bench_question.jsonl", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        out += [dict(source="mt_bench", source_id=str(r["question_id"]), system=None, user=r["turns"][0])
                for r in take(rows, n["mt_bench"], "mt_bench")]
    if "chat" in n:
        with open(data / "chat_prompts.jsonl", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        out += [dict(source="chat", source_id=r["id"], system=None, user=r["messages"][0]["content"])
                for r in take(rows, n["chat"], "chat")]
    if "tools" in n:
        with gzip.open(data / "tool_prompts.jsonl.gz", "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        out += [dict(source="tools", source_id=r["id"], system=tool_system_message(r["tools"]),
                     user=r["messages"][0]["content"]) for r in take(rows, n["tools"], "tools")]
    held = benchmark_prompts(data, cfg.holdout) if not n.get("mt_bench") else set()
    out = [p for p in out if p["user"].strip() not in held]
    order = torch.randperm(len(out), generator=g).tolist()
    return [out[i] for i in order]


@torch.no_grad()
def _answer(model, tokenizer, prompts: list[dict], cfg: DistillConfig, seed: int, sampled: bool) -> list[dict]:
    """Batched generation for one group of prompts (left padding)."""
    encoded = [encode_chat(tokenizer, p["user"], system=p["system"])[0] for p in prompts]
    keep = [i for i, e in enumerate(encoded) if len(e) <= cfg.max_prompt_tokens]
    prompts, encoded = [prompts[i] for i in keep], [encoded[i] for i in keep]
    if not prompts:
        return []
    width = max(len(e) for e in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(encoded):
        ids[i, width - len(e):] = e
        mask[i, width - len(e):] = 1
    device = next(model.parameters()).device
    torch.manual_seed(seed)  # transformers' generate samples from the global RNG; seed it per batch
    kwargs = dict(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p) if sampled else dict(do_sample=False)
    out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=cfg.max_new_tokens,
                         pad_token_id=pad, **kwargs).cpu()
    eos = tokenizer.eos_token_id
    rows = []
    for p, e, seq in zip(prompts, encoded, out):
        resp = seq[width:].tolist()
        if eos in resp:
            resp = resp[: resp.index(eos) + 1]
        rows.append(dict(source=p["source"], source_id=p["source_id"], prompt_ids=e.tolist(), response_ids=resp,
                         decoding="sampled" if sampled else "greedy"))
    return rows


def distill(model, tokenizer, cfg: DistillConfig, out_dir: str | os.PathLike, *, target_name: str = "") -> Path:
    """Generate the dataset into ``out_dir`` (resuming finished shards); returns the dataset path."""
    from datasets import Dataset

    out = Path(out_dir)
    shards = out / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    _check_manifest(out, model, cfg)
    prompts = collect_prompts(cfg)
    # Interleave sampled answers: every k-th prompt is sampled.
    for i, p in enumerate(prompts):
        p["sampled"] = bool(cfg.sampled_every) and i % cfg.sampled_every == cfg.sampled_every - 1
    started = time.time()
    groups = [prompts[i: i + cfg.shard_size] for i in range(0, len(prompts), cfg.shard_size)]
    bar = tqdm(total=len(prompts), desc="self-distillation", unit="prompt")
    made, t_run = 0, time.perf_counter()
    for s, group in enumerate(groups):
        path = shards / f"{s:05d}.jsonl"
        if path.exists():
            bar.update(len(group))
            continue
        rows: list[dict] = []
        for sampled in (False, True):
            part = [p for p in group if p["sampled"] == sampled]
            part = sorted(part, key=lambda p: len(p["user"]) + len(p["system"] or ""))
            for b in range(0, len(part), cfg.batch_size):
                batch = part[b: b + cfg.batch_size]
                new = _answer(model, tokenizer, batch, cfg, cfg.seed * 100003 + s * 1009 + b, sampled)
                rows += new
                made += sum(len(r["response_ids"]) for r in new)
                bar.update(len(batch))
                bar.set_postfix(tokens=made, tok_s=f"{made / (time.perf_counter() - t_run):.0f}")
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    bar.close()
    records = [json.loads(line) for path in sorted(shards.glob("*.jsonl")) for line in open(path, encoding="utf-8")]
    dataset = Dataset.from_list(records)
    dataset.save_to_disk(str(out / "dataset"))
    provenance = dict(
        target=target_name,
        target_fingerprint=target_fingerprint(model),
        config=asdict(cfg),
        examples=len(records),
        response_tokens=sum(len(r["response_ids"]) for r in records),
        per_source={s: sum(r["source"] == s for r in records) for s in cfg.sources},
        tokens_per_source={s: sum(len(r["response_ids"]) for r in records if r["source"] == s) for s in cfg.sources},
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        wall_time_s_this_run=round(time.time() - started, 1),
        tokens_per_s_this_run=round(made / max(time.perf_counter() - t_run, 1e-9), 1),
        created=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    atomic_write_text(out / "provenance.json", json.dumps(provenance, indent=1))
    return out / "dataset"


def _check_manifest(out: Path, model, cfg: DistillConfig) -> None:
    """Write (or check) ``manifest.json``: shards only ever come from one target and config."""
    manifest = dict(target_fingerprint=target_fingerprint(model), config=asdict(cfg))
    path = out / "manifest.json"
    if path.exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        if old != manifest:
            diff = [k for k in ("target_fingerprint",) if old.get(k) != manifest[k]]
            diff += [f"config.{k}" for k in manifest["config"] if old.get("config", {}).get(k) != manifest["config"][k]]
            raise ValueError(f"{out} holds answers made with another target or config ({', '.join(diff)}); "
                             "use another output folder or delete it")
        return
    if any((out / "shards").glob("*.jsonl")):
        raise ValueError(f"{out} holds shards without a manifest: made by an older version; use another folder")
    atomic_write_text(path, json.dumps(manifest, indent=1))
