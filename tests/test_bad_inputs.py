"""The bad-input suite: every public boundary (``generate`` / ``stream``, the loaders, checkpoints,
distillation and pipeline configs, each command) refuses bad input with a clear error of the right
type whose message names the culprit, and a refused command changes no file. (Training state and
recipe configs: tests/test_training_state.py; overwrites: tests/test_overwrite.py.)"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import selfspec
from selfspec.checkpoint import CheckpointError
from tiny_models import save_tiny, tiny_model

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab=VOCAB, dtype=torch.float32)


IDS = torch.tensor([[1, 2, 3, 4]])

# (case id, keyword arguments of generate, exception type, text the message must contain)
GENERATE = [
    ("prompt-none", dict(input_ids=None), TypeError, "input_ids is None"),
    ("prompt-text", dict(input_ids="hello"), TypeError, "not text"),
    ("prompt-list-of-text", dict(input_ids=["a", "b"]), TypeError, "not text"),
    ("prompt-float", dict(input_ids=torch.tensor([[1.0, 2.0]])), ValueError, "integer token ids"),
    ("prompt-bool", dict(input_ids=torch.tensor([[True, False]])), ValueError, "integer token ids"),
    ("prompt-empty", dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "empty"),
    ("prompt-3d", dict(input_ids=torch.ones(1, 1, 3, dtype=torch.long)), ValueError, "shape"),
    ("prompt-negative", dict(input_ids=torch.tensor([[1, -2]])), ValueError, "token ids must lie"),
    ("prompt-too-big", dict(input_ids=torch.tensor([[1, VOCAB]])), ValueError, "token ids must lie"),
    ("prompt-meta", dict(input_ids=torch.ones(1, 3, dtype=torch.long, device="meta")), ValueError, "meta device"),
    ("prompt-ragged", dict(input_ids=[1, [2, 3]]), ValueError, "input_ids"),
    ("prompt-too-long", dict(input_ids=torch.ones(1, 300, dtype=torch.long)), ValueError, "context holds"),
    ("mask-with-2s", dict(input_ids=torch.tensor([[1, 2], [3, 4]]), attention_mask=torch.tensor([[1, 2], [1, 1]])),
     ValueError, "only 0"),
    ("mask-shape", dict(input_ids=torch.tensor([[1, 2], [3, 4]]), attention_mask=torch.ones(2, 3)), ValueError,
     "attention_mask has shape"),
    ("mask-all-zero", dict(input_ids=torch.tensor([[1, 2], [3, 4]]), attention_mask=torch.tensor([[0, 0], [1, 1]])),
     ValueError, "masks every token"),
    ("max-new-0", dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    ("max-new-neg", dict(max_new_tokens=-3), ValueError, "max_new_tokens"),
    ("max-new-float", dict(max_new_tokens=2.5), ValueError, "max_new_tokens"),
    ("max-new-str", dict(max_new_tokens="8"), ValueError, "max_new_tokens"),
    ("max-new-bool", dict(max_new_tokens=True), ValueError, "max_new_tokens"),
    ("temp-neg", dict(temperature=-0.5), ValueError, "temperature"),
    ("temp-nan", dict(temperature=math.nan), ValueError, "temperature"),
    ("temp-inf", dict(temperature=math.inf), ValueError, "temperature"),
    ("temp-str", dict(temperature="hot"), ValueError, "temperature"),
    ("temp-bool", dict(temperature=True), ValueError, "temperature"),
    ("topk-neg", dict(temperature=1.0, top_k=-1), ValueError, "top_k"),
    ("topk-float", dict(temperature=1.0, top_k=2.5), ValueError, "top_k"),
    ("topp-zero", dict(temperature=1.0, top_p=0.0), ValueError, "top_p"),
    ("topp-two", dict(temperature=1.0, top_p=2.0), ValueError, "top_p"),
    ("topp-nan", dict(temperature=1.0, top_p=math.nan), ValueError, "top_p"),
    ("seed-str", dict(temperature=1.0, seed="abc"), TypeError, "seed"),
    ("seed-float", dict(temperature=1.0, seed=1.5), TypeError, "seed"),
    ("seed-huge", dict(temperature=1.0, seed=2 ** 70), ValueError, "seed"),
    ("seed-neg", dict(temperature=1.0, seed=-1), ValueError, "seed"),
    ("seed-bool", dict(temperature=1.0, seed=True), TypeError, "seed"),
    ("seed-and-generator", dict(seed=1, generator=torch.Generator()), ValueError, "seed or generator"),
    ("generator-wrong", dict(generator="gen"), ValueError, "generator"),
    ("eos-str", dict(eos_token_id="x"), TypeError, "eos_token_id"),
    ("eos-float", dict(eos_token_id=1.5), TypeError, "eos_token_id"),
    ("eos-bool", dict(eos_token_id=True), TypeError, "eos_token_id"),
    ("eos-neg", dict(eos_token_id=-1), ValueError, "eos_token_id"),
    ("eos-too-big", dict(eos_token_id=VOCAB), ValueError, "eos_token_id"),
    ("eos-list-bad", dict(eos_token_id=[1, "x"]), TypeError, "eos_token_id"),
    ("eos-object", dict(eos_token_id=object()), TypeError, "eos_token_id"),
    ("stopping-str", dict(stopping_criteria="abc"), ValueError, "stopping_criteria"),
    ("stopping-int", dict(stopping_criteria=3), ValueError, "stopping_criteria"),
    ("stopping-list-bad", dict(stopping_criteria=[1]), ValueError, "stopping_criteria"),
    ("stop-strings-no-tokenizer", dict(stop_strings=["x"]), ValueError, "tokenizer"),
    ("stop-strings-bad", dict(stop_strings=[1], tokenizer=object()), ValueError, "stop_strings"),
    ("processor-bad", dict(logits_processor=[1]), ValueError, "logits_processor"),
    ("generation-config-bad", dict(generation_config={"do_sample": True}), ValueError, "generation_config"),
    ("constraint-bad", dict(constraint="json"), ValueError, "constraint"),
    ("control-bad", dict(control="yes"), ValueError, "control"),
    ("drafter-bad", dict(drafter="ngram"), ValueError, "drafter"),
    ("drafter-list-bad", dict(drafter=[1]), ValueError, "drafter"),
    ("streamer-batch", dict(input_ids=[[1, 2], [3, 4]], streamer=object()), ValueError, "streamer"),
    ("batch-empty", dict(input_ids=[]), ValueError, "input_ids"),
]


@pytest.mark.parametrize("case, kwargs, error, text", GENERATE, ids=[c[0] for c in GENERATE])
def test_generate_refuses_bad_arguments_naming_them(model, case, kwargs, error, text):
    kwargs = {"input_ids": IDS, "max_new_tokens": 4} | kwargs
    with pytest.raises(error, match=text):
        selfspec.generate(model, **kwargs)


@pytest.mark.parametrize("case, kwargs, error, text", GENERATE[:12] + GENERATE[15:45], ids=[c[0] for c in GENERATE[:12] + GENERATE[15:45]])
def test_stream_refuses_the_same_before_anything_runs(model, case, kwargs, error, text):
    kwargs = {"input_ids": IDS, "max_new_tokens": 4} | kwargs
    with pytest.raises(error, match=text):
        stream = selfspec.stream(model, **kwargs)
        list(stream)


GOOD = [
    ("numpy-ids", dict(input_ids=np.array([[1, 2, 3]]))),
    ("list-ids", dict(input_ids=[1, 2, 3])),
    ("numpy-seed", dict(temperature=1.0, seed=np.int64(3))),
    ("numpy-eos", dict(eos_token_id=np.int64(5))),
    ("tensor-eos", dict(eos_token_id=torch.tensor(5))),
    ("eos-list", dict(eos_token_id=[5, 6])),
    ("tiny-temperature", dict(temperature=1e-300, seed=0)),
    ("huge-budget", dict(max_new_tokens=10 ** 12)),
    ("one-criterion", dict(stopping_criteria=lambda ids, scores, **kw: torch.zeros(ids.shape[0], dtype=torch.bool))),
]


@pytest.mark.parametrize("case, kwargs", GOOD, ids=[c[0] for c in GOOD])
def test_what_should_work_does(model, case, kwargs):
    """Numpy integers, tensors and lists; any positive temperature (computed stably); a budget far
    past the context (the buffers are sized by what can be written)."""
    kwargs = {"input_ids": IDS, "max_new_tokens": 4} | kwargs
    out = selfspec.generate(model, **kwargs)
    assert out.sequences.shape[1] > 3


def test_a_tiny_temperature_is_greedy(model):
    """The law at T -> 0 is greedy's, and sampling there is computed without overflow; negative
    control: dividing the logits by the temperature as they are gives no law at all."""
    from selfspec.decoding.sampling import SamplingConfig, target_probs

    a = selfspec.generate(model, IDS, max_new_tokens=6, temperature=1e-300, seed=1)
    b = selfspec.generate(model, IDS, max_new_tokens=6)
    assert torch.equal(a.sequences, b.sequences)
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0]])
    p = target_probs(logits, SamplingConfig(temperature=1e-300))
    assert torch.equal(p, torch.tensor([[0.0, 0.5, 0.0, 0.5]]))  # a tie splits evenly, as its limit does
    naive = (logits.float() / 1e-300).softmax(-1)
    assert not bool(torch.isfinite(naive).all())


def test_a_generation_config_with_top_p_two_is_refused(model):
    from transformers import GenerationConfig

    with pytest.raises(ValueError, match="generation_config.top_p"):
        selfspec.generate(model, IDS, max_new_tokens=4, generation_config=GenerationConfig(do_sample=True, top_p=2.0))


# ------------------------------------------------------------------------------------------ loaders
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("m") / "tiny")


LOAD = [
    ("dtype-bad", dict(dtype="int8"), ValueError, "dtype"),
    ("device-cuda", dict(device="cuda"), ValueError, "CUDA"),
    ("unknown-kwarg", dict(colour="red"), TypeError, "colour"),
    ("prepack-on-fp32", dict(dtype="float32", prepack=True), ValueError, "prepack"),
    ("skinny-on-bf16", dict(dtype="bfloat16", skinny=True), ValueError, "skinny"),
]


@pytest.mark.parametrize("case, kwargs, error, text", LOAD, ids=[c[0] for c in LOAD])
def test_load_target_refuses_bad_arguments(folder, case, kwargs, error, text):
    if case == "device-cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(error, match=text):
        selfspec.load_target(str(folder), **kwargs)


def test_load_target_names_missing_and_corrupt_files(folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="no model folder"):
        selfspec.load_target("./no/such/model")
    with pytest.raises(ValueError, match="not a .gguf"):
        (tmp_path / "weights.bin").write_bytes(b"x")
        selfspec.load_target(str(tmp_path / "weights.bin"))
    import shutil

    truncated = tmp_path / "truncated"
    shutil.copytree(folder, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match="local folder .*truncated.*corrupt or truncated"):
        selfspec.load_target(str(truncated))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises((OSError, ValueError), match="broken"):
        selfspec.load_target(str(broken))


def _checkpoint(tmp_path, model):
    drafter = selfspec.build_drafter(model, "eagle3", draft_vocab_size=32)
    path = tmp_path / "ck"
    selfspec.save_drafter(drafter, path)
    return path


@pytest.mark.parametrize("damage, text", [
    ("missing-folder", "no drafter checkpoint folder"),
    ("no-config", "drafter.json is missing"),
    ("bad-json", "drafter.json"),
    ("no-weights", "adapter.safetensors is missing"),
    ("truncated-weights", "corrupt or truncated"),
    ("wrong-format", "format"),
    ("wrong-version", "version"),
    ("unknown-kind", "unknown kind"),
    ("other-target", "another"),
    ("pickle", "adapter.safetensors"),
])
def test_load_drafter_names_what_is_wrong_with_a_checkpoint(model, tmp_path, damage, text):
    path = _checkpoint(tmp_path, model)
    meta = json.loads((path / "drafter.json").read_text())
    if damage == "missing-folder":
        path = tmp_path / "nowhere"
    elif damage == "no-config":
        (path / "drafter.json").unlink()
    elif damage == "bad-json":
        (path / "drafter.json").write_text("{")
    elif damage == "no-weights":
        (path / "adapter.safetensors").unlink()
    elif damage == "truncated-weights":
        data = (path / "adapter.safetensors").read_bytes()
        (path / "adapter.safetensors").write_bytes(data[: len(data) // 2])
    elif damage in ("wrong-format", "wrong-version", "unknown-kind", "other-target"):
        key, value = {"wrong-format": ("format", "other"), "wrong-version": ("version", 99),
                      "unknown-kind": ("kind", "magic"), "other-target": ("target", meta["target"] | {"hidden_size": 7})}[damage]
        (path / "drafter.json").write_text(json.dumps(meta | {key: value}))
    elif damage == "pickle":
        (path / "adapter.safetensors").unlink()
        torch.save({"x": torch.zeros(1)}, path / "adapter.bin")
    with pytest.raises(CheckpointError, match=text):
        selfspec.load_drafter(path, model)


@pytest.mark.parametrize("spec, error, text", [
    ("./no/such/head", FileNotFoundError, "no checkpoint folder"),
    ("magic", ValueError, "unknown drafter kind"),
    ("ngram:bogus=1", ValueError, "bogus"),
    ("eagle3", ValueError, "no eagle3 checkpoint is shipped"),
])
def test_drafter_specs_name_what_is_wrong(model, spec, error, text):
    from selfspec.drafters import drafter_from_spec

    with pytest.raises(error, match=text):
        drafter_from_spec(model, spec, "some-model")


# ------------------------------------------------------------------------------------------ configs
DISTILL = [
    ("distill.batch_size=0", "batch_size"), ("distill.max_new_tokens=0", "max_new_tokens"),
    ("distill.shard_size=0", "shard_size"), ("distill.sampled_every=-1", "sampled_every"),
    ("distill.temperature=0", "temperature"), ("distill.top_p=1.5", "top_p"), ("distill.holdout=-1", "holdout"),
    ("distill.max_prompt_tokens=0", "max_prompt_tokens"), ("dtype=int8", "dtype"), ("recipe=train_heads", "recipe"),
    ("distill.nonsense=1", "nonsense"), ("distill.sources=3", "distill.sources"), ("distill.data_files=[{format: x}]", "path"),
    ("distill.data_files=[{path: a.jsonl, format: yaml}]", "format"),
    ("distill.data_files=[{path: a.jsonl, limit: -1}]", "limit"),
]


@pytest.mark.parametrize("override, culprit", DISTILL, ids=[o for o, _ in DISTILL])
def test_distill_configs_refuse_bad_values_by_key(override, culprit):
    from selfspec.training.config import load_config
    from selfspec.training.distill import DistillJob

    with pytest.raises(ValueError, match=culprit):
        load_config(DistillJob, None, [override])


PIPELINE = [
    ("drafter=magic", "--drafter"), ("report_to=comet", "--report-to"), ("export=[onnx]", "--export"),
    ("bench.per_category=0", "bench.per_category"), ("bench.max_new_tokens=0", "bench.max_new_tokens"),
    ("bench.temperatures=[-1]", "bench.temperatures"), ("calibrate.prompts=0", "calibrate.prompts"),
    ("calibrate.temperature=0", "calibrate.temperature"), ("recipe=distill", "recipe"), ("model=", "model"),
    ("load.nonsense=1", "nonsense"), ("smoke=maybe", "smoke"),
]


@pytest.mark.parametrize("override, culprit", PIPELINE, ids=[o for o, _ in PIPELINE])
def test_pipeline_configs_refuse_bad_values_by_key(override, culprit):
    from selfspec.training.pipeline import load_pipeline

    with pytest.raises(ValueError, match=culprit):
        load_pipeline(None, [override])


# ------------------------------------------------------------------------------------------ commands
COMMANDS = [
    ("generate", ["--max-new-tokens", "0"], "--max-new-tokens"),
    ("generate", ["--repeats", "0"], "--repeats"),
    ("generate", ["--model", "./no/model"], "no model folder"),
    ("generate", ["--model", "TINY", "--drafter", "./no/head"], "no checkpoint folder"),
    ("generate", ["--model", "TINY", "--drafter", "magic"], "unknown drafter kind"),
    ("generate", ["--model", "TINY", "--dtype", "int8"], "dtype"),
    ("generate", ["--model", "TINY", "--temperature", "-1"], "temperature"),
    ("generate", ["--model", "TINY", "--top-p", "3"], "top_p"),
    ("generate", ["--model", "TINY", "--device", "cuda:7"], "CUDA"),
    ("bench", ["--questions", "nowhere.jsonl", "--model", "TINY"], "nowhere.jsonl"),
    ("bench", ["--questions", "Q", "--model", "TINY", "--repeats", "0"], "--repeats"),
    ("bench", ["--questions", "Q", "--model", "./no/model"], "no model folder"),
    ("bench", ["--questions", "Q", "--model", "TINY", "--methods", "magic"], "unknown drafter kind"),
    ("distill", ["--config", "nowhere.yaml"], "nowhere.yaml"),
    ("distill", ["--model", "TINY", "distill.batch_size=0"], "batch_size"),
    ("distill", ["--model", "TINY", "OUT=", "distill.data_dir=./none"], "data_dir"),
    ("distill", ["--model", "TINY", "OUT=", "distill.sources={}", "distill.data_files=[{path: none.jsonl}]"],
     "none.jsonl"),
    ("train", [], "--drafter or --config"),
    ("train", ["--config", "nowhere.yaml"], "nowhere.yaml"),
    ("train", ["--drafter", "eagle3", "--model", "./no/model", "--out", "OUT"], "no model folder"),
    ("train", ["--drafter", "medusa", "--export", "vllm", "--out", "OUT"], "--export"),
    ("train", ["--drafter", "eagle3", "--processes", "0"], "--processes"),
    ("train", ["--drafter", "eagle3", "--model", "TINY", "--out", "OUT", "--data", "none.jsonl"], "none.jsonl"),
    ("calibrate", ["./no/head"], "no drafter checkpoint folder"),
    ("calibrate", ["CK", "--prompts", "0"], "--prompts"),
    ("calibrate", ["CK", "--temperature", "0"], "--temperature"),
    ("export", ["./no/head", "--format", "eagle3", "--out", "OUT"], "no drafter checkpoint folder"),
    ("export", ["CK", "--model", "TINY", "--format", "eagle3", "--out", ".", "--overwrite"],
     "holds files this write did not make"),
]


@pytest.mark.parametrize("command, argv, culprit", COMMANDS, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(COMMANDS)])
def test_commands_print_one_line_naming_the_culprit_and_write_nothing(command, argv, culprit, folder, tmp_path,
                                                                     monkeypatch, capsys):
    import importlib

    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    ck = tmp_path / "ck"
    if "CK" in argv:
        target, _ = selfspec.load_target(str(folder), dtype="float32")
        selfspec.save_drafter(selfspec.build_drafter(target, "eagle3", draft_vocab_size=32), ck)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["hi"]}) + "\n")
    subs = {"TINY": str(folder), "CK": str(ck), "OUT": str(tmp_path / "out"), "Q": str(questions),
            "OUT=": f"out={tmp_path / 'out'}"}
    argv = [subs.get(a, a) for a in argv]
    monkeypatch.chdir(work)
    before = sorted(p.name for p in work.iterdir())
    module = importlib.import_module(f"selfspec.commands.{command}")
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("selfspec ")]
    assert len(err) == 1 and err[0].startswith(f"selfspec {command}: error:") and culprit in err[0], err
    assert sorted(p.name for p in work.iterdir()) == before
    assert not (tmp_path / "out").exists()


POOL = [c for c in GENERATE if c[0] in ("prompt-none", "prompt-text", "prompt-float", "prompt-meta", "max-new-0",
                                        "temp-neg", "seed-str", "eos-str", "eos-neg", "stopping-str", "topp-two")]


@pytest.mark.parametrize("case, kwargs, error, text", POOL, ids=[c[0] for c in POOL])
def test_pool_submit_refuses_the_same_and_the_pool_keeps_working(model, case, kwargs, error, text):
    from selfspec.batch import Pool

    pool = Pool(model)
    good = pool.submit(IDS, max_new_tokens=3)
    kwargs = {"input_ids": IDS, "max_new_tokens": 4} | kwargs
    with pytest.raises(error, match=text):
        pool.submit(kwargs.pop("input_ids"), **kwargs)
    pool.run()
    assert torch.equal(good.output.sequences, selfspec.generate(model, IDS, max_new_tokens=3).sequences)
