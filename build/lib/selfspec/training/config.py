"""Typed configs: dataclasses are the source of truth, YAML files in configs/ are saved copies.

``load_config(cls, path, overrides)`` reads YAML into nested dataclasses, applies dotted overrides
(``optim.lr=3e-4``, values parsed as YAML), converts every value to its field's declared type
(``"3e-4"`` to a float for a ``float`` field, ``1`` to ``1.0``, never a float to an ``int`` unless it
is whole, never a word to a ``bool`` other than true / false) and rejects unknown keys and values
that do not convert, naming the dotted key, the expected type and the value.
"""

from __future__ import annotations

import dataclasses
import types
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
        else:
            value = coerce(value, hint, where + key)
        kwargs[key] = value
    return cls(**kwargs)


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) if typing.get_origin(hint) is None else str(hint).replace("typing.", "")


def coerce(value, hint, key: str):
    """``value`` as type ``hint`` (see the module docstring); ``ValueError`` naming ``key``, the
    expected type and the value when it does not convert."""
    def fail():
        return ValueError(f"config key {key}: expected {_type_name(hint) or hint}, got {value!r} "
                          f"({type(value).__name__})")

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any or isinstance(hint, typing.TypeVar):
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise fail()
        for option in args:  # the first declared type the value converts to
            if option is type(None):
                continue
            try:
                return coerce(value, option, key)
            except ValueError:
                continue
        raise fail()
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, dict):
            return from_dict(hint, value, key + ".")
        raise fail()
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise fail()
    if hint is int or hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise fail()
        if isinstance(value, str):
            try:
                value = hint(value.strip())
            except ValueError:
                raise fail() from None
        if hint is int and isinstance(value, float) and not value.is_integer():
            raise fail()
        return hint(value)
    if hint is str:
        if isinstance(value, str):
            return value
        raise fail()
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise fail()
        item = args[0] if args else typing.Any
        return [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise fail()
        item = args[1] if len(args) == 2 else typing.Any
        return {k: coerce(v, item, f"{key}.{k}") for k, v in value.items()}
    if hint is dict or hint is list:
        if not isinstance(value, hint):
            raise fail()
    return value


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
