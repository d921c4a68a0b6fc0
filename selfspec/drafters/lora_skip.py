"""Layer-skip drafting through PEFT LoRA adapters on the target's first E layers (kind
``layerskip_lora``).

The drafter drafts like :mod:`selfspec.drafters.layerskip` (the first E layers, the final norm, the
LM head; the same dynamic tree), but its E layers carry LoRA adapters made by ``peft``
(``LoraConfig`` on every linear map of those layers, ``layers_to_transform = 0..E-1``), trained to
make the early exit agree with the full model.

The adapters live on *copies* of the first E layer modules that share every weight tensor with the
target (no extra memory beyond the LoRA matrices): the target itself is never modified, so the
verify pass is the unmodified target, bit for bit, whatever the drafter did (tested), and no
adapter has to be switched on and off around it. The price: the adapted layers' keys and values
differ from the target's, so this drafter keeps its own cache and cannot hand layer outputs to the
verify pass (the block adapter of ``layerskip`` can).

:meth:`LoraSkipDrafter.save_peft` writes a standard PEFT adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``, module names as in the target) that
``peft.PeftModel.from_pretrained(target, folder)`` loads onto the target model.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from ..layer_slice import LayerSlice, num_layers
from .base import Requirements, TargetSignature
from .registry import register
from .layerskip import POLICY_FIELDS, LayerSkipConfig, LayerSkipDrafter, LayerSkipPolicy, split_options


@dataclass
class LoraSkipConfig:
    """The drafting layers and their LoRA adapters (what a checkpoint is; the tree policy is a
    :class:`~selfspec.drafters.layerskip.LayerSkipPolicy`, without KV reuse: adapted layers).

    Attributes:
        exit_layer: E, draft with layers ``0 .. E-1``.
        rank: LoRA rank r.
        alpha: LoRA scaling numerator (the update is ``alpha / r * B A``).
        target_modules: names of the linear maps that get adapters (default: every ``nn.Linear``
            inside a decoder layer, e.g. ``q_proj ... down_proj``).
    """

    exit_layer: int = 8
    rank: int = 8
    alpha: float = 16.0
    target_modules: list[str] | None = None

    def __post_init__(self) -> None:
        if self.exit_layer < 1 or self.rank < 1 or self.alpha <= 0:
            raise ValueError(f"need exit_layer >= 1, rank >= 1, alpha > 0; got {self.exit_layer}, {self.rank}, {self.alpha}")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


LORA_FIELDS = tuple(f.name for f in fields(LoraSkipConfig))


def decoder_path(model) -> str:
    """The dotted name of the target's decoder module (``"model"`` for Llama-style models)."""
    decoder = model.get_decoder()
    for name, module in model.named_modules():
        if module is decoder:
            return name
    raise ValueError(f"{type(model).__name__}: its decoder is not one of its submodules")


def lora_stack(model, cfg: LoraSkipConfig) -> tuple[nn.Module, nn.ModuleList]:
    """A module tree ``<decoder path>.layers[0..E-1]`` of weight-sharing copies of the target's
    first E layers, with PEFT LoRA adapters injected; returns ``(root, layers)``. Module names
    match the target's, so the adapter state dict is the one PEFT would make on the target."""
    from peft import LoraConfig, inject_adapter_in_model

    decoder = model.get_decoder()
    total = num_layers(model)
    if not 1 <= cfg.exit_layer < total:
        raise ValueError(f"exit_layer must be in [1, {total}) for this {total}-layer target, got {cfg.exit_layer}")
    copies = nn.ModuleList()
    for i in range(cfg.exit_layer):
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
    targets = cfg.target_modules or sorted({name.rsplit(".", 1)[-1] for name, m in copies[0].named_modules()
                                            if isinstance(m, nn.Linear)})
    lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, target_modules=targets,
                      layers_to_transform=list(range(cfg.exit_layer)), layers_pattern="layers")
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


