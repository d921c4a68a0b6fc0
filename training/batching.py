"""Examples (prompt + response token ids) and their batches, shared by the recipes: loading a
distillation folder, length buckets, a seeded order, right-padded collation."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def load_distilled(path: str | Path) -> list[dict]:
    """Examples ``{prompt_ids, response_ids, source, ...}`` of a distillation folder (its shards,
    finished ones only, so a run still in progress can be read) or of a ``datasets`` folder."""
    path = Path(path)
    shards = sorted((path / "shards").glob("*.jsonl")) if (path / "shards").is_dir() else []
    if shards:
        return [json.loads(line) for s in shards for line in s.read_text(encoding="utf-8").splitlines() if line]
    if (path / "shards").is_dir():
        raise FileNotFoundError(f"{path} has no finished shard yet: let scripts/distill_data.py run longer")
    if path.is_dir():
        from datasets import load_from_disk

        return list(load_from_disk(str(path)))
    raise FileNotFoundError(f"no distilled data at {str(path)!r}: run scripts/distill_data.py first")


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


def split_examples(examples: list[dict], eval_fraction: float, seed: int, max_eval: int) -> tuple[list[dict], list[dict]]:
    """Seeded train / held-out split of the examples with a response (held-out capped at ``max_eval``)."""
    usable = [ex for ex in examples if ex["response_ids"] and ex["prompt_ids"]]
    order = torch.randperm(len(usable), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, int(len(usable) * eval_fraction))
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
