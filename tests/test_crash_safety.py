"""Crash safety of checkpoint writes: a process killed at any point of an atomic folder swap leaves
either the old folder or the new one, whole, for the next reader (and for ``--resume``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec.checkpoint import atomic_dir, recover_dir

ROOT = Path(__file__).resolve().parents[1]

# Writes version 2 of a 3-file folder over version 1, and dies (os._exit: no cleanup, no finally)
# at the K-th file-system step of the swap: each os.replace, or inside the write itself.
CHILD = r"""
import os, sys
from pathlib import Path
import selfspec.checkpoint as ck

path, crash_at = Path(sys.argv[1]), int(sys.argv[2])
steps = [0]
real_replace = os.replace

def replace(a, b):
    steps[0] += 1
    if steps[0] == crash_at:
        os._exit(9)
    real_replace(a, b)

ck.os.replace = replace
with ck.atomic_dir(path) as tmp:
    for name in ("a", "b", "c"):
        (tmp / name).write_text("2" * 1000)
        if crash_at == 0 and name == "b":
            os._exit(9)  # killed half-way through writing the new folder
"""


def _version(path: Path) -> str:
    texts = {(path / n).read_text() for n in ("a", "b", "c")}
    assert len(texts) == 1, "a folder mixes two versions"
    return texts.pop()[0]


@pytest.mark.parametrize("crash_at", [0, 2, 3])  # partial new folder; before; inside the swap
def test_a_kill_at_any_point_leaves_the_old_or_the_new_folder(tmp_path, crash_at):
    path = tmp_path / "checkpoint"
    with atomic_dir(path) as tmp:
        for name in ("a", "b", "c"):
            (tmp / name).write_text("1" * 1000)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(crash_at)], env=env, timeout=120)
    assert proc.returncode == 9
    recover_dir(path)
    # killed before the new folder was complete: the old one; after: the new one
    assert _version(path) == ("1" if crash_at in (0, 1) else "2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]  # no staging folder left


def test_an_error_inside_the_block_keeps_the_old_folder(tmp_path):
    path = tmp_path / "checkpoint"
    with atomic_dir(path) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(path) as tmp:
            (tmp / "a").write_text("new")
            raise RuntimeError("interrupted")
    assert (path / "a").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
