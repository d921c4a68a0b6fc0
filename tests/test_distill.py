"""Self-distillation pipeline on a tiny model with a tokenizer trained in code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk

from selfspec import prompts
from selfspec.measurement import calibration
from selfspec.training.distill import DistillConfig, collect_prompts, distill
from tiny_models import tiny_model, tiny_tokenizer

DATA = prompts.root()  # the shipped prompt sets
ROOT = Path(__file__).resolve().parents[1]


def config(**kw) -> DistillConfig:
    base = dict(sources={"gsm8k": 3, "bfcl_simple": 2, "humaneval": 1}, data_dir=str(DATA), max_new_tokens=6,
                batch_size=2, shard_size=3, sampled_every=2, max_prompt_tokens=10**6)
    return DistillConfig(**(base | kw))


def test_prompt_selection_is_seeded_and_holds_out_benchmark_prompts():
    a, b = collect_prompts(config()), collect_prompts(config())
    assert a == b and len(a) == 6
    bfcl = [p for p in a if p["source"] == "bfcl_simple"]
    assert all(int(p["source_id"].rsplit("_", 1)[1]) >= 100 for p in bfcl)
    assert collect_prompts(config(seed=1)) != a


def test_the_task_family_source_covers_every_family_and_none_of_its_held_out_prompts():
    from selfspec.measurement.workloads import load_spec_bench
    picked = collect_prompts(DistillConfig(sources={"families": 10**6}, data_dir=str(DATA)))
    rows = [json.loads(line) for line in open(DATA / "families" / "families_prompts.jsonl", encoding="utf-8")]
    assert len(picked) == len(rows) and {p["source"] for p in picked} == {"families"}
    families = {"translation", "summarization", "extraction", "qa", "code"}
    assert {r["category"] for r in rows} == families
    held = load_spec_bench(DATA / "heldout" / "families_heldout.jsonl")
    assert {q.category for q in held} == families
    assert not {t.strip() for q in held for t in q.turns} & {p["user"].strip() for p in picked}


def test_distill_writes_a_dataset_and_resumes_from_shards(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model("llama", vocab=len(tok), dtype=torch.float32)
    path = distill(model, tok, config(), tmp_path / "d", target_name="tiny")
    ds = load_from_disk(str(path))
    assert len(ds) == 6 and set(ds["decoding"]) == {"greedy", "sampled"}
    assert all(1 <= len(r) <= 6 for r in ds["response_ids"])
    shard = sorted((tmp_path / "d" / "shards").glob("*.jsonl"))[0]
    before = shard.read_text()
    (sorted((tmp_path / "d" / "shards").glob("*.jsonl"))[-1]).unlink()  # "interrupted" before the last shard
    again = distill(model, tok, config(), tmp_path / "d", target_name="tiny")
    assert shard.read_text() == before and len(load_from_disk(str(again))) == 6
    assert (tmp_path / "d" / "provenance.json").exists()


def _fixture(root: Path) -> Path:
    """A miniature of the shipped prompt sets (same formats) whose chat set repeats benchmark prompts."""
    import gzip

    d = root / "data"
    (d / "bfcl").mkdir(parents=True)
    (d / "gsm8k").mkdir()
    mt = [{"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now in French."]}]
    (d / "mt_bench_question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mt))
    fn = [{"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}]
    bfcl = [{"id": f"simple_python_{i}", "question": [[{"role": "user", "content": f"call f {i}"}]], "function": fn}
            for i in range(4)]
    for name in ("BFCL_v4_simple_python.json", "BFCL_v4_multiple.json"):
        (d / "bfcl" / name).write_text("".join(json.dumps(r) + "\n" for r in bfcl))
    (d / "gsm8k" / "train.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    with gzip.open(d / "HumanEval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}) + "\n")
    chat = ["Write a haiku about rain.", "Tell me a joke.", "Now in French.", "call f 0", "Explain RoPE."]
    (d / "chat_prompts.jsonl").write_text("".join(
        json.dumps({"id": f"c:{i}", "source": "c", "category": "x", "messages": [{"role": "user", "content": t}]}) + "\n"
        for i, t in enumerate(chat)))
    with gzip.open(d / "tool_prompts.jsonl.gz", "wt") as f:
        for i, t in enumerate(["call f 1", "book a table"]):
            f.write(json.dumps({"id": f"t:{i}", "source": "t", "category": "x",
                                "messages": [{"role": "user", "content": t}], "tools": fn}) + "\n")
    return d


def test_benchmark_prompts_never_reach_distillation(tmp_path):
    """A fixture whose chat / tool sets repeat MT-Bench turns and held-out BFCL prompts: none of them
    is distilled; then the chat-scale configs on the shipped prompt sets."""
    from selfspec.training.distill import benchmark_prompts

    data = _fixture(tmp_path)
    cfg = DistillConfig(sources={"chat": 10, "tools": 10, "bfcl_simple": 10, "gsm8k": 1, "humaneval": 1},
                        data_dir=str(data), holdout=2)
    held = benchmark_prompts(data, holdout=2)
    assert {"Write a haiku about rain.", "Now in French.", "call f 0", "call f 1"} <= held
    users = [p["user"] for p in collect_prompts(cfg)]
    assert not set(users) & held
    assert "Tell me a joke." in users and "book a table" in users and "call f 3" in users
    if True:
        from selfspec.training.jobs import load_any

        job = load_any(Path(__file__).resolve().parents[1] / "configs" / "distill" / "smollm2.yaml")
        real = collect_prompts(DistillConfig(**(job.distill.__dict__ | {"data_dir": str(DATA)})))
        assert not {p["user"].strip() for p in real} & benchmark_prompts(DATA)
        # the second window (skip) is held out the same way and shares no prompt with the first
        ids = lambda ps: {(p["source"], p["source_id"]) for p in ps if p["source"] in ("chat", "tools")}  # noqa: E731
        seen = ids(real)
        for window in ("c", "d", "e", "f", "g"):  # later windows: held out alike, no prompt of an earlier window
            job_w = load_any(Path(__file__).resolve().parents[1] / "configs" / "distill" / f"smollm2-window-{window}.yaml")
            more = collect_prompts(DistillConfig(**(job_w.distill.__dict__ | {"data_dir": str(DATA)})))
            assert not {p["user"].strip() for p in more} & benchmark_prompts(DATA)
            assert ids(more) and not ids(more) & seen  # (a few prompt texts occur twice in the set itself)
            seen |= ids(more)


def test_skip_takes_the_next_window_of_a_source(tmp_path):
    """``skip`` passes over the prompts an earlier run took (same seed): disjoint windows whose
    union is the longer run's selection; skipping past the end is refused."""
    data = _fixture(tmp_path)
    base = dict(data_dir=str(data), holdout=2, sampled_every=0)
    users = lambda cfg: {p["user"] for p in collect_prompts(cfg)}  # noqa: E731
    first = users(DistillConfig(sources={"chat": 2}, **base))
    second = users(DistillConfig(sources={"chat": 2}, skip={"chat": 2}, **base))
    both = users(DistillConfig(sources={"chat": 4}, **base))
    assert first and second and not first & second and first | second == both  # (benchmark prompts held out)
    with pytest.raises(ValueError, match="leaves none"):
        collect_prompts(DistillConfig(sources={"chat": 1}, skip={"chat": 5}, **base))
    with pytest.raises(ValueError, match="unknown"):
        collect_prompts(DistillConfig(sources={"chat": 1}, skip={"chats": 1}, **base))


