"""Drafters and the registry behind :func:`selfspec.build_drafter`."""

from __future__ import annotations

from dataclasses import fields
from typing import Callable

from .base import DraftContext, Drafter, TargetSignature
from .ngram import NgramConfig, NgramDrafter

_BUILDERS: dict[str, Callable[..., Drafter]] = {}


def register(kind: str, builder: Callable[..., Drafter]) -> None:
    """Make ``build_drafter(model, kind, **options)`` call ``builder(model, **options)``."""
    _BUILDERS[kind] = builder


def build_drafter(model, kind: str, **options) -> Drafter:
    """Build a drafter of ``kind`` for ``model``; unknown kinds or options raise ``ValueError``."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown drafter kind {kind!r}; known kinds: {sorted(_BUILDERS)}")
    return _BUILDERS[kind](model, **options)


def _build_ngram(model, **options) -> NgramDrafter:
    known = {f.name for f in fields(NgramConfig)}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown ngram drafter options {sorted(unknown)}; known: {sorted(known)}")
    return NgramDrafter(NgramConfig(**options), TargetSignature.of(model))


register("ngram", _build_ngram)

__all__ = ["DraftContext", "Drafter", "NgramConfig", "NgramDrafter", "TargetSignature", "build_drafter", "register"]
