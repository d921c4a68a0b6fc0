"""``selfspec train --dry-run``: what a training config will need, before it runs.

The target's architecture comes from its local ``config.json`` (a folder, an alias, or the local
Hugging Face cache) or, for the GPU recipes' targets, from :data:`KNOWN_TARGETS` (the published
``config.json`` fields), so the estimate needs no download. The target and the drafter are built
on PyTorch's ``meta`` device (shapes only, no memory), so trainable parameters are counted
exactly, by the same ``build_drafter`` the recipe calls.

The estimate per process: target weights in the config's ``target_dtype``, trainable parameters
with their gradients and AdamW moments in float32 (16 bytes each), and the largest activations of
one micro-batch (cached-feature kinds: the heads' logits over the vocabulary; online kinds: the
target's transient pass plus the drafter's activations per unrolled step (Medusa / layer-skip
with ``features: online``: the heads' logits over every position of the micro-batch), for EAGLE-3 including
its attention scores with every example ``max_len`` long, the worst case), so that the estimate is
meant to bound a run's peak memory from above (the GPU check is in docs/decisions.md).
Time: ``6 x trainable (x unrolled steps) + 2 x target (online kinds)`` FLOPs per token and epoch at an assumed
sustained throughput (``--tflops``, default 200 per GPU: bf16 on an H100-class card at about 40% of
peak); tokens from the dataset when it exists here, else from the distill config's prompt counts.
These are planning numbers, not measurements.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import torch

#: Published ``config.json`` fields of the GPU recipes' targets (used only when the target is not
#: available locally; a local config always wins).
KNOWN_TARGETS: dict[str, dict] = {
    "Qwen/Qwen2.5-7B-Instruct": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                     vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
                                     rms_norm_eps=1e-6, tie_word_embeddings=False),
    "meta-llama/Llama-3.1-8B-Instruct": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                             vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                                             rms_norm_eps=1e-5, tie_word_embeddings=False),
}

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def target_config(target: str):
    """The target's transformers config, offline: local files first, then :data:`KNOWN_TARGETS`."""
    from transformers import AutoConfig

    from selfspec.model.loading import resolve

    try:
        where, gguf = resolve(target)
        return AutoConfig.from_pretrained(where, gguf_file=gguf, local_files_only=True) if gguf else \
            AutoConfig.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError, ModuleNotFoundError):
        if target in KNOWN_TARGETS:
            fields = dict(KNOWN_TARGETS[target])
            return AutoConfig.for_model(fields.pop("model_type"), **fields)
        raise ValueError(f"no local config.json for target {target!r} and it is not one of {sorted(KNOWN_TARGETS)}; "
                         "pass target=/path/to/model") from None


def drafter_options(cfg) -> dict:
    """The options the recipe passes to ``build_drafter`` for ``cfg.kind``."""
    options = getattr(cfg, cfg.kind)
    return options.to_dict() if hasattr(options, "to_dict") else asdict(options)


def _dataset_tokens(cfg) -> int | None:
    """Prompt + response tokens of ``cfg.dataset`` (a shard range counts only its shards); None
    while no data is there yet."""
    from .batching import load_distilled

    try:
        rows = load_distilled(cfg.dataset)
    except (FileNotFoundError, ValueError):  # not there yet, or a shard range past the shards written so far
        return None
    return sum(len(ex["prompt_ids"]) + len(ex["response_ids"]) for ex in rows)


