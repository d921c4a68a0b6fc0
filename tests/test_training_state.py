"""Training state and configs are validated before anything runs or resumes: a resumed state with a
bad step or optimizer tensors, config values out of range, non-finite weights; each refused with an
error that names the file and field or the dotted key, before anything is created on disk."""

from __future__ import annotations

import math

import pytest
import torch

from selfspec.checkpoint import CheckpointError, TargetIdentity, save_checkpoint
from selfspec.training.config import load_config
from selfspec.training.recipes import Eagle3TrainConfig, HeadsTrainConfig
from selfspec.training.state import STATE_JSON, STATE_TENSORS, check_train_state, optimizer_to_flat


def _optimizer():
    module = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.ones(1, 3)).sum().backward()
    opt.step()
    tensors, groups = optimizer_to_flat(opt)
    return opt, tensors, {"step": 1, "param_groups": groups}


def _bad(tensors, key, value):
    out = dict(tensors)
    if value is None:
        out.pop(key)
    else:
        out[key] = value
    return out


@pytest.mark.parametrize("field, info_patch, tensor_patch, culprit", [
    ("step", {"step": "abc"}, None, "'step'"),
    ("step", {"step": -5}, None, "'step'"),
    ("step", {"step": True}, None, "'step'"),
    ("step", {"step": 1.5}, None, "'step'"),
    ("param_groups", {"param_groups": None}, None, "'param_groups'"),
    ("shape", {}, ("optim.0.exp_avg", torch.zeros(5)), "optim.0.exp_avg has shape"),
    ("nan", {}, ("optim.0.exp_avg_sq", torch.full((2, 3), math.nan)), "non-finite"),
    ("inf", {}, ("optim.1.exp_avg", torch.full((2,), math.inf)), "non-finite"),
    ("missing", {}, ("optim.1.exp_avg_sq", None), "incomplete state"),
    ("extra", {}, ("optim.7.exp_avg", torch.zeros(2)), "unexpected"),
])
def test_a_bad_training_state_is_refused_naming_file_and_field(tmp_path, field, info_patch, tensor_patch, culprit):
    opt, tensors, info = _optimizer()
    check_train_state(tmp_path, info, tensors, opt)  # the good one passes
    if tensor_patch:
        tensors = _bad(tensors, *tensor_patch)
    with pytest.raises(CheckpointError, match=culprit) as err:
        check_train_state(tmp_path, info | info_patch, tensors, opt)
    assert (STATE_JSON if field in ("step", "param_groups") else STATE_TENSORS) in str(err.value)


BAD_CONFIG = [
    ("run.ckpt_every=0", "run.ckpt_every"), ("run.log_every=0", "run.log_every"), ("run.eval_every=-1", "run.eval_every"),
    ("max_len=0", "max_len"), ("max_len=1", "max_len"), ("eval_fraction=1.5", "eval_fraction"),
    ("eval_fraction=1", "eval_fraction"), ("eval_fraction=-0.1", "eval_fraction"), ("optim.epochs=0", "optim.epochs"),
    ("optim.epochs=-1", "optim.epochs"), ("optim.epochs=.nan", "optim.epochs"), ("optim.warmup_steps=-3", "optim.warmup_steps"),
    ("tokens_per_batch=0", "tokens_per_batch"), ("optim.lr=0", "optim.lr"), ("optim.lr=-1e-3", "optim.lr"),
    ("optim.grad_accum=0", "optim.grad_accum"), ("optim.grad_clip=-1", "optim.grad_clip"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"), ("max_eval_examples=0", "max_eval_examples"),
    ("optim.batch_size=-2", "optim.batch_size"), ("run.report_to=comet", "run.report_to"),
]


@pytest.mark.parametrize("override, key", BAD_CONFIG)
@pytest.mark.parametrize("cls", [Eagle3TrainConfig, HeadsTrainConfig])
def test_config_values_out_of_range_name_their_key(cls, override, key, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(cls, None, [override])
    assert not any(tmp_path.iterdir())  # refused before anything exists on disk


def test_non_finite_weights_are_never_saved(tmp_path):
    identity = TargetIdentity("llama", 8, 4, 1, "0" * 16)
    with pytest.raises(ValueError, match="non-finite"):
        save_checkpoint(tmp_path / "d", kind="eagle3", config={}, target=identity,
                        weights={"eagle3.w": torch.tensor([1.0, math.nan])})
    assert not (tmp_path / "d").exists()


def test_resume_without_a_checkpoint_creates_nothing(tmp_path):
    from selfspec.training.recipes import recipe_for
    from tiny_models import tiny_model

    out = tmp_path / "run"
    cfg = load_config(Eagle3TrainConfig, None, [f"run.out_dir={out}", "run.report_to=none"])
    recipe = recipe_for(cfg, model=tiny_model("llama", vocab=64, dtype=torch.float32), examples=[])
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint"):
        recipe.setup(resume=True)
    assert not out.exists()
