"""The docs a newcomer reads: the README within 15 KB and free of round numbers, every command in
its code blocks parses with the command's own parser, every Python block compiles, every repository
file the docs cite exists, and model cards stay within 3 KB with Hugging Face front matter."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "data" / "distill" / "README.md",
        ROOT / "selfspec" / "prompts" / "heldout" / "README.md"]  # (prompts/README.md cites its sources' own paths)
CARDS = sorted((ROOT / "selfspec" / "checkpoints").glob("*/README.md"))
ROUND = re.compile(r"\bround[- ]?\d+|\br\d{1,2}_", re.I)


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_readme_is_short_and_has_no_history():
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= 15 * 1024, len(text.encode())
    assert not ROUND.search(text), ROUND.search(text).group(0)


def _commands() -> list[list[str]]:
    out = []
    for block in _blocks(README.read_text(encoding="utf-8"), "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if not line:
                continue
            words = shlex.split(line)
            if words[:3] == ["accelerate", "launch", "-m"] and words[3] == "selfspec.cli":
                words = ["selfspec"] + words[4:]
            out.append(words)
    return out


def test_every_readme_command_parses():
    commands = _commands()
    assert sum(w[0] == "selfspec" for w in commands) >= 5
    for words in commands:
        if words[0] == "make":
            assert words[1] in ("demo", "test"), words
        elif words[0] == "selfspec":
            module = importlib.import_module(f"selfspec.commands.{words[1]}")
            module.parser().parse_args(words[2:])  # SystemExit on an unknown or missing option
        else:  # serving engines' own commands (not installed here): only what we control is checked
            assert words[0] in ("vllm", "python"), words


def test_every_readme_python_block_compiles():
    blocks = _blocks(README.read_text(encoding="utf-8"), "python")
    assert len(blocks) >= 2
    for block in blocks:
        compile(block, "README.md", "exec")


CITED = re.compile(r"(?<![\w./-])((?:docs|configs|checkpoints|scripts|selfspec|data|tests|examples)/[\w./-]*\w)")


@pytest.mark.parametrize("doc", DOCS + CARDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_the_docs_cite_exists(doc):
    """(Tables copied from result files are skipped: a result's command names paths as they were.)"""
    text = re.sub(r"<!-- BEGIN .*?<!-- END [^>]*-->", "", doc.read_text(encoding="utf-8"), flags=re.S)
    missing = []
    for path in set(CITED.findall(text)):
        if any(c in path for c in "<>*") or path.startswith("runs/"):
            continue
        for base in (ROOT, doc.parent):  # a file, a folder, or a prefix (an --out prefix, a glob's stem)
            target = base / path
            if target.exists() or any(target.parent.glob(target.name + "*")):
                break
        else:
            missing.append(path)
    assert not missing, f"{doc.name} cites files that do not exist: {sorted(missing)}"


@pytest.mark.parametrize("card", CARDS, ids=lambda p: p.parent.name)
def test_model_cards_are_short_with_front_matter(card):
    text = card.read_text(encoding="utf-8")
    assert len(text.encode()) <= 3 * 1024
    front = text.split("---")[1]
    for key in ("base_model:", "library_name: selfspec", "license:", "tags:"):
        assert key in front, key
    assert not ROUND.search(text)
