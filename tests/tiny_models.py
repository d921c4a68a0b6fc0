"""Tiny random causal LMs of each supported family, built in code (no downloads)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}<assistant>"
FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "mistral")


def tiny_model(family: str = "llama", *, vocab: int = 64, seed: int = 0, dtype=torch.float64, layers: int | None = None):
    """A 2-3 layer (or ``layers``-layer) random model in eval mode; sliding-window families get a
    window of 5 (Gemma 3: every third layer is full attention)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers or 2, **common))
    elif family == "qwen2":
        cfg = Qwen2Config(num_hidden_layers=layers or 3, use_sliding_window=True, sliding_window=5,
                          max_window_layers=1, **common)
        model = Qwen2ForCausalLM(cfg)
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers or 2, head_dim=8, **common))
    elif family == "mistral":  # one model-wide sliding window, no per-layer types
        model = MistralForCausalLM(MistralConfig(num_hidden_layers=layers or 2, sliding_window=5, **common))
    elif family == "gemma3":
        n = layers or 3
        types = ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(n)]
        cfg = Gemma3TextConfig(num_hidden_layers=n, head_dim=8, sliding_window=5, layer_types=types,
                               query_pre_attn_scalar=8, final_logit_softcapping=30.0, **common)
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(family)
    model.config._attn_implementation = "sdpa"
    return model.to(dtype).eval()


def tiny_tokenizer(vocab: int = 128) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in code, with a minimal chat template."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x): return x + 1", "What is 3 + 4?", "{\"name\": \"f\"}"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="</s>")
    fast.chat_template = TEMPLATE
    return fast


def save_tiny(folder, family: str = "llama", *, layers: int | None = None):
    """A tiny float32 model and its tokenizer saved as a Hugging Face folder (what a user's hub
    checkout looks like to ``selfspec.load_target``); returns the folder."""
    tok = tiny_tokenizer()
    model = tiny_model(family, vocab=len(tok), dtype=torch.float32, layers=layers)
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
