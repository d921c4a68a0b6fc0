"""Prompt sets in the field's formats, as chat conversations.

* Spec-Bench / MT-Bench question files (JSON Lines: ``question_id``, ``category``, ``turns``);
  multi-turn questions are replayed turn by turn by the benchmark.
* BFCL tool-calling files (JSON Lines: ``id``, ``question`` = list of message lists, ``function``
  = JSON-schema tool list); the tool list is rendered into the system message.
* Agent sessions: multi-turn tool-use records of ``tool_prompts.jsonl.gz`` (``messages`` = user
  turns, ``tools`` = JSON-schema functions), the tools in the system message of every turn.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

from selfspec import prompts

TOOL_SYSTEM = (
    "You are a function-calling assistant. You can call these functions (JSON schema):\n{tools}\n"
    "Answer with the function call as JSON: {{\"name\": ..., \"arguments\": {{...}}}}."
)


@dataclass(frozen=True)
class Question:
    """One conversation: user ``turns`` in order, an optional ``system`` message."""

    question_id: str
    category: str
    turns: tuple[str, ...]
    system: str | None = None
    meta: dict = field(default_factory=dict, compare=False)


def _jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_spec_bench(path: str | Path) -> list[Question]:
    """Questions from a Spec-Bench-format file (MT-Bench's ``question.jsonl`` is one)."""
    out = []
    for rec in _jsonl(path):
        if "turns" not in rec or "category" not in rec:
            raise ValueError(f"{path}: not a Spec-Bench question file (needs 'turns' and 'category')")
        out.append(Question(str(rec["question_id"]), rec["category"], tuple(rec["turns"])))
    return out


def tool_system_message(functions: list[dict]) -> str:
    return TOOL_SYSTEM.format(tools=json.dumps(functions, indent=1))


def load_bfcl(path: str | Path, category: str = "tool_call") -> list[Question]:
    """Questions from a BFCL file; user turns are the user messages of the first conversation."""
    out = []
    for rec in _jsonl(path):
        if "question" not in rec or "function" not in rec:
            raise ValueError(f"{path}: not a BFCL file (needs 'question' and 'function')")
        turns = tuple(m["content"] for m in rec["question"][0] if m["role"] == "user")
        out.append(Question(str(rec["id"]), category, turns, tool_system_message(rec["function"]),
                            {"tools": rec["function"]}))
    return out


def load_tool_sessions(path: str | Path, *, min_turns: int = 2, exclude: set[str] | None = None,
                       sources: tuple[str, ...] | None = None) -> list[Question]:
    """Multi-turn tool-use sessions (``tool_prompts.jsonl[.gz]`` records with at least
    ``min_turns`` user turns), category = the record's source, skipping ids in ``exclude`` (e.g.
    the records a drafter was distilled on) and sources not in ``sources`` (if given)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if "tools" not in rec or "messages" not in rec:
                raise ValueError(f"{path}: not a tool-session file (needs 'messages' and 'tools')")
            turns = tuple(m["content"] for m in rec["messages"] if m.get("role", "user") == "user")
            if len(turns) < min_turns or rec["id"] in (exclude or ()) or (sources and rec.get("source") not in sources):
                continue
            out.append(Question(str(rec["id"]), str(rec.get("source", "tools")), turns, tool_system_message(rec["tools"]),
                                {"tools": rec["tools"]}))
    return out


def load_questions(path: str | Path) -> list[Question]:
    """Load any of the formats above, told apart by the first record's fields."""
    path = Path(path)
    if path.name.startswith("tool_prompts"):
        return load_tool_sessions(path)
    first = _jsonl(path)[:1]
    if first and "function" in first[0]:
        return load_bfcl(path)
    return load_spec_bench(path)


def take_per_category(questions: list[Question], n: int) -> list[Question]:
    """The first ``n`` questions of each category, in file order."""
    counts: dict[str, int] = {}
    out = []
    for q in questions:
        if counts.get(q.category, 0) < n:
            counts[q.category] = counts.get(q.category, 0) + 1
            out.append(q)
    return out


def calibration_prompts(n: int, data_dir: str | Path | None = None) -> list[str]:
    """``n`` prompts for calibration, never from a benchmark set: GSM8K train questions and
    HumanEval function stubs alternately (``data_dir``: a folder laid out as
    :mod:`selfspec.prompts`; default the shipped one)."""
    data_dir = Path(data_dir) if data_dir is not None else prompts.root()
    gsm = [rec["question"] for rec in _jsonl(data_dir / "gsm8k" / "train.jsonl")[: (n + 1) // 2]]
    with gzip.open(data_dir / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        code = ["Complete this Python function:\n" + json.loads(line)["prompt"] for line in f][: n // 2]
    out = [p for pair in zip(gsm, code) for p in pair] + gsm[len(code):]
    return out[:n]


def heldout_chat_prompts(n: int, exclude: set[str] | None = None, data_dir: str | Path | None = None) -> list[str]:
    """``n`` chat / instruction prompts for calibrating chat-trained drafters: first user turns of
    ``chat_prompts.jsonl`` read from its end, skipping any text in ``exclude`` (the drafter's
    training prompts) and any benchmark prompt."""
    data_dir = Path(data_dir) if data_dir is not None else prompts.root()
    skip = set(exclude or ()) | benchmark_prompts(data_dir)
    out = []
    for rec in reversed(_jsonl(Path(data_dir) / "chat_prompts.jsonl")):
        text = rec["messages"][0]["content"]
        if text.strip() not in skip and text not in skip and len(text) < 1500:
            out.append(text)
            if len(out) == n:
                break
    return out


def benchmark_prompts(data_dir: str | Path | None = None, holdout: int = 100) -> set[str]:
    """User texts of every prompt set the benchmarks measure on (MT-Bench turns, the held-out BFCL
    records of ``data_dir``, and the shipped held-out files in ``selfspec/prompts/heldout``):
    self-distillation and calibration never use them."""
    data = Path(data_dir) if data_dir is not None else prompts.root()
    texts: set[str] = set()
    mt = data / "mt_bench_question.jsonl"
    if mt.exists():
        texts |= {t.strip() for q in load_spec_bench(mt) for t in q.turns}
    for name in ("BFCL_v4_simple_python.json", "BFCL_v4_multiple.json"):
        if (data / "bfcl" / name).exists():
            texts |= {t.strip() for q in load_bfcl(data / "bfcl" / name)[:holdout] for t in q.turns}
    for shipped in sorted((prompts.root() / "heldout").glob("*.jsonl")):
        texts |= {t.strip() for q in load_spec_bench(shipped) for t in q.turns}
    return texts
