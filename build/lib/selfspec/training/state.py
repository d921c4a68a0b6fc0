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

from selfspec.checkpoint import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, atomic_write_text, check_replaceable

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
    except (OSError, ValueError, SafetensorError) as err:
        raise CheckpointError(f"training state in {folder} is missing or corrupt: {err!r}") from err
    check_train_state(folder, info, tensors, optimizer)
    try:
        optimizer_from_flat(optimizer, tensors, info["param_groups"])
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        raise CheckpointError(f"training state in {folder} does not fit this optimizer: {err!r}") from err
    return info


def check_train_state(folder: Path, info: dict, tensors: dict[str, torch.Tensor], optimizer) -> None:
    """Refuse, before anything resumes, a state whose ``step`` is not an integer >= 0 or whose
    optimizer tensors are not exactly the optimizer's (every parameter's ``step``, ``exp_avg`` and
    ``exp_avg_sq`` for AdamW, each shaped as its parameter) and finite: ``CheckpointError`` naming
    the file and the field."""
    step = info.get("step") if isinstance(info, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{folder / STATE_JSON}: field 'step' must be an integer >= 0, got {step!r}")
    if not isinstance(info.get("param_groups"), list):
        raise CheckpointError(f"{folder / STATE_JSON}: field 'param_groups' is missing or not a list")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    want = {}
    for i, p in enumerate(params):
        want[f"optim.{i}.exp_avg"] = p.shape
        want[f"optim.{i}.exp_avg_sq"] = p.shape
        want[f"optim.{i}.step"] = None
    have = {k for k in tensors if k.startswith("optim.")}
    extra = sorted(have - set(want))
    partial = sorted({k.rsplit(".", 1)[0] for k in have & set(want)
                      if not all(f"{k.rsplit('.', 1)[0]}.{n}" in have for n in ("exp_avg", "exp_avg_sq", "step"))})
    if extra or partial:  # (a parameter that never had a gradient has no state at all, which is fine)
        raise CheckpointError(f"{folder / STATE_TENSORS}: optimizer tensors do not match the model being trained "
                              f"(unexpected {extra[:3]}, incomplete state of {partial[:3]})")
    for key in sorted(have & set(want)):
        value = tensors[key]
        if want[key] is not None and tuple(value.shape) != tuple(want[key]):
            raise CheckpointError(f"{folder / STATE_TENSORS}: {key} has shape {tuple(value.shape)}, its parameter "
                                  f"{tuple(want[key])}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{folder / STATE_TENSORS}: {key} holds non-finite values (NaN or inf)")


def check_export_target(export: str | None, overwrite: bool) -> None:
    """Refuse, before any training, to export over an existing drafter folder (a shipped checkpoint
    with its calibration, or an earlier run's) unless ``overwrite_export`` is set, and even then a
    folder holding anything but a drafter's own two files (a card, other checkpoints, the run's
    source): the export replaces the folder whole."""
    if not export or not Path(export).exists():
        return
    if not overwrite:
        raise FileExistsError(
            f"export folder {export!r} already exists (a shipped or earlier drafter, with its calibration); "
            "set overwrite_export=true to replace it, or export=<another folder>")
    check_replaceable(export, {CONFIG_FILE, WEIGHTS_FILE}, "export")

