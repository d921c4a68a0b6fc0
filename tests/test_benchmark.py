"""Benchmark bookkeeping: speedups are computed against the baseline on the same prompts."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from selfspec.measurement.benchmark import Record, divergence_table, from_rows, markdown_table, summarise


def rec(qid, cat, method, tokens, time_s, steps, identical=True, turn=0):
    return Record(qid, cat, turn, method, 10, tokens, steps, time_s, 0.1, identical, [steps], [steps // 2])


def test_speedup_is_a_rate_ratio_per_category_and_overall():
    records = [
        rec("1", "a", "baseline", 100, 10.0, 100), rec("1", "a", "x", 100, 5.0, 40),
        rec("2", "b", "baseline", 50, 5.0, 50), rec("2", "b", "x", 40, 8.0, 40, identical=False),
    ]
    s = summarise(records)
    assert s["a"]["x"]["speedup"] == pytest.approx(2.0)
    assert s["b"]["x"]["speedup"] == pytest.approx((40 / 8) / (50 / 5))
    assert s["overall"]["x"]["speedup"] == pytest.approx((140 / 13) / (150 / 15))
    assert s["a"]["x"]["mean_accepted_length"] == pytest.approx(2.5)
    assert s["overall"]["x"]["identical_share"] == 0.5
    assert s["a"]["baseline"]["speedup"] == pytest.approx(1.0)
    assert list(s)[-1] == "overall"
    assert "| b | x | 1 |" in markdown_table(s)


def test_the_identity_column_says_where_and_why_outputs_diverged():
    """A bf16 greedy output that left plain greedy: the table's identity column gives the near-tie
    count and the widest top-2 margin, the divergence table each turn's first divergent token,
    margin and rounding gap, and flags one the rounding cannot explain."""
    records = [rec("1", "a", "baseline", 100, 10.0, 100), rec("1", "a", "x", 100, 5.0, 40, identical=False),
               rec("2", "a", "baseline", 100, 10.0, 100), rec("2", "a", "x", 100, 5.0, 40, identical=False)]
    records[1].divergence = dict(position=22, margin=0.0625, rounding_gap=0.05, ulp=0.0156, explained=True)
    records[3].divergence = dict(position=3, margin=1.5, rounding_gap=0.05, ulp=0.0156, explained=False)
    s = summarise(records)
    assert "| 0% (1/2 near-ties, margin <= 1.5) |" in markdown_table(s)
    where = divergence_table(s)
    assert "| x | 1 | 1 | 22 | 0.0625 | 0.05 | yes |" in where and "| x | 2 | 1 | 3 | 1.5 | 0.05 | NO |" in where
    assert divergence_table(summarise([rec("1", "a", "baseline", 9, 1.0, 9), rec("1", "a", "x", 9, 1.0, 3)])) == ""


def test_speedup_intervals_and_unions_against_their_members():
    """A paired bootstrap interval brackets each speedup and is reproducible; a union is compared
    with each member run in the same dtype on the same prompts (a loss shows as a ratio below 1)."""
    records = []
    for q in range(6):
        noise = 1.0 + 0.1 * (q % 3)  # the machine's speed varies from prompt to prompt
        records += [rec(str(q), "a", "baseline", 100, 10.0 * noise, 100),
                    rec(str(q), "a", "ngram", 100, 5.0 * noise, 50),
                    rec(str(q), "a", "eagle3+ngram", 100, 6.0 * noise, 40),
                    rec(str(q), "a", "ngram%bfloat16", 100, 4.0 * noise, 50),
                    rec(str(q), "a", "eagle3+ngram%bfloat16", 100, 4.0 * noise, 40)]
    s = summarise(records)
    lo, hi = s["overall"]["ngram"]["speedup_ci"]
    assert lo <= s["overall"]["ngram"]["speedup"] <= hi
    assert summarise(records)["overall"]["ngram"]["speedup_ci"] == [lo, hi]  # seeded
    unions = {(u["union"], u["member"]): u for u in s["overall"]["baseline"]["unions"]}
    assert set(unions) == {("eagle3+ngram", "ngram"), ("eagle3+ngram%bfloat16", "ngram%bfloat16")}
    assert unions[("eagle3+ngram", "ngram")]["ratio"] == pytest.approx(5 / 6)
    assert unions[("eagle3+ngram", "ngram")]["ci"][1] < 1.0  # a loss the noise cannot explain
    assert unions[("eagle3+ngram%bfloat16", "ngram%bfloat16")]["ratio"] == pytest.approx(1.0)
    table = markdown_table(s)
    assert "95% CI" in table and "| eagle3+ngram | ngram | 0.83x |" in table
    assert unions[("eagle3+ngram", "ngram")]["same_text"] is None  # no digests stored: not claimed
    ci = "{:.2f}-{:.2f}".format(*unions[("eagle3+ngram", "ngram")]["ci"])
    assert "| same text |" in table and f"| eagle3+ngram | ngram | 0.83x | {ci} | - |" in table
    rows = [asdict(r) for r in records]
    for row in rows:
        del row["output_sha"]  # a result file stored before digests were kept still loads
    assert from_rows(rows)[0].output_sha is None
    for r in records:  # digests: the union wrote its member's text on 4 of the 6 turns
        parted = r.method == "eagle3+ngram" and r.question_id in {"2", "5"}
        r.output_sha = ("u" if parted else "t") + r.question_id
    u = next(u for u in summarise(records)["overall"]["baseline"]["unions"] if u["union"] == "eagle3+ngram")
    assert u["same_text"] == [4, 6] and " | 4/6 |" in markdown_table(summarise(records))
    assert summarise(records[:10])["overall"]["ngram"]["speedup_ci"] is None  # too few conversations


def test_intervals_resample_whole_conversations():
    """Turns of one conversation are resampled together: six two-turn conversations whose turns
    move together give a wider interval than the same twelve turns as independent units, and
    fewer than three conversations give none."""
    def records(pairs: bool):
        out = []
        for q in range(6):
            speed = 1.0 + 0.3 * (q % 3)  # conversation-level variation, shared by both turns
            for turn in range(2):
                qid = str(q) if pairs else f"{q}-{turn}"
                out += [rec(qid, "a", "baseline", 100, 10.0, 100, turn=turn),
                        rec(qid, "a", "ngram", 100, 5.0 / speed, 50, turn=turn)]
        return out

    paired, independent = summarise(records(True)), summarise(records(False))
    wide, narrow = paired["overall"]["ngram"]["speedup_ci"], independent["overall"]["ngram"]["speedup_ci"]
    assert wide[1] - wide[0] > narrow[1] - narrow[0]
    assert summarise(records(True)[:8])["overall"]["ngram"]["speedup_ci"] is None  # two conversations


def test_two_methods_of_a_result_file_are_compared_on_the_turns_both_ran():
    """scripts/dev/paired.py: rate ratio and MAT of A against B over the turns both ran (a turn only one
    of them ran is left out), with a seeded interval."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "dev"))
    import paired

    records = []
    for q in range(6):
        noise = 1.0 + 0.1 * (q % 3)
        records += [rec(str(q), "a", "new", 100, 4.0 * noise, 40), rec(str(q), "a", "old", 100, 5.0 * noise, 50)]
    records.append(rec("9", "a", "new", 100, 100.0, 100))  # B never ran it: not compared
    c = paired.compare(records, "new", "old")
    assert c["units"] == 6 and c["ratio"] == pytest.approx(5 / 4)
    assert c["mat_a"] == pytest.approx(2.5) and c["mat_b"] == pytest.approx(2.0)
    assert c["ci"][0] > 1.0 and paired.compare(records, "new", "old")["ci"] == c["ci"]
    assert c["same_text"] is None  # results stored without digests claim nothing
    for r in records:
        r.output_sha = r.question_id if r.question_id != "0" or r.method == "new" else "other"
    assert paired.compare(records, "new", "old")["same_text"] == [5, 6]  # turn 0 parted


