"""Any job config file (distillation or training) into its typed dataclass.

The dispatcher sits above :mod:`selfspec.training.config` (generic typed configs), :mod:`selfspec.training.distill`
and :mod:`selfspec.training.recipes`, so none of those imports another in a circle.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from .config import apply_overrides, from_dict
from .distill import DistillJob
from .recipes import config_class


def load_any(path: str | Path | None, overrides: list[str] | None = None, default_recipe: str | None = None):
    """Load a config file into the dataclass its ``recipe`` key (and, for ``train_heads``, its
    ``kind``: one recipe per drafter kind, see :mod:`selfspec.training.recipes`) names."""
    data = (yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    recipe = data.get("recipe", default_recipe)
    if recipe == "train_heads":
        return from_dict(config_class(data.get("kind", "medusa")), data)
    if recipe != "distill":
        raise ValueError(f"{path}: 'recipe' must be 'distill' or 'train_heads', got {recipe!r}")
    return from_dict(DistillJob, data)
