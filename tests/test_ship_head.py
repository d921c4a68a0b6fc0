"""scripts/ship_head.py: a retrained head replaces a shipped checkpoint's weights and keeps its
calibrated trees, each race record marked with the head it measured; foreign drafters refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from selfspec.checkpoint import CheckpointError, read_checkpoint
from selfspec.drafters import build_drafter, save_drafter
from tiny_models import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import ship_head  # noqa: E402


def _head(model, seed: int):
    drafter = build_drafter(model, "eagle3", draft_vocab_size=16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.head.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return drafter


def test_a_retrained_head_ships_with_the_checkpoints_calibrated_trees(tmp_path):
    model = tiny_model("llama", layers=5)
    trees = {"bfloat16": {"max_depth": 4, "max_nodes": 6, "width": 2, "branch": 2, "head_weights": "int8"},
             "float32": {"max_depth": 3, "max_nodes": 3, "width": 1, "branch": 1, "head_weights": "native"}}
    old_extra = {"training": {"run": {"out_dir": "runs/old-head"}}, "options_by_dtype": trees,
                 "calibration_by_dtype": {"bfloat16": {"chosen": "4/2/6"}, "float32": {"chosen": "chain 3"}},
                 "options_sampled_by_dtype": {"bfloat16@amx": {"max_depth": 2, "max_nodes": 3, "width": 2, "branch": 2}}}
    shipped = tmp_path / "shipped"
    save_drafter(_head(model, 0), shipped, extra=old_extra)
    meta = json.loads((shipped / "drafter.json").read_text())
    meta["config"]["max_depth"] = 3  # a float32 rewrite of the config's tree by calibrate.py
    (shipped / "drafter.json").write_text(json.dumps(meta))
    (shipped / "README.md").write_text("card")
    new = tmp_path / "new"
    save_drafter(_head(model, 1), new, extra={"training": {"run": {"out_dir": "runs/new-head"}}, "steps": 7})
    ship_head.main([str(new), str(shipped)])
    meta, weights = read_checkpoint(shipped)
    _, new_weights = read_checkpoint(new)
    assert all(torch.equal(weights[k], new_weights[k]) for k in new_weights)
    assert meta["extra"]["steps"] == 7 and meta["extra"]["training"]["run"]["out_dir"] == "runs/new-head"
    assert meta["extra"]["options_by_dtype"] == trees and meta["config"]["max_depth"] == 3
    assert meta["extra"]["options_sampled_by_dtype"]["bfloat16@amx"]["max_depth"] == 2
    assert {r["raced_with_head"] for r in meta["extra"]["calibration_by_dtype"].values()} == {"runs/old-head"}
    assert (shipped / "README.md").read_text() == "card"
    # shipping again keeps the first marks (the trees still measure the old head)
    ship_head.main([str(new), str(shipped)])
    assert read_checkpoint(shipped)[0]["extra"]["calibration_by_dtype"]["float32"]["raced_with_head"] == "runs/old-head"
    # negative controls: a head of another target, another kind
    foreign = tmp_path / "foreign"
    save_drafter(_head(tiny_model("llama", layers=5, seed=7), 2), foreign)
    with pytest.raises(CheckpointError, match="another target"):
        ship_head.main([str(foreign), str(shipped)])
    medusa = tmp_path / "medusa"
    save_drafter(build_drafter(model, "medusa", num_heads=2), medusa)
    with pytest.raises(CheckpointError, match="medusa"):
        ship_head.main([str(medusa), str(shipped)])
    after = read_checkpoint(shipped)[1]
    assert all(torch.equal(after[k], new_weights[k]) for k in new_weights)  # refused: nothing changed
