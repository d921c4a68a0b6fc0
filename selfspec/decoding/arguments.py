"""A request's arguments checked at the boundary: every error is a ``ValueError`` or ``TypeError``
naming the argument, raised before anything runs. :func:`settings` returns the validated
:class:`Settings` a :class:`~selfspec.decoding.request.Request` decodes with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..control import ControlConfig, Controller
from ..drafters.base import Drafter
from ..model.target import context_length
from .sampling import SamplingConfig


@dataclass
class Settings:
    """A request's validated decoding settings (built by :func:`settings`).

    Attributes:
        cfg: the target's sampling law; ``gen``: the request's own generator.
        max_new_tokens: most tokens to emit; ``eos``: stop token ids.
        context_limit: most positions prompt + output may fill.
        logits_processor / stopping_criteria: transformers lists (or ``None``); ``constraint``: a
            :class:`~selfspec.decoding.constraint.Constraint`; ``tools``: validated tool definitions.
    """

    cfg: SamplingConfig
    gen: torch.Generator
    max_new_tokens: int
    eos: set[int]
    context_limit: int
    logits_processor: object = None
    stopping_criteria: object = None
    constraint: object = None
    tools: list | None = None



def settings(model, prompt_len: int, *, max_new_tokens=None, temperature=None, top_k=None, top_p=None, seed=None,
             generator=None, eos_token_id=None, generation_config=None, logits_processor=None, stopping_criteria=None,
             stop_strings=None, tokenizer=None, constraint=None, tools=None) -> Settings:
    """Check one request's decoding arguments (see :func:`selfspec.generate`) for a prompt of
    ``prompt_len`` tokens and return them validated; every error is a ``ValueError`` naming the
    argument."""
    check_constraint(constraint)
    cfg, processors, max_new_tokens = sampling(model, generation_config, temperature, top_k, top_p, max_new_tokens)
    processor = processor_list(processors, logits_processor)
    stopping = stopping_list(stopping_criteria, stop_strings, tokenizer)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if tools is not None:
        from .tool_grammar import check_tools

        tools = check_tools(tools)
    device = next(model.parameters()).device
    limit = context_length(model) or prompt_len + max_new_tokens
    return Settings(cfg, make_generator(seed, generator, device), max_new_tokens, eos_ids(model, eos_token_id),
                    limit, processor, stopping, constraint, tools)


def check_constraint(constraint) -> None:
    from .constraint import Constraint

    if constraint is not None and not isinstance(constraint, Constraint):
        raise ValueError(f"constraint must be a selfspec.decoding.constraint.Constraint, got {type(constraint).__name__}")


def sampling(model, generation_config, temperature, top_k, top_p, max_new_tokens):
    """``(SamplingConfig, processors, max_new_tokens)`` from the explicit arguments and the
    generation config (see :func:`selfspec.generate`)."""
    from .logits_processing import from_generation_config, penalties

    gc = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    if generation_config is not None and not hasattr(generation_config, "do_sample"):
        raise ValueError(f"generation_config must be a transformers GenerationConfig, got {type(generation_config).__name__}")
    if max_new_tokens is None:
        max_new_tokens = getattr(gc, "max_new_tokens", None) or 128
    if gc is None:
        return SamplingConfig(temperature or 0.0, top_k or 0, 1.0 if top_p is None else top_p), [], max_new_tokens
    if temperature is None and top_k is None and top_p is None:
        from_config, processors = from_generation_config(gc)
        return from_config, processors, max_new_tokens
    cfg = SamplingConfig(0.0 if temperature is None else temperature, top_k or 0, 1.0 if top_p is None else top_p)
    return cfg, penalties(gc), max_new_tokens


def processor_list(processors: list, given):
    if given is None and not processors:
        return None
    from transformers import LogitsProcessorList

    given = list(given) if given is not None else []
    for p in given:
        if not callable(p):
            raise ValueError(f"logits_processor entries must be transformers LogitsProcessors, got {type(p).__name__}")
    return LogitsProcessorList(processors + given)


def stopping_list(criteria, stop_strings, tokenizer):
    if criteria is None and not stop_strings:
        return None
    from transformers import StoppingCriteriaList

    if criteria is not None:
        if callable(criteria) and not isinstance(criteria, (list, tuple)):
            criteria = [criteria]
        if isinstance(criteria, (str, bytes)) or not isinstance(criteria, (list, tuple)):
            raise ValueError(f"stopping_criteria must be a list of transformers StoppingCriteria, got "
                             f"{type(criteria).__name__}")
        for c in criteria:
            if not callable(c):
                raise ValueError(f"stopping_criteria entries must be callables (StoppingCriteria), got {type(c).__name__}")
    if stop_strings is not None and not isinstance(stop_strings, str) and \
            not all(isinstance(x, str) for x in stop_strings):
        raise ValueError("stop_strings must be a string or a list of strings")
    out = StoppingCriteriaList(list(criteria) if criteria is not None else [])
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings need tokenizer= (the target's tokenizer)")
        from transformers.generation.stopping_criteria import StopStringCriteria

        out.append(StopStringCriteria(tokenizer, [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)))
    return out


def controller_for(drafter, control) -> Controller | None:
    """The controller a call uses: the caller's own, a fresh one over the given drafter(s), or
    ``None`` (plain decoding)."""
    if isinstance(drafter, Controller):
        if control is not None:
            raise ValueError("give control= only with drafters, not with a Controller (it has its own config)")
        return drafter
    if control is not None and control is not False and not isinstance(control, ControlConfig):
        raise ValueError(f"control must be None, False or a ControlConfig, got {type(control).__name__}")
    if drafter is None:
        return None
    members = list(drafter) if isinstance(drafter, (list, tuple)) else [drafter]
    for m in members:
        if not isinstance(m, Drafter):
            raise ValueError(f"drafter must be a selfspec Drafter (see build_drafter), a list of them or a "
                             f"Controller, got {type(m).__name__}")
    config = ControlConfig(fixed=True) if control is False else control
    return Controller(members, config)


def as_token_ids(input_ids, name: str = "input_ids") -> torch.Tensor:
    """``input_ids`` (a tensor, a numpy array, or a list of ints) as an integer tensor, or a
    ``TypeError`` / ``ValueError`` naming ``name``: text, ``None``, floats and ragged lists are refused
    before torch sees them."""
    if input_ids is None:
        raise TypeError(f"{name} is None: give token ids (tokenizer(text, return_tensors='pt').input_ids)")
    if isinstance(input_ids, (str, bytes)) or (isinstance(input_ids, (list, tuple)) and input_ids
                                               and isinstance(input_ids[0], (str, bytes))):
        raise TypeError(f"{name} must be token ids, not text: tokenize it first "
                        "(tokenizer(text, return_tensors='pt').input_ids, or selfspec.chat.encode_chat)")
    if torch.is_tensor(input_ids):
        if input_ids.device.type == "meta":
            raise ValueError(f"{name} is on the meta device (no values): give real token ids")
        ids = input_ids
    else:
        try:
            ids = torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"{name} must be a rectangular array of integer token ids: {err}") from None
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be integer token ids, got dtype {ids.dtype}")
    return ids


def check_prompt(model, input_ids) -> torch.Tensor:
    """Validate and return one prompt as a CPU ``[L]`` LongTensor."""
    ids = as_token_ids(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"expected one prompt, got a batch of {ids.shape[0]}")
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must have shape [L] or [1, L], got {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token (e.g. the BOS token)")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}); the prompt holds {lo if lo < 0 else hi}")
    limit = context_length(model)
    if limit is not None and ids.shape[0] >= limit:
        raise ValueError(
            f"the prompt has {ids.shape[0]} tokens but the model's context holds {limit}: "
            "nothing can be generated; shorten the prompt"
        )
    return ids.to("cpu", torch.long)


def make_generator(seed, generator, device) -> torch.Generator:
    if seed is not None and generator is not None:
        raise ValueError("give either seed or generator, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if generator.device.type != torch.device(device).type:
            raise ValueError(f"generator is on {generator.device} but the model runs on {device}")
        return generator
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(check_seed(seed))
    return gen


def check_seed(seed) -> int:
    """``seed`` as an int in ``[0, 2**63)`` (numpy integers too), else an error naming it."""
    import numbers

    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer, got {seed!r} ({type(seed).__name__})")
    if not 0 <= int(seed) < 2 ** 63:
        raise ValueError(f"seed must lie in [0, 2**63), got {seed}")
    return int(seed)


def eos_ids(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        gen_cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(gen_cfg, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    import numbers

    scalar = isinstance(eos_token_id, numbers.Number) or (torch.is_tensor(eos_token_id) and eos_token_id.dim() == 0)
    values = [eos_token_id] if scalar else eos_token_id
    try:
        values = list(values)
    except TypeError:
        raise TypeError(f"eos_token_id must be a token id or a list of them, got {eos_token_id!r}") from None
    vocab = model.config.get_text_config(decoder=True).vocab_size
    out = set()
    for t in values:
        t = t.item() if torch.is_tensor(t) else t
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"eos_token_id must hold integer token ids, got {t!r} ({type(t).__name__})")
        if not 0 <= int(t) < vocab:
            raise ValueError(f"eos_token_id {t} is outside the vocabulary [0, {vocab})")
        out.add(int(t))
    return out
