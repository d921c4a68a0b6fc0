"""The Medusa heads drafter through the core engine's exactness harness, and its checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

import selfspec
from selfspec.checkpoint import CheckpointError
from selfspec.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from selfspec.decoding.sampling import SamplingConfig
from stubs import FakeLM
import selfspec.decoding.verify as verify_mod
from test_distribution import SAMPLES, SETTINGS, _stale_bonus, chi_square_ok, control_samples, draw_with, exact_law
from tiny_models import FAMILIES, tiny_model

VOCAB = 64
PROMPT = torch.tensor([[3, 9, 27, 3, 9, 27, 3, 9, 5, 11]])


def random_heads(drafter: MedusaDrafter, seed: int = 0, scale: float = 0.5) -> MedusaDrafter:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return drafter


@pytest.mark.parametrize("family", FAMILIES)
def test_random_heads_greedy_identity(family):
    model = tiny_model(family, vocab=VOCAB)
    reference = model.generate(PROMPT, max_new_tokens=30, do_sample=False, pad_token_id=0)
    for drafter in (selfspec.build_drafter(model, "medusa"), random_heads(selfspec.build_drafter(model, "medusa"))):
        out = selfspec.generate(model, PROMPT, drafter=drafter, max_new_tokens=30)
        assert torch.equal(out.sequences, reference)
        assert out.stats.draft_nodes > 0  # the heads really drafted (hidden states reached them)


def test_heads_that_copy_the_target_are_accepted():
    """A head whose block is the identity predicts what the LM head predicts at the same hidden
    state; on a model whose next token ignores position (a 2-cycle), such drafts are always right."""
    model = tiny_model("llama", vocab=VOCAB)
    drafter = selfspec.build_drafter(model, "medusa", num_heads=2, tree=[[0], [0, 0]])
    reference = model.generate(PROMPT, max_new_tokens=20, do_sample=False, pad_token_id=0)
    out = selfspec.generate(model, PROMPT, drafter=drafter, max_new_tokens=20)
    assert torch.equal(out.sequences, reference)


@pytest.mark.parametrize("setting,lossy", [("T1", False), ("T0.7-topk3", False), ("T1", True)])
def test_random_heads_keep_the_target_law(setting, lossy, monkeypatch):
    """The heads' point-mass trees through the decode-loop harness; with a stale bonus token
    (drawn from the parent's law, ``lossy``) the same harness must fail."""
    cfg = SETTINGS[setting]
    if lossy:
        monkeypatch.setattr(verify_mod, "_verify_sampled", _stale_bonus)
    lm = FakeLM(vocab=6, hidden=8)
    heads = MedusaHeads(MedusaConfig(num_heads=2, tree=[[0], [1], [2], [0, 0], [1, 0]]), 8).double()
    drafter = random_heads(MedusaDrafter(lm, heads), scale=1.0)
    n = control_samples(SAMPLES) if lossy else SAMPLES
    ok, msg = chi_square_ok(exact_law(cfg, prompt=[1, 2, 3]), draw_with(cfg, drafter, n=n, hidden_size=8, prompt=[1, 2, 3]),
                            n=n)
    assert ok != lossy, msg


def test_checkpoint_round_trip_gives_identical_proposals(tmp_path):
    model = tiny_model("qwen3", vocab=VOCAB)
    drafter = random_heads(selfspec.build_drafter(model, "medusa", num_layers=2))
    selfspec.save_drafter(drafter, tmp_path / "ckpt", extra={"note": "test"})
    loaded = selfspec.load_drafter(tmp_path / "ckpt", model)
    h = torch.randn(32, dtype=torch.float64)
    torch.testing.assert_close(loaded.heads.logits(model, h), drafter.heads.logits(model, h), rtol=0, atol=0)
    assert loaded.template.paths == drafter.template.paths
    from selfspec.checkpoint import read_checkpoint

    assert read_checkpoint(tmp_path / "ckpt")[0]["extra"]["note"] == "test"
    a = selfspec.generate(model, PROMPT, drafter=drafter, max_new_tokens=20)
    b = selfspec.generate(model, PROMPT, drafter=loaded, max_new_tokens=20)
    assert torch.equal(a.sequences, b.sequences) and a.stats.steps == b.stats.steps


def test_foreign_and_corrupt_checkpoints_are_refused(tmp_path):
    model = tiny_model("llama", vocab=VOCAB)
    path = tmp_path / "ckpt"
    selfspec.save_drafter(selfspec.build_drafter(model, "medusa"), path)

    other_arch = tiny_model("qwen3", vocab=VOCAB)
    with pytest.raises(CheckpointError, match="model_type"):
        selfspec.load_drafter(path, other_arch)
    same_arch_other_weights = tiny_model("llama", vocab=VOCAB, seed=1)
    with pytest.raises(CheckpointError, match="fingerprint"):
        selfspec.load_drafter(path, same_arch_other_weights)

    weights = path / "adapter.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        selfspec.load_drafter(path, model)
    weights.unlink()
    with pytest.raises(CheckpointError, match="partial"):
        selfspec.load_drafter(path, model)
    (path / "drafter.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        selfspec.load_drafter(path, model)
    (path / "drafter.json").write_text(json.dumps({"format": "selfspec-drafter", "version": 1, "kind": "medusa"}))
    (path / "adapter.safetensors").write_bytes(data)
    with pytest.raises(CheckpointError, match="no valid target identity"):
        selfspec.load_drafter(path, model)
    (path / "drafter.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="not a selfspec drafter config"):
        selfspec.load_drafter(path, model)
    with pytest.raises(CheckpointError, match="no drafter checkpoint folder"):
        selfspec.load_drafter(tmp_path / "missing", model)


def test_bad_medusa_options():
    model = tiny_model("llama", vocab=VOCAB)
    with pytest.raises(ValueError, match="unknown medusa drafter options"):
        selfspec.build_drafter(model, "medusa", heads=3)
    with pytest.raises(ValueError, match="exceeds num_heads"):
        selfspec.build_drafter(model, "medusa", num_heads=1, tree=[[0], [0, 0]])


def test_drafter_specs(tmp_path, monkeypatch):
    from selfspec import drafters

    model = tiny_model("llama", vocab=VOCAB)
    assert drafters.drafter_from_spec(model, "none") is None
    assert drafters.drafter_from_spec(model, "ngram:max_depth=5").config.max_depth == 5
    assert drafters.drafter_from_spec(model, "medusa:num_heads=2").heads.cfg.num_heads == 2
    with pytest.raises(ValueError, match="no medusa checkpoint is shipped"):
        drafters.drafter_from_spec(model, "medusa", "tiny")
    selfspec.save_drafter(selfspec.build_drafter(model, "medusa"), tmp_path / "tiny-medusa")
    assert drafters.drafter_from_spec(model, str(tmp_path / "tiny-medusa")).kind == "medusa"
    monkeypatch.setattr(drafters, "SHIPPED_CHECKPOINTS", tmp_path)
    assert drafters.drafter_from_spec(model, "medusa", "tiny").kind == "medusa"
    union = drafters.drafter_from_spec(model, "medusa:num_heads=2+ngram")  # a union: a list for the controller
    assert [m.kind for m in union] == ["medusa", "ngram"]
    with pytest.raises(ValueError, match="unknown drafter kind 'union'"):
        drafters.drafter_from_spec(model, "union:max_nodes=3")


def test_union_of_heads_and_ngram_is_exact_and_merges_prefixes():
    model = tiny_model("gemma3", vocab=VOCAB)
    reference = model.generate(PROMPT, max_new_tokens=30, do_sample=False, pad_token_id=0)
    heads = random_heads(selfspec.build_drafter(model, "medusa"))
    ngram = selfspec.build_drafter(model, "ngram", min_ngram=1)
    for control in (None, False):
        out = selfspec.generate(model, PROMPT, drafter=[heads, ngram], max_new_tokens=30, control=control)
        assert torch.equal(out.sequences, reference)
    from selfspec.control import ControlConfig, Controller, CostModel
    from selfspec.drafters.base import DraftContext

    ctx = DraftContext(PROMPT[0], None, 8, SamplingConfig(), torch.Generator())
    union = Controller([heads, ngram], ControlConfig(fixed=True), cost=CostModel.flat())
    tree = union.propose(ctx).tree  # no hidden state yet: only the n-gram member drafts
    assert tree.num_nodes == ngram.propose(ctx).num_nodes
    tokens = [tuple(tree.tokens[tree.path_to(i)].tolist()) for i in range(tree.num_nodes)]
    assert len(tokens) == len(set(tokens)), "shared prefixes must be merged"
