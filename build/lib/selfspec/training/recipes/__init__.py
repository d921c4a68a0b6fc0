"""One training recipe per trainable drafter kind, all on the shared loop of :mod:`selfspec.training.loop`.

A drafter kind names its recipe module in its registry entry (``selfspec.drafters.register(kind,
..., recipe="selfspec.training.recipes.<kind>")``); that module defines ``RECIPE`` (the recipe class, or a
function ``cfg -> recipe class`` for a kind trained several ways) and ``CONFIG`` (its typed config). A new trainable kind adds its recipe file and nothing here.
"""

from __future__ import annotations

from .cached_features import HeadsTrainConfig
from .eagle3 import Eagle3Recipe, Eagle3TrainConfig
from .layerskip import LayerSkipRecipe
from .layerskip_peft import LoraSkipRecipe
from .medusa import MedusaRecipe


def _module(kind: str):
    from selfspec.drafters import kind_entry, kinds
    from selfspec.drafters.registry import resolve

    entry = kind_entry(kind) if kind in kinds() else None
    if entry is None or entry.recipe is None:
        raise ValueError(f"no training recipe for drafter kind {kind!r}; known: {recipe_kinds()}")
    return resolve(entry.recipe)


def recipe_kinds() -> list[str]:
    """Kinds whose registry entry names a training recipe."""
    from selfspec.drafters import kind_entry, kinds

    return [k for k in kinds() if kind_entry(k).recipe is not None]


def config_class(kind: str) -> type:
    return _module(kind).CONFIG


def _recipe_class(cfg) -> type:
    recipe = _module(cfg.kind).RECIPE
    return recipe if isinstance(recipe, type) else recipe(cfg)


def recipe_for(cfg, **given):
    """The recipe for ``cfg.kind``, built with ``given`` (``model=``, ``tokenizer=``, data)."""
    return _recipe_class(cfg)(cfg, **given)


def run(cfg, *, resume: bool = False, allow_config_change: bool = False, **given) -> dict:
    """setup -> train -> export -> cleanup for ``cfg``'s kind; returns the export summary."""
    return _recipe_class(cfg).run(cfg, resume=resume, allow_config_change=allow_config_change, **given)


__all__ = ["Eagle3Recipe", "Eagle3TrainConfig", "HeadsTrainConfig", "LayerSkipRecipe", "LoraSkipRecipe",
           "MedusaRecipe", "config_class", "recipe_for", "recipe_kinds", "run"]
