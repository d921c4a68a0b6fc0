"""Self-distillation pipeline on a tiny model with a tokenizer trained in code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import load_from_disk

from training.distill import DistillConfig, collect_prompts, distill
from tiny_models import tiny_model, tiny_tokenizer

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
pytestmark = pytest.mark.skipif(not DATA.exists(), reason="shared/data not beside the checkout")


def config(**kw) -> DistillConfig:
    base = dict(sources={"gsm8k": 3, "bfcl_simple": 2, "humaneval": 1}, data_dir=str(DATA), max_new_tokens=6,
                batch_size=2, shard_size=3, sampled_every=2, max_prompt_tokens=10**6)
    return DistillConfig(**(base | kw))


def test_prompt_selection_is_seeded_and_holds_out_benchmark_prompts():
    a, b = collect_prompts(config()), collect_prompts(config())
    assert a == b and len(a) == 6
    bfcl = [p for p in a if p["source"] == "bfcl_simple"]
    assert all(int(p["source_id"].rsplit("_", 1)[1]) >= 100 for p in bfcl)
    assert collect_prompts(config(seed=1)) != a


def test_distill_writes_a_dataset_and_resumes_from_shards(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model("llama", vocab=len(tok), dtype=torch.float32)
    path = distill(model, tok, config(), tmp_path / "d", target_name="tiny")
    ds = load_from_disk(str(path))
    assert len(ds) == 6 and set(ds["decoding"]) == {"greedy", "sampled"}
    assert all(1 <= len(r) <= 6 for r in ds["response_ids"])
    shard = sorted((tmp_path / "d" / "shards").glob("*.jsonl"))[0]
    before = shard.read_text()
    (sorted((tmp_path / "d" / "shards").glob("*.jsonl"))[-1]).unlink()  # "interrupted" before the last shard
    again = distill(model, tok, config(), tmp_path / "d", target_name="tiny")
    assert shard.read_text() == before and len(load_from_disk(str(again))) == 6
    assert (tmp_path / "d" / "provenance.json").exists()
