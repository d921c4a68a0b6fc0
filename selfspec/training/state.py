"""Resumable training state in safetensors (never pickles).

A training checkpoint folder holds the drafter checkpoint (``drafter.json`` +
``adapter.safetensors``, loadable with ``selfspec.load_drafter``) plus ``train_state.safetensors``
(optimizer moments, flattened as ``optim.<param index>.<name>``) and ``train_state.json`` (step,
param groups, config). The whole folder is replaced atomically. The data order is a pure function
of (seed, epoch), so the step number is all that is needed to resume the sampler.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from selfspec.checkpoint import CheckpointError, atomic_write_text

STATE_TENSORS, STATE_JSON = "train_state.safetensors", "train_state.json"


def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    sd = optimizer.state_dict()
    tensors = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            tensors[f"optim.{idx}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    return tensors, sd["param_groups"]


def optimizer_from_flat(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def write_train_state(folder: Path, optimizer: torch.optim.Optimizer, step: int, info: dict) -> None:
    """Write the optimizer and step into ``folder`` (called inside an atomic checkpoint folder)."""
    tensors, groups = optimizer_to_flat(optimizer)
    save_file(tensors, str(folder / STATE_TENSORS))
    atomic_write_text(folder / STATE_JSON, json.dumps(dict(step=step, param_groups=groups, **info), indent=1))


def read_train_state(folder: Path, optimizer: torch.optim.Optimizer) -> dict:
    """Restore the optimizer from ``folder``; returns the JSON info (with ``step``)."""
    from safetensors import SafetensorError

    try:
        info = json.loads((folder / STATE_JSON).read_text(encoding="utf-8"))
        tensors = load_file(str(folder / STATE_TENSORS))
        optimizer_from_flat(optimizer, tensors, info["param_groups"])
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as err:
        raise CheckpointError(f"training state in {folder} is missing or corrupt: {err!r}") from err
    return info


def check_export_target(export: str | None, overwrite: bool) -> None:
    """Refuse, before any training, to export over an existing drafter folder (a shipped checkpoint
    with its calibration, or an earlier run's) unless ``overwrite_export`` is set."""
    if export and Path(export).exists() and not overwrite:
        raise FileExistsError(
            f"export folder {export!r} already exists (a shipped or earlier drafter, with its calibration); "
            "set overwrite_export=true to replace it, or export=<another folder>")

