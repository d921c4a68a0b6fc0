"""The prompt sets that ship with selfspec (package data; their sources, licenses and provenance are
in ``README.md`` beside this file).

Layout (the same as any ``distill.data_dir`` a user points at):

* training prompts: ``chat_prompts.jsonl``, ``tool_prompts.jsonl.gz``, ``gsm8k/train.jsonl``,
  ``HumanEval.jsonl.gz``, ``bfcl/BFCL_v4_{simple_python,multiple}.json`` past their first
  ``holdout`` records;
* held out for benchmarks: ``mt_bench_question.jsonl``, the first ``holdout`` BFCL records, and
  every file in ``heldout/``.

Invariant: nothing here is read from outside the installed package, so a checkout, a wheel and a
fresh clone with nothing beside it see the same files.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def root() -> Path:
    """The folder holding the shipped prompt sets (a real directory: setuptools installs package
    data unzipped)."""
    return Path(str(resources.files(__name__)))


def path(name: str) -> Path:
    """The shipped file ``name`` (relative to :func:`root`); ``FileNotFoundError`` naming it."""
    p = root() / name
    if not p.exists():
        raise FileNotFoundError(f"no shipped prompt file {name!r} in {root()}")
    return p


def heldout(name: str) -> Path:
    """A held-out evaluation file (``heldout/<name>``)."""
    return path(f"heldout/{name}")