def estimate(cfg, processes: int = 1, tflops: float = 200.0, tokens: int | None = None) -> dict:
    """Memory (GiB per process) and time (hours) estimates for training ``cfg`` (see module doc)."""
    import selfspec
    from transformers import AutoModelForCausalLM

    config = target_config(cfg.target)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        drafter = selfspec.build_drafter(model, cfg.kind, **drafter_options(cfg))
    target_params = sum(p.numel() for p in model.parameters())
    text = config.get_text_config(decoder=True)
    layers, hidden = text.num_hidden_layers, text.hidden_size
    lora = cfg.kind == "layerskip" and cfg.layerskip.adapter == "lora"
    trainable = drafter.stack if lora else {"medusa": lambda: drafter.heads, "layerskip": lambda: drafter.adapter,
                                             "eagle3": lambda: drafter.head}[cfg.kind]()
    n_train = sum(p.numel() for n, p in trainable.named_parameters() if not lora or "lora_" in n)
    dtype = getattr(cfg, "target_dtype", "float32")
    split = max(1, processes * cfg.optim.grad_accum)
    vocab = text.vocab_size
    heads = cfg.kind in ("medusa", "layerskip") and not lora  # LoRA adapters train online through the layers
    if heads and getattr(cfg, "features", "cached") == "online":
        # online: the target's transient pass over the micro-batch, then heads over its positions
        micro = max(1, cfg.tokens_per_batch // split)
        outputs = cfg.medusa.num_heads if cfg.kind == "medusa" else 1
        run_layers = layers
        act = micro * (hidden * 24 + vocab * 2 * 2) + micro * outputs * vocab * 4 * (5 if cfg.loss == "kl" else 3)
    elif heads:  # cached features: B positions x outputs x vocab logits
        outputs = cfg.medusa.num_heads if cfg.kind == "medusa" else 1
        micro = max(1, cfg.optim.batch_size // split)
        act = micro * outputs * vocab * 4 * (5 if cfg.loss == "kl" else 3)  # logits, log-softmax, grad (+ target law)
        run_layers = 0  # the target ran once, when the cache was built
    else:  # online: the target's pass (no grad, transient) + the drafter with gradients
        micro = max(1, cfg.tokens_per_batch // split)
        steps = getattr(cfg, "ttt_steps", 1)
        draft_vocab = getattr(getattr(cfg, "eagle3", None), "draft_vocab_size", vocab)
        run_layers = layers
        act = micro * (hidden * 24 + vocab * 2 * 2) + steps * micro * (hidden * 34 + draft_vocab * 4 * 3)
        if cfg.kind == "eagle3":  # the unrolled steps' attention scores, worst case every example max_len long:
            # [B, heads, T, T] per step, kept for backward as bf16 scores + mask, fp32 softmax, bf16 probs
            act += steps * micro * text.num_attention_heads * min(cfg.max_len, micro) * 10
    gib = 1024 ** 3
    mem = {"target_weights_gib": target_params * BYTES.get(dtype, 4) / gib,
           "trainable_and_adam_gib": n_train * 16 / gib, "activations_gib": act / gib}
    mem["total_gib"] = sum(mem.values())
    tokens = tokens if tokens is not None else _dataset_tokens(cfg)
    out = {"target": cfg.target, "kind": cfg.kind, "target_params": target_params, "trainable_params": n_train,
           "processes": processes, "memory_per_process": {k: round(v, 2) for k, v in mem.items()},
           "dataset_tokens": tokens}
    if tokens:
        flops = tokens * cfg.optim.epochs * (6 * n_train * getattr(cfg, "ttt_steps", 1)
                                             + 2 * target_params * run_layers / layers)
        out["hours"] = round(flops / (tflops * 1e12 * processes) / 3600, 3)
        out["assumed_tflops_per_process"] = tflops
    return out


def launch_command(config_path: str | None, cfg, processes: int, overrides: list[str]) -> str:
    """The exact command that runs this config on ``processes`` GPUs (one process: ``selfspec train``)."""
    args = " ".join((["--config", config_path] if config_path else []) + list(overrides))
    if processes <= 1:
        return f"selfspec train {args}"
    precision = cfg.run.mixed_precision
    return (f"accelerate launch --multi_gpu --num_processes {processes} --mixed_precision {precision} "
            f"-m selfspec.cli train {args}")


def report(config_path: str | None, cfg, overrides: list[str], processes: int, tflops: float) -> str:
    est = estimate(cfg, processes, tflops)
    mem = est["memory_per_process"]
    lines = [f"dry run: {est['kind']} on {est['target']} ({est['target_params'] / 1e9:.2f}B parameters), "
             f"{est['trainable_params'] / 1e6:.1f}M trainable",
             f"memory per process: {mem['total_gib']:.1f} GiB (target weights {mem['target_weights_gib']:.1f}, "
             f"trainable + AdamW {mem['trainable_and_adam_gib']:.2f}, activations ~{mem['activations_gib']:.1f})"]
    if est.get("hours") is not None:
        lines.append(f"time: ~{est['hours']:.2f} h for {est['dataset_tokens']:,} tokens x {cfg.optim.epochs} epochs "
                     f"on {processes} process(es) at {tflops:g} TFLOP/s each (an estimate, not a measurement)")
    else:
        lines.append(f"time: unknown until the dataset exists ({cfg.dataset}: run selfspec distill first)")
    lines.append("command: " + launch_command(config_path, cfg, processes, overrides))
    return "\n".join(lines) + "\n" + json.dumps(est) + "\n"


__all__ = ["KNOWN_TARGETS", "estimate", "launch_command", "report", "target_config"]
