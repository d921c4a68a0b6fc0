"""Serving-engine layouts: export trained drafters in them, and import heads written in them.

* ``eagle3``: the EAGLE-3 draft layout of vLLM (``speculative_config={"method": "eagle3",
  "model": DIR}``, ``Eagle3LlamaForCausalLM`` / ``LlamaForCausalLMEagle3``) and SGLang
  (``--speculative-algorithm EAGLE3``, ``LlamaForCausalLMEagle3``): ``config.json`` (a llama config
  with ``num_hidden_layers: 1``, the target's ``vocab_size``, ``draft_vocab_size``,
  ``norm_before_residual: false``, ``target_hidden_size``, ``tie_word_embeddings: false``) and
  ``model.safetensors`` with ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``,
  ``d2t`` (int64 offsets: draft id i is target id ``i + d2t[i]``) and ``t2d`` (bool over the target
  vocabulary); no embedding (both engines share the target's).

  Aux layer ids: both engines default to the inputs of layers (2, L // 2, L - 3), selfspec's
  default taps. vLLM reads ``eagle_aux_hidden_state_layer_ids`` (top level first) as the input of
  layer k (= transformers' ``hidden_states[k]``, our tap numbering); SGLang reads only
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` and captures layer ``id + 1``'s input. The
  export writes our taps at the top level and ``taps - 1`` under ``eagle_config``, so each engine
  reads the taps the head was trained on.
* ``medusa``: vLLM's Medusa layout (``model_type: medusa``, ``MedusaModel``): ``blocks.{i}.layers.{j}``
  residual blocks ``x + SiLU(W x + b)`` (``medusa_fc_bias: true``) and ``lm_heads.{i}.weight`` (the
  target's LM head repeated for shared heads).

* ``speculators``: the format of vLLM's ``speculators`` library, which ``vllm serve DIR`` reads
  directly: the same tensors with the layer under ``layers.0.`` and a config with
  ``speculators_model_type: eagle3``, ``transformer_layer_config`` (the draft layer),
  ``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids`` and ``speculators_config`` (algorithm,
  proposal method, verifier: the target's name or path).

Engines serve EAGLE-3 heads only on targets whose model class records aux hidden states and a
llama-style draft layer with SiLU MLP; anything else is refused with a clear error.

Import (:func:`import_drafter`, what ``load_drafter`` does with a folder that has a ``config.json``
and no ``drafter.json``): an EAGLE-3 head in the vLLM / SGLang layout or the ``speculators``
format, and Medusa heads in vLLM's layout, from safetensors only (pickled ``.bin`` weights are
refused). The head must fit the target: its vocabulary, hidden size, draft-layer shape; its taps
are the folder's (or the engines' default). Such a head carries no weight fingerprint: what it was
trained on is its authors' word, and its measured acceptance the judge (exactness never depends
on it). The imported drafter drafts what the exported one did (round-trip test).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import atomic_dir, atomic_write_text, check_replaceable
from .drafters.eagle3 import Eagle3Drafter
from .drafters.medusa import MedusaDrafter

#: Target families whose vLLM / SGLang model classes capture EAGLE-3 aux hidden states (llama-style
#: decoders); the draft layer is always llama-style.
EAGLE3_TARGETS = ("llama", "mistral", "qwen2", "qwen3")
FORMATS = ("eagle3", "speculators", "medusa")


class ExportError(ValueError):
    """The drafter cannot be exported in the requested layout (with the reason)."""


def export_drafter(drafter, out_dir: str | os.PathLike, fmt: str, *, dtype: torch.dtype = torch.bfloat16,
                   target_path: str | None = None, overwrite: bool = False) -> Path:
    """Write ``drafter`` to ``out_dir`` in layout ``fmt``; returns the folder.

    Refuses to write over an existing selfspec checkpoint (``drafter.json``) or a non-empty folder
    unless ``overwrite``.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; known: {list(FORMATS)}")
    out = Path(os.path.abspath(out_dir))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if (out / "drafter.json").exists():
            raise ExportError(f"{out} holds a selfspec drafter checkpoint; refusing to overwrite it with an export")
        if not overwrite:
            raise ExportError(f"{out} is not empty; pass overwrite=True (--overwrite) to replace it")
        try:  # an earlier export of ours: replaced; anything else (other files, checkpoints, the source): refused
            check_replaceable(out, {"config.json", "model.safetensors"}, "--out")
        except FileExistsError as err:
            raise ExportError(str(err)) from None
    from .drafters.registry import kind_entry, resolve

    entry = kind_entry(drafter.kind)
    if fmt == "speculators" and drafter.kind == "eagle3":
        config, tensors = speculators_layout(drafter, dtype, target_path)
        with atomic_dir(out) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            atomic_write_text(tmp / "config.json", json.dumps(config, indent=2))
        return out
    if entry.exporter is None or entry.export_format != fmt:
        raise ExportError(f"--format {fmt} exports {fmt} drafters, not {drafter.kind!r}"
                          + (f" (a {drafter.kind} drafter exports as --format {entry.export_format})"
                             if entry.export_format else ""))
    config, tensors = resolve(entry.exporter)(drafter, dtype)
    if target_path:
        config["_selfspec_target"] = target_path
    with atomic_dir(out) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        atomic_write_text(tmp / "config.json", json.dumps(config, indent=2))
    return out


