"""Greedy identity: speculative greedy output is token-identical to transformers' plain greedy
``model.generate(do_sample=False)``, for every drafter, with drafts that are always, never and
sometimes right, on every supported family, and with exact / near ties in the logits."""

from __future__ import annotations

import pytest
import torch

import selfspec
from stubs import OracleDrafter
from tiny_models import FAMILIES, tiny_model

VOCAB = 64
PROMPT = torch.tensor([[3, 9, 27, 3, 9, 27, 3, 9, 5, 11]])


def hf_greedy(model, prompt, n, eos=None):
    kwargs = dict(max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return model.generate(prompt, **kwargs)


def drafters(model, reference):
    ref = reference[0].tolist()
    return {
        "plain": None,
        "ngram": selfspec.build_drafter(model, "ngram", min_ngram=1),
        "ngram_grown": selfspec.build_drafter(model, "ngram", min_ngram=1, max_depth=2, long_depth=16),
        "always_right": OracleDrafter(ref, VOCAB, depth=5),
        "never_right": OracleDrafter(ref, VOCAB, depth=3, corrupt=lambda pos, tok: (tok + 2) % VOCAB),
        "sometimes_right": OracleDrafter(
            ref, VOCAB, depth=4, corrupt=lambda pos, tok: tok if pos % 3 else (tok + 5) % VOCAB
        ),
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_every_drafter(family):
    model = tiny_model(family, vocab=VOCAB)
    reference = hf_greedy(model, PROMPT, 40)
    for name, drafter in drafters(model, reference).items():
        out = selfspec.generate(model, PROMPT, drafter=drafter, max_new_tokens=40)
        assert torch.equal(out.sequences, reference), name
        assert out.stats.new_tokens == 40
    always = selfspec.generate(model, PROMPT, drafter=drafters(model, reference)["always_right"], max_new_tokens=40,
                               control=False)  # a plain first step would change the count
    assert always.stats.mean_accepted_length == pytest.approx(40 / 7)  # 5 accepted + bonus per step
    never = selfspec.generate(model, PROMPT, drafter=drafters(model, reference)["never_right"], max_new_tokens=40)
    assert never.stats.mean_accepted_length == 1.0


def test_greedy_identity_with_ties_and_near_ties():
    """Pairs of LM-head rows are equal (exact ties) or differ by 1e-9 (near ties); the drafter
    proposes the losing twin first, so only the first-maximum tie-break keeps identity."""
    model = tiny_model("llama", vocab=VOCAB, seed=5)
    with torch.no_grad():
        w = model.lm_head.weight  # tied with the input embeddings
        w[1::2] = w[0::2]
        w[1::4] += 1e-9
    reference = hf_greedy(model, PROMPT, 30)
    ref = reference[0].tolist()
    twin = OracleDrafter(ref, VOCAB, depth=4, corrupt=lambda pos, tok: tok ^ 1, sibling=False)
    out = selfspec.generate(model, PROMPT, drafter=twin, max_new_tokens=30)
    assert torch.equal(out.sequences, reference)
    logits = model(reference).logits[0, PROMPT.shape[1] - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    assert bool((top2[:, 0] - top2[:, 1] < 1e-8).any()), "the test needs real ties on the generated path"


@pytest.mark.parametrize("eos_offset", [0, 2, 5])
def test_eos_inside_accepted_run_ends_output_there(eos_offset):
    model = tiny_model("llama", vocab=VOCAB)
    free = hf_greedy(model, PROMPT, 30)[0, PROMPT.shape[1]:].tolist()
    eos = free[eos_offset + 3]
    first = free.index(eos)
    reference = hf_greedy(model, PROMPT, 30, eos=eos)
    drafter = OracleDrafter(PROMPT[0].tolist() + free, VOCAB, depth=6)
    out = selfspec.generate(model, PROMPT, drafter=drafter, max_new_tokens=30, eos_token_id=eos)
    assert out.finish_reason == "eos"
    assert out.sequences[0, -1].item() == eos
    assert out.sequences.shape[1] == PROMPT.shape[1] + first + 1
    assert torch.equal(out.sequences, reference)


@pytest.mark.parametrize("n", [1, 2, 3, 6, 7, 13])
def test_never_more_than_max_new_tokens(n):
    model = tiny_model("llama", vocab=VOCAB)
    reference = hf_greedy(model, PROMPT, 20)
    drafter = OracleDrafter(reference[0].tolist(), VOCAB, depth=6)
    out = selfspec.generate(model, PROMPT, drafter=drafter, max_new_tokens=n)
    assert out.sequences.shape[1] == PROMPT.shape[1] + n
    assert torch.equal(out.sequences, reference[:, : PROMPT.shape[1] + n])
    assert out.finish_reason == "length"


def test_generation_stops_at_the_context_limit():
    model = tiny_model("llama", vocab=VOCAB)
    model.config.max_position_embeddings = PROMPT.shape[1] + 4
    out = selfspec.generate(model, PROMPT, drafter=selfspec.build_drafter(model, "ngram"), max_new_tokens=20)
    assert out.sequences.shape[1] == PROMPT.shape[1] + 4
    assert out.finish_reason == "context"


def test_sampling_is_reproducible_with_seed_and_generator():
    model = tiny_model("qwen3", vocab=VOCAB)
    drafter = selfspec.build_drafter(model, "ngram", min_ngram=1)
    # control=False: the adaptive schedule depends on measured time, so it is exact in law only
    kw = dict(drafter=drafter, max_new_tokens=25, temperature=0.9, top_p=0.95, control=False)
    a = selfspec.generate(model, PROMPT, seed=7, **kw).sequences
    b = selfspec.generate(model, PROMPT, generator=torch.Generator().manual_seed(7), **kw).sequences
    c = selfspec.generate(model, PROMPT, seed=8, **kw).sequences
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
