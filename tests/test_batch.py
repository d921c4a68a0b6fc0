"""Batched speculation (selfspec.batch): every row decodes exactly as it would alone.

* Greedy identity per row: float64 tiny models of every family, prompts of mixed lengths, rows
  with different budgets finishing at different steps, requests joining a running pool late,
  plain / prompt lookup / an EAGLE-3 head / their union: each row equals ``model.generate`` on
  that prompt alone.
* The law per row at T > 0: two interleaved prompts with their own exact laws, sampled drafts,
  chi-square per prompt; negative control: a commit that copies a neighbour row's keys and values
  (a row reading another row's cache) fails.
* Heads draft for every row in one call per level (EAGLE-3, Medusa, layer-skip): each row's tree
  is the one it drafts alone; negative control: rows seeing each other's keys draft other trees.
* Inputs: padded ``[B, L]`` ids with an attention mask (left and right padding) equal the list of
  prompts; holes in the mask, empty batches and bad ``max_batch`` are refused.
"""

from __future__ import annotations

import os

import pytest
import torch

import selfspec
from selfspec.batch import BatchTarget, Pool
from selfspec.control.gate import BatchGate
from selfspec.control.cost import CostModel
from selfspec.decoding.sampling import SamplingConfig, target_probs
from stubs import ScriptedDrafter, padded
from test_distribution import chi_square_ok
from tiny_models import FAMILIES, tiny_model

VOCAB = 64
PROMPTS = [[3, 9, 27, 3, 9, 27, 3, 9, 5, 11], [7, 1], [5, 6, 5, 6, 5, 6, 5], [2, 40, 2, 40, 2, 40, 2, 40, 2, 40, 2, 33],
           [12]]


def alone(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0]


def _eagle3(model, seed=0):
    d = selfspec.build_drafter(model, "eagle3", draft_vocab_size=16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.head.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.4)
    return d


