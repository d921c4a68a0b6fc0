"""Benchmarking methods side by side on a prompt set (greedy or sampled, batch 1).

For every turn of every question, the plain baseline runs first and its reply becomes the
conversation history of the next turn for every method, so all methods see identical prompts.
Runs of the baseline and of each method alternate per prompt (machine noise hits all alike).
Speedup of a method over a group of prompts = its decode tokens/s / the baseline's decode tokens/s
on those prompts (greedy: the same tokens, so a ratio of times; sampling: outputs differ in length,
so rates are compared); MAT = total new tokens / total target passes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import torch
from tqdm.auto import tqdm

from .chat import encode_chat
from .drafters.base import Drafter
from .engine import SpecOutput, generate
from .workloads import Question


@dataclass
class Record:
    """One (prompt, method) run."""

    question_id: str
    category: str
    turn: int
    method: str
    prompt_tokens: int
    new_tokens: int
    steps: int
    decode_time_s: float
    prefill_time_s: float
    identical_to_baseline: bool
    tested_per_depth: list[int]
    accepted_per_depth: list[int]


def run(
    model,
    tokenizer,
    questions: Iterable[Question],
    methods: dict[str, Drafter | None],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
) -> list[Record]:
    """Run ``baseline`` (plain decoding) and each drafter in ``methods`` ({name: drafter}).

    Returns one :class:`Record` per (turn, method), the baseline's under the name ``"baseline"``.
    """
    questions = list(questions)
    records: list[Record] = []
    total = sum(len(q.turns) for q in questions)
    bar = tqdm(total=total, desc="benchmark", disable=not progress, unit="turn")
    gen = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    generate(model, torch.tensor([[0, 1]]), max_new_tokens=2)  # warm-up
    for q in questions:
        history: list[dict] = []
        for turn, user in enumerate(q.turns):
            history.append({"role": "user", "content": user})
            ids = encode_chat(tokenizer, history, system=q.system)
            base = generate(model, ids, **gen)
            records.append(_record(q, turn, "baseline", ids, base, True))
            for name, drafter in methods.items():
                out = generate(model, ids, drafter=drafter, **gen)
                records.append(_record(q, turn, name, ids, out, torch.equal(out.sequences, base.sequences)))
            reply = tokenizer.decode(base.sequences[0, ids.shape[1]:], skip_special_tokens=True)
            history.append({"role": "assistant", "content": reply})
            bar.update(1)
    bar.close()
    return records


def _record(q: Question, turn: int, method: str, ids, out: SpecOutput, identical: bool) -> Record:
    s = out.stats
    return Record(q.question_id, q.category, turn, method, int(ids.shape[1]), s.new_tokens, s.steps,
                  s.decode_time_s, s.prefill_time_s, identical, list(s.tested_per_depth), list(s.accepted_per_depth))


def summarise(records: list[Record]) -> dict[str, dict[str, dict]]:
    """``{category or "overall": {method: metrics}}`` with speedup against the baseline."""
    groups: dict[str, list[Record]] = {}
    for r in records:
        groups.setdefault(r.category, []).append(r)
    groups["overall"] = list(records)
    out: dict[str, dict[str, dict]] = {}
    for cat, recs in groups.items():
        base = [r for r in recs if r.method == "baseline"]
        base_rate = sum(r.new_tokens for r in base) / max(1e-9, sum(r.decode_time_s for r in base))
        out[cat] = {}
        for method in dict.fromkeys(r.method for r in recs):
            mine = [r for r in recs if r.method == method]
            time_s = sum(r.decode_time_s for r in mine)
            tokens = sum(r.new_tokens for r in mine)
            depth = max(len(r.tested_per_depth) for r in mine)
            tested = [sum(r.tested_per_depth[d] for r in mine if d < len(r.tested_per_depth)) for d in range(depth)]
            acc = [sum(r.accepted_per_depth[d] for r in mine if d < len(r.accepted_per_depth)) for d in range(depth)]
            out[cat][method] = dict(
                prompts=len(mine),
                new_tokens=tokens,
                tokens_per_s=tokens / time_s if time_s else 0.0,
                speedup=(tokens / time_s) / base_rate if time_s and base_rate else 0.0,
                mean_accepted_length=tokens / max(1, sum(r.steps for r in mine)),
                acceptance_per_depth=[a / t if t else 0.0 for a, t in zip(acc, tested)],
                identical_share=sum(r.identical_to_baseline for r in mine) / len(mine),
            )
    return out


def as_rows(records: list[Record]) -> list[dict]:
    return [asdict(r) for r in records]


def from_rows(rows: list[dict]) -> list[Record]:
    return [Record(**r) for r in rows]


def markdown_table(summary: dict[str, dict[str, dict]]) -> str:
    lines = ["| category | method | prompts | tokens/s | speedup | MAT | identical |", "|---|---|---|---|---|---|---|"]
    for cat, methods in summary.items():
        for m, v in methods.items():
            lines.append(
                f"| {cat} | {m} | {v['prompts']} | {v['tokens_per_s']:.1f} | {v['speedup']:.2f}x | "
                f"{v['mean_accepted_length']:.2f} | {v['identical_share']:.0%} |"
            )
    return "\n".join(lines)
