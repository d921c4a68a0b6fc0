"""Writes replace only what they wrote: an export or a training run's export over a folder that holds
anything else (other checkpoints, the source checkpoint, unrelated files, the current folder) is
refused, naming the folder and what is in it; an earlier export of the same kind is replaced."""

from __future__ import annotations

import os

import pytest
import torch

import selfspec
from selfspec.checkpoint import check_replaceable
from selfspec.export import ExportError, export_drafter
from selfspec.training.state import check_export_target
from tiny_models import tiny_model


@pytest.fixture()
def head(tmp_path):
    model = tiny_model("llama", vocab=64, dtype=torch.float32, layers=4)
    drafter = selfspec.build_drafter(model, "eagle3", draft_vocab_size=32)
    folder = tmp_path / "checkpoints" / "mine-eagle3"
    selfspec.save_drafter(drafter, folder)
    (tmp_path / "checkpoints" / "other-eagle3").mkdir()
    (tmp_path / "checkpoints" / "other-eagle3" / "drafter.json").write_text("{}")
    return model, drafter, folder


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("where", ["parent", "source", "sibling", "unrelated", "dot"])
def test_an_export_never_replaces_a_folder_it_did_not_write(head, tmp_path, where, monkeypatch):
    model, drafter, folder = head
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    out = {"parent": folder.parent, "source": folder, "sibling": folder.parent / "other-eagle3",
           "unrelated": tmp_path / "notes", "dot": "."}[where]
    monkeypatch.chdir(tmp_path / "notes" if where == "dot" else tmp_path)
    before = _listing(tmp_path)
    with pytest.raises(ExportError) as err:
        export_drafter(drafter, out, "eagle3", overwrite=True)
    assert os.path.abspath(out) in str(err.value) or "drafter checkpoint" in str(err.value)
    assert _listing(tmp_path) == before  # nothing deleted, no staging folder left


def test_an_earlier_export_is_replaced_and_a_non_empty_folder_needs_overwrite(head, tmp_path):
    _, drafter, _ = head
    out = tmp_path / "export"
    export_drafter(drafter, out, "eagle3")
    with pytest.raises(ExportError, match="not empty"):
        export_drafter(drafter, out, "eagle3")
    export_drafter(drafter, out, "eagle3", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_training_export_refuses_a_folder_with_a_card_or_other_files(head, tmp_path):
    _, _, folder = head
    check_export_target(str(folder), overwrite=True)  # a drafter's own two files: replaceable
    (folder / "README.md").write_text("card")
    with pytest.raises(FileExistsError, match="README.md"):
        check_export_target(str(folder), overwrite=True)
    with pytest.raises(FileExistsError, match="mine-eagle3, other-eagle3"):
        check_export_target(str(folder.parent), overwrite=True)
    with pytest.raises(FileExistsError, match="overwrite_export"):
        check_export_target(str(folder), overwrite=False)
    with pytest.raises(FileExistsError, match="is a file"):
        check_replaceable(folder / "README.md", {"x"}, "export")
