"""Prompt-set loaders on the shipped prompt files and on malformed input."""

from __future__ import annotations

import json

import pytest

from selfspec import prompts

from selfspec.measurement.workloads import (load_bfcl, load_questions, load_spec_bench,
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


