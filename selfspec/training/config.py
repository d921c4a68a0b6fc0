"""Typed configs: dataclasses are the source of truth, YAML files in configs/ are saved copies.

``load_config(cls, path, overrides)`` reads YAML into nested dataclasses, applies dotted overrides
(``optim.lr=3e-4``, values parsed as YAML), and rejects unknown keys with the full dotted name.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def from_dict(cls: type[T], data: dict, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, recursing into dataclass-typed fields."""
    if not isinstance(data, dict):
        raise ValueError(f"config section {where or '<root>'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown config keys {sorted(where + k for k in unknown)}; known: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = from_dict(hint, value, f"{where}{key}.")
        kwargs[key] = value
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides to a nested dict (values parsed as YAML scalars; a boolean only
    from ``true`` / ``false``, so ``run.mixed_precision=no`` stays the word ``no``)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section")
        value = yaml.safe_load(raw)
        if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
            value = raw.strip()  # YAML 1.1 reads no / yes / on / off as booleans: keep the word
        node[parts[-1]] = value
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Read ``path`` (YAML) into ``cls`` with dotted ``overrides``."""
    data: dict[str, Any] = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    return from_dict(cls, apply_overrides(data, overrides or []))


def dump_config(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
