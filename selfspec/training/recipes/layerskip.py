"""Recipes for the layer-skip drafter (``kind: layerskip``): the block adapter (one next-token
prediction from the first E layers' output through the trained block adapter, the final norm and
the LM head, on cached or online features) here; LoRA adapters on the drafting layers in
:mod:`selfspec.training.recipes.layerskip_peft`. One config, :class:`HeadsTrainConfig`."""

from __future__ import annotations

from dataclasses import asdict

import torch

from selfspec.drafters.layerskip import LayerSkipPolicy
from selfspec.model.lm_head import lm_logits

from ..features import FeatureCache
from .cached_features import CachedFeatureRecipe, HeadsTrainConfig


class LayerSkipRecipe(CachedFeatureRecipe):
    name = "exit adapter"
    first = 1
    num_outputs = 1

    @property
    def exit_layer(self) -> int:
        return self.cfg.layerskip.exit_layer

    def options(self) -> dict:
        return asdict(self.cfg.layerskip)

    def trainable_of(self, drafter) -> torch.nn.Module:
        return drafter.adapter

    def inputs(self, cache: FeatureCache, rows: torch.Tensor) -> torch.Tensor:
        return cache.exit_hidden[rows].to(self.acc.device, torch.float32)

    def forward(self, adapter, h: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` outputs of the first E layers -> ``[B, 1, V]`` next-token logits."""
        return lm_logits(self.model, self.drafter.norm(adapter(h)))[:, None]

    def eval_extras(self, acc: list[list[float]]) -> dict:
        """A greedy chain of ``max_depth`` with independent acceptance ``acc[0][0]`` per token."""
        a = acc[0][0]
        return {"eval/expected_mat_chain": sum(a ** d for d in range(LayerSkipPolicy().max_depth + 1))}


def recipe_class(cfg: HeadsTrainConfig) -> type:
    """The recipe for ``cfg.layerskip.adapter``."""
    if cfg.layerskip.adapter == "lora":
        from .layerskip_peft import LoraSkipRecipe

        return LoraSkipRecipe
    return LayerSkipRecipe


#: what the registry entry of this kind points to (selfspec.drafters.register(..., recipe=...)):
#: RECIPE is a recipe class or, for a kind with several, a function ``cfg -> recipe class``
RECIPE, CONFIG = recipe_class, HeadsTrainConfig
