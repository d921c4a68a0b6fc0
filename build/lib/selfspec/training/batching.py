"""Examples (prompt + response token ids) and their batches, shared by the recipes: loading a
distillation folder, length buckets, a seeded order, right-padded collation."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def shard_selection(spec: str | Path) -> tuple[Path, slice | None]:
    """``"folder"`` or ``"folder[a:b]"`` -> ``(folder, slice)``: a distillation folder, optionally
    restricted to a range of its shards in file-name order (``[6:]``: all but the first six;
    ``[:6]``: the first six). Lets one window hold both a held-out set and training data."""
    text = str(spec)
    if not text.endswith("]") or "[" not in text or Path(text).exists():  # (a folder named like that)
        return Path(text), None
    folder, _, rng = text[:-1].rpartition("[")
    parts = rng.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        lo, hi = (int(p) if p.strip() else None for p in parts)
    except ValueError:
        raise ValueError(f"{text!r}: a shard range is written folder[a:b] with integers a, b (either may be left out)") from None
    if (lo is not None and lo < 0) or (hi is not None and hi < 0):
        raise ValueError(f"{text!r}: shard ranges count from the first shard (no negative bounds)")
    return Path(folder), slice(lo, hi)


def dataset_specs(spec) -> list[str]:
    """A config's ``dataset``: one folder spec or a list of them -> the list (refuses an empty one)."""
    raw = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    specs = [str(s) for s in raw if s is not None and str(s).strip()]
    if not raw or len(specs) != len(raw):
        raise ValueError(f"dataset must name at least one distillation folder, got {spec!r}")
    return specs


def load_distilled(path) -> list[dict]:
    """Examples ``{prompt_ids, response_ids, source, ...}`` of a distillation folder (its shards,
    finished ones only, so a run still in progress can be read), of a shard range of one
    (``folder[a:b]``, see :func:`shard_selection`) or of a ``datasets`` folder; a list of such
    specs gives their examples concatenated in order."""
    if isinstance(path, (list, tuple)):
        return [ex for spec in dataset_specs(path) for ex in load_distilled(spec)]
    path, chosen = shard_selection(path)
    shards = sorted((path / "shards").glob("*.jsonl")) if (path / "shards").is_dir() else []
    if chosen is not None:
        if not shards:
            raise FileNotFoundError(f"{str(path)!r} has no finished shards to take the range [{chosen.start}:{chosen.stop}] of")
        if chosen.stop is not None and chosen.stop > len(shards):
            raise ValueError(f"shard range [{chosen.start}:{chosen.stop}] of {str(path)!r}, which has {len(shards)} finished shards")
        total, shards = len(shards), shards[chosen]
        if not shards:
            raise ValueError(f"shard range [{chosen.start}:{chosen.stop}] of {str(path)!r} is empty ({total} finished shards)")
    if shards:
        return shard_records(shards)
    if (path / "shards").is_dir():
        raise FileNotFoundError(f"{path} has no finished shard yet: let selfspec distill run longer")
    if path.is_dir():
        from datasets import load_from_disk

        return list(load_from_disk(str(path)))
    raise FileNotFoundError(f"no distilled data at {str(path)!r}: run selfspec distill first")


def shard_records(files) -> list[dict]:
    """The records of distillation shard files (JSON lines), in order."""
    return [json.loads(line) for f in files for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]


def length_buckets(examples: list[dict], max_len: int, tokens_per_batch: int) -> list[list[int]]:
    """Example indices grouped by length into batches of at most ``tokens_per_batch`` padded
    tokens (a fixed list: with :func:`batch_at` the data order is a pure function of seed and step)."""
    lengths = [min(len(e["prompt_ids"]) + len(e["response_ids"]), max_len) for e in examples]
    order = sorted(range(len(examples)), key=lambda i: lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > tokens_per_batch:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def batch_at(batches: list[list[int]], step: int, seed: int) -> list[int]:
    """The batch of ``step``: each epoch visits every batch once, in a seeded order."""
    epoch, i = divmod(step, len(batches))
    perm = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    return batches[int(perm[i])]


def collate(examples: list[dict], max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [B, T] right-padded with 0, lengths [B], prompt lengths [B])``, cut at ``max_len``."""
    cut = [(e["prompt_ids"] + e["response_ids"])[:max_len] for e in examples]
    ids = torch.zeros(len(cut), max(len(c) for c in cut), dtype=torch.long)
    for b, c in enumerate(cut):
        ids[b, : len(c)] = torch.tensor(c)
    return ids, torch.tensor([len(c) for c in cut]), torch.tensor([len(e["prompt_ids"]) for e in examples])


def split_examples(examples: list[dict], eval_fraction: float, seed: int, max_eval: int | None
                   ) -> tuple[list[dict], list[dict]]:
    """Seeded train / held-out split of the examples with a response (held-out capped at
    ``max_eval``; ``None``: no cap)."""
    usable = [ex for ex in examples if ex["response_ids"] and ex["prompt_ids"]]
    order = torch.randperm(len(usable), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, int(len(usable) * eval_fraction))
    if len(usable) <= n_eval:
        raise ValueError(f"{len(usable)} usable examples (prompt and answer) leave none to train on after holding "
                         f"out {n_eval} for evaluation: distil more prompts")
    return [usable[i] for i in order[n_eval:]], [usable[i] for i in order[:n_eval]][:max_eval]


def held_out_dataset(train: list[dict], held: list[dict], seed: int, max_eval: int
                     ) -> tuple[list[dict], list[dict], int]:
    """``(train_set, eval_set, dropped)``: every usable example of ``train`` for training and a seeded
    sample of at most ``max_eval`` usable examples of ``held`` for evaluation, none of whose prompts
    occurs in ``train`` (``dropped`` counts those removed for that). Refuses an empty result."""
    usable = lambda rows: [ex for ex in rows if ex["response_ids"] and ex["prompt_ids"]]  # noqa: E731
    train, held = usable(train), usable(held)
    seen = {tuple(ex["prompt_ids"]) for ex in train}
    fresh = [ex for ex in held if tuple(ex["prompt_ids"]) not in seen]
    if not train or not fresh:
        raise ValueError(f"held-out dataset: {len(train)} training and {len(fresh)} unseen held-out examples; "
                         "both must be non-empty")
    order = torch.randperm(len(fresh), generator=torch.Generator().manual_seed(seed)).tolist()
    return train, [fresh[i] for i in order[:max_eval]], len(held) - len(fresh)