def _drafters(model):
    return {
        "plain": None,
        "ngram": selfspec.build_drafter(model, "ngram", min_ngram=1),
        "eagle3": _eagle3(model),
        "union": [_eagle3(model), selfspec.build_drafter(model, "ngram", min_ngram=1)],
        "medusa": selfspec.build_drafter(model, "medusa", num_heads=3, num_layers=1),
        "layerskip": selfspec.build_drafter(model, "layerskip", exit_layer=1),
        "suffix": selfspec.build_drafter(model, "suffix"),
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_every_row_equals_its_prompt_decoded_alone(family):
    model = tiny_model(family, vocab=VOCAB)
    budgets = [30, 12, 25, 7, 18]
    refs = [alone(model, p, n) for p, n in zip(PROMPTS, budgets)]
    for name, drafter in _drafters(model).items():
        pool = Pool(model, drafter, max_batch=len(PROMPTS))
        handles = [pool.submit(torch.tensor(p), max_new_tokens=n, eos_token_id=[]) for p, n in zip(PROMPTS, budgets)]
        finished = pool.run()
        assert sorted(h.index for h in finished) == list(range(len(PROMPTS)))
        for h, ref in zip(handles, refs):
            assert torch.equal(h.output.sequences[0], ref), (family, name, h.index)
            assert h.output.finish_reason == "length"
        assert pool.idle and pool.target.rows == 0


def test_rows_finishing_at_different_steps_and_joining_late():
    """Seven requests through a pool of two rows: each joins when a row leaves (its prefill between
    the other's steps), rows stop at EOS or their budget; each equals its prompt alone."""
    model = tiny_model("gemma3", vocab=VOCAB)
    prompts = PROMPTS + [[1, 2, 3, 4, 5, 6, 7, 8, 9], [33, 34]]
    budgets = [20, 5, 14, 9, 11, 3, 16]
    refs = [alone(model, p, n) for p, n in zip(prompts, budgets)]
    eos = int(refs[0][len(prompts[0]) + 6])  # the 7th token of the first row ends it there
    pool = Pool(model, [_eagle3(model), selfspec.build_drafter(model, "ngram", min_ngram=1)], max_batch=2)
    handles = [pool.submit(torch.tensor(p), max_new_tokens=n, eos_token_id=eos if i == 0 else [])
               for i, (p, n) in enumerate(zip(prompts, budgets))]
    sizes = []
    while not pool.idle:
        pool.step()
        sizes.append(pool.target.rows)
    assert max(sizes) == 2 and pool.stats.steps > 0
    first = refs[0][: len(prompts[0]) + 7]
    assert torch.equal(handles[0].output.sequences[0], first) and handles[0].output.finish_reason == "eos"
    for h, ref in zip(handles[1:], refs[1:]):
        assert torch.equal(h.output.sequences[0], ref), h.index
    assert all(h.admitted is not None and h.finished >= h.admitted for h in handles)
    assert handles[-1].admitted > handles[0].admitted  # joined later


def test_generate_takes_a_list_or_padded_ids_with_a_mask():
    model = tiny_model("qwen2", vocab=VOCAB)
    prompts = PROMPTS[:4]
    refs = [alone(model, p, 10) for p in prompts]
    left, mask_l = padded(prompts)
    right, mask_r = padded(prompts, left=False)
    drafter = selfspec.build_drafter(model, "ngram", min_ngram=1)
    for ids, mask in ((prompts, None), (left, mask_l), (right, mask_r)):
        out = selfspec.generate(model, ids, attention_mask=mask, drafter=drafter, max_new_tokens=10, eos_token_id=[])
        assert isinstance(out, selfspec.batch.BatchOutput)
        assert all(torch.equal(s, r) for s, r in zip(out.sequences, refs))
        assert out.padded(0).shape == (4, max(r.shape[0] for r in refs))
    one = selfspec.generate(model, left[1:2], attention_mask=mask_l[1:2], max_new_tokens=10, eos_token_id=[])
    assert torch.equal(one.sequences[0], refs[1])


def test_a_batch_streams_each_rows_tokens_as_they_are_committed():
    model = tiny_model("mistral", vocab=VOCAB)
    prompts = PROMPTS[:3]
    refs = [alone(model, p, 9) for p in prompts]
    drafter = selfspec.build_drafter(model, "ngram", min_ngram=1)
    got = {b: [] for b in range(len(prompts))}
    with selfspec.stream(model, prompts, drafter=drafter, max_new_tokens=9, eos_token_id=[]) as it:
        for row, tokens in it:
            got[row] += tokens
    assert all(torch.equal(o, r) for o, r in zip(it.output.sequences, refs))
    assert all(got[b] == refs[b][len(p):].tolist() for b, p in enumerate(prompts))
    with pytest.raises(ValueError, match="temperature"):  # checked before anything runs
        selfspec.stream(model, prompts, temperature=-1.0)


def test_batch_inputs_are_checked():
    model = tiny_model("llama", vocab=VOCAB)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="holes"):
        selfspec.generate(model, ids, attention_mask=torch.tensor([[1, 0, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match="masks every token"):
        selfspec.generate(model, ids, attention_mask=torch.tensor([[0, 0, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match="shape"):
        selfspec.generate(model, ids, attention_mask=torch.tensor([[1, 1], [1, 1]]))
    with pytest.raises(ValueError, match="one prompt"):
        selfspec.generate(model, ids, streamer=object())
    with pytest.raises(ValueError, match="max_batch"):
        Pool(model, max_batch=0)
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        selfspec.generate(model, [[1, 2], [3, 99]])
    with pytest.raises(ValueError, match="temperature"):
        Pool(model).submit(torch.tensor([1, 2]), temperature=-1.0)


def test_a_rows_cost_share_falls_with_the_batch():
    cost = CostModel({1: 1.0, 8: 1.2, 64: 4.0})
    assert cost.verify(1, rows=8) == pytest.approx(1.2 / 8)  # eight rows of one node: one pass of eight
    assert cost.verify(8, rows=8) == pytest.approx(4.0 / 8)  # eight rows of eight nodes
    assert cost.verify(8, rows=8) / cost.verify(1, rows=8) > cost.verify(8) / cost.verify(1)


def test_the_batch_gate_runs_plain_steps_while_speculation_measures_slower():
    gate, pattern = BatchGate(), []
    for _ in range(40):  # speculation at 4 tokens/s, plain at 8
        d = gate.draft(4)
        pattern.append(d)
        gate.record(4, d, 4 if d else 8, 1.0)
    assert pattern[:3] == [True, True, False]  # a warm-up, a measured speculative step, a plain one
    assert sum(pattern) <= 10  # then probes (a warm-up and a measured step) after 2, 4, 8, ... plain steps
    assert gate.verdict(4) is False and gate.verdict(16) is False and gate.verdict(2) is None
    assert not gate.draft(16)  # a size never measured starts from the nearest smaller one's verdict
    later = []
    for _ in range(40):  # speculation turns faster: from its next probe on, every step drafts
        d = gate.draft(4)
        later.append(d)
        gate.record(4, d, 40 if d else 8, 1.0)
    first = later.index(True)
    assert first <= 32 and all(later[first:])
    assert gate.draft(8)  # (nearest smaller verdict: faster)


def test_the_batch_budget_cuts_rows_to_one_node_count_and_stays_exact():
    """Rows whose controllers size trees of different sizes: the batch picks one budget for all
    (the biggest tree no longer sets every row's pass), and each row still equals its prompt
    alone."""
    model = tiny_model("llama", vocab=VOCAB)
    refs = [alone(model, p, 16) for p in PROMPTS]
    pool = Pool(model, [_eagle3(model), selfspec.build_drafter(model, "ngram", min_ngram=1)], max_batch=len(PROMPTS))
    handles = [pool.submit(torch.tensor(p), max_new_tokens=16, eos_token_id=[]) for p in PROMPTS]
    cuts = []
    original = type(pool.controller).cut

    def cut(self, plan, n):
        cuts.append(n)
        return original(self, plan, n)

    import unittest.mock

    with unittest.mock.patch.object(type(pool.controller), "cut", cut):
        pool.run()
    assert cuts, "no row was cut to the batch's budget"
    for h, ref in zip(handles, refs):
        assert torch.equal(h.output.sequences[0], ref), h.index


def test_the_throughput_sweep_and_stream_record_what_the_tables_show():
    from selfspec.control import Controller
    from selfspec.measurement import throughput

    model = tiny_model("llama", vocab=VOCAB)
    model.generation_config.eos_token_id = None
    prompts = [torch.tensor(p) for p in PROMPTS[:4]]
    methods = {"hf-greedy": "hf", "none": None, "ngram": Controller(selfspec.build_drafter(model, "ngram", min_ngram=1))}
    records = throughput.sweep(model, methods, prompts, [1, 2], max_new_tokens=5, min_prompts=4)
    assert [(r["batch"], r["method"]) for r in records] == [(b, m) for b in (1, 2) for m in methods]
    for r in records:
        r["dtype"] = "float64"
        assert r["tokens"] == 20 and len(r["chunks"]) == 4 // r["batch"] and r["identical_rows"] == 4
    table = throughput.sweep_table(records)
    assert "| float64 | 1 | ngram |" in table and "(" in table.split("| float64 | 1 | ngram |")[1].split("\n")[0]
    pooled = {"none": None, "ngram": methods["ngram"]}
    streams = throughput.stream_runs(model, pooled, prompts + prompts[::-1], requests=2, rate=100.0, repeats=4,
                                     max_batch=2, max_new_tokens=5)
    for name, result in streams.items():
        assert result["tokens"] == 40 and len(result["latency_s"]) == 8 and len(result["runs"]) == 4
        for r, run in enumerate(result["runs"]):  # stream r: the next 2 prompts, each row exact
            part = (prompts + prompts[::-1])[2 * r: 2 * r + 2]
            assert all(torch.equal(torch.tensor(o), alone(model, p.tolist(), 5)) for o, p in zip(run["outputs"], part))
    table = throughput.stream_table({f"{k} (float64)": v for k, v in streams.items()})
    assert "| ngram (float64) |" in table and "x (" in table.split("| ngram (float64) |")[1].split("\n")[0]


# ---------------------------------------------------------------- heads draft every row in one call
def _contexts(model, drafter, prompts, temperature):
    """One draft context per prompt as the engine builds it (its taps, its root's hidden state,
    its own generator)."""
    from selfspec.drafters.base import DraftContext
    from selfspec.model.taps import capture_taps

    ctxs = []
    for i, p in enumerate(prompts):
        ids = torch.tensor(p)
        with capture_taps(model, drafter.requires.taps) as rec:
            out = model(ids[None], output_hidden_states=True)
        feats = rec.get()[0, :-1] if drafter.requires.taps else None
        ctxs.append(DraftContext(ids, out.hidden_states[-1][0, -2], 4, SamplingConfig(temperature=temperature),
                                 torch.Generator().manual_seed(i), features=feats, prompt_len=1))
    return ctxs


def _same_tree(a, b) -> bool:
    same = torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and torch.equal(a.laws, b.laws)
    if same and a.draft_probs is not None:
        same = torch.equal(a.draft_row, b.draft_row) and torch.allclose(a.draft_probs, b.draft_probs, atol=1e-12)
    return same


def _leak(module, name):
    """Negative control: after the batch is built, each row's queries also see every other row's
    slots (and pads)."""
    init = getattr(module, name).__init__

    def leaky(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.seen[:] = True

    return leaky


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["eagle3", "medusa", "layerskip"])
@pytest.mark.parametrize("leak", [False, True])
def test_heads_draft_every_row_in_one_call_as_each_would_alone(family, kind, leak, monkeypatch):
    """``propose_many`` over five rows of mixed lengths gives each row the tree (tokens, shape,
    laws, draft distributions) it drafts alone, greedy and sampled, on a first step and after its
    rows grew by different amounts; the model runs once per level for all rows. Negative control:
    rows that see each other's keys (EAGLE-3, layer-skip) or each other's hidden state (Medusa)
    draft other trees."""
    import selfspec.drafters.eagle3 as eagle3_mod
    import selfspec.drafters.layerskip as layerskip_mod

    model = tiny_model(family, vocab=VOCAB)
    drafter = {"eagle3": lambda: _eagle3(model),
               "medusa": lambda: selfspec.build_drafter(model, "medusa", num_heads=3, num_layers=1),
               "layerskip": lambda: selfspec.build_drafter(model, "layerskip", exit_layer=1)}[kind]()
    if kind == "medusa":
        with torch.no_grad():
            for p in drafter.heads.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype) * 0.5)
    calls = []
    counted = {"eagle3": lambda: (drafter.head, "step_many"), "medusa": lambda: (drafter.heads, "logits"),
               "layerskip": lambda: (type(drafter.body), "__call__")}[kind]()
    original = getattr(*counted)

    def count(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(*counted, count)
    if leak and kind != "medusa":
        module, name = (eagle3_mod, "_Rows") if kind == "eagle3" else (layerskip_mod, "_Rows")
        monkeypatch.setattr(getattr(module, name), "__init__", _leak(module, name))
    longer = [p + [1, 2, 3][: i % 3 + 1] for i, p in enumerate(PROMPTS)]
    differs = False
    for temperature in (0.0, 1.0):
        alone_, batch = [drafter.fork() for _ in PROMPTS], [drafter.fork() for _ in PROMPTS]
        for prompts in (PROMPTS[:4] + [[12, 4]], longer[:4] + [[12, 4, 1]]):
            trees = [f.propose(c) for f, c in zip(alone_, _contexts(model, drafter, prompts, temperature))]
            ctxs = _contexts(model, drafter, prompts, temperature)
            if leak and kind == "medusa":
                hidden = [c.root_hidden for c in ctxs]
                for c, h in zip(ctxs, hidden[1:] + hidden[:1]):
                    c.root_hidden = h
            calls.clear()
            many = type(drafter).propose_many(batch, ctxs)
            assert len(calls) <= 1 + 4  # one catch-up, then one call per level, whatever the rows
            same = [_same_tree(a, b) for a, b in zip(trees, many)]
            differs |= not all(same)
            if not leak:
                assert all(same), (temperature, same)
    assert differs == leak


# ---------------------------------------------------------------- the law per row at T > 0
LAW_VOCAB, NEW = 6, 3
LAW_PROMPTS = ([1, 2, 3], [4, 0, 5, 5, 1])
ROWS = 100  # per prompt, per pool
SAMPLES = int(os.environ.get("SELFSPEC_BATCH_LAW_SAMPLES", 8_000))


def _law_model():
    """Sliding-window layers and attention strong enough that the context moves the next token's
    law (total variation about 0.2 between the two prompts' contexts), so a row reading another
    row's keys and values shows."""
    model = tiny_model("qwen2", vocab=LAW_VOCAB, layers=3, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(5)
        for layer in model.model.layers:
            for proj, scale in ((layer.self_attn.q_proj, 3), (layer.self_attn.k_proj, 3),
                                (layer.self_attn.v_proj, 8), (layer.self_attn.o_proj, 8)):
                proj.weight.mul_(scale)
    return model


def _exact(model, cfg, prompt):
    import itertools

    law = {}
    for seq in itertools.product(range(LAW_VOCAB), repeat=NEW):
        prob, ctx = 1.0, list(prompt)
        for tok in seq:
            with torch.no_grad():
                logits = model(torch.tensor([ctx])).logits[0, -1]
            prob *= float(target_probs(logits, cfg)[tok])
            ctx.append(tok)
        if prob > 0:
            law[seq] = prob
    return law


def _batch_counts(model, cfg, n, control=False):
    counts = [dict(), dict()]
    drafter = ScriptedDrafter(LAW_VOCAB, point=1, sampled=2)
    drafter.check_target = lambda m: None
    runs = max(1, n // ROWS)
    for r in range(runs):
        pool = Pool(model, drafter, control=control, max_batch=2 * ROWS)
        handles = [pool.submit(torch.tensor(LAW_PROMPTS[i % 2]), max_new_tokens=NEW, temperature=cfg.temperature,
                               top_k=cfg.top_k, seed=r * 2 * ROWS + i, eos_token_id=[]) for i in range(2 * ROWS)]
        pool.run()
        for i, h in enumerate(handles):
            key = tuple(h.output.sequences[0, len(LAW_PROMPTS[i % 2]):].tolist())
            counts[i % 2][key] = counts[i % 2].get(key, 0) + 1
    return counts, runs * ROWS


def _neighbour_commit(self, paths, real):
    """Lossy: after each commit the cache's rows are shifted by one, so every request reads its
    neighbour's cache from then on (rows misaligned with their requests)."""
    real(self, paths)
    for layer in self.cache.layers:
        layer.keys, layer.values = layer.keys.roll(1, dims=0), layer.values.roll(1, dims=0)


@pytest.mark.parametrize("lossy,control", [(False, False), (False, None), (True, False)])
def test_the_law_of_every_row_is_its_prompts_law(lossy, control, monkeypatch):
    """``control=False``: every row verifies its drafter's whole tree; ``None``: each row's
    controller picks arms and sizes, the batch cuts rows to one budget and its gate may run plain
    steps."""
    model = _law_model()
    cfg = SamplingConfig(1.0, top_k=0)
    if lossy:
        real = BatchTarget.commit
        monkeypatch.setattr(BatchTarget, "commit", lambda self, paths: _neighbour_commit(self, paths, real))
    counts, n = _batch_counts(model, cfg, SAMPLES // 4 if lossy else SAMPLES, control)
    results = [chi_square_ok(_exact(model, cfg, p), c, n=n) for p, c in zip(LAW_PROMPTS, counts)]
    if lossy:
        assert not all(ok for ok, _ in results), results
    else:
        assert all(ok for ok, _ in results), results