def test_methods_on_another_dtype_against_plain_decoding_in_that_dtype():
    """``spec%dtype`` is also compared with ``none%dtype`` on the same prompts, so the dtype's own
    speed is not credited to speculation."""
    records = []
    for q in range(4):
        records += [rec(str(q), "a", "baseline", 100, 10.0, 100),
                    rec(str(q), "a", "none%bfloat16", 100, 5.0, 100),
                    rec(str(q), "a", "ngram%bfloat16", 100, 4.0, 50)]
    s = summarise(records)
    assert s["overall"]["ngram%bfloat16"]["speedup"] == pytest.approx(2.5)  # against the main baseline
    same = s["overall"]["baseline"]["same_dtype"]
    assert [(u["method"], u["plain"]) for u in same] == [("ngram%bfloat16", "none%bfloat16")]
    assert same[0]["ratio"] == pytest.approx(1.25)
    assert "| ngram%bfloat16 | none%bfloat16 | 1.25x |" in markdown_table(s)


# ---------------------------------------------------------------- end-to-end smoke on a tiny model
import json  # noqa: E402

import torch  # noqa: E402

from selfspec.measurement import benchmark  # noqa: E402
from selfspec.measurement.workloads import load_questions  # noqa: E402
from tiny_models import tiny_model, tiny_tokenizer  # noqa: E402

