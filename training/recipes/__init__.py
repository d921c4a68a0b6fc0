"""One training recipe per drafter kind, all on the shared loop of :mod:`training.loop`.

``RECIPES`` maps a drafter kind to its config class and recipe class; :func:`recipe_for` builds
the recipe a config asks for. Adding a kind adds a file here and one line in ``RECIPES``.
"""

from __future__ import annotations

from .cached_features import HeadsTrainConfig
from .eagle3 import Eagle3Recipe, Eagle3TrainConfig
from .layerskip import LayerSkipRecipe
from .layerskip_lora import LoraSkipRecipe, LoraSkipTrainConfig
from .medusa import MedusaRecipe

#: kind -> (config class, recipe class)
RECIPES: dict[str, tuple[type, type]] = {
    "medusa": (HeadsTrainConfig, MedusaRecipe),
    "layerskip": (HeadsTrainConfig, LayerSkipRecipe),
    "eagle3": (Eagle3TrainConfig, Eagle3Recipe),
    "layerskip_lora": (LoraSkipTrainConfig, LoraSkipRecipe),
}


def config_class(kind: str) -> type:
    if kind not in RECIPES:
        raise ValueError(f"no training recipe for drafter kind {kind!r}; known: {sorted(RECIPES)}")
    return RECIPES[kind][0]


def recipe_for(cfg, **given):
    """The recipe for ``cfg.kind``, built with ``given`` (``model=``, ``tokenizer=``, data)."""
    if cfg.kind not in RECIPES:
        raise ValueError(f"no training recipe for drafter kind {cfg.kind!r}; known: {sorted(RECIPES)}")
    return RECIPES[cfg.kind][1](cfg, **given)


def run(cfg, *, resume: bool = False, **given) -> dict:
    """setup -> train -> export -> cleanup for ``cfg``'s kind; returns the export summary."""
    return RECIPES[cfg.kind][1].run(cfg, resume=resume, **given)


__all__ = ["RECIPES", "Eagle3Recipe", "Eagle3TrainConfig", "HeadsTrainConfig", "LayerSkipRecipe", "LoraSkipRecipe", "LoraSkipTrainConfig", "MedusaRecipe",
           "config_class", "recipe_for", "run"]
