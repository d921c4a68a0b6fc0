"""A trained drafter's model card and its ``recommended.json`` entry, from what the run measured.

The card is built with ``huggingface_hub``'s model-card tools (``ModelCardData`` front matter:
base model, license, tags), so it renders and validates on the Hub. Invariants: every number in it
comes from a result file that ships beside it (``results/`` inside the drafter folder, linked
relatively, so the links work once the folder is uploaded); a method whose mean accepted length is
below :data:`NO_SPEEDUP_MAT` is stated as "no speedup"; the license is the target's own terms
(Gemma's for Gemma, for instance), never assumed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from selfspec.checkpoint import atomic_write_text

#: Below this mean accepted length (tokens per target pass) a drafter saves nothing worth a claim.
NO_SPEEDUP_MAT = 1.05

KIND_NAMES = {"eagle3": "EAGLE-3 draft head", "medusa": "set of Medusa heads", "layerskip": "layer-skip drafter"}


def _geomean(values: list[float]) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else 0.0


def recommended_entry(cfg, out: Path, bench: dict, dtype: str) -> dict:
    """The selfspec setting with the best geometric-mean speedup over the bench files (ties to the
    simpler one), as a ``selfspec/checkpoints/recommended.json``-style entry; plain decoding (``none``) when
    no setting reaches a mean accepted length of :data:`NO_SPEEDUP_MAT`."""
    head = str(out / "drafter")
    specs = {cfg.drafter: head, "ngram": "ngram", f"{cfg.drafter}+ngram": f"{head}+ngram"}
    pays = {}
    for name in specs:
        rows = [file[name] for file in bench.values() if name in file]
        if rows and min(r["mean_accepted_length"] for r in rows) >= NO_SPEEDUP_MAT:
            pays[name] = _geomean([r["speedup"] for r in rows])
    # a union is a candidate only when the head itself drafts accepted tokens: otherwise it is prompt
    # lookup plus the head's cost
    scores = {n: v for n, v in pays.items() if "+" not in n or cfg.drafter in pays}
    evidence = [str(out / "drafter" / "results" / f"{name}.json") for name in bench]
    if not scores or max(scores.values()) <= 1.0:
        return {"drafter": "none", "dtype": dtype, "evidence": evidence,
                "why": "no setting ran faster than plain decoding on the held-out prompts"}
    best = max(scores, key=lambda n: (round(scores[n], 2), -len(n)))
    return {"drafter": specs[best], "dtype": dtype, "evidence": evidence,
            "why": f"best geometric-mean speedup over plain decoding in {', '.join(bench)}: "
                   + ", ".join(f"{n} {s:.2f}x" for n, s in scores.items())}


def _line(name: str, row: dict) -> str:
    if row["mean_accepted_length"] < NO_SPEEDUP_MAT:
        return f"| {name} | no speedup | {row['mean_accepted_length']:.2f} |"
    ci = row.get("speedup_ci")
    return (f"| {name} | {row['speedup']:.2f}x" + (" ({:.2f}-{:.2f})".format(*ci) if ci else "")
            + f" | {row['mean_accepted_length']:.2f} |")


def card_text(cfg, out: Path, bench: dict) -> str:
    """The model card (Markdown with Hub front matter) of the run in ``out``."""
    from huggingface_hub import ModelCard, ModelCardData

    from .pipeline_config import ALIAS_BASE_MODELS, ALIAS_LICENSES

    meta = json.loads((out / "drafter" / "drafter.json").read_text(encoding="utf-8"))
    extra, kind = meta.get("extra") or {}, meta["kind"]
    base = cfg.base_model or ALIAS_BASE_MODELS.get(cfg.model) or (cfg.model if cfg.model.count("/") == 1 else None)
    license_ = cfg.license or ALIAS_LICENSES.get(cfg.model) or "other"
    data = ModelCardData(base_model=base, library_name="selfspec", license=license_,
                         tags=["selfspec", "speculative-decoding", kind, *cfg.tags], pipeline_tag="text-generation")
    ev = extra.get("eval") or {}
    what = KIND_NAMES.get(kind, kind)
    article = "An" if what[0].upper() in "AEIOU" else "A"
    lines = [f"# {what} for {cfg.model}", "",
             f"{article} {what} (selfspec drafter kind `{kind}`) trained by `selfspec train --model {cfg.model} --drafter {kind}` on the "
             "target's own answers (self-distillation), for exact speculative decoding: the output distribution is "
             "the target's. Weight fingerprint of the target: "
             f"`{meta['target']['fingerprint']}` (`selfspec.load_drafter` refuses other weights).", ""]
    if license_ == "other":
        lines += ["License: set it to the target model's own terms (`license:` above) before sharing.", ""]
    lines += ["## Use", "", "```python", "import selfspec",
              f"model, tok = selfspec.load_target({cfg.model!r})",
              "drafter = selfspec.load_drafter(\"PATH/TO/THIS/FOLDER\", model)",
              "out = selfspec.generate(model, tok(\"Hello\", return_tensors=\"pt\").input_ids, drafter=drafter)", "```", ""]
    top1 = ev.get("eval/top1_per_step")
    if top1:
        lines += ["## Held-out acceptance (teacher-forced, per unrolled step)", "",
                  "| step | " + " | ".join(str(j + 1) for j in range(len(top1))) + " |",
                  "|---|" + "---|" * len(top1),
                  "| greedy (top-1 = target argmax) | " + " | ".join(f"{a:.3f}" for a in top1) + " |",
                  "| T=1 (sum min(p, q)) | " + " | ".join(f"{a:.3f}" for a in ev.get("eval/accept_t1_per_step", [])) + " |",
                  ""]
    if bench:
        lines += ["## Speed on held-out prompts", "",
                  "Against plain decoding of the same target, side by side in one process (95% interval over "
                  "conversations); MAT = tokens per target pass. A MAT below "
                  f"{NO_SPEEDUP_MAT} is reported as no speedup.", ""]
        for name, rows in bench.items():
            lines += [f"[{name}](results/{name}.md) ({_temperature_label(out, name)}):", "", "| method | speedup | MAT |",
                      "|---|---|---|"]
            lines += [_line(m, r) for m, r in rows.items() if m != "baseline"] + [""]
    lines += ["## Limitations", "", "Measured at batch 1 on the machine that trained it (the result files name it); "
              "speed on other hardware differs. Drafts only for this target's weights.", ""]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))
    return str(card)


def _temperature_label(out: Path, name: str) -> str:
    """``T=<temperature>`` of the result file ``name`` (its own name if unreadable)."""
    path = out / "drafter" / "results" / f"{name}.json"
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
        return f"T={records['args'].get('temperature', 0):g}"
    except (OSError, json.JSONDecodeError, KeyError):
        return name


def write_card(cfg, out: Path, bench: dict) -> Path:
    """Write ``<out>/drafter/README.md``; returns its path."""
    path = out / "drafter" / "README.md"
    atomic_write_text(path, card_text(cfg, out, bench))
    return path
