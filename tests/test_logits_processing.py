"""transformers' processors, stopping criteria and generation configs through speculation: greedy
output equal to ``model.generate`` with the same settings, a processed law at T > 0 that equals the
exact processed law (decode-loop harness, with a negative control that processes every node after
the root's path), and ``model.generate(custom_generate=selfspec.custom_generate(drafter))`` on one
sequence and on a padded batch (``model.generate``'s own output, padding and early stops included;
negative control: processors shown the rows without their padding)."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, RepetitionPenaltyLogitsProcessor, StoppingCriteria

import selfspec
import selfspec.decoding.logits_processing as lp
import selfspec.decoding.arguments
import selfspec.decoding.request
from selfspec.drafters import build_drafter
from stubs import decode
from selfspec.decoding.sampling import SamplingConfig, target_probs
from stubs import ScriptedDrafter, fixed, padded, table_target
from test_distribution import NEW, PROMPT, SAMPLES, VOCAB, chi_square_ok, control_samples
from tiny_models import FAMILIES, tiny_model

IDS = torch.tensor([[3, 9, 27, 3, 9, 27, 3, 9, 5, 11]])


def _drafters(model):
    eagle = build_drafter(model, "eagle3", draft_vocab_size=48)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in eagle.head.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return [build_drafter(model, "ngram", min_ngram=1), eagle]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_processors_equals_model_generate(family):
    model = tiny_model(family, layers=6)
    want = model.generate(IDS, max_new_tokens=30, do_sample=False, repetition_penalty=1.5, no_repeat_ngram_size=3,
                          pad_token_id=0)
    plain = model.generate(IDS, max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert not torch.equal(want, plain)  # the processors matter here
    gc = GenerationConfig(do_sample=False, repetition_penalty=1.5, no_repeat_ngram_size=3, max_new_tokens=30)
    for drafter in [None, *_drafters(model), _drafters(model)]:
        out = selfspec.generate(model, IDS, drafter=drafter, generation_config=gc, eos_token_id=[])
        assert torch.equal(out.sequences, want[:, : out.sequences.shape[1]]) and out.sequences.shape == want.shape
    explicit = selfspec.generate(model, IDS, drafter=_drafters(model)[0], max_new_tokens=30, temperature=0,
                                 logits_processor=[RepetitionPenaltyLogitsProcessor(1.5)], eos_token_id=[])
    assert torch.equal(explicit.sequences,
                       model.generate(IDS, max_new_tokens=30, do_sample=False, repetition_penalty=1.5, pad_token_id=0))


def test_the_models_generation_config_is_the_default_and_arguments_override_it():
    model = tiny_model("llama", layers=6)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.8, top_k=5, max_new_tokens=12)
    out = selfspec.generate(model, IDS, seed=0, eos_token_id=[])
    assert out.sequences.shape[1] == IDS.shape[1] + 12
    cfg, processors, n = selfspec.decoding.arguments.sampling(model, None, None, None, None, None)
    assert cfg.temperature == 1.0 and [type(p).__name__ for p in processors] == ["TemperatureLogitsWarper", "TopKLogitsWarper"]
    cfg, processors, n = selfspec.decoding.arguments.sampling(model, None, 0.0, None, None, 7)
    assert cfg.greedy and processors == [] and n == 7
    greedy = selfspec.generate(model, IDS, temperature=0, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(greedy.sequences, model.generate(IDS, do_sample=False, max_new_tokens=12, pad_token_id=0))
    with pytest.raises(ValueError, match="num_beams"):
        selfspec.generate(model, IDS, generation_config=GenerationConfig(num_beams=4))


class StopAfter(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_stopping_criteria_end_where_plain_decoding_ends():
    model = tiny_model("llama", layers=6)
    full = model.generate(IDS, max_new_tokens=40, do_sample=False, pad_token_id=0)
    stop_token = int(full[0, IDS.shape[1] + 17])
    first = IDS.shape[1] + next(i for i, t in enumerate(full[0, IDS.shape[1]:].tolist()) if t == stop_token)
    for drafter in [None, *_drafters(model)]:
        out = selfspec.generate(model, IDS, drafter=drafter, max_new_tokens=40, temperature=0,
                                stopping_criteria=[StopAfter(stop_token)], eos_token_id=[])
        assert out.finish_reason == "stop" and torch.equal(out.sequences, full[:, : first + 1])
    with pytest.raises(ValueError, match="tokenizer"):
        selfspec.generate(model, IDS, stop_strings=["x"])


@pytest.mark.parametrize("sample", [False, True])
def test_model_generate_with_custom_generate(sample):
    model = tiny_model("llama", layers=6)
    kw = dict(max_new_tokens=24, repetition_penalty=1.3, pad_token_id=0)
    kw |= dict(do_sample=True, temperature=0.8, top_k=6) if sample else dict(do_sample=False)
    hook = selfspec.custom_generate(_drafters(model)[1])
    out = model.generate(IDS, custom_generate=hook, **kw)
    assert out.shape == (1, IDS.shape[1] + 24)
    if not sample:
        assert torch.equal(out, model.generate(IDS, **kw))
    else:
        torch.manual_seed(3)
        a = model.generate(IDS, custom_generate=hook, **kw)
        torch.manual_seed(3)
        b = model.generate(IDS, custom_generate=hook, **kw)
        assert a.shape == b.shape  # (the controller may change trees between runs; the law is tested below)


ROWS = [[3, 9, 27, 3, 9, 27, 3, 9, 5, 11], [7, 8, 9], [12, 40, 12, 40, 12]]


# EOS 44 ends rows 0 and 1 at different steps; min_length counts the left padding in model.generate
BATCH_KW = dict(max_new_tokens=24, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3, pad_token_id=0,
                eos_token_id=44)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_model_generate_with_custom_generate_on_a_padded_batch(family):
    model = tiny_model(family, layers=6)
    ids, mask = padded(ROWS)
    kw = BATCH_KW | dict(min_length=ids.shape[1] + 8)
    want = model.generate(ids, attention_mask=mask, **kw)
    for drafter in [None, _drafters(model)]:
        out = model.generate(ids, attention_mask=mask, custom_generate=selfspec.custom_generate(drafter), **kw)
        assert torch.equal(out, want), (out, want)
    if family == "llama":  # the batch's rows stop at different steps; the finished ones are padded
        assert (want[:, -1] == 0).sum() >= 1 and (want[:, ids.shape[1]:] == 0).sum() < want[:, ids.shape[1]:].numel()


def test_custom_generate_batch_negative_control_processors_see_unpadded_rows(monkeypatch):
    """Processors and criteria shown each row without its padding (min_length then counts fewer
    tokens than model.generate does): the output must differ."""
    import importlib

    cg = importlib.import_module("selfspec.custom_generate")  # (the package's attribute is the function)
    model = tiny_model("llama", layers=6)
    ids, mask = padded(ROWS)
    kw = BATCH_KW | dict(min_length=ids.shape[1] + 8)
    want = model.generate(ids, attention_mask=mask, **kw)
    monkeypatch.setattr(cg, "row_view", lambda input_ids, given, n: input_ids)
    out = model.generate(ids, attention_mask=mask, custom_generate=selfspec.custom_generate(None), **kw)
    assert not torch.equal(out, want)


def test_custom_generate_batch_right_padding_sampling_and_refusals():
    model = tiny_model("llama", layers=6)
    hook = selfspec.custom_generate(_drafters(model)[1], control=False)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    ids, mask = padded(ROWS, left=False)  # new tokens follow each row as given; each continues its unpadded prompt
    out = model.generate(ids, attention_mask=mask, custom_generate=hook, **kw)
    for b, row in enumerate(ROWS):
        alone = model.generate(torch.tensor([row]), **kw)
        assert torch.equal(out[b, ids.shape[1]:], alone[0, len(row):]) and torch.equal(out[b, : ids.shape[1]], ids[b])
    sample = dict(max_new_tokens=12, do_sample=True, temperature=0.9, pad_token_id=0)
    ids, mask = padded(ROWS)
    torch.manual_seed(5)
    a = model.generate(ids, attention_mask=mask, custom_generate=hook, **sample)
    torch.manual_seed(5)
    b = model.generate(ids, attention_mask=mask, custom_generate=hook, **sample)
    assert torch.equal(a, b) and a.shape == (3, ids.shape[1] + 12)  # control=False: seeded sampling repeats
    assert not torch.equal(a[0, -12:], a[1, -12:])


# ---------------------------------------------------------------- the law at T > 0
PENALTY = 3.0


def _processed_law(cfg) -> dict[tuple[int, ...], float]:
    """The exact law of the first NEW tokens of plain decoding with a repetition penalty on the
    table target (its logits depend on the last two tokens; the penalty on the whole sequence)."""
    table = table_target(VOCAB).table
    proc = RepetitionPenaltyLogitsProcessor(PENALTY)
    law = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW):
        p, ids = 1.0, list(PROMPT)
        for t in seq:
            logits = proc(torch.tensor([ids]), table[ids[-2], ids[-1]][None].clone())[0]
            p *= float(target_probs(logits, cfg)[t])
            ids.append(t)
        law[seq] = p
    return law


def _counts(cfg, n, seed=0):
    target, gen, counts = table_target(VOCAB), torch.Generator().manual_seed(seed), {}
    controller = fixed(ScriptedDrafter(VOCAB, point=1, sampled=2))  # every step drafts, whole trees verified
    proc = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(PENALTY)])
    for _ in range(n):
        out = decode(target, torch.tensor(PROMPT), controller, cfg, gen, NEW, set(), 100, logits_processor=proc)
        key = tuple(out.sequences[0, len(PROMPT):].tolist())
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("lossy", [False, True])
def test_processed_law_equals_plain_processed_law(lossy, monkeypatch):
    """Sampled and point-mass children under a repetition penalty at T = 0.9: the law of the first
    three tokens is the exact processed law (chi-square, 1e-6). Processing every node after the
    root's path instead of its own (``lossy``) must fail the same test."""
    if lossy:
        real = lp.process_tree

        def root_path_for_all(processor, committed, tree, logits):
            root = type(tree).root_only(int(tree.tokens[0]))
            return torch.cat([real(processor, committed, root, logits[i:i + 1]) for i in range(logits.shape[0])])

        monkeypatch.setattr(selfspec.decoding.request, "process_tree", root_path_for_all)
    cfg = SamplingConfig(0.9)
    n = control_samples(SAMPLES) if lossy else SAMPLES
    ok, msg = chi_square_ok(_processed_law(cfg), _counts(cfg, n), n=n)
    assert ok != lossy, msg


def test_a_beam_search_default_is_refused_only_when_it_would_decide_sampling():
    model = tiny_model("llama", layers=6)
    model.generation_config = GenerationConfig(num_beams=4, repetition_penalty=1.5)
    with pytest.raises(ValueError, match="num_beams"):
        selfspec.generate(model, IDS, max_new_tokens=8)
    out = selfspec.generate(model, IDS, max_new_tokens=8, temperature=0, eos_token_id=[])  # explicit: greedy
    assert torch.equal(out.sequences, model.generate(IDS, max_new_tokens=8, do_sample=False, num_beams=1,
                                                     repetition_penalty=1.5, pad_token_id=0))
