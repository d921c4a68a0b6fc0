"""Write drafter checkpoints' model cards (README.md) from what the checkpoints and result files record.

    python scripts/model_card.py --all            # every card listed in checkpoints/cards.json
    python scripts/model_card.py --all --check    # exit 1 when a committed card is stale (a test runs this)
    python scripts/model_card.py checkpoints/smollm2-135m-instruct-eagle3 \
        --results docs/results/r6_mtbench_greedy.json ...

Every number in a card is read from ``drafter.json`` (training provenance, held-out metrics,
calibration) or from the benchmark result files named in ``checkpoints/cards.json`` (with the command
and commit stored in each); the only hand-written text is the ``about`` prose there, which carries no
measurements. Rerunning this after a new run keeps the cards true.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def _datasets(spec) -> str:
    """A training config's ``dataset`` (one folder spec or a list) as Markdown code spans."""
    return " + ".join(f"`{d}`" for d in (spec if isinstance(spec, list) else [spec]))

def _table(rows: list[list[str]]) -> str:
    head, *body = rows
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in body])


def results_section(path: Path) -> str:
    data = json.loads((ROOT / path).read_text(encoding="utf-8"))
    summary = data["summary"]
    overall = summary["overall"]
    methods = list(overall)
    rows = [["category"] + [m for m in methods if m != "baseline"]]
    for cat, by_method in summary.items():
        rows.append([cat] + [f"{by_method[m]['speedup']:.2f}x / {by_method[m]['mean_accepted_length']:.2f}"
                             if m in by_method else "-" for m in methods if m != "baseline"])
    cmd = data.get("command", "")
    ident = ", ".join(f"{m} {overall[m]['identical_share']:.0%}" for m in methods if m != "baseline")
    title = data.get("args", {}).get("title") or path.stem
    commit = data.get("provenance", {}).get("commit", "")[:8] or "not recorded"
    same = (overall.get("baseline") or {}).get("same_dtype") or []
    tail = ""
    if same:
        tail = "\nAgainst plain decoding in the same dtype (paired, 95% CI): " + "; ".join(
            f"{u['method']} {u['ratio']:.2f}x" + (" ({:.2f}-{:.2f})".format(*u["ci"]) if u.get("ci") else "")
            for u in same) + "\n"
    return (f"### {title}\n\n`{path}` (commit {commit}; speedup / MAT against plain decoding in the same "
            f"process; identical to plain greedy: {ident})\n\n    {cmd}\n\n" + _table(rows) + "\n" + tail)


ROOT = Path(__file__).resolve().parents[1]
CARDS = ROOT / "checkpoints" / "cards.json"


def _kind_lines(kind: str, cfg: dict, extra: dict | None = None) -> list[str]:
    """What the drafter is, from its stored config."""
    if kind == "eagle3":
        return ["EAGLE-3-class head: one decoder layer over the target's fused hidden states at taps "
                f"{cfg['taps']} (inputs of those layers), the embedding of the last drafted token and its "
                f"own previous output; LM head over a reduced vocabulary of {cfg['draft_vocab_size']} tokens. "
                "Its trees are sized per step by the controller (`selfspec.control`) from the acceptance below and "
                "this machine's verify cost, measured on first use.", ""]
    if kind == "medusa":
        return [f"Medusa heads: {cfg['num_heads']} heads, head k a stack of {cfg['num_layers']} residual block(s) "
                "`x + SiLU(W x + b)` on the target's last hidden state, then the target's frozen LM head"
                f"{' (own copy)' if cfg.get('own_lm_head') else ' (shared)'}; static tree {cfg['tree']}.", ""]
    if kind == "layerskip" and cfg.get("adapter") == "lora":
        return [f"Layer-skip with LoRA adapters: weight-sharing copies of the target's first {cfg['exit_layer']} decoder layers carrying "
                f"PEFT LoRA adapters (rank {cfg['rank']}, alpha {cfg['alpha']}), then the target's final norm and LM head; "
                "the target is not modified, so there is no KV reuse. Trees sized per step by the controller.", ""]
    if kind == "layerskip":
        adapter = {"block": f"{cfg.get('adapter_layers', 1)} residual block(s) `x + SiLU(W x + b)`",
                   "none": "no adapter"}.get(cfg.get("adapter"), cfg.get("adapter", "LoRA adapters"))
        return [f"Layer-skip: the target's own first {cfg['exit_layer']} decoder layers (unmodified, shared), then "
                f"{adapter}, then the target's final norm and LM head; drafting alone, the drafting layers' keys / "
                "values go to the verify pass, which runs only the layers above. Trees sized per step by the "
                "controller.", ""]
    return []


