"""selfspec inside ``model.generate``: transformers' ``custom_generate`` hook.

    out = model.generate(input_ids, attention_mask=mask, custom_generate=selfspec.custom_generate(drafter),
                         max_new_tokens=64, do_sample=True, temperature=0.7, repetition_penalty=1.1)

``model.generate`` prepares everything as usual (the generation config with the caller's keyword
arguments, the logits processors and warpers, the stopping criteria: length, EOS, stop strings)
and then hands the decoding loop to the callable: selfspec decodes with the drafter, applying
transformers' prepared processors at every tree node with that node's own path and its stopping
criteria after every new token (:mod:`selfspec.decoding.logits_processing`), so the output has the law of
``model.generate`` without the hook (greedy: the same tokens; tested). Sampling draws from a
``torch.Generator`` seeded from torch's global generator (row b of a batch from that seed + b), so
``torch.manual_seed`` before the call makes it repeat. The result is the sequences tensor
(``return_dict_in_generate`` is refused).

A batch (``[B, L]`` ids, with an attention mask when rows are padded) decodes as one
:class:`selfspec.batch.Pool` (every row's tree in one target pass). The result has
``model.generate``'s layout: ``[B, L + new]``, each row its input row as given (padding included)
followed by its new tokens, and ``pad_token_id`` after a row that stopped early; ``new`` is the
longest row's count. Processors and stopping criteria see each row as ``model.generate`` shows it
to them, the padded input row followed by the new tokens (:func:`row_view`), so criteria that count
the padding (``min_length``, ``max_length``) and processors that see the pad tokens (n-gram bans)
or skip them (the repetition penalty's per-row padding lengths, :func:`for_row`) act as they do
there. Internally each row decodes unpadded (its own positions), so with right padding the new tokens are those of the unpadded prompt (transformers'
own loop would read the first one after a pad).

transformers (5.x) hands no streamer to a ``custom_generate`` callable (it puts the prompt to it
and keeps it); to stream, use :func:`selfspec.stream`.
"""

from __future__ import annotations

import torch


class RowView:
    """A transformers processor or stopping criterion seen through one row's padding: calls
    ``inner(view(ids), scores)`` where ``ids`` is ``[m, L_b + k]`` (the row's unpadded prompt, then
    ``k`` tokens after it) and ``view(ids)`` is ``[m, L + k]``: the row as given to
    ``model.generate`` (``[L]``, padding included), then the same ``k`` tokens. ``inner`` is
    :func:`for_row` of the prepared processor (its state for this row alone)."""

    def __init__(self, inner, given_row: torch.Tensor, prompt_length: int):
        self.inner, self.given, self.prompt_length = inner, given_row, int(prompt_length)

    def __call__(self, input_ids: torch.Tensor, scores):  # (two arguments: LogitsProcessorList passes no others)
        return self.inner(row_view(input_ids, self.given, self.prompt_length), scores)


def for_row(processor, row: int):
    """``processor`` as it acts on batch row ``row`` alone, for calls with any number of rows (tree
    nodes of that row). transformers' prepared repetition penalty holds each row's padding length
    (``prompt_ignore_length``, ``[B]``, when the batch is padded) and refuses other batch sizes;
    its row's copy holds that row's length as an int, which ignores the same positions. Every other
    processor is a function of its inputs (see :mod:`selfspec.decoding.logits_processing`) and is returned
    as it is."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ignore = getattr(processor, "prompt_ignore_length", None)
    if isinstance(processor, RepetitionPenaltyLogitsProcessor) and torch.is_tensor(ignore):
        return RepetitionPenaltyLogitsProcessor(processor.penalty, prompt_ignore_length=int(ignore[row]))
    return processor


def row_view(input_ids: torch.Tensor, given_row: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """``[m, prompt_length + k]`` unpadded rows -> ``[m, len(given_row) + k]``: ``given_row`` then
    each row's last ``k`` tokens."""
    given = given_row.to(input_ids.device, input_ids.dtype).expand(input_ids.shape[0], -1)
    return torch.cat([given, input_ids[:, prompt_length:]], dim=1)