SUMMARY_KEYS = {"prompts", "new_tokens", "tokens_per_s", "speedup", "mean_accepted_length", "acceptance_per_depth",
                "ttft_s", "tpot_s", "peak_mem_mib", "identical_share"}


def _questions(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": 1, "category": "math", "turns": ["What is 3 + 4?", "And 3 + 5?"]},
            {"question_id": 2, "category": "code", "turns": ["def f(x): return x + 1"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return load_questions(path)


def test_benchmark_smoke_with_peers_schema_and_resume(tmp_path):
    tok = tiny_tokenizer(128)
    model = tiny_model("llama", vocab=len(tok))
    questions = _questions(tmp_path)
    methods = {spec: benchmark.method_from_spec(model, spec) for spec in
               ("ngram:min_ngram=1", "hf-greedy", "hf-prompt-lookup:3", "hf-early-exit:1")}
    persisted = []
    records = benchmark.run(model, tok, questions, methods, max_new_tokens=8, progress=False,
                            on_turn=persisted.extend)
    assert len(records) == 3 * 5 and persisted == records  # 3 turns x (baseline + 4 methods)
    for r in records:  # every method saw exactly the baseline's prompt of that turn
        base = next(b for b in records if b.method == "baseline" and (b.question_id, b.turn) == (r.question_id, r.turn))
        assert r.prompt_tokens == base.prompt_tokens and r.new_tokens == 8
        assert r.ttft_s > 0 and r.wall_time_s >= r.ttft_s and r.steps >= 1
    summary = benchmark.summarise(records)
    assert set(summary) == {"math", "code", "overall"}
    for cat in summary.values():
        assert set(cat) == {"baseline", *methods} and all(SUMMARY_KEYS <= set(v) for v in cat.values())
    assert summary["overall"]["baseline"]["speedup"] == pytest.approx(1.0)
    assert summary["overall"]["hf-greedy"]["identical_share"] == 1.0  # greedy peers agree with us
    assert summary["overall"]["ngram:min_ngram=1"]["identical_share"] == 1.0
    benchmark.write_report(str(tmp_path / "out"), {"x": 1}, records, "cmd")
    stored = json.loads((tmp_path / "out.json").read_text())
    assert set(stored) == {"args", "command", "provenance", "summary", "records"} and len(stored["records"]) == 15
    assert {"commit", "torch", "transformers", "machine"} <= set(stored["provenance"])
    assert (tmp_path / "out_speedup.png").stat().st_size > 1000 and (tmp_path / "out_acceptance.png").exists()
    # resume: the first question's two turns are done; only the last turn runs again
    calls = []

    def counting(model, ids, **kw):
        calls.append(ids.shape[1])
        return benchmark.SelfspecMethod(None)(model, ids, **kw)

    done = [r for r in records if r.question_id == "1"]
    again = benchmark.run(model, tok, questions, {name: counting if name == "hf-greedy" else m for name, m in methods.items()},
                          max_new_tokens=8, progress=False, done=done)
    assert len(again) == 15 and len(calls) == 2  # the warm-up call and the one remaining turn


def test_methods_run_in_an_order_rotated_per_turn(tmp_path):
    """No method always runs first or right after another (order effects cancel over the turns);
    every record still pairs with the baseline of its own turn."""
    tok = tiny_tokenizer(128)
    model = tiny_model("llama", vocab=len(tok))
    order = []

    def named(name):
        def run(model, ids, **kw):
            order.append(name)
            return benchmark.SelfspecMethod(None)(model, ids, **kw)
        return run

    records = benchmark.run(model, tok, _questions(tmp_path), {"a": named("a"), "b": named("b")},
                            max_new_tokens=8, progress=False)
    turns = [order[i:i + 2] for i in range(2, len(order), 2)]  # (after the warm-up calls)
    assert turns == [["a", "b"], ["a", "b"], ["b", "a"]]  # baseline, a, b; a, b, baseline; b, baseline, a
    assert all(r.identical_to_baseline for r in records)  # each paired with its own turn's baseline
    assert all(r.output_sha and r.output_sha == base.output_sha  # the same text, the same digest
               for r in records for base in records if base.method == "baseline" and base.question_id == r.question_id
               and base.turn == r.turn)


def test_repeats_keep_each_methods_median_run_and_refuse_methods_that_remember(tmp_path):
    """``repeats``: every turn's methods run N times in rotated order; each record is the method's
    run with the median seconds per token (every run's kept); a greedy record is identical only if
    every repeat was; methods whose second run is not the same work (they remember outputs or keep
    a prefix cache) are refused."""
    import dataclasses

    from selfspec.drafters import build_drafter

    tok = tiny_tokenizer(128)
    model = tiny_model("llama", vocab=len(tok))
    slow = iter([0.0, 9.0, 1.0, 4.0])  # extra wall seconds of the timed method's runs (warm-up first)
    order = []

    def timed(model, ids, **kw):
        order.append("t")
        out = benchmark.SelfspecMethod(None)(model, ids, **kw)
        return dataclasses.replace(out, wall_time_s=out.wall_time_s + next(slow))

    calls = {"n": 0}

    def flaky(model, ids, **kw):  # its second run of every turn changes the text
        order.append("f")
        out = benchmark.SelfspecMethod(None)(model, ids, **kw)
        calls["n"] += 1
        if calls["n"] % 3 == 0:  # (the first call is the warm-up)
            seq = out.sequences.clone()
            seq[0, -1] = (seq[0, -1] + 1) % 128
            out = dataclasses.replace(out, sequences=seq)
        return out

    records = benchmark.run(model, tok, _questions(tmp_path)[1:], {"t": timed, "f": flaky}, max_new_tokens=6,
                            progress=False, repeats=3)
    assert order[2:] == ["t", "f", "t", "f", "f", "t"]  # (after the warm-up) b t f, t f b, f b t
    by = {r.method: r for r in records}
    assert all(len(r.repeat_s_per_token) == 3 for r in records)
    t = by["t"]
    assert sorted(t.repeat_s_per_token)[1] == pytest.approx((t.wall_time_s - t.ttft_s) / (t.new_tokens - t.first_tokens))
    assert t.repeat_s_per_token[0] > t.repeat_s_per_token[2] > t.repeat_s_per_token[1]  # 9 s, then 1 s, then 4 s
    assert t.identical_to_baseline and not by["f"].identical_to_baseline
    suffix = build_drafter(model, "suffix")
    for methods in ({"s": suffix}, {"u": benchmark.SelfspecMethod([build_drafter(model, "ngram"), suffix])},
                    {"c": benchmark.method_from_spec(model, "ngram~cache")}):
        with pytest.raises(ValueError, match="remembers earlier runs"):
            benchmark.run(model, tok, _questions(tmp_path), methods, max_new_tokens=4, progress=False, repeats=2)
    benchmark.run(model, tok, _questions(tmp_path)[1:], {"s": suffix}, max_new_tokens=4, progress=False)  # 1 is fine


def test_warm_up_drafts_before_the_first_measured_run(tmp_path):
    """The untimed warm-up drafts every step before the first measured run, so a drafter's
    first-call costs land neither in a measured prompt nor in the controller's measurements."""
    from selfspec.drafters import build_drafter

    tok = tiny_tokenizer(128)
    model = tiny_model("llama", vocab=len(tok))
    drafter = build_drafter(model, "ngram")
    proposals, seen = [], []
    inner = drafter.propose
    drafter.propose = lambda ctx: (proposals.append(ctx.tokens.shape[0]), inner(ctx))[1]

    class Watched(benchmark.SelfspecMethod):
        def __call__(self, model, ids, **kw):
            seen.append(len(proposals))
            return super().__call__(model, ids, **kw)

    benchmark.run(model, tok, _questions(tmp_path)[:1], {"ngram": Watched(drafter)}, max_new_tokens=4, progress=False)
    assert seen[0] >= 3  # drafted at every step of the warm-up, before any other call


def test_docs_tables_match_their_result_files():
    """Every result block embedded in the docs equals the result file it names."""
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("render_docs", root / "scripts" / "dev" / "render_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["docs/results.md", "README.md", "--check"]) == 0


def test_recommended_settings_are_the_fastest_in_their_result_files():
    """The demo's default setting per model (selfspec/checkpoints/recommended.json: a drafter and the dtype it
    ran in) is, among the selfspec methods measured in every result file cited beside it, the one
    with the best geometric-mean speedup over those files, and within 10% of the best method of
    each file, or not clearly slower than it (the paired interval of a union against its member
    reaches 1.0). A benchmark names a method run in another dtype than its baseline's
    ``spec%dtype``."""
    import json
    import math
    import pathlib

    from selfspec.drafters import RECOMMENDED, recommended_setting

    root = pathlib.Path(__file__).parents[1]
    entries = json.loads(RECOMMENDED.read_text(encoding="utf-8"))
    assert entries, "no recommended drafter recorded"
    for target, entry in entries.items():
        drafter, dtype = recommended_setting(target)
        assert drafter == entry["drafter"]
        assert entry["evidence"], target
        speedups, names = [], set()
        for path in entry["evidence"]:
            stored = json.loads((root / path).read_text(encoding="utf-8"))
            base_dtype = stored["args"].get("dtype", "float32")
            name = drafter if dtype == base_dtype else f"{drafter}%{dtype}"
            names.add(name)
            overall = stored["summary"]["overall"]
            ours = {m: r["speedup"] for m, r in overall.items()
                    if m != "baseline" and not m.startswith(("hf-", "none"))}
            assert name in ours, (path, name)
            best_m = max(ours, key=ours.get)
            paired = {u["member"]: u for u in (overall.get("baseline") or {}).get("unions") or [] if u["union"] == name}
            within = best_m in paired and paired[best_m]["ci"] and paired[best_m]["ci"][1] >= 1.0
            assert ours[name] >= 0.9 * ours[best_m] or within, (path, ours)  # (or not clearly slower: paired CI)
            speedups.append(ours)
        common = set.intersection(*(set(s) for s in speedups))
        geo = {m: math.exp(sum(math.log(s[m]) for s in speedups) / len(speedups)) for m in common}
        best = max(geo.values())
        assert len(names) == 1, names  # (evidence files with the same baseline dtype)
        assert geo[names.pop()] == best, geo


def test_speedup_is_a_ratio_of_rates_when_outputs_differ_in_length():
    """A bf16 near-tie or a sampled run can end one output earlier: the speedup compares tokens per
    decode second, not total decode times (which would charge the longer run for its extra tokens)."""
    from selfspec.measurement.measure import Comparison, pooled_speedup

    c = Comparison(None, None, plain_time_s=2.0, spec_time_s=2.0, identical=False, plain_tokens=50, spec_tokens=100)
    assert c.speedup == pytest.approx(2.0)
    assert Comparison(None, None, 2.0, 1.0, True).speedup == pytest.approx(2.0)  # counts unknown: times
    other = Comparison(None, None, plain_time_s=2.0, spec_time_s=6.0, identical=True, plain_tokens=50, spec_tokens=100)
    assert pooled_speedup([c, other]) == pytest.approx((200 / 8) / (100 / 4))  # sums, not a mean of ratios


def test_compare_times_a_reference_copy_in_the_same_alternation():
    """``compare(..., reference=)``: plain decoding on another copy of the target runs in the same
    alternation and gives a second speedup; a model with another vocabulary is refused."""
    from selfspec.drafters import build_drafter
    from selfspec.measurement.measure import compare

    model = tiny_model("llama", vocab=64)
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    c = compare(model, ids, build_drafter(model, "ngram", min_ngram=1), max_new_tokens=8, reference=model)
    assert c.reference is not None and c.identical
    assert torch.equal(c.reference.sequences, c.plain.sequences)
    assert c.speedup_vs_reference == pytest.approx(c.reference_time_s / c.spec_time_s)  # same lengths
    assert c.spec_tokens == c.plain_tokens == c.reference_tokens == 8
    assert compare(model, ids, None, max_new_tokens=4).speedup_vs_reference is None
    with pytest.raises(ValueError, match="copy of the target"):
        compare(model, ids, None, max_new_tokens=4, reference=tiny_model("llama", vocab=96))


def test_model_cards_match_their_checkpoints_and_result_files():
    """Every shipped checkpoint's README.md is what scripts/dev/model_card.py generates from its
    drafter.json and the result files named in selfspec/checkpoints/cards.json (no hand-typed numbers)."""
    import importlib.util
    import json
    import pathlib

    root = pathlib.Path(__file__).parents[1]
    cards = json.loads((root / "selfspec" / "checkpoints" / "cards.json").read_text(encoding="utf-8"))
    shipped = {f"selfspec/checkpoints/{p.parent.name}" for p in (root / "selfspec" / "checkpoints").glob("*/drafter.json")}
    assert shipped == set(cards), "every shipped checkpoint needs an entry in selfspec/checkpoints/cards.json"
    spec = importlib.util.spec_from_file_location("model_card", root / "scripts" / "dev" / "model_card.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--all", "--check"]) == 0


def test_a_method_on_another_copy_of_the_target(tmp_path):
    """``spec%dtype`` (``benchmark.OnModel``): the method runs on its own model, against the main
    baseline on the same prompts; its differences are not diagnosed on the main model."""
    tok = tiny_tokenizer(128)
    model, other = tiny_model("llama", vocab=len(tok)), tiny_model("llama", vocab=len(tok))
    torch.manual_seed(5)
    other.lm_head = torch.nn.Linear(32, len(tok), bias=False, dtype=torch.float64)  # its own (untied) head
    methods = {"same%copy": benchmark.OnModel(tiny_model("llama", vocab=len(tok)), benchmark.SelfspecMethod(None)),
               "other%copy": benchmark.OnModel(other, benchmark.SelfspecMethod(None))}
    records = benchmark.run(model, tok, _questions(tmp_path), methods, max_new_tokens=8, progress=False)
    summary = benchmark.summarise(records)["overall"]
    assert summary["same%copy"]["identical_share"] == 1.0  # an equal copy: the baseline's text
    assert summary["other%copy"]["identical_share"] < 1.0  # it really ran on its own model
    assert all(r.divergence is None for r in records if r.method == "other%copy")


def test_results_name_the_cpu_and_its_speed_flags():
    from selfspec.model.machine import cpu_identity, cpu_label

    info = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16 sse\n"
    c = cpu_identity(info)
    assert c["model"] == "AMD EPYC" and c["flags"] == ["avx2", "avx512f", "avx512_bf16"]
    assert "avx512_bf16" in cpu_label(c) and "AMD EPYC" in cpu_label(c)
    assert cpu_identity("")["flags"] == []
    assert "cpu" in benchmark.provenance()


def test_compare_warms_up_each_drafter_before_timing(monkeypatch):
    """``compare`` (the demo's timing) drafts with each drafter alone, every step, before the
    controller's own warm-up and the timed runs, so first-call costs are not measured as drafting."""
    from selfspec.control import Controller
    from selfspec.drafters import build_drafter
    from selfspec.measurement import measure

    model = tiny_model("llama", vocab=64)
    members = [build_drafter(model, "ngram"), build_drafter(model, "ngram", min_ngram=1)]
    ctl = Controller(members)
    seen = []
    real = measure.generate

    def spy(model, ids, drafter=None, **kw):
        seen.append((drafter, kw.get("control"), kw.get("max_new_tokens")))
        return real(model, ids, drafter=drafter, **kw)

    monkeypatch.setattr(measure, "generate", spy)
    measure.compare(model, torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]]), ctl, max_new_tokens=6)
    assert [(d, c) for d, c, _ in seen[1:3]] == [(m, False) for m in members]  # each drafter, every step
    assert seen[3][0] is ctl and seen[3][2] == 4  # then the controller's own warm-up, then the timed runs
    assert [d for d, _, n in seen[4:]] == [None, ctl] and all(n == 6 for _, _, n in seen[4:])


def test_method_names_are_parsed_in_one_place():
    from selfspec.measurement.benchmark import MethodSpec

    assert MethodSpec.parse("eagle3+ngram#fixed~cache%bfloat16") == MethodSpec("eagle3+ngram", fixed=True, cache=True,
                                                                               dtype="bfloat16")
    assert MethodSpec.parse("ngram#nogate") == MethodSpec("ngram", gate=False)
    assert MethodSpec.parse("hf-prompt-lookup:10").peer and not MethodSpec.parse("none").peer
    with pytest.raises(ValueError, match="selfspec methods"):
        MethodSpec.parse("hf-greedy#fixed")
