"""Identity of a target model, so a drafter trained for one target refuses another.

The fingerprint hashes the decoder config's shape fields and a strided sample (up to 4096 values)
of every parameter, rounded to bfloat16 so that loading the same weights in float32 or bfloat16
gives the same fingerprint. The tokenizer fingerprint hashes the vocabulary. Both are hex strings.
"""

from __future__ import annotations

import hashlib
import json

import torch

_SAMPLES_PER_TENSOR = 4096


def target_fingerprint(model) -> str:
    """sha256 (16 hex chars) of the target's architecture and sampled weights."""
    cfg = model.config.get_text_config(decoder=True)
    h = hashlib.sha256()
    shape = {k: getattr(cfg, k, None) for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")}
    h.update(json.dumps(shape, sort_keys=True).encode())
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::step][:_SAMPLES_PER_TENSOR].to("cpu", torch.bfloat16).view(torch.int16)
            h.update(name.encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (16 hex chars) of the tokenizer's vocabulary and special tokens."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()[:16]
