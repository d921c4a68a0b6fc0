"""Drafters and the registry behind :func:`selfspec.build_drafter`."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Callable

import torch
import yaml

from .base import DraftContext, Drafter, Proposal, TargetSignature
from .eagle3 import Eagle3Config, Eagle3Drafter, build_eagle3, eagle3_from_checkpoint, eagle3_weights
from .layerskip import (LayerSkipConfig, LayerSkipDrafter, build_layerskip, layerskip_from_checkpoint,
                        layerskip_weights)
from .lora_skip import (LoraSkipConfig, LoraSkipDrafter, build_lora_skip, lora_skip_from_checkpoint,
                        lora_skip_weights)
from .medusa import MedusaConfig, MedusaDrafter, build_medusa, medusa_from_checkpoint, medusa_weights
from .ngram import NgramConfig, NgramDrafter
from .suffix import SuffixConfig, SuffixDrafter
from .tool_schema import ToolCallDrafter, ToolDraftConfig
from .union import UnionDrafter

#: Drafters trained for the packaged targets ship in the repository's checkpoints/ folder.
SHIPPED_CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"

_BUILDERS: dict[str, Callable[..., Drafter]] = {}
# kind -> (weights of a drafter, drafter from (model, meta, weights))
_CHECKPOINTS: dict[str, tuple[Callable, Callable]] = {}


_NEEDS_TOKENIZER: set[str] = set()


def register(kind: str, builder: Callable[..., Drafter], *, needs_tokenizer: bool = False) -> None:
    """Make ``build_drafter(model, kind, **options)`` call ``builder(model, **options)``
    (``needs_tokenizer``: the builder takes the target's ``tokenizer=``, which command-line specs
    then pass)."""
    _BUILDERS[kind] = builder
    if needs_tokenizer:
        _NEEDS_TOKENIZER.add(kind)


def build_drafter(model, kind: str, **options) -> Drafter:
    """Build a drafter of ``kind`` for ``model``; unknown kinds or options raise ``ValueError``."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown drafter kind {kind!r}; known kinds: {sorted(_BUILDERS)}")
    return _BUILDERS[kind](model, **options)


def load_drafter(path, model) -> Drafter:
    """Load a drafter checkpoint folder for ``model``.

    Raises ``selfspec.checkpoint.CheckpointError`` (a ``ValueError``) when the folder is missing,
    partial or corrupt, holds an unknown kind, or was made for another target.
    """
    from ..checkpoint import CheckpointError, check_target, read_checkpoint
    from ..measurement.machine import for_machine

    meta, weights = read_checkpoint(path)
    kind = meta.get("kind")
    if kind not in _CHECKPOINTS:
        raise CheckpointError(f"{str(path)!r} holds a drafter of unknown kind {kind!r}; known: {sorted(_CHECKPOINTS)}")
    check_target(meta, model, path)
    try:
        drafter = _CHECKPOINTS[kind][1](model, meta, weights)
        # trees calibrated for this dtype on this class of machine (scripts/calibrate.py --dtype),
        # else for this dtype on another machine
        param = next(model.parameters())
        dtype, extra = str(param.dtype).removeprefix("torch."), meta.get("extra") or {}

        def calibrated(table):
            return for_machine(extra.get(table), dtype, param.device)

        options = calibrated("options_by_dtype")
        if options:
            drafter = drafter.with_options(**options)
        sampled_options = calibrated("options_sampled_by_dtype")
        if sampled_options:  # the tree of T > 0 steps drafted alone (scripts/calibrate.py --temperature)
            drafter = drafter.for_sampling(sampled_options)
        union_options = calibrated("options_in_union_by_dtype")
        if union_options:
            drafter.with_options(**union_options)  # refused here, at load time, if invalid
            drafter.union_options = dict(union_options)
    except (ValueError, TypeError) as err:  # bad stored options (medusa's with_options raises TypeError)
        raise CheckpointError(f"{str(path)!r}: {err}") from None
    drafter.checkpoint_meta = meta
    return drafter


