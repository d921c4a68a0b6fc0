"""Several processes through the real launcher (``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu
--num_processes 2``, gloo on CPU processes): distillation splits the shards between processes and
writes exactly what one process writes, resumes after a lost shard, and the one-command pipeline runs
every stage under the same launch line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import save_tiny

ACCELERATE = Path(sys.executable).with_name("accelerate")
pytestmark = pytest.mark.skipif(not ACCELERATE.exists(), reason="the accelerate CLI is not installed")
PORT = "29547"  # (not the training test's port: the two files may run at once)


def _env() -> dict:
    return os.environ | {"ACCELERATE_USE_CPU": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
                         "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _launch(processes: int, *args: str) -> list[str]:
    if processes == 1:
        return [sys.executable, "-m", "selfspec.cli", *args]
    return [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", PORT,
            "-m", "selfspec.cli", *args]


def _shards(folder: Path) -> dict[str, str]:
    return {f.name: f.read_text() for f in sorted((folder / "shards").glob("*.jsonl"))}


def test_two_processes_distill_what_one_does_and_resume_a_lost_shard(tmp_path):
    model = save_tiny(tmp_path / "model")
    cfg = tmp_path / "distill.yaml"
    cfg.write_text(f"""recipe: distill
target: {model}
out: unused
dtype: float32
distill: {{sources: {{chat: 10}}, max_new_tokens: 6, batch_size: 2, shard_size: 2, sampled_every: 2,
           max_prompt_tokens: 160}}
""")
    for processes, out in ((1, tmp_path / "one"), (2, tmp_path / "two")):
        done = subprocess.run(_launch(processes, "distill", "--config", str(cfg), f"out={out}"), env=_env(),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = _shards(tmp_path / "one"), _shards(tmp_path / "two")
    assert len(one) == 5 and one == two  # greedy and seeded sampled answers: the same bytes
    assert json.loads((tmp_path / "two" / "provenance.json").read_text())["processes"] == 2
    (tmp_path / "two" / "shards" / "00003.jsonl").unlink()  # as if its process was killed before writing it
    kept = {f.name: f.stat().st_mtime_ns for f in (tmp_path / "two" / "shards").glob("*.jsonl")}
    done = subprocess.run(_launch(2, "distill", "--config", str(cfg), f"out={tmp_path / 'two'}"), env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _shards(tmp_path / "two") == one
    assert all((tmp_path / "two" / "shards" / name).stat().st_mtime_ns == t for name, t in kept.items())


def test_the_pipeline_runs_under_one_launch_line(tmp_path):
    model = save_tiny(tmp_path / "model", layers=4)
    run = tmp_path / "run"
    done = subprocess.run(_launch(2, "train", "--model", str(model), "--drafter", "eagle3", "--smoke", "--out", str(run),
                                  "--report-to", "none", "--dtype", "float32"),
                          env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    assert all(s["done"] for s in stages.values()) and "card" in stages
    assert (run / "drafter" / "README.md").exists() and (run / "recommended.json").exists()
    assert done.stdout.count("recommended:") == 1  # the main process reports, once
