"""selfspec inside ``model.generate``: transformers' ``custom_generate`` hook.

    out = model.generate(input_ids, custom_generate=selfspec.custom_generate(drafter), max_new_tokens=64,
                         do_sample=True, temperature=0.7, repetition_penalty=1.1)

``model.generate`` prepares everything as usual (the generation config with the caller's keyword
arguments, the logits processors and warpers, the stopping criteria: length, EOS, stop strings)
and then hands the decoding loop to the callable: selfspec decodes with the drafter, applying
transformers' prepared processors at every tree node with that node's own path and its stopping
criteria after every new token (:mod:`selfspec.logits_processing`), so the output has the law of
``model.generate`` without the hook (greedy: the same tokens; tested). Sampling draws from a
``torch.Generator`` seeded from torch's global generator, so ``torch.manual_seed`` before the call
makes it repeat. Batch size 1 without padding; the result is the ``[1, L + new]`` sequences tensor
(``return_dict_in_generate`` is refused).
"""

from __future__ import annotations

import torch


def custom_generate(drafter, *, control=None):
    """A callable for ``model.generate(..., custom_generate=...)`` that decodes with ``drafter``
    (a drafter, a list of them or a :class:`~selfspec.control.Controller`; ``None``: plain steps)."""

    def decoding_loop(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                      streamer=None, **model_kwargs):
        from transformers import GenerationConfig

        from .engine import generate

        if input_ids.shape[0] != 1:
            raise ValueError(f"selfspec's custom_generate decodes one sequence; got a batch of {input_ids.shape[0]}")
        mask = model_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError("selfspec's custom_generate takes unpadded input (an attention mask of ones)")
        if generation_config is not None and generation_config.return_dict_in_generate:
            raise ValueError("selfspec's custom_generate returns the sequences tensor: return_dict_in_generate=False")
        length = generation_config.max_length if generation_config is not None else None
        new = (length - input_ids.shape[1]) if length else 128
        if new < 1:
            return input_ids
        sample = bool(generation_config is not None and generation_config.do_sample)
        seed = int(torch.randint(0, 2 ** 62, (1,)))  # from torch's global generator, as model.generate samples
        eos = getattr(generation_config, "eos_token_id", None)
        out = generate(model, input_ids, drafter=drafter, control=control, max_new_tokens=new,
                       temperature=1.0 if sample else 0.0, seed=seed, logits_processor=logits_processor,
                       generation_config=GenerationConfig(),  # transformers' prepared processors are the whole law
                       stopping_criteria=stopping_criteria, eos_token_id=eos if eos is not None else [],
                       streamer=streamer)
        return out.sequences

    return decoding_loop