def save_drafter(drafter: Drafter, path, *, tokenizer=None, extra: dict | None = None,
                 weights_dtype: torch.dtype | None = None) -> None:
    """Atomically save a trainable drafter (with its target's identity) to a checkpoint folder.

    ``weights_dtype`` (e.g. ``torch.bfloat16``) stores the floating-point weights in that dtype (a
    smaller shipped file); loading casts them to the target's dtype. Integer and bool buffers
    (``d2t``, ``t2d``) are stored as they are."""
    from ..checkpoint import TargetIdentity, save_checkpoint

    if drafter.kind not in _CHECKPOINTS:
        raise ValueError(f"drafters of kind {drafter.kind!r} have no weights to save")
    weights = _CHECKPOINTS[drafter.kind][0](drafter)
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


def recommended_drafter(target: str) -> str | None:
    """The drafter spec of :func:`recommended_setting` (``None``: no record)."""
    setting = recommended_setting(target)
    return setting[0] if setting else None


def shipped_checkpoint(target: str, kind: str) -> Path:
    """Folder of the drafter of ``kind`` shipped for the packaged ``target`` alias."""
    return SHIPPED_CHECKPOINTS / f"{target}-{kind}"


def drafter_from_spec(model, spec: str, target: str | None = None, tokenizer=None) -> Drafter | None:
    """Resolve a command-line drafter spec.

    * ``none``: plain decoding;
    * a checkpoint folder: :func:`load_drafter`;
    * a bare trainable kind (``medusa``): the checkpoint shipped for ``target`` (error if none);
    * ``kind`` or ``kind:key=value,...``: a fresh drafter from :func:`build_drafter` (values that
      look like integers are parsed as such);
    * ``a+b+...``: the union of those drafters' trees, budgeted by measured acceptance (at most
      as many draft nodes as its largest member); ``union@key=value,...:a+b+...`` with
      :class:`UnionDrafter` options (e.g. ``union@explore_budget=0.02,explore_share=0:eagle3+ngram``,
      the exploration budget of rounds 21-29);
    * ``<checkpoint folder or shipped kind>@key=value,...``: a loaded drafter with tree options
      changed (e.g. ``layerskip@kv_reuse=false``, ``medusa@tree=[[0],[0,0]]``).
    """
    if spec == "none":
        return None
    if spec.startswith("union@"):
        opts, sep, members = spec[len("union@"):].partition(":")
        if not sep or not members:
            raise ValueError(f"a union spec with options reads 'union@key=value,...:a+b', got {spec!r}")
        return _union(model, members.split("+"), target, tokenizer, _parse_options(opts))
    if "+" in spec:
        return _union(model, spec.split("+"), target, tokenizer, {})
    if "@" in spec:
        base, _, opts = spec.partition("@")
        drafter = drafter_from_spec(model, base, target, tokenizer)
        if not hasattr(drafter, "with_options"):
            raise ValueError(f"drafters of kind {drafter.kind!r} take no @options")
        options = _parse_options(opts)
        changed = drafter.with_options(**options)
        if drafter.union_options:  # inside a union: the union-calibrated tree with these options on top
            changed.union_options = drafter.union_options | options
        return changed
    if Path(spec).is_dir():
        return load_drafter(spec, model)
    if spec in _CHECKPOINTS:
        path = shipped_checkpoint(target or "", spec)
        if not path.is_dir():
            raise ValueError(
                f"no {spec} checkpoint is shipped for target {target!r} (looked in {path}); train one with "
                f"scripts/train_heads.py, pass its folder, or use '{spec}:' for an untrained drafter"
            )
        return load_drafter(path, model)
    kind, _, opts = spec.partition(":")
    options = _parse_options(opts)
    if kind in _NEEDS_TOKENIZER:
        options["tokenizer"] = tokenizer
    return build_drafter(model, kind, **options)


def _union(model, specs: list[str], target, tokenizer, options: dict) -> UnionDrafter:
    """The union of the drafters of ``specs`` with :class:`UnionDrafter` ``options``."""
    _check_union_options(options)
    return UnionDrafter([union_member(drafter_from_spec(model, s, target, tokenizer)) for s in specs], **options)


def _check_union_options(options: dict) -> None:
    """Refuse options that :class:`UnionDrafter` does not take (``ValueError``, naming the known)."""
    import inspect

    known = set(inspect.signature(UnionDrafter.__init__).parameters) - {"self", "members", "clock"}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown union options {sorted(unknown)}; known: {sorted(known)}")


