"""Write a drafter checkpoint's model card (README.md) from what the checkpoint and result files record.

    python scripts/model_card.py checkpoints/smollm2-135m-instruct-eagle3 \
        --results docs/results/eagle3_mtbench_greedy.json docs/results/eagle3_bfcl_greedy.json ...

Every number in the card is read from ``drafter.json`` (training provenance, held-out metrics,
calibration) or from the benchmark result files named (with the command stored beside each); nothing
is typed by hand, so rerunning this after a new run keeps the card true.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _table(rows: list[list[str]]) -> str:
    head, *body = rows
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in body])


def results_section(path: Path) -> str:
    data = json.loads(path.read_text(encoding="utf-8"))
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
    return (f"### {title}\n\n`{path}` (speedup / MAT against plain decoding in the same "
            f"process; identical to plain greedy: {ident})\n\n    {cmd}\n\n" + _table(rows) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--results", nargs="*", default=[])
    ap.add_argument("--costs", default=None, help="scripts/profile_draft.py output (.json)")
    args = ap.parse_args(argv)
    ckpt = Path(args.checkpoint)
    meta = json.loads((ckpt / "drafter.json").read_text(encoding="utf-8"))
    extra, cfg = meta.get("extra", {}), meta["config"]
    training = extra.get("training", {})
    ev = extra.get("eval", {})
    lines = [f"# {ckpt.name}", "",
             f"A selfspec `{meta['kind']}` drafter for `{training.get('target', '?')}` (target fingerprint "
             f"`{meta['target']['fingerprint']}`; `load_drafter` refuses any other target).", ""]
    if meta["kind"] == "eagle3":
        lines += ["EAGLE-3-class head: one decoder layer over the target's fused hidden states at taps "
                  f"{cfg['taps']} (inputs of those layers), the embedding of the last drafted token and its "
                  f"own previous output; LM head over a reduced vocabulary of {cfg['draft_vocab_size']} tokens.", ""]
    lines += ["## Training", "",
              f"- command: `python scripts/train_heads.py --config configs/eagle3_smollm2.yaml`",
              f"- data: `{training.get('dataset')}` (self-distilled: the target's own answers; see its "
              "`provenance.json` / `manifest.json`); benchmark prompts held out",
              f"- response tokens trained on: {extra.get('train_response_tokens', '?')}; optimizer steps: "
              f"{extra.get('steps', '?')}; training-time test steps: {training.get('ttt_steps', '?')}",
              f"- optimizer: AdamW lr {training.get('optim', {}).get('lr', '?')}, "
              f"{training.get('optim', {}).get('warmup_steps', '?')} warm-up steps, cosine to 10%, "
              f"{training.get('optim', {}).get('epochs', '?')} epochs of {training.get('tokens_per_batch', '?')} "
              f"padded tokens per step; target features in {training.get('target_dtype', '?')}; weights stored "
              f"in {training.get('export_dtype', 'float32')}",
              "- curves: `docs/results/eagle3_smollm2_training_curves.png`; continue training with "
              "`--resume` and a larger `optim.epochs` (the run folder keeps the optimizer state)",
              ""]
    if "draft_vocab_coverage" in extra:
        cov = extra["draft_vocab_coverage"]
        lines += ["Draft vocabulary: share of held-out response tokens covered by the top-n tokens of the "
                  "training responses:", "", _table([["n"] + list(cov), ["coverage"] + [f"{v:.3f}" for v in cov.values()]]), ""]
    if ev:
        top1, acc1 = ev.get("eval/top1_per_step", []), ev.get("eval/accept_t1_per_step", [])
        lines += ["Held-out acceptance per unrolled step (teacher-forced; step j drafts depth j + 1):", "",
                  _table([["step"] + [str(j) for j in range(len(top1))],
                          ["top-1 = target argmax (greedy acceptance)"] + [f"{a:.3f}" for a in top1],
                          ["sum min(p, q) (acceptance at T=1)"] + [f"{a:.3f}" for a in acc1]]), "",
                  f"Expected MAT of a greedy chain of {len(top1)}: {ev.get('eval/expected_mat_chain', 0):.2f}", ""]
    calib = extra.get("options_by_dtype", {})
    if calib:
        lines += ["## Calibrated trees (this machine, `scripts/calibrate.py --dtype ...`)", ""]
        for dtype, opts in calib.items():
            lines.append(f"- {dtype}: {opts}")
            record = extra.get("calibration_by_dtype", {}).get(dtype, {})
            if "grid" in record:
                lines.append("  measured speedup over plain decoding on held-out chat prompts: " + "; ".join(
                    f"{g['max_depth']}/{g['width']}/{g['max_nodes']} (depth/width/nodes) {v:.2f}x"
                    for g, v in zip(record["grid"], record["measured_speedup"])))
        lines.append("")
    if args.costs:
        c = json.loads(Path(args.costs).read_text(encoding="utf-8"))
        d = c["draft"]
        lines += [f"## Draft-step cost ({c['dtype']}, `{args.costs}`)", "",
                  f"propose {d['propose_s'] * 1e3:.1f} ms for {d['tree']}: per level the draft layer "
                  f"{d['layer_call_s'] * 1e3:.2f} ms and the head (norm, {d['draft_vocab_size']}-row LM head, "
                  f"log-softmax, top-k) {d['head_call_s'] * 1e3:.2f} ms; tree building and Python the rest "
                  f"({d['overhead_s'] * 1e3:.1f} ms). A verify pass over 1 / 8 / 16 nodes: "
                  + " / ".join(f"{c['verify'][str(n)]['hooks'] * 1e3:.0f}" for n in (1, 8, 16)) + " ms.", ""]
    if args.results:
        alone = []
        for p in args.results:
            data = json.loads(Path(p).read_text(encoding="utf-8"))
            if meta["kind"] in data["summary"]["overall"]:
                alone.append((data.get("args", {}).get("title") or p, data["summary"]["overall"][meta["kind"]]["speedup"]))
        if alone:
            verdict = ("pays on this machine" if min(v for _, v in alone) >= 1.0 else
                       "does not pay on this machine yet (alone, below plain decoding where marked < 1.00x)")
            lines[4:4] = ["**Status**: this drafter " + verdict + ": " + "; ".join(
                f"{t} {v:.2f}x" for t, v in alone) + " (tables below).", ""]
        lines += ["## Benchmarks", ""] + [results_section(Path(p)) for p in args.results]
    (ckpt / "README.md").write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {ckpt / 'README.md'}")


if __name__ == "__main__":
    main()
