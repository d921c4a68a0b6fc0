"""Prompt-set loaders on the shipped prompt files and on malformed input."""

from __future__ import annotations

import json

import pytest

from selfspec import prompts

from selfspec.measurement.workloads import (first_per_category, load_bfcl, load_questions, load_spec_bench,
                                            take_per_category)

DATA = prompts.root()


def test_mt_bench_loads_with_two_turns_per_question():
    qs = load_spec_bench(DATA / "mt_bench_question.jsonl")
    assert len(qs) == 80 and all(len(q.turns) == 2 for q in qs)
    picked = take_per_category(qs, 1)
    assert len(picked) == 8 and len({q.category for q in picked}) == 8


def test_bfcl_renders_tools_into_the_system_message():
    qs = load_questions(DATA / "bfcl" / "BFCL_v4_simple_python.json")
    assert len(qs) == 400
    assert "calculate_triangle_area" in qs[0].system and qs[0].turns[0].startswith("Find the area")


def test_wrong_format_is_refused(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps({"id": 1, "prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="Spec-Bench"):
        load_spec_bench(bad)
    with pytest.raises(ValueError, match="BFCL"):
        load_bfcl(bad)


def test_first_question_per_category_in_the_order_asked(tmp_path):
    """Diagnostics (scripts/union_arms.py, union_cold_start.py) take each category's first question;
    a category the file lacks is named in the error."""
    path = tmp_path / "q.jsonl"
    rows = [("1", "math", "a"), ("2", "writing", "b"), ("3", "math", "c")]
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, c, t in rows))
    picked = first_per_category(path, ["writing", "math"])
    assert list(picked) == ["writing", "math"] and picked["math"].turns == ("a",)
    with pytest.raises(ValueError, match="roleplay"):
        first_per_category(path, ["math", "roleplay"])