def _eval_lines(kind: str, ev: dict) -> list[str]:
    if "eval/top1_per_step" in ev:
        top1, acc1 = ev.get("eval/top1_per_step", []), ev.get("eval/accept_t1_per_step", [])
        return ["Held-out acceptance per unrolled step (teacher-forced; step j drafts depth j + 1):", "",
                _table([["step"] + [str(j) for j in range(len(top1))],
                        ["top-1 = target argmax (greedy acceptance)"] + [f"{a:.3f}" for a in top1],
                        ["sum min(p, q) (acceptance at T=1)"] + [f"{a:.3f}" for a in acc1]]), "",
                f"Expected MAT of a greedy chain of {len(top1)}: {ev.get('eval/expected_mat_chain', 0):.2f}", ""]
    if "eval/rank_accuracy" in ev:
        acc = ev["eval/rank_accuracy"]
        name = "head" if kind == "medusa" else "exit"
        rows = [["held-out accuracy"] + [f"{name} {k + 1}" for k in range(len(acc))],
                ["top-1"] + [f"{a[0]:.3f}" for a in acc],
                [f"top-{len(acc[0])}"] + [f"{sum(a):.3f}" for a in acc]]
        out = [_table(rows), ""]
        if "eval/expected_mat_current_tree" in ev:
            out += [f"Expected MAT of the stored tree from these accuracies: {ev['eval/expected_mat_current_tree']:.2f}", ""]
        return out
    scalars = {k.split("/", 1)[1]: v for k, v in ev.items() if isinstance(v, (int, float))}
    if scalars:  # any other kind: its held-out scalars as measured
        return ["Held-out evaluation at the end of training:", "",
                _table([list(scalars), [f"{v:.3f}" for v in scalars.values()]]), ""]
    return []


def _calibration_lines(extra: dict) -> list[str]:
    """The measured acceptance a controller starts from (``scripts/calibrate.py``)."""
    acc = extra.get("acceptance")
    if not isinstance(acc, dict):
        return []
    lines = [f"## Measured acceptance (`scripts/calibrate.py`, {acc.get('prompts', '?')} held-out prompts, "
             f"{acc.get('dtype', '?')})", "",
             "Share of draft nodes accepted given their parent was, per depth (rows) and sibling rank (columns); "
             "the controller's prior for this head.", ""]
    for name in ("greedy", "sampled"):
        if isinstance(acc.get(name), list):
            title = "greedy" if name == "greedy" else f"T={acc.get('temperature', '?')}"
            lines.append(f"- {title}: " + "; ".join(f"d{d + 1} " + "/".join(f"{x:.2f}" for x in row)
                                                    for d, row in enumerate(acc[name])))
    return lines + [""]


