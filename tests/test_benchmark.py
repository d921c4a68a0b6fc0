"""Benchmark bookkeeping: speedups are computed against the baseline on the same prompts."""

from __future__ import annotations

import pytest

from selfspec.benchmark import Record, markdown_table, summarise


def rec(qid, cat, method, tokens, time_s, steps, identical=True):
    return Record(qid, cat, 0, method, 10, tokens, steps, time_s, 0.1, identical, [steps], [steps // 2])


def test_speedup_is_a_rate_ratio_per_category_and_overall():
    records = [
        rec("1", "a", "baseline", 100, 10.0, 100), rec("1", "a", "x", 100, 5.0, 40),
        rec("2", "b", "baseline", 50, 5.0, 50), rec("2", "b", "x", 40, 8.0, 40, identical=False),
    ]
    s = summarise(records)
    assert s["a"]["x"]["speedup"] == pytest.approx(2.0)
    assert s["b"]["x"]["speedup"] == pytest.approx((40 / 8) / (50 / 5))
    assert s["overall"]["x"]["speedup"] == pytest.approx((140 / 13) / (150 / 15))
    assert s["a"]["x"]["mean_accepted_length"] == pytest.approx(2.5)
    assert s["overall"]["x"]["identical_share"] == 0.5
    assert s["a"]["baseline"]["speedup"] == pytest.approx(1.0)
    assert list(s)[-1] == "overall"
    assert "| b | x | 1 |" in markdown_table(s)
