"""Self-distillation pipeline on a tiny model with a tokenizer trained in code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from training.distill import DistillConfig, collect_prompts, distill
from tiny_models import tiny_model

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
pytestmark = pytest.mark.skipif(not DATA.exists(), reason="shared/data not beside the checkout")
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}<assistant>"


def tiny_tokenizer(vocab: int = 128) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x): return x + 1", "What is 3 + 4?", "{\"name\": \"f\"}"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="</s>")
    fast.chat_template = TEMPLATE
    return fast


def config(**kw) -> DistillConfig:
    base = dict(sources={"gsm8k": 3, "bfcl_simple": 2, "humaneval": 1}, data_dir=str(DATA), max_new_tokens=6,
                batch_size=2, shard_size=3, sampled_every=2)
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