def card_text(ckpt: Path, results: list[str], costs: str | None = None, about: str = "",
              command: str | None = None, target: str = "?") -> str:
    """The model card of checkpoint folder ``ckpt`` (see the module docstring)."""
    meta = json.loads((ckpt / "drafter.json").read_text(encoding="utf-8"))
    extra, cfg = meta.get("extra", {}), meta["config"]
    training = extra.get("training", {})
    ev = extra.get("eval", {})
    lines = [f"# {ckpt.name}", "",
             f"A selfspec `{meta['kind']}` drafter for `{training.get('target') or target}` "
             f"(target fingerprint `{meta['target']['fingerprint']}`; `load_drafter` refuses any other target).", ""]
    lines += _kind_lines(meta["kind"], cfg, extra)
    if about:
        lines += [about, ""]
    if training:
        o = training.get("optim", {})
        lines += ["## Training", "",
                  f"- command: `{command or 'python scripts/train_heads.py --config configs/<kind>_smollm2.yaml'}`",
                  f"- data: {_datasets(training.get('dataset'))} (self-distilled: the target's own answers); benchmark "
                  "prompts held out (`tests/test_distill.py`)",
                  f"- optimizer steps: {extra.get('steps', '?')}; AdamW lr {o.get('lr', '?')}, {o.get('warmup_steps', '?')} "
                  f"warm-up steps, cosine to 10%, {o.get('epochs', '?')} epochs"
                  + (f"; training-time test steps: {training['ttt_steps']}" if "ttt_steps" in training else "")
                  + (f"; response tokens: {extra['train_response_tokens']}" if "train_response_tokens" in extra else "")]
        for run in extra.get("lineage") or []:  # init_from: the runs this head continued
            lines.append(f"- continued from `{run.get('checkpoint')}`, itself trained {run.get('steps', '?')} optimizer steps "
                         f"on {_datasets(run.get('dataset'))} ({run.get('train_response_tokens', '?')} response tokens)")
        lines.append("")
    elif "training_free" in extra:
        lines += ["## Training", "", "None: training-free (the exit layer chosen by `scripts/pick_exit_layer.py` "
                  "from measured acceptance and cost).", ""]
        acc = extra.get("acceptance_per_exit")
        if acc:
            best = max(range(len(acc)), key=lambda i: acc[i])
            lines += [f"Measured greedy acceptance of a plain exit after layer e, e = 1..{len(acc)}: best "
                      f"{acc[best]:.3f} (e = {best + 1}), after layer 1 {acc[0]:.3f}; measured speedup of the stored "
                      f"choice: {extra.get('measured_speedup', 0):.2f}x (below 1: a plain early exit does not pay here).", ""]
    if "draft_vocab_coverage" in extra:
        cov = extra["draft_vocab_coverage"]
        lines += ["Draft vocabulary: share of held-out response tokens covered by the top-n tokens of the "
                  "training responses:", "", _table([["n"] + list(cov), ["coverage"] + [f"{v:.3f}" for v in cov.values()]]), ""]
        if extra.get("lineage") and extra.get("vocab_in_use_coverage") is not None:
            lines += [f"The vocabulary in use is the first run's (kept by every continued run): it covers "
                      f"{extra['vocab_in_use_coverage']:.3f} of the latest run's held-out response tokens.", ""]
    lines += _eval_lines(meta["kind"], ev)
    lines += _calibration_lines(extra)
    if results:
        alone = []
        for p in results:
            data = json.loads((ROOT / p).read_text(encoding="utf-8"))
            overall = data["summary"]["overall"]
            # `%dtype` methods ran on a copy of the target in that dtype: judged against plain decoding
            # in that dtype where the file has it (else against the main baseline, as older files)
            same = {u["method"]: u for u in (overall.get("baseline") or {}).get("same_dtype") or []}
            for method, row in overall.items():  # the shipped alias or this folder, unmodified
                spec, _, dtype = method.partition("%")
                if spec == meta["kind"] or spec.rstrip("/").endswith("/" + ckpt.name):
                    title = data.get("args", {}).get("title") or p
                    if method in same:
                        alone.append((f"{title} [{dtype} target, against plain {dtype}]", same[method]["ratio"]))
                    else:
                        alone.append((f"{title} [{dtype} target]" if dtype else title, row["speedup"]))
        if alone:
            low = min(v for _, v in alone)
            verdict = ("pays on every workload measured" if low >= 1.0 else
                       "does not pay yet (alone, below plain decoding where marked < 1.00x)"
                       if max(v for _, v in alone) < 1.0 else
                       "pays on some workloads, not on all (alone, below plain decoding where < 1.00x; each "
                       "file's title names its dtype, and its CPU is in the file)")
            lines[4:4] = ["**Status**: this drafter " + verdict + ": " + "; ".join(
                f"{t} {v:.2f}x" for t, v in alone) + " (tables below).", ""]
        lines += ["## Benchmarks", ""] + [results_section(Path(p)) for p in results]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--results", nargs="*", default=[])
    ap.add_argument("--costs", default=None, help="scripts/draft_cost.py or scripts/profile_draft.py output (.json)")
    ap.add_argument("--all", action="store_true", help="every card in checkpoints/cards.json")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a card differs")
    args = ap.parse_args(argv)
    if args.all:
        jobs = [(ROOT / name, spec) for name, spec in json.loads(CARDS.read_text(encoding="utf-8")).items()]
    elif args.checkpoint:
        jobs = [(Path(args.checkpoint), {"results": args.results, "costs": args.costs})]
    else:
        ap.error("name a checkpoint or pass --all")
    stale = []
    for ckpt, spec in jobs:
        text = card_text(ckpt, spec.get("results", []), spec.get("costs"), spec.get("about", ""), spec.get("command"),
                         spec.get("target", "?"))
        path = ckpt / "README.md"
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"stale model cards {stale}: run python scripts/model_card.py --all", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
