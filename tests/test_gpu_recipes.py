"""The GPU recipes (``configs/eagle3/llama3.1-8b.yaml``, ``configs/medusa/qwen2.5-7b.yaml``) run here, on CPU, through the same entry point
and code path with a tiny model of the same architecture (only sizes, paths and the step count are
overridden; bf16 mixed precision stays on, as CPU autocast), and ``--dry-run`` prints an estimate
and the exact launch command for the real target without loading it."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_training import saved_target_and_data
from selfspec.training.jobs import load_any
from selfspec.training.dry_run import KNOWN_TARGETS

ROOT = Path(__file__).resolve().parents[1]
GPU_CONFIGS = [ROOT / "configs" / "eagle3" / "llama3.1-8b.yaml", ROOT / "configs" / "medusa" / "qwen2.5-7b.yaml"]
FAMILY = {"qwen2": "qwen2", "llama": "llama"}


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one process-wide state: earlier tests made it with mixed_precision "no", and
    a bf16 recipe in the same process must start from a fresh one (as a new process would)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _train_heads():
    from selfspec.commands.train import main

    return main


def test_there_are_gpu_recipes_for_medusa_and_eagle3():
    assert {load_any(p).kind for p in GPU_CONFIGS} >= {"medusa", "eagle3"}


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=[p.name for p in GPU_CONFIGS])
def test_gpu_recipe_runs_on_a_tiny_model_of_its_architecture(path, tmp_path, capsys):
    cfg = load_any(path)
    family = FAMILY[KNOWN_TARGETS[cfg.target]["model_type"]]
    saved_target_and_data(tmp_path, family, layers=8, n=10, new=16)
    overrides = [f"target={tmp_path / 'model'}", f"dataset={tmp_path / 'data'}", f"run.out_dir={tmp_path / 'run'}",
                 f"export={tmp_path / 'exported'}", "run.wandb_mode=disabled", "run.eval_every=2", "run.ckpt_every=2",
                 "optim.warmup_steps=1", "eval_fraction=0.2"]
    if cfg.kind == "eagle3":
        overrides += ["eagle3.draft_vocab_size=32", "tokens_per_batch=64", "optim.epochs=0.2", "max_eval_examples=2"]
    else:
        overrides += ["optim.batch_size=32", "optim.epochs=0.5", "max_len=64"]
    _train_heads()(["--config", str(path), *overrides])
    assert "steps" in capsys.readouterr().out
    import selfspec

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    drafter = selfspec.load_drafter(tmp_path / "exported", model)
    assert drafter.kind == cfg.kind


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=[p.name for p in GPU_CONFIGS])
def test_dry_run_estimates_the_real_target_without_loading_it(path, capsys):
    _train_heads()(["--config", str(path), "--dry-run", "--processes", "8"])
    out = capsys.readouterr().out
    cfg = load_any(path)
    assert f"command: accelerate launch --multi_gpu --num_processes 8 --mixed_precision {cfg.run.mixed_precision} " \
           f"-m selfspec.cli train --config {path}" in out
    assert "memory per process" in out and "B parameters" in out
    params = float(out.split("(")[1].split("B parameters")[0])
    assert 6.5 < params < 8.5  # a 7-8B target, from its published config (meta device: no weights)
    _train_heads()(["--config", str(path), "--dry-run"])  # one process: the shipped recipe fits an 80 GB card
    one = capsys.readouterr().out
    assert float(one.split("memory per process: ")[1].split(" GiB")[0]) < 75