def eagle3_layout(drafter: Eagle3Drafter, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json dict, tensors)`` of an EAGLE-3 head in the vLLM / SGLang layout."""
    if not isinstance(drafter, Eagle3Drafter):
        raise ExportError(f"--format eagle3 exports eagle3 drafters, not {drafter.kind!r}")
    target = drafter.model.config.get_text_config(decoder=True)
    if target.model_type not in EAGLE3_TARGETS:
        raise ExportError(f"vLLM and SGLang serve EAGLE-3 heads for {list(EAGLE3_TARGETS)} targets, "
                          f"not {target.model_type!r}")
    layer = drafter.head.cfg
    if layer.hidden_act != "silu":
        raise ExportError(f"the engines' EAGLE-3 layer has a SiLU MLP; this head uses {layer.hidden_act!r}")
    taps = list(drafter.requires.taps)
    if min(taps) < 1:
        raise ExportError(f"SGLang cannot capture tap {min(taps)} (the embeddings); retrain with taps >= 1")
    config = layer.to_dict()
    for key in ("transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "model_type"):
        config.pop(key, None)
    rope = config.get("rope_parameters") or {}
    config |= {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "vocab_size": int(target.vocab_size),
        "draft_vocab_size": int(drafter.head.d2t.shape[0]),
        "target_hidden_size": int(target.hidden_size),
        "norm_before_residual": False,
        "tie_word_embeddings": False,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": taps,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in taps], "use_aux_hidden_state": True},
        "bos_token_id": getattr(target, "bos_token_id", None),
        "eos_token_id": getattr(target, "eos_token_id", None),
    }
    state = drafter.head.state_dict()
    tensors = {k: v.detach().to("cpu", dtype) for k, v in state.items() if k not in ("d2t", "t2d", "tap_scale")}
    tensors["fc.weight"] = drafter.head.folded_fc_weight().detach().to("cpu", dtype)
    tensors["d2t"] = state["d2t"].to("cpu", torch.int64)
    tensors["t2d"] = state["t2d"].to("cpu", torch.bool)
    return config, tensors


def medusa_layout(drafter: MedusaDrafter, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json dict, tensors)`` of Medusa heads in vLLM's ``MedusaModel`` layout."""
    if not isinstance(drafter, MedusaDrafter):
        raise ExportError(f"--format medusa exports medusa drafters, not {drafter.kind!r}")
    heads = drafter.heads
    target = drafter.model.config.get_text_config(decoder=True)
    tensors = {}
    for i, block in enumerate(heads.blocks):
        for j, res in enumerate(block):
            tensors[f"blocks.{i}.layers.{j}.weight"] = res.linear.weight.detach().to("cpu", dtype)
            tensors[f"blocks.{i}.layers.{j}.bias"] = res.linear.bias.detach().to("cpu", dtype)
        lm = heads.lm_heads[i] if heads.lm_heads is not None else drafter.model.get_output_embeddings()
        if getattr(lm, "bias", None) is not None:
            raise ExportError("vLLM's Medusa LM heads have no bias")
        tensors[f"lm_heads.{i}.weight"] = lm.weight.detach().to("cpu", dtype).clone()
    if getattr(target, "final_logit_softcapping", None):
        raise ExportError("vLLM's Medusa heads apply no logit soft-capping, which this target needs")
    config = {
        "architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": int(target.hidden_size),
        "vocab_size": int(target.vocab_size), "truncated_vocab_size": int(target.vocab_size),
        "num_heads": heads.cfg.num_heads, "num_hidden_layers": heads.cfg.num_layers, "medusa_fc_bias": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return config, tensors


def speculators_layout(drafter: Eagle3Drafter, dtype: torch.dtype, target_path: str | None = None
                       ) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json dict, tensors)`` of an EAGLE-3 head in the ``speculators`` format."""
    config, tensors = eagle3_layout(drafter, dtype)
    layer = {k: v for k, v in config.items() if k not in (
        "architectures", "draft_vocab_size", "target_hidden_size", "norm_before_residual", "eagle_config",
        "eagle_aux_hidden_state_layer_ids", "torch_dtype")}
    target = target_path or getattr(drafter.model.config, "_name_or_path", None) or "unknown"
    arch = list(getattr(drafter.model.config, "architectures", None) or [type(drafter.model).__name__])
    spec = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "transformer_layer_config": layer, "draft_vocab_size": config["draft_vocab_size"],
        "norm_before_residual": False, "target_hidden_size": config["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"],
        "torch_dtype": config["torch_dtype"],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target, "architectures": arch},
        },
    }
    return spec, {(f"layers.0.{k.removeprefix('midlayer.')}" if k.startswith("midlayer.") else k): v
                  for k, v in tensors.items()}


# ---------------------------------------------------------------- import
def _read_layout(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .checkpoint import CheckpointError

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder}: no readable config.json ({err})") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        raise CheckpointError(f"{folder}: no .safetensors weights" + (
            f" ({pickled} are pickles, which selfspec never loads: convert them to safetensors)" if pickled else ""))
    tensors = {}
    for f in files:
        try:
            tensors |= load_file(str(f))
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{f} is corrupt or truncated: {err}") from None
    return config, tensors


def import_drafter(folder, model):
    """A drafter for ``model`` from a head folder in a serving layout (see the module docstring);
    ``CheckpointError`` naming what does not fit."""
    from .checkpoint import CheckpointError

    folder = Path(folder)
    config, tensors = _read_layout(folder)
    try:
        if config.get("speculators_model_type") == "eagle3":
            layer = dict(config.get("transformer_layer_config") or {})
            return _import_eagle3(model, config, layer, tensors, config.get("eagle_aux_hidden_state_layer_ids"))
        archs = " ".join(config.get("architectures") or [])
        if "eagle3" in archs.lower() or "d2t" in tensors:
            ids = config.get("eagle_aux_hidden_state_layer_ids")
            sglang = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            taps = ids if ids is not None else ([k + 1 for k in sglang] if sglang is not None else None)
            return _import_eagle3(model, config, config, tensors, taps)
        if config.get("model_type") == "medusa" or "MedusaModel" in archs:
            return _import_medusa(model, config, tensors)
    except (ValueError, RuntimeError, KeyError, TypeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{folder}: {err}") from None
    raise CheckpointError(f"{folder}: not a selfspec checkpoint (no drafter.json) nor a head layout selfspec "
                          f"imports (EAGLE-3 vLLM / SGLang / speculators, Medusa vLLM); architectures {archs!r}")


def _import_eagle3(model, config: dict, layer: dict, tensors: dict, taps) -> Eagle3Drafter:
    import warnings

    from .drafters import build_drafter
    from .drafters.eagle3_head import default_taps, draft_layer_config

    target = model.config.get_text_config(decoder=True)
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if config.get(flag):
            raise ValueError(f"this head sets {flag}, a variant selfspec's EAGLE-3 layer does not compute")
    if int(layer.get("vocab_size", config.get("vocab_size", target.vocab_size))) != int(target.vocab_size):
        raise ValueError(f"the head's target vocabulary ({layer.get('vocab_size')}) is not this model's "
                         f"({target.vocab_size})")
    if int(config.get("target_hidden_size") or layer.get("hidden_size")) != int(target.hidden_size):
        raise ValueError(f"the head reads hidden states of size {config.get('target_hidden_size')}, this model's "
                         f"are {target.hidden_size}")
    d2t = tensors.get("d2t")
    vd = int(config.get("draft_vocab_size") or (d2t.shape[0] if d2t is not None else tensors["lm_head.weight"].shape[0]))
    taps = list(taps) if taps is not None else default_taps(int(target.num_hidden_layers))
    ours = draft_layer_config(model, layer.get("intermediate_size"))
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if key in layer and layer[key] is not None and int(layer[key]) != int(getattr(ours, key)):
            raise ValueError(f"the head's draft layer has {key} {layer[key]}, selfspec builds {getattr(ours, key)} "
                             "for this target")
    if layer.get("hidden_act", "silu") != "silu":
        raise ValueError(f"the head's MLP uses {layer['hidden_act']!r}; the EAGLE-3 layer is SiLU")
    theta = layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and float(theta) != float(ours.rope_parameters.get("rope_theta", theta)):
        warnings.warn(f"the head was configured with rope_theta {theta}, the target uses "
                      f"{ours.rope_parameters.get('rope_theta')}: selfspec drafts with the target's", RuntimeWarning,
                      stacklevel=3)
    drafter = build_drafter(model, "eagle3", taps=taps, draft_vocab_size=vd,
                            intermediate_size=layer.get("intermediate_size"))
    head = drafter.head
    state = {}
    for k, v in tensors.items():
        if k.startswith("embed_tokens."):
            continue  # the engines share the target's embedding; so does selfspec
        name = "midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k
        state[name] = v
    d2t = state.pop("d2t", None)
    state.pop("t2d", None)
    want = head.state_dict()
    param = next(model.parameters())
    state["tap_scale"] = torch.ones_like(want["tap_scale"])  # exports fold the scale into fc
    state["d2t"], state["t2d"] = want["d2t"], want["t2d"]
    missing, unexpected = set(want) - set(state), set(state) - set(want)
    if missing or unexpected:
        raise ValueError(f"the head's tensors do not match an EAGLE-3 layer: missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")
    head.load_state_dict({k: v.to(param.device, want[k].dtype) for k, v in state.items()})
    head.set_vocab(torch.arange(vd) + (d2t.to(torch.long) if d2t is not None else 0))
    drafter._draft_ids = head.draft_ids.to("cpu")
    return drafter


def _import_medusa(model, config: dict, tensors: dict):
    from .drafters import build_drafter

    target = model.config.get_text_config(decoder=True)
    if int(config.get("hidden_size", target.hidden_size)) != int(target.hidden_size):
        raise ValueError(f"the heads read hidden states of size {config.get('hidden_size')}, this model's are "
                         f"{target.hidden_size}")
    if int(config.get("truncated_vocab_size") or config.get("vocab_size") or target.vocab_size) != int(target.vocab_size):
        raise ValueError("truncated-vocabulary Medusa heads are not supported: the heads must cover the target's vocabulary")
    k, layers = int(config["num_heads"]), int(config.get("num_hidden_layers", 1))
    lm = model.get_output_embeddings().weight
    shared = all(torch.equal(tensors[f"lm_heads.{i}.weight"].to(lm.dtype), lm.detach().cpu())
                 for i in range(k) if f"lm_heads.{i}.weight" in tensors)
    drafter = build_drafter(model, "medusa", num_heads=k, num_layers=layers, own_lm_head=not shared)
    state = {}
    for name, v in tensors.items():
        if name.startswith("blocks."):
            _, i, _, j, leaf = name.split(".")
            state[f"blocks.{i}.{j}.linear.{leaf}"] = v
        elif name.startswith("lm_heads.") and not shared:
            state[name] = v
    want = drafter.heads.state_dict()
    if set(want) != set(state):
        raise ValueError(f"the heads' tensors do not match {k} heads of {layers} block(s): missing "
                         f"{sorted(set(want) - set(state))[:4]}, unexpected {sorted(set(state) - set(want))[:4]}")
    param = next(model.parameters())
    drafter.heads.load_state_dict({n: v.to(param.device, want[n].dtype) for n, v in state.items()})
    return drafter
