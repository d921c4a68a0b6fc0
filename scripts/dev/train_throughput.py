"""Training throughput on this machine: 1 vs N processes, cached vs online target features.

Runs ``scripts/train_heads.py`` as a user would (plain ``python`` for one process; ``accelerate
launch --multi_gpu --num_processes N`` with ``ACCELERATE_USE_CPU=1`` and one thread per process on
a CPU machine) on the first ``--examples`` examples of a distillation folder, for a few optimizer
steps each, and reads the run's own ``train/tokens_per_s`` (trained positions per second for
Medusa, counted from the start of training, so the first step's warm-up is included) and wall
times from its checkpoint. Writes ``OUT.json`` and ``OUT.md``.

    python scripts/train_throughput.py --dataset runs/distill/smollm2-chat-b --out docs/results/r7_train_throughput
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: name -> (config, overrides)
SETUPS = {
    "medusa, cached features": ("configs/medusa/smollm2.yaml", ["features=cached", "optim.epochs=0.08"]),
    "medusa, online features": ("configs/medusa/smollm2.yaml", ["features=online", "tokens_per_batch=4096",
                                                                "optim.epochs=0.7"]),
    "eagle3, online features": ("configs/eagle3/smollm2.yaml", ["tokens_per_batch=4096", "optim.epochs=0.7",
                                                                "max_eval_examples=4"]),
}


def subset(dataset: str, n: int, folder: Path) -> Path:
    """The first ``n`` examples of a distillation folder, as one shard."""
    from selfspec.training.batching import load_distilled

    rows = load_distilled(dataset)[:n]
    (folder / "shards").mkdir(parents=True, exist_ok=True)
    with open(folder / "shards" / "00000.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({k: r[k] for k in ("prompt_ids", "response_ids")}) + "\n")
    return folder


def run_one(config: str, overrides: list[str], processes: int, data: Path, out: Path) -> dict:
    script = [str(ROOT / "scripts" / "train_heads.py"), "--config", str(ROOT / config), f"dataset={data}",
              f"run.out_dir={out}", "export=null", "run.wandb_mode=disabled", "run.log_every=1",
              "run.eval_every=100000", "run.ckpt_every=100000", *overrides]
    env = os.environ | {"WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if processes == 1:
        cmd = [sys.executable, *script]
    else:
        accelerate = Path(sys.executable).with_name("accelerate")
        cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29541", *script]
        env |= {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // processes))}
    started = time.time()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    state = json.loads((out / "checkpoint" / "train_state.json").read_text())
    rows = [r for r in state["history"] if "train/tokens_per_s" in r]
    return {"processes": processes, "steps": state["step"], "tokens_per_s": round(rows[-1]["train/tokens_per_s"], 1),
            "train_wall_s": round(state.get("wall_time_s", 0.0), 1), "process_wall_s": round(wall, 1),
            "command": " ".join(cmd[cmd.index(str(ROOT / "scripts" / "train_heads.py")) - (1 if processes == 1 else 0):])
            .replace(sys.executable, "python").replace(str(ROOT) + "/", "")}


def markdown(result: dict) -> str:
    lines = [f"Command: `{result['command']}` ({result['examples']} examples of `{result['dataset']}`, "
             f"{result['machine']}, commit {result['provenance'].get('commit', '?')[:8]}).", "",
             "| setup | processes | optimizer steps | trained tokens/s | training wall (s) | whole run (s) |",
             "|---|---|---|---|---|---|"]
    for name, runs in result["setups"].items():
        for r in runs:
            lines.append(f"| {name} | {r['processes']} | {r['steps']} | {r['tokens_per_s']:,.0f} | {r['train_wall_s']} | "
                         f"{r['process_wall_s']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--setups", nargs="*", default=list(SETUPS))
    ap.add_argument("--out", required=True, help="OUT.json / OUT.md")
    args = ap.parse_args(argv)
    from selfspec.measurement.benchmark import provenance

    result = {"command": "python scripts/train_throughput.py " + " ".join(argv or sys.argv[1:]),
              "dataset": args.dataset, "examples": args.examples, "provenance": provenance(),
              "machine": f"{os.cpu_count()} CPU cores", "setups": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = subset(args.dataset, args.examples, Path(tmp) / "data")
        for name in args.setups:
            config, overrides = SETUPS[name]
            result["setups"][name] = []
            for n in args.processes:
                out = Path(tmp) / f"run-{len(result['setups'])}-{n}"
                r = run_one(config, overrides, n, data, out)
                print(name, r, flush=True)
                result["setups"][name].append(r)
                shutil.rmtree(out, ignore_errors=True)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
