"""Turning chat messages into prompt token ids with the target's own chat template."""

from __future__ import annotations

import torch


def encode_chat(tokenizer, messages: str | list[dict], *, system: str | None = None) -> torch.Tensor:
    """Render ``messages`` with the tokenizer's chat template, ready for the assistant's turn.

    Args:
        tokenizer: a transformers tokenizer with a chat template (plain encoding otherwise).
        messages: a user message, or a list of ``{"role", "content"}`` dicts.
        system: optional system message put first.

    Returns:
        ``[1, L]`` LongTensor of prompt ids.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if system is not None:
        messages = [{"role": "system", "content": system}] + list(messages)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n".join(m["content"] for m in messages) + "\n"
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return ids.long()
