"""The drafter registry: one entry per kind, filled by each drafter's own file.

``register(kind, builder, checkpoint=..., recipe=..., exporter=...)`` is all a new drafter adds:
its builder (``builder(model, **options)``), for trainable kinds the two functions that save and
rebuild it from a checkpoint, the import path of its training recipe module (the library never
imports ``selfspec.training``, which finds recipes here) and of its serving-layout exporter.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from .base import Drafter


@dataclass(frozen=True)
class DrafterKind:
    """A registered drafter kind.

    Attributes:
        builder: ``builder(model, **options) -> Drafter`` (unknown options raise ``ValueError``).
        weights: ``weights(drafter) -> {name: tensor}`` for a checkpoint (``None``: nothing to save).
        from_checkpoint: ``from_checkpoint(model, meta, weights) -> Drafter``.
        recipe: import path of the training recipe module (it defines ``RECIPE`` and ``CONFIG``).
        exporter: ``"module:function"``, ``function(drafter, dtype) -> (config, tensors)`` writing a
            layout serving engines load; ``export_format`` names that layout.
        needs_tokenizer: the builder takes the target's ``tokenizer=``.
    """

    kind: str
    builder: Callable[..., Drafter]
    weights: Callable | None = None
    from_checkpoint: Callable | None = None
    recipe: str | None = None
    exporter: str | None = None
    export_format: str | None = None
    needs_tokenizer: bool = False


_KINDS: dict[str, DrafterKind] = {}


def register(kind: str, builder: Callable[..., Drafter], *, checkpoint: tuple[Callable, Callable] | None = None,
             recipe: str | None = None, exporter: str | None = None, export_format: str | None = None,
             needs_tokenizer: bool = False) -> None:
    """Register drafter ``kind`` (see :class:`DrafterKind`; ``checkpoint`` is ``(weights,
    from_checkpoint)``). Registering a kind again replaces it."""
    weights, rebuild = checkpoint if checkpoint is not None else (None, None)
    _KINDS[kind] = DrafterKind(kind, builder, weights, rebuild, recipe, exporter, export_format, needs_tokenizer)


def kind_entry(kind: str) -> DrafterKind:
    """The entry of ``kind``; ``ValueError`` naming the known kinds."""
    if kind not in _KINDS:
        raise ValueError(f"unknown drafter kind {kind!r}; known kinds: {sorted(_KINDS)}")
    return _KINDS[kind]


def kinds(trainable: bool = False) -> list[str]:
    """Registered kinds (``trainable``: only those with checkpoints)."""
    return sorted(k for k, e in _KINDS.items() if not trainable or e.from_checkpoint is not None)


def resolve(path: str):
    """The object at ``"module:attribute"`` (or a module for a bare module path)."""
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def config_from_options(kind: str, cls, options: dict):
    """``cls(**options)`` for a dataclass config, unknown keys refused with a ``ValueError`` that
    names the known ones."""
    from dataclasses import fields

    known = [f.name for f in fields(cls)]
    unknown = set(options) - set(known)
    if unknown:
        raise ValueError(f"unknown {kind} drafter options {sorted(unknown)}; known: {sorted(known)}")
    return cls(**options)
