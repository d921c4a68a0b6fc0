"""Export trained drafters in the layouts serving engines load.

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

Engines serve EAGLE-3 heads only on targets whose model class records aux hidden states and a
llama-style draft layer with SiLU MLP; anything else is refused with a clear error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import atomic_dir, atomic_write_text
from .drafters.eagle3 import Eagle3Drafter
from .drafters.medusa import MedusaDrafter

#: Target families whose vLLM / SGLang model classes capture EAGLE-3 aux hidden states (llama-style
#: decoders); the draft layer is always llama-style.
EAGLE3_TARGETS = ("llama", "mistral", "qwen2", "qwen3")
FORMATS = ("eagle3", "medusa")


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
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if (out / "drafter.json").exists():
            raise ExportError(f"{out} holds a selfspec drafter checkpoint; refusing to overwrite it with an export")
        if not overwrite:
            raise ExportError(f"{out} is not empty; pass overwrite=True (--overwrite) to replace it")
    from .drafters.registry import kind_entry, resolve

    entry = kind_entry(drafter.kind)
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