def custom_generate(drafter, *, control=None):
    """A callable for ``model.generate(..., custom_generate=...)`` that decodes with ``drafter``
    (a drafter, a list of them or a :class:`~selfspec.control.Controller`; ``None``: plain steps)."""

    def decoding_loop(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                      streamer=None, **model_kwargs):
        from transformers import GenerationConfig

        from .engine import generate

        mask = model_kwargs.get("attention_mask")
        if generation_config is not None and generation_config.return_dict_in_generate:
            raise ValueError("selfspec's custom_generate returns the sequences tensor: return_dict_in_generate=False")
        length = generation_config.max_length if generation_config is not None else None
        new = (length - input_ids.shape[1]) if length else 128
        if new < 1:
            return input_ids
        sample = bool(generation_config is not None and generation_config.do_sample)
        seed = int(torch.randint(0, 2 ** 62, (1,)))  # from torch's global generator, as model.generate samples
        eos = getattr(generation_config, "eos_token_id", None)
        common = dict(max_new_tokens=new, temperature=1.0 if sample else 0.0,
                      generation_config=GenerationConfig(),  # transformers' prepared processors are the whole law
                      eos_token_id=eos if eos is not None else [])
        if input_ids.shape[0] == 1 and (mask is None or bool(mask.all())):
            out = generate(model, input_ids, drafter=drafter, control=control, seed=seed,
                           logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                           streamer=streamer, **common)
            return out.sequences
        if streamer is not None:  # (a transformers version that hands one over)
            raise ValueError("selfspec's custom_generate streams one unpadded sequence; a batch takes no streamer "
                             "(selfspec.stream yields (row, tokens) for several prompts)")
        return _batch(model, input_ids, mask, drafter, control, seed, logits_processor, stopping_criteria,
                      generation_config, common)

    return decoding_loop


def _batch(model, input_ids, mask, drafter, control, seed, logits_processor, stopping_criteria, generation_config,
           common) -> torch.Tensor:
    """Decode a ``[B, L]`` batch in one pool; ``model.generate``'s ``[B, L + new]`` layout."""
    from .batch import Pool, run_to_end, split_prompts

    rows = split_prompts(input_ids, mask)
    pool = Pool(model, drafter, control=control, max_batch=len(rows))
    handles = []
    for b, ids in enumerate(rows):
        given, n = input_ids[b], ids.shape[0]
        processors = None if logits_processor is None else [RowView(for_row(p, b), given, n) for p in logits_processor]
        criteria = None if stopping_criteria is None else [RowView(c, given, n) for c in stopping_criteria]
        handles.append(pool.submit(ids, seed=seed + b, logits_processor=processors, stopping_criteria=criteria,
                                   **common))
    run_to_end(pool)
    new = [h.result().sequences[0, r.shape[0]:].to(input_ids.device) for h, r in zip(handles, rows)]
    longest = max(t.shape[0] for t in new)
    pad = _pad_token(generation_config)
    if pad is None and any(t.shape[0] < longest for t in new):
        raise ValueError("rows of the batch stopped at different lengths and the generation config has no "
                         "pad_token_id to fill them with; pass pad_token_id=")
    out = torch.full((input_ids.shape[0], input_ids.shape[1] + longest), 0 if pad is None else pad,
                     dtype=input_ids.dtype, device=input_ids.device)
    out[:, : input_ids.shape[1]] = input_ids
    for b, t in enumerate(new):
        out[b, input_ids.shape[1]: input_ids.shape[1] + t.shape[0]] = t
    return out


def _pad_token(generation_config) -> int | None:
    """The pad id ``model.generate`` fills finished rows with (its prepared tensor: the config's
    ``pad_token_id``, else the first EOS id), or ``None``."""
    prepared = getattr(generation_config, "_pad_token_tensor", None)
    return None if prepared is None else int(prepared.reshape(-1)[0])
