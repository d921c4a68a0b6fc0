"""Training recipes on a tiny random model: loss goes down, resume continues, configs load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import Dataset

import selfspec
from selfspec.training.config import load_config
from selfspec.training.jobs import load_any
from selfspec.training.features import IGNORE, head_labels
from selfspec.training.recipes import HeadsTrainConfig, recipe_for
from tiny_models import tiny_model

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*/*.yaml"))


def tiny_dataset(model, n: int = 12, new: int = 24) -> Dataset:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        prompt = torch.randint(0, 64, (6,), generator=g)
        out = model.generate(prompt[None], max_new_tokens=new, do_sample=False, pad_token_id=0)[0]
        rows.append(dict(source="tiny", source_id=str(i), prompt_ids=prompt.tolist(),
                         response_ids=out[6:].tolist(), decoding="greedy"))
    return Dataset.from_list(rows)


def saved_target_and_data(folder: Path, family: str = "llama", layers: int | None = None, n: int = 12,
                          new: int = 24) -> tuple[Path, Path]:
    """A tiny float32 target with a tokenizer (``folder/model``) and its greedy self-distilled
    dataset (``folder/data``), on disk as ``scripts/train_heads.py`` reads them."""
    from tiny_models import tiny_tokenizer

    model = tiny_model(family, vocab=64, dtype=torch.float32, layers=layers)
    model.save_pretrained(folder / "model")
    tiny_tokenizer().save_pretrained(folder / "model")
    tiny_dataset(model, n, new).save_to_disk(str(folder / "data"))
    return folder / "model", folder / "data"


def tiny_config(tmp_path, **run) -> HeadsTrainConfig:
    return load_config(HeadsTrainConfig, None, [
        f"run.out_dir={tmp_path / 'run'}", "run.wandb_mode=disabled", "run.log_every=2", "run.eval_every=5",
        "run.ckpt_every=5", "optim.batch_size=32", "optim.lr=0.01", "optim.warmup_steps=1", "optim.epochs=3",
        "medusa.num_heads=3", "medusa.tree=[[0],[1],[0,0],[0,0,0]]", "tree_budget=4", "eval_fraction=0.25",
        f"export={tmp_path / 'exported'}",
    ] + [f"run.{k}={v}" for k, v in run.items()])


def cut_and_resumed(make, stop_at: int, checkpointed: int):
    """A run from ``make()`` stopped at step ``stop_at`` (as if killed), then a new one resumed from
    its last checkpoint (step ``checkpointed``) and trained to the end; returns the resumed run."""
    cut = make()
    cut.setup()
    cut.train(stop_at=stop_at)
    resumed = make()
    resumed.setup(resume=True)
    assert resumed.step == checkpointed
    resumed.train()
    return resumed


def test_head_labels_shift_by_head():
    tokens = torch.arange(10, 20)
    pos, lab = head_labels(tokens, prompt_len=4, num_heads=2)
    assert pos.tolist() == list(range(3, 9))
    assert lab[0].tolist() == [15, 16]  # at the last prompt token: head 1 guesses t+2, head 2 t+3
    assert lab[-1].tolist() == [IGNORE, IGNORE] and lab[-2].tolist() == [19, IGNORE]


def test_training_lowers_loss_and_exports_a_loadable_drafter(tmp_path):
    model = tiny_model("llama", vocab=64, dtype=torch.float32)
    data = tiny_dataset(model)
    recipe = recipe_for(tiny_config(tmp_path), model=model, dataset=data)
    recipe.setup()
    before = recipe.evaluate()["eval/loss"]
    recipe.train()
    after = recipe.evaluate()["eval/loss"]
    summary = recipe.export()
    recipe.cleanup()
    assert after < before - 0.1, (before, after)
    drafter = selfspec.load_drafter(tmp_path / "exported", model)
    assert drafter.template.to_list() == summary["tree"]
    assert (tmp_path / "run" / "training_curves.png").stat().st_size > 1000
    logged = [r for r in recipe.history if "train/loss" in r][-1]
    assert logged["train/seconds_per_step"] > 0 and 0 < logged["train/peak_memory_gib"] < 64  # sizing a machine
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])
    reference = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(selfspec.generate(model, prompt, drafter=drafter, max_new_tokens=16).sequences, reference)
    # a second run exporting to the same folder is refused before it trains (shipped checkpoints
    # and their calibration are never overwritten by accident) unless overwrite_export is set
    again = recipe_for(tiny_config(tmp_path), model=model, dataset=data)
    with pytest.raises(FileExistsError, match="overwrite_export"):
        again.setup()


def test_resume_continues_from_the_saved_step(tmp_path):
    model = tiny_model("llama", vocab=64, dtype=torch.float32)
    data = tiny_dataset(model)
    full = recipe_for(tiny_config(tmp_path / "a"), model=model, dataset=data)
    full.setup()
    full.train()
    # the same run, "killed" two steps after its first checkpoint (step 5), then resumed: those two are lost
    resumed = cut_and_resumed(lambda: recipe_for(tiny_config(tmp_path / "b"), model=model, dataset=data), 7, 5)
    for a, b in zip(full.trainable.parameters(), resumed.trainable.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", CONFIGS, ids=[f"{p.parent.name}/{p.name}" for p in CONFIGS])
def test_every_config_loads(path):
    cfg = load_any(path)
    assert cfg.recipe in ("distill", "train_heads")


def test_unknown_config_key_is_named(tmp_path):
    with pytest.raises(ValueError, match="optim.lrr"):
        load_config(HeadsTrainConfig, None, ["optim.lrr=1"])


def test_config_values_take_their_field_types_or_are_refused_by_name(tmp_path):
    cfg = load_config(HeadsTrainConfig, None, ["optim.lr=3e-4", "optim.epochs=2", "run.seed=7"])
    assert isinstance(cfg.optim.lr, float) and cfg.optim.lr == 3e-4 and isinstance(cfg.optim.epochs, float)
    path = tmp_path / "c.yaml"
    path.write_text('optim:\n  lr: "3e-4"\n  warmup_steps: 10.0\n')  # YAML 1.1 reads 3e-4 as a string
    cfg = load_config(HeadsTrainConfig, path)
    assert cfg.optim.lr == 3e-4 and cfg.optim.warmup_steps == 10 and isinstance(cfg.optim.warmup_steps, int)
    for bad, words in [("optim.lr=fast", ["optim.lr", "float", "'fast'"]),
                       ("optim.warmup_steps=2.5", ["optim.warmup_steps", "int", "2.5"]),
                       ("optim.grad_accum=true", ["optim.grad_accum", "int", "True"]),
                       ("run.wandb_mode=[1]", ["run.wandb_mode", "str"])]:
        with pytest.raises(ValueError) as err:
            load_config(HeadsTrainConfig, None, [bad])
        assert all(w in str(err.value) for w in words), (bad, str(err.value))


def test_resume_refuses_a_changed_config_and_never_overwrites_the_stored_one(tmp_path):
    from selfspec.checkpoint import CheckpointError

    model = tiny_model("llama", vocab=64, dtype=torch.float32)
    data = tiny_dataset(model)
    first = recipe_for(tiny_config(tmp_path), model=model, dataset=data)
    first.setup()
    first.train(stop_at=6)
    stored = (tmp_path / "run" / "config.yaml").read_text()
    changed = load_config(HeadsTrainConfig, None, [f"run.out_dir={tmp_path / 'run'}", "run.wandb_mode=disabled",
                                                  "optim.lr=0.5"])
    with pytest.raises(ValueError, match="optim.lr"):
        recipe_for(changed, model=model, dataset=data).setup(resume=True)
    allowed = recipe_for(tiny_config(tmp_path, seed=3), model=model, dataset=data)
    allowed.setup(resume=True, allow_config_change=True)
    assert allowed.step == 5
    assert (tmp_path / "run" / "config.yaml").read_text() == stored
    assert "seed: 3" in (tmp_path / "run" / "config.resumed-5.yaml").read_text()
    state = tmp_path / "run" / "checkpoint" / "train_state.safetensors"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError, match="corrupt"):
        recipe_for(tiny_config(tmp_path), model=model, dataset=data).setup(resume=True)


def test_layerskip_training_lowers_loss_resumes_and_exports(tmp_path):
    """The exit adapter on a 4-layer model (exit after layer 2) learns the full model's law,
    resumes from its checkpoint, and exports a drafter whose greedy output is still exact."""
    model = tiny_model("llama", vocab=64, dtype=torch.float32, layers=4)
    with torch.no_grad():  # make the skipped layers matter, so the plain exit is a poor draft
        for layer in model.model.layers[2:]:
            layer.mlp.down_proj.weight.mul_(20)
    data = tiny_dataset(model)
    overrides = [f"run.out_dir={tmp_path / 'run'}", "run.wandb_mode=disabled", "run.log_every=2",
                 "run.eval_every=5", "run.ckpt_every=5", "optim.batch_size=32", "optim.lr=0.01",
                 "optim.warmup_steps=1", "optim.epochs=3", "kind=layerskip", "layerskip.exit_layer=2",
                 "loss=kl", "eval_fraction=0.25", f"export={tmp_path / 'exported'}"]
    recipe = recipe_for(load_config(HeadsTrainConfig, None, overrides), model=model, dataset=data)
    recipe.setup()
    assert recipe.features.exit_hidden.shape == recipe.features.hidden.shape
    before = recipe.evaluate()["eval/loss"]
    recipe.train(stop_at=7)
    resumed = recipe_for(load_config(HeadsTrainConfig, None, overrides), model=model, dataset=data)
    resumed.setup(resume=True)
    assert resumed.step == 5
    resumed.train()
    after = resumed.evaluate()["eval/loss"]
    resumed.export()
    assert after < 0.85 * before, (before, after)  # an untrained (identity) adapter scores before
    drafter = selfspec.load_drafter(tmp_path / "exported", model)
    assert drafter.kind == "layerskip" and drafter.config.exit_layer == 2
    for a, b in zip(drafter.adapter.parameters(), resumed.trainable.parameters()):
        torch.testing.assert_close(a, b)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])
    reference = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(selfspec.generate(model, prompt, drafter=drafter, max_new_tokens=16).sequences, reference)


def test_layerskip_training_refuses_a_plain_exit():
    with pytest.raises(ValueError, match="pick_exit_layer"):
        load_config(HeadsTrainConfig, None, ["kind=layerskip", "layerskip.adapter=none"])


@pytest.mark.parametrize("kind", ["medusa", "layerskip"])
def test_online_features_equal_the_cached_ones(kind):
    """One padded target pass over several examples gives the cached features, positions and labels."""
    from selfspec.training.features import batch_features, build_features

    model = tiny_model("llama", vocab=64, layers=4)  # float64
    data = tiny_dataset(model.float(), n=5, new=12)
    model.double()
    rows = [dict(r) for r in data]
    rows[2]["response_ids"] = rows[2]["response_ids"][:5]  # lengths differ: padding inside the batch
    opts = dict(exit_layer=2, first=1) if kind == "layerskip" else dict(first=2)
    k = 1 if kind == "layerskip" else 3
    a = build_features(model, rows, k, dtype=torch.float64, progress=False, **opts)
    b = batch_features(model, rows, k, dtype=torch.float64, **opts)
    for name in ("positions", "labels", "example"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(b.hidden, a.hidden, rtol=0, atol=1e-10)
    if kind == "layerskip":
        torch.testing.assert_close(b.exit_hidden, a.exit_hidden, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["medusa", "layerskip"])
def test_online_training_lowers_loss_resumes_exactly_and_exports(tmp_path, kind):
    """features: online (the GPU recipes' mode): no feature file is written, the loss falls, a run
    cut after its checkpoint resumes to the weights of an uninterrupted one, the export loads."""
    model = tiny_model("llama", vocab=64, dtype=torch.float32, layers=4)
    data = tiny_dataset(model, n=16)
    extra = ["kind=layerskip", "layerskip.exit_layer=2", "loss=kl"] if kind == "layerskip" else []

    def config(folder):
        return load_config(HeadsTrainConfig, None, [
            f"run.out_dir={folder}", "run.wandb_mode=disabled", "run.log_every=2", "run.eval_every=100",
            "run.ckpt_every=3", "features=online", "tokens_per_batch=128", "max_len=64", "optim.lr=0.01",
            "optim.warmup_steps=1", "optim.epochs=4", "eval_fraction=0.25", "medusa.num_heads=2",
            "medusa.tree=[[0],[1],[0,0]]", "tree_budget=3", f"export={folder / 'exported'}"] + extra)

    full = recipe_for(config(tmp_path / "a"), model=model, dataset=data)
    full.setup()
    before = full.evaluate()["eval/loss"]
    full.train()
    assert full.evaluate()["eval/loss"] < before
    summary = full.export()
    assert summary["features"] == "online" and not (tmp_path / "a" / "features.safetensors").exists()
    assert full.total_steps > 6
    resumed = cut_and_resumed(lambda: recipe_for(config(tmp_path / "b"), model=model, dataset=data), 5, 3)
    for a, b in zip(full.trainable.parameters(), resumed.trainable.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert selfspec.load_drafter(tmp_path / "a" / "exported", model).kind == kind


def test_overrides_keep_yaml_1_1_words_as_strings():
    """``run.mixed_precision=no`` must reach accelerate as the word ``no`` (YAML 1.1 reads it as
    False, which accelerate rejects); ``true`` / ``false`` still give booleans."""
    from selfspec.training.config import apply_overrides

    data = apply_overrides({}, ["run.mixed_precision=no", "a.b=true", "a.c=False", "a.d=3", "a.e=on"])
    assert data == {"run": {"mixed_precision": "no"}, "a": {"b": True, "c": False, "d": 3, "e": "on"}}
