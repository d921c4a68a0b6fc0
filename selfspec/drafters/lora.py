"""PEFT LoRA adapters for a layer-skip drafter's drafting layers (``adapter: lora`` of
:mod:`selfspec.drafters.layerskip`).

The adapters live on *copies* of the target's first E layer modules that share every weight tensor
with the target (no extra memory beyond the LoRA matrices), made by ``peft``
(``LoraConfig`` on the chosen linear maps, ``layers_to_transform = 0..E-1``). The target itself is
never modified, so the verify pass is the unmodified target, bit for bit, whatever the drafter did,
and no adapter has to be switched on and off around it. The price: the adapted layers' keys and
values differ from the target's, so a LoRA drafter keeps its own cache and cannot hand layer
outputs to the verify pass (the block adapter can).

:func:`save_peft` writes a standard PEFT adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``, module names as in the target) that
``peft.PeftModel.from_pretrained(target, folder)`` loads onto the target model.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import torch
from torch import nn

from ..model.layer_slice import num_layers


def decoder_path(model) -> str:
    """The dotted name of the target's decoder module (``"model"`` for Llama-style models)."""
    decoder = model.get_decoder()
    for name, module in model.named_modules():
        if module is decoder:
            return name
    raise ValueError(f"{type(model).__name__}: its decoder is not one of its submodules")


def lora_stack(model, exit_layer: int, rank: int, alpha: float,
               target_modules: list[str] | None = None) -> tuple[nn.Module, nn.ModuleList]:
    """A module tree ``<decoder path>.layers[0..E-1]`` of weight-sharing copies of the target's
    first E layers, with PEFT LoRA adapters injected (B = 0: an untrained stack computes what the
    target's layers compute); returns ``(root, layers)``. Module names match the target's, so the
    adapter state dict is the one PEFT would make on the target. ``target_modules`` (default: every
    ``nn.Linear`` inside a decoder layer) names the adapted maps."""
    from ..extras import need

    need("peft", "train", "a layer-skip drafter with LoRA adapters")
    from peft import LoraConfig, inject_adapter_in_model

    decoder = model.get_decoder()
    total = num_layers(model)
    if not 1 <= exit_layer < total:
        raise ValueError(f"exit_layer must be in [1, {total}) for this {total}-layer target, got {exit_layer}")
    copies = nn.ModuleList()
    for i in range(exit_layer):
        layer = decoder.layers[i]
        shared = {id(t): t for t in itertools.chain(layer.parameters(), layer.buffers())}
        copies.append(copy.deepcopy(layer, shared))  # new modules, the same weight tensors
    root = holder = nn.Module()
    path = decoder_path(model)
    for part in (path.split(".") if path else []):
        child = nn.Module()
        holder.add_module(part, child)
        holder = child
    holder.add_module("layers", copies)
    targets = target_modules or sorted({name.rsplit(".", 1)[-1] for name, m in copies[0].named_modules()
                                        if isinstance(m, nn.Linear)})
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets,
                      layers_to_transform=list(range(exit_layer)), layers_pattern="layers")
    inject_adapter_in_model(lora, root)
    param = next(model.parameters())
    for name, p in root.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(param.device, param.dtype)
        else:
            p.requires_grad_(False)
    if not isinstance(getattr(root, "peft_config", None), dict):  # (set by inject_adapter_in_model)
        root.peft_config = {"default": lora}
    return root, copies


def lora_state(root: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of a :func:`lora_stack` root, named as PEFT names them on the target
    (without ``base_model.model.``)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(root)


def load_lora_state(root: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load :func:`lora_state` tensors into ``root``; unexpected tensors raise ``ValueError``."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(root, state)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"LoRA checkpoint has unexpected tensors {result.unexpected_keys[:4]}")


def save_peft(root: nn.Module, model, folder) -> Path:
    """Write a standard PEFT adapter folder for ``model`` (``PeftModel.from_pretrained``)."""
    from safetensors.torch import save_file

    from ..checkpoint import atomic_dir

    folder = Path(folder)
    with atomic_dir(folder) as tmp:
        cfg = copy.deepcopy(root.peft_config["default"])
        cfg.base_model_name_or_path = getattr(model.config, "_name_or_path", None)
        cfg.save_pretrained(str(tmp))
        tensors = {f"base_model.model.{k}": v.detach().contiguous().cpu() for k, v in lora_state(root).items()}
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder
