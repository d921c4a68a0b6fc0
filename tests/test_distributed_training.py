"""Multi-process training through the real entry point: ``ACCELERATE_USE_CPU=1 accelerate launch
--multi_gpu --num_processes 2`` (torch.distributed with gloo on CPU processes; ``accelerate launch
--cpu --num_processes 2`` starts a single process unless MPI is set up) on a tiny model, killed with SIGKILL once it has checkpointed, resumed on ONE process,
ends where an uninterrupted one-process run with the same global batch ends.

What this pins down: every process trains its shard of the same global batch through the
prepared (DDP) module; only the main process writes checkpoints, features and exports (the others
read them); the checkpoint is process-count independent and always whole (a SIGKILL at any moment
loses at most the steps since the last checkpoint); a folder holding a checkpoint is not silently
overwritten by a new run. Each process backpropagates its share of the global batch's loss
(divided by the global batch's count of valid labels), so the only difference to one process is
float summation order: measured max |difference| 1.8e-7 on weights of size 0.5 after 270 Adam
steps; the tolerance is 1e-5 relative + 1e-6 absolute."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_training import saved_target_and_data

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
pytestmark = pytest.mark.skipif(not ACCELERATE.exists(), reason="the accelerate CLI is not installed")


def _setup(tmp: Path) -> Path:
    saved_target_and_data(tmp, n=16)
    cfg = tmp / "medusa_tiny.yaml"
    cfg.write_text(f"""recipe: train_heads
kind: medusa
target: {tmp / 'model'}
dataset: {tmp / 'data'}
medusa: {{num_heads: 2, tree: [[0], [1], [0, 0]]}}
tree_budget: 3
eval_fraction: 0.25
optim: {{batch_size: 32, lr: 0.003, warmup_steps: 1, epochs: 30}}
run: {{wandb_mode: disabled, log_every: 4, eval_every: 1000, ckpt_every: 2}}
""")
    return cfg


def _cmd(cfg: Path, out: Path, processes: int | None, *extra: str) -> list[str]:
    script = [str(ROOT / "scripts" / "train_heads.py"), "--config", str(cfg), f"run.out_dir={out}", *extra]
    if processes is None:
        return [sys.executable, *script]
    return [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29533", *script]


def _env() -> dict:
    return os.environ | {"ACCELERATE_USE_CPU": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                         "TOKENIZERS_PARALLELISM": "false"}


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoint" / "drafter" / "adapter.safetensors"))


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process and all its children at once, and return only when every one of them is
    gone: a worker still alive after the launcher exits could write one more checkpoint after
    the caller read the last one (seen once in a fresh-clone run under load, round 26)."""
    import psutil

    try:
        group = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        return
    for p in group:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass

    def gone(p) -> bool:  # a zombie writes nothing (nobody may reap it here: PID 1 of a container)
        try:
            return p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.time() + 60
    while not all(gone(p) for p in group):
        assert time.time() < deadline, f"processes survived SIGKILL: {[p for p in group if not gone(p)]}"
        time.sleep(0.01)


def test_two_processes_killed_and_resumed_on_one_match_one_process(tmp_path):
    cfg = _setup(tmp_path)
    ref = tmp_path / "one"
    done = subprocess.run(_cmd(cfg, ref, None), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    total = json.loads((ref / "checkpoint" / "train_state.json").read_text())["step"]
    assert total >= 12

    # two processes, SIGKILLed (the whole launcher group) once a checkpoint past step 4 exists
    run = tmp_path / "two"
    proc = subprocess.Popen(_cmd(cfg, run, 2), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    state = run / "checkpoint" / "train_state.json"
    deadline, seen = time.time() + 300, 0
    while time.time() < deadline and proc.poll() is None:
        try:
            seen = json.loads(state.read_text())["step"]
        except (OSError, ValueError, KeyError):
            seen = 0
        if seen >= 4:  # SIGKILL the launcher and every worker at once (workers run in their own sessions)
            _kill_group(proc)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    log = proc.stdout.read()
    assert seen >= 4, f"the 2-process run never checkpointed past step 4:\n{log[-3000:]}"
    # the kill may land inside the next checkpoint's folder swap (checkpoint/ moved aside, the new one
    # not yet in place): what --resume does first, recover_dir, finishes it (or keeps the last one)
    from selfspec.checkpoint import recover_dir

    recover_dir(run / "checkpoint")
    info = json.loads(state.read_text())
    assert info["processes"] == 2 and seen <= info["step"] < total, info["step"]  # whole, and before the end

    # a new run may not overwrite it; --resume on one process continues from it
    again = subprocess.run(_cmd(cfg, run, None), env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode != 0 and "--resume" in again.stderr
    resumed = subprocess.run(_cmd(cfg, run, None, "--resume"), env=_env(), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoint'} at step {info['step']} (written by 2" in resumed.stdout
    a, b = _weights(ref), _weights(run)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


FAILING_RANK = """import runpy, sys
sys.path.insert(0, {root!r})
from selfspec.training.loop import TrainingRun

real = TrainingRun._train_step


def failing(self, items):
    if self.acc.process_index == 1 and self.step == 3:
        raise RuntimeError("injected failure on rank 1 at step 3")
    return real(self, items)


TrainingRun._train_step = failing
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


def test_a_failure_on_one_rank_ends_the_run_with_its_error(tmp_path):
    """Rank 1 raises mid-training while rank 0 waits in the gradient all-reduce: the launcher must
    end every process and exit non-zero with rank 1's error, quickly (no hang until the collective
    times out), and the last checkpoint stays whole and resumable."""
    cfg = _setup(tmp_path)
    wrapper = tmp_path / "fail_rank1.py"
    wrapper.write_text(FAILING_RANK.format(root=str(ROOT), script=str(ROOT / "scripts" / "train_heads.py")))
    run = tmp_path / "run"
    cmd = _cmd(cfg, run, 2)
    cmd[cmd.index(str(ROOT / "scripts" / "train_heads.py"))] = str(wrapper)
    started = time.time()
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    elapsed = time.time() - started
    assert done.returncode != 0
    assert "injected failure on rank 1 at step 3" in done.stdout + done.stderr
    assert elapsed < 240, f"the launcher took {elapsed:.0f} s to give up"
    info = json.loads((run / "checkpoint" / "train_state.json").read_text())
    assert info["step"] == 2 and info["processes"] == 2  # ckpt_every 2: the checkpoint before the failure
    resumed = subprocess.run(_cmd(cfg, run, None, "--resume"), env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout


def test_sigkill_at_random_moments_then_resume_matches_an_uninterrupted_run(tmp_path):
    """A one-process run SIGKILLed again and again at seeded random moments (a random delay after
    each new checkpoint, so some kills land inside a checkpoint write or between writes), resumed
    with ``--resume`` each time, ends with the weights of a run never interrupted: every kill left a
    whole checkpoint and resuming from it is exact."""
    import random

    cfg = _setup(tmp_path)
    ref = tmp_path / "ref"
    done = subprocess.run(_cmd(cfg, ref, None), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    total = json.loads((ref / "checkpoint" / "train_state.json").read_text())["step"]

    rng = random.Random(0)
    run = tmp_path / "killed"
    state = run / "checkpoint" / "train_state.json"
    kills, seen, finished = 0, 0, False
    for attempt in range(8):
        extra = ("--resume",) if state.parent.exists() else ()
        proc = subprocess.Popen(_cmd(cfg, run, None, *extra), env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        start, deadline = seen, time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            try:
                seen = json.loads(state.read_text())["step"]
            except (OSError, ValueError, KeyError):
                pass
            if seen > start and attempt < 4:  # progress since the last resume: kill soon, anywhere
                time.sleep(rng.uniform(0.0, 0.4))
                _kill_group(proc)
                kills += 1
                break
            time.sleep(0.01)
        proc.wait(timeout=60)
        err = proc.stderr.read()
        if proc.returncode == 0:
            finished = True
            break
        assert proc.returncode == -signal.SIGKILL, err[-3000:]
    assert finished and kills >= 3, (kills, finished)
    assert json.loads(state.read_text())["step"] == total
    a, b = _weights(ref), _weights(run)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
