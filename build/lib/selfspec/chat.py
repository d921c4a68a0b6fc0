"""Turning chat messages into prompt token ids with the target's own chat template."""

from __future__ import annotations

import torch


def encode_chat(tokenizer, messages: str | list[dict], *, system: str | None = None, tools: list | None = None
                ) -> torch.Tensor:
    """Render ``messages`` with the tokenizer's chat template, ready for the assistant's turn.

    Args:
        tokenizer: a transformers tokenizer with a chat template (otherwise the turns' plain text,
            one per line, with the tokenizer's own special tokens, e.g. a base model's BOS).
        messages: a user message, or a list of ``{"role", "content"}`` dicts.
        system: optional system message put first.
        tools: optional function list, rendered by the chat template (``apply_chat_template(tools=)``).

    Returns:
        ``[1, L]`` LongTensor of prompt ids.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if system is not None:
        messages = [{"role": "system", "content": system}] + list(messages)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    elif tools:
        raise ValueError("this tokenizer has no chat template: tools cannot be rendered for it")
    else:
        text = "\n".join(m["content"] for m in messages) + "\n"
    # a template writes its own special tokens; plain text gets the tokenizer's (a base model's BOS)
    template = bool(getattr(tokenizer, "chat_template", None))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not template).input_ids
    return ids.long()
