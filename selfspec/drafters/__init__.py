"""Drafters and the registry behind :func:`selfspec.build_drafter`."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml

from .base import DraftContext, Drafter, Proposal, Requirements, Step, TargetSignature
from .eagle3 import Eagle3Config, Eagle3Drafter
from .layerskip import LayerSkipConfig, LayerSkipDrafter
from .medusa import MedusaConfig, MedusaDrafter
from .ngram import NgramConfig, NgramDrafter
from .registry import kind_entry, kinds, register
from .suffix import SuffixConfig, SuffixDrafter
from .tool_schema import ToolCallDrafter, ToolDraftConfig

#: Drafters trained for the packaged targets ship as package data (``selfspec/checkpoints/``), so an
#: installed wheel finds them as a checkout does.
SHIPPED_CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"

def build_drafter(model, kind: str, **options) -> Drafter:
    """Build a drafter of ``kind`` for ``model``; unknown kinds or options raise ``ValueError``."""
    return kind_entry(kind).builder(model, **options)


def load_drafter(path, model, *, strict: bool = True) -> Drafter:
    """Load a drafter checkpoint folder for ``model``.

    A folder with a ``config.json`` and no ``drafter.json`` is a head in a serving layout (EAGLE-3
    for vLLM / SGLang or ``speculators``, Medusa for vLLM): it is imported
    (:func:`selfspec.export.import_drafter`).

    Raises ``selfspec.checkpoint.CheckpointError`` (a ``ValueError``) when the folder is missing,
    partial or corrupt, holds an unknown kind, or was made for another target (another
    architecture, shape or vocabulary always; other weights of the same shape unless
    ``strict=False``, which loads it with a warning).
    """
    from ..checkpoint import CONFIG_FILE, CheckpointError, check_target, read_checkpoint

    folder = Path(path)
    if folder.is_dir() and not (folder / CONFIG_FILE).exists() and (folder / "config.json").exists():
        from ..export import import_drafter

        return import_drafter(folder, model)

    meta, weights = read_checkpoint(path)
    kind = meta.get("kind")
    if kind not in kinds(trainable=True):
        raise CheckpointError(f"{str(path)!r} holds a drafter of unknown kind {kind!r}; known: {kinds(trainable=True)}")
    check_target(meta, model, path, strict=strict)
    try:
        return kind_entry(kind).from_checkpoint(model, meta, weights)
    except (ValueError, TypeError) as err:  # bad stored config (a dataclass refuses unknown fields)
        raise CheckpointError(f"{str(path)!r}: {err}") from None


def save_drafter(drafter: Drafter, path, *, tokenizer=None, extra: dict | None = None,
                 weights_dtype: torch.dtype | None = None) -> None:
    """Atomically save a trainable drafter (with its target's identity) to a checkpoint folder.

    ``weights_dtype`` (e.g. ``torch.bfloat16``) stores the floating-point weights in that dtype (a
    smaller shipped file); loading casts them to the target's dtype. Integer and bool buffers
    (``d2t``, ``t2d``) are stored as they are."""
    from ..checkpoint import TargetIdentity, save_checkpoint

    entry = kind_entry(drafter.kind)
    if entry.weights is None:
        raise ValueError(f"drafters of kind {drafter.kind!r} have no weights to save")
    weights = entry.weights(drafter)
    if weights_dtype is not None:
        weights = {k: v.to(weights_dtype) if v.is_floating_point() else v for k, v in weights.items()}
    save_checkpoint(path, kind=drafter.kind, config=drafter.config_dict(),
                    target=TargetIdentity.of(drafter.model, tokenizer), weights=weights, extra=extra)


#: The setting the demo uses per packaged target: a drafter spec and the target dtype it was measured
#: in, with the benchmark result files that measured it the fastest overall (a test checks they
#: still say so).
RECOMMENDED = SHIPPED_CHECKPOINTS / "recommended.json"


def recommended_setting(target: str) -> tuple[str, str] | None:
    """``(drafter spec, dtype name)`` measured fastest for the packaged ``target`` alias (``None``:
    no record). The dtype is where the measurement ran; entries without one were float32 runs."""
    import json

    if not RECOMMENDED.exists():
        return None
    entry = json.loads(RECOMMENDED.read_text(encoding="utf-8")).get(target)
    return (entry["drafter"], entry.get("dtype", "float32")) if entry else None





def shipped_checkpoint(target: str, kind: str) -> Path:
    """Folder of the drafter of ``kind`` shipped for the packaged ``target`` alias."""
    return SHIPPED_CHECKPOINTS / f"{target}-{kind}"


def drafter_from_spec(model, spec: str, target: str | None = None, tokenizer=None) -> "Drafter | list[Drafter] | None":
    """Resolve a command-line drafter spec.

    * ``none``: plain decoding (``None``);
    * a checkpoint folder: :func:`load_drafter`;
    * a bare trainable kind (``medusa``): the checkpoint shipped for ``target`` (error if none);
    * ``kind`` or ``kind:key=value,...``: a fresh drafter from :func:`build_drafter`;
    * ``a+b+...``: a list of those drafters (their union: the controller runs each alone, their
      merge or plain steps);
    * ``<checkpoint folder or shipped kind>@key=value,...``: a loaded drafter with policy options
      changed (e.g. ``eagle3@max_depth=4``, ``medusa@tree=[[0],[0,0]]``).
    """
    if spec == "none":
        return None
    if "+" in spec:
        return [drafter_from_spec(model, s, target, tokenizer) for s in spec.split("+")]
    if "@" in spec:
        base, _, opts = spec.partition("@")
        return drafter_from_spec(model, base, target, tokenizer).with_options(**_parse_options(opts))
    if Path(spec).is_dir():
        return load_drafter(spec, model)
    if spec in kinds(trainable=True):
        path = shipped_checkpoint(target or "", spec)
        if not path.is_dir():
            raise ValueError(
                f"no {spec} checkpoint is shipped for target {target!r} (looked in {path}); train one with "
                f"scripts/train_heads.py, pass its folder, or use '{spec}:' for an untrained drafter"
            )
        return load_drafter(path, model)
    kind, _, opts = spec.partition(":")
    if kind not in kinds() and (os.sep in spec or spec.startswith(".")):
        raise FileNotFoundError(f"drafter {spec!r}: no checkpoint folder there (and not a drafter kind: {kinds()})")
    options = _parse_options(opts)
    if kind_entry(kind).needs_tokenizer:
        options["tokenizer"] = tokenizer
    return build_drafter(model, kind, **options)


def _parse_options(text: str) -> dict:
    """``a=1,b=0.5,c=false,d=[[0],[1]]`` -> typed values (YAML scalars / flow lists)."""
    options, depth, buf = {}, 0, ""
    for ch in text + ",":
        if ch == "," and depth == 0:
            if buf:
                key, _, value = buf.partition("=")
                options[key.strip()] = yaml.safe_load(value)
            buf = ""
            continue
        depth += (ch == "[") - (ch == "]")
        buf += ch
    return options


from . import eagle3, layerskip, medusa, ngram, suffix, tool_schema  # noqa: E402, F401  (each registers itself)

__all__ = [
    "DraftContext", "Drafter", "Proposal", "Requirements", "Step", "TargetSignature", "Eagle3Config", "Eagle3Drafter",
    "LayerSkipConfig", "LayerSkipDrafter", "MedusaConfig", "MedusaDrafter",
    "NgramConfig", "NgramDrafter", "SuffixConfig", "SuffixDrafter", "ToolCallDrafter", "ToolDraftConfig",
    "build_drafter", "drafter_from_spec", "kind_entry", "kinds", "load_drafter", "register", "save_drafter",
    "shipped_checkpoint",
]
