"""The agent-loop example's deterministic tools: calls parse in every call format, arithmetic only."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("agent_loop", Path(__file__).parents[1] / "examples" / "agent_loop.py")
agent_loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(agent_loop)


def test_tools_run_from_calls_in_any_format():
    assert agent_loop.run_tool('{"name": "calculate", "arguments": {"expression": "17.5 * 42 + 3"}}',
                               "arguments")["result"] == 738.0
    out = agent_loop.run_tool('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", '
                              '"unit": "fahrenheit"}}\n</tool_call>', "arguments")
    assert out == {"city": "Tokyo", "temperature": 75, "unit": "fahrenheit", "conditions": "sunny"}
    assert agent_loop.run_tool('{"name": "convert_currency", "parameters": {"amount": 100, "from_currency": "EUR", '
                               '"to_currency": "USD"}}', "parameters")["result"] == 108.0


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "open('x')", "2 ** 'a'", "1 / 0"])
def test_calculator_evaluates_arithmetic_only(expr):
    assert "error" in agent_loop.calculate(expr)