class LoraSkipDrafter(LayerSkipDrafter):
    """Drafts with LoRA-adapted copies of the target's first E layers (see the module docstring)."""

    kind = "layerskip_lora"

    def __init__(self, model, cfg: LoraSkipConfig, stack: tuple[nn.Module, nn.ModuleList] | None = None,
                 signature: TargetSignature | None = None, policy: LayerSkipPolicy | None = None):
        policy = LayerSkipPolicy(**(asdict(policy or LayerSkipPolicy()) | {"kv_reuse": False}))
        super().__init__(model, LayerSkipConfig(exit_layer=cfg.exit_layer, adapter="none"), None, policy, signature)
        self.config = cfg
        self.stack, layers = stack or lora_stack(model, cfg)
        self.body = LayerSlice(model, list(range(cfg.exit_layer)), final_norm=False, layers=layers)
        self.requires = Requirements()  # adapted layers: their keys and values are not the target's

    def config_dict(self) -> dict:
        return self.config.to_dict()

    def with_options(self, **options) -> "LoraSkipDrafter":
        """A drafter sharing these adapters with other tree options."""
        fixed = set(LORA_FIELDS) & set(options)
        if fixed:
            raise ValueError(f"cannot change {sorted(fixed)} of a trained LoRA layer-skip drafter")
        _, policy = split_options(self.kind, options, LORA_FIELDS, POLICY_FIELDS)
        return LoraSkipDrafter(self.model, self.config, (self.stack, self.body.layers), self.signature,
                               LayerSkipPolicy(**(asdict(self.policy) | policy)))

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The adapter tensors, named as PEFT names them on the target (without ``base_model.model.``)."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.stack)

    def save_peft(self, folder) -> Path:
        """Write a standard PEFT adapter folder for the target (``PeftModel.from_pretrained``)."""
        from safetensors.torch import save_file

        from ..checkpoint import atomic_dir

        folder = Path(folder)
        with atomic_dir(folder) as tmp:
            cfg = copy.deepcopy(self.stack.peft_config["default"])
            cfg.base_model_name_or_path = getattr(self.model.config, "_name_or_path", None)
            cfg.save_pretrained(str(tmp))
            tensors = {f"base_model.model.{k}": v.detach().contiguous().cpu() for k, v in self.lora_state().items()}
            save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        return folder


def build_lora_skip(model, **options) -> LoraSkipDrafter:
    """``build_drafter(model, "layerskip_lora", exit_layer=8, rank=8, ...)``: fresh adapters (B = 0,
    so an untrained drafter drafts exactly like the plain early exit)."""
    config, policy = split_options("layerskip_lora", options, LORA_FIELDS, POLICY_FIELDS)
    return LoraSkipDrafter(model, LoraSkipConfig(**config), policy=LayerSkipPolicy(**policy))


def lora_skip_weights(drafter: LoraSkipDrafter) -> dict[str, torch.Tensor]:
    return {f"lora.{k}": v for k, v in drafter.lora_state().items()}


def lora_skip_from_checkpoint(model, meta: dict, weights: dict[str, torch.Tensor]) -> LoraSkipDrafter:
    """Rebuild the drafter from a checkpoint already checked against ``model``."""
    from peft import set_peft_model_state_dict

    from ..checkpoint import adapter_state

    try:
        cfg = LoraSkipConfig(**meta["config"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"layerskip_lora checkpoint config is invalid: {err}") from None
    drafter = build_lora_skip(model, **cfg.to_dict())
    state = adapter_state(weights, "lora.", drafter.lora_state())
    result = set_peft_model_state_dict(drafter.stack, state)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"layerskip_lora checkpoint has unexpected tensors {result.unexpected_keys[:4]}")
    return drafter


__all__ = ["LoraSkipConfig", "LoraSkipDrafter", "build_lora_skip", "lora_stack"]


register("layerskip_lora", build_lora_skip, checkpoint=(lora_skip_weights, lora_skip_from_checkpoint),
         recipe="training.recipes.layerskip_lora")