def union_member(drafter: Drafter) -> Drafter:
    """``drafter`` as a union member: with its checkpoint's tree calibrated inside a union
    (:attr:`~selfspec.drafters.base.Drafter.union_options`, ``scripts/calibrate.py --within``)
    where one is stored, else as it is. A union spends one verify budget on several members' nodes,
    so a member's best tree there can differ from its best tree alone. Options given in a spec
    (``eagle3@head_weights=native+ngram``) apply on top of the union-calibrated tree. Returns a new
    drafter object where options apply (the one passed in is left as it is)."""
    if drafter is None or not drafter.union_options:
        return drafter
    member = drafter.for_merging(drafter.union_options)
    member.checkpoint_meta = getattr(drafter, "checkpoint_meta", None)
    return member


def _parse_options(text: str) -> dict:
    """``a=1,b=0.5,c=false,d=[[0],[1]]`` -> typed values (YAML scalars / flow lists)."""
    options, key, depth, buf = {}, None, 0, ""
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


def _check_options(kind: str, config_cls, options: dict) -> None:
    known = {f.name for f in fields(config_cls)}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown {kind} drafter options {sorted(unknown)}; known: {sorted(known)}")


def _build_medusa(model, **options) -> MedusaDrafter:
    _check_options("medusa", MedusaConfig, options)
    return build_medusa(model, **options)


def _build_layerskip(model, **options) -> LayerSkipDrafter:
    _check_options("layerskip", LayerSkipConfig, options)
    return build_layerskip(model, **options)


def _build_lora_skip(model, **options) -> LoraSkipDrafter:
    _check_options("layerskip_lora", LoraSkipConfig, options)
    return build_lora_skip(model, **options)


def _build_eagle3(model, **options) -> Eagle3Drafter:
    _check_options("eagle3", Eagle3Config, options)
    return build_eagle3(model, **options)


def _build_ngram(model, **options) -> NgramDrafter:
    _check_options("ngram", NgramConfig, options)
    return NgramDrafter(NgramConfig(**options), TargetSignature.of(model))


def _build_suffix(model, **options) -> SuffixDrafter:
    _check_options("suffix", SuffixConfig, options)
    return SuffixDrafter(SuffixConfig(**options), TargetSignature.of(model))


def _build_tools(model, tokenizer=None, **options) -> ToolCallDrafter:
    if tokenizer is None:
        raise ValueError("the tools drafter needs the target's tokenizer: build_drafter(model, 'tools', tokenizer=tok)")
    _check_options("tools", ToolDraftConfig, options)
    return ToolCallDrafter(ToolDraftConfig(**options), tokenizer, TargetSignature.of(model))


def _build_union(model, members: list[Drafter], **options) -> UnionDrafter:
    """The union of ``members``, each as :func:`union_member` (a checkpoint's tree calibrated
    inside unions replaces its own: the union may hold new member objects), with
    :class:`UnionDrafter` ``options``."""
    _check_union_options(options)
    drafter = UnionDrafter([union_member(m) for m in members], **options)
    drafter.check_target(model)
    return drafter


register("ngram", _build_ngram)
register("suffix", _build_suffix)
register("tools", _build_tools, needs_tokenizer=True)
register("union", _build_union)
register("medusa", _build_medusa)
_CHECKPOINTS["medusa"] = (medusa_weights, medusa_from_checkpoint)
register("eagle3", _build_eagle3)
_CHECKPOINTS["eagle3"] = (eagle3_weights, eagle3_from_checkpoint)
register("layerskip", _build_layerskip)
_CHECKPOINTS["layerskip"] = (layerskip_weights, layerskip_from_checkpoint)
register("layerskip_lora", _build_lora_skip)
_CHECKPOINTS["layerskip_lora"] = (lora_skip_weights, lora_skip_from_checkpoint)

__all__ = [
    "DraftContext", "Drafter", "Proposal", "Eagle3Config", "Eagle3Drafter", "LayerSkipConfig", "LayerSkipDrafter", "LoraSkipConfig", "LoraSkipDrafter", "MedusaConfig", "MedusaDrafter", "NgramConfig", "NgramDrafter", "SuffixConfig", "SuffixDrafter", "TargetSignature", "ToolCallDrafter", "ToolDraftConfig",
    "UnionDrafter", "build_drafter", "drafter_from_spec", "union_member", "load_drafter", "register", "save_drafter", "shipped_checkpoint",
]