def test_a_separate_window_is_held_out_without_any_prompt_trained_on():
    """``held_out_dataset``: all of the training data trains; the evaluated answers are a seeded
    sample of the other window minus any whose prompt was trained on (counted); empty is refused."""
    from selfspec.training.batching import held_out_dataset

    ex = lambda p, r=(1,): {"prompt_ids": list(p), "response_ids": list(r)}  # noqa: E731
    train = [ex((1, 2)), ex((3,)), ex((4,), ())]  # the last has no answer: unusable
    held = [ex((5,)), ex((3,)), ex((6, 7)), ex((8,))]
    tr, ev, dropped = held_out_dataset(train, held, seed=0, max_eval=2)
    assert tr == train[:2] and dropped == 1 and len(ev) == 2
    assert not {tuple(e["prompt_ids"]) for e in ev} & {(1, 2), (3,)}
    assert held_out_dataset(train, held, seed=0, max_eval=2)[1] == ev  # seeded
    assert {tuple(e["prompt_ids"]) for e in held_out_dataset(train, held, 0, 9)[1]} == {(5,), (6, 7), (8,)}
    with pytest.raises(ValueError, match="non-empty"):
        held_out_dataset(train, [ex((3,))], seed=0, max_eval=2)


def test_a_shard_range_splits_one_window_into_held_out_and_training_answers(tmp_path):
    """``folder[a:b]`` reads shards a..b-1 in file-name order: ``[:2]`` and ``[2:]`` partition the
    window; a range past the finished shards, an empty one or a malformed one is refused."""

    from selfspec.training.batching import load_distilled, shard_selection

    folder = tmp_path / "win"
    (folder / "shards").mkdir(parents=True)
    for i in range(4):
        rows = [{"prompt_ids": [i, j], "response_ids": [1]} for j in range(3)]
        (folder / "shards" / f"shard-{i:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole = load_distilled(folder)
    held, rest = load_distilled(f"{folder}[:2]"), load_distilled(f"{folder}[2:]")
    assert held + rest == whole and len(held) == 6 and {r["prompt_ids"][0] for r in held} == {0, 1}
    assert load_distilled(f"{folder}[1:3]") == whole[3:9]
    assert shard_selection("a/b") == (Path("a/b"), None) and shard_selection("a/b[3:]") == (Path("a/b"), slice(3, None))
    for bad, match in (("[2:9]", "has 4 finished"), ("[3:3]", "empty"), ("[x:]", "integers"), ("[1]", "integers"),
                       ("[-1:]", "negative")):
        with pytest.raises(ValueError, match=match):
            load_distilled(f"{folder}{bad}")
    with pytest.raises(FileNotFoundError):
        load_distilled(f"{tmp_path / 'none'}[1:]")
    literal = tmp_path / "run[1:2]"  # a folder really named like a range is read as that folder
    (literal / "shards").mkdir(parents=True)
    (literal / "shards" / "00000.jsonl").write_text(json.dumps({"prompt_ids": [9], "response_ids": [1]}) + "\n")
    assert load_distilled(literal) == [{"prompt_ids": [9], "response_ids": [1]}]
    assert load_distilled([f"{folder}[3:]", str(literal)]) == whole[9:] + load_distilled(literal)
    for empty in ([], [None], [str(folder), ""]):
        with pytest.raises(ValueError, match="at least one"):
            load_distilled(empty)


def test_calibration_keeps_out_every_prompt_the_head_and_its_ancestors_trained_on(tmp_path, monkeypatch):
    """Calibration's hold-out: the prompts of the head's dataset (its manifest) and of
    every dataset in its lineage (a shard range keeps its window out but for the prompts answered only
    outside the range, the held-out shards); an absent ``runs/`` folder is traced to the distill config in
    configs/ that writes it; a dataset it cannot trace is refused, never silently ignored."""

    
    data = _fixture(tmp_path)
    folder = tmp_path / "ds"
    folder.mkdir()
    cfg = DistillConfig(sources={"chat": 2}, data_dir=str(data), holdout=2, sampled_every=0)
    (folder / "manifest.json").write_text(json.dumps({"config": cfg.__dict__}))
    mine = {p["user"].strip() for p in collect_prompts(cfg)}
    meta = {"extra": {"training": {"dataset": str(folder)}, "lineage": [{"dataset": str(folder)}]}}
    assert calibration.training_prompts(meta) == mine and mine
    ranged = {"extra": {"training": {"dataset": f"{folder}[1:]"}}}  # a shard range, no shards here: the whole window
    assert calibration.training_prompts(ranged) == mine
    # with its shards here: a prompt answered only in a shard outside the range is held out (window
    # d's first six shards), one answered inside it is not, nor one the window never answered
    window = tmp_path / "window"
    (window / "shards").mkdir(parents=True)
    whole = DistillConfig(sources={"chat": 5}, data_dir=str(data), holdout=2, sampled_every=0)
    (window / "manifest.json").write_text(json.dumps({"config": whole.__dict__}))
    records = collect_prompts(whole)
    assert len(records) == 2  # (the fixture's other chat prompts are benchmark prompts)
    for i, rec in enumerate(records):
        line = {"source": rec["source"], "source_id": rec["source_id"], "prompt_ids": [1], "response_ids": [2]}
        (window / "shards" / f"{i:05d}.jsonl").write_text(json.dumps(line) + "\n")
    first, second = records[0]["user"].strip(), records[1]["user"].strip()
    assert calibration.training_prompts({"extra": {"training": {"dataset": f"{window}[1:]"}}}) == {second}
    assert calibration.training_prompts({"extra": {"training": {"dataset": f"{window}[:1]"}}}) == {first}
    both = {"extra": {"training": {"dataset": f"{window}[1:]"}, "lineage": [{"dataset": f"{window}[:1]"}]}}
    assert calibration.training_prompts(both) == {first, second}  # held out by one run, trained on by its ancestor
    (window / "shards" / "00001.jsonl").unlink()  # the range's shard not written (yet): kept out all the same
    assert calibration.training_prompts({"extra": {"training": {"dataset": f"{window}[1:]"}}}) == {second}
    (window / "shards" / "00000.jsonl").rename(window / "shards" / "00001.jsonl")  # a gap: positions unknown
    assert calibration.training_prompts({"extra": {"training": {"dataset": f"{window}[1:]"}}}) == {first, second}
    monkeypatch.setattr(calibration, "heldout_chat_prompts", lambda n, exclude: ["a", "b", "c"])
    with pytest.raises(ValueError, match="only 3 calibration prompts are left"):
        calibration.heldout_prompts({"extra": {}}, 24)
    assert calibration.heldout_prompts({"extra": {}}, 3) == ["a", "b", "c"]  # as many as asked for: enough
    lost = {"extra": {"training": {"dataset": str(folder)}, "lineage": [{"dataset": "runs/distill/nowhere"}]}}
    with pytest.raises(ValueError, match="cannot be kept out"):
        calibration.training_prompts(lost)
    # the shipped head's first window lived in runs/ of an earlier session: traced to its distill config
    traced = calibration.training_prompts({"extra": {"lineage": [{"dataset": "runs/distill/smollm2-chat-b"}]}},
                                          ROOT / "configs" / "distill")
    assert len(traced) > 4000


def test_your_own_conversations_in_every_format_are_regenerated_turn_by_turn(tmp_path):
    """OpenAI messages JSONL (with tools), ShareGPT JSON and a datasets folder: the record's
    assistant turns are dropped and every turn is answered by the target after its own earlier
    answers (one example per assistant turn, the conversation so far as its prompt); resumable,
    keyed by the data's digest; bad records are refused by file and record."""

    from datasets import Dataset

    from selfspec.chat import encode_chat
    from selfspec.training.conversations import DataFile
    from selfspec.training.distill import DistillConfig

    tok = tiny_tokenizer()
    model = tiny_model("llama", vocab=len(tok), dtype=torch.float32)
    fn = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}}]
    openai = tmp_path / "chat.jsonl"
    openai.write_text(json.dumps({"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "THEIR ANSWER"}, {"role": "user", "content": "and again"}], "tools": fn}) + "\n")
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "what is 2+2"},
                                                       {"from": "gpt", "value": "4"}]}]))
    folder = tmp_path / "ds"
    Dataset.from_list([{"text": "Once upon a time"}]).save_to_disk(str(folder))
    cfg = DistillConfig(sources={}, data_dir=str(tmp_path), max_new_tokens=5, batch_size=4, shard_size=8,
                        sampled_every=0, data_files=[DataFile(str(openai)), DataFile(str(sharegpt)),
                                                     DataFile(str(folder), format="text")])
    path = distill(model, tok, cfg, tmp_path / "out", target_name="tiny")
    rows = {r["source_id"] + "@" + Path(r["source"]).name: r for r in load_from_disk(str(path))}
    assert set(rows) == {"0@chat.jsonl", "0#1@chat.jsonl", "0@sharegpt.json", "0@ds"}
    first, second = rows["0@chat.jsonl"], rows["0#1@chat.jsonl"]
    answer = tok.decode(first["response_ids"], skip_special_tokens=True)
    want = encode_chat(tok, [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": answer},
                             {"role": "user", "content": "and again"}], system="be brief", tools=fn)[0].tolist()
    assert second["prompt_ids"] == want  # the target's own first answer, not the record's
    assert "THEIR ANSWER" not in tok.decode(second["prompt_ids"])
    again = distill(model, tok, cfg, tmp_path / "out", target_name="tiny")  # resumes: every shard done
    assert len(load_from_disk(str(again))) == 4
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": "changed"}]}]))
    with pytest.raises(ValueError, match="data_sha256"):
        distill(model, tok, cfg, tmp_path / "out", target_name="tiny")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "narrator", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl record 0: unknown roles"):
        distill(model, tok, DistillConfig(sources={}, data_dir=str(tmp_path), data_files=[DataFile(str(bad))]),
                tmp_path / "out2", target_name="tiny")
