"""Time the sampled verifier on one realistic tree (B = 1), optionally against an earlier commit's.

A 31-node tree with 10 without-replacement children per level over V = 49,152 (SmolLM2's
vocabulary) at T = 0.7, drafted from a law unrelated to the target's, so most children are
rejected (the verifier's worst case). Prints ms per call, interleaved runs.

    python scripts/bench_verify.py                      # this checkout's verifier
    python scripts/bench_verify.py --against 7002ea3    # and the verify.py of that commit, side by side
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from selfspec import verify  # noqa: E402
from selfspec.sampling import SamplingConfig, target_probs  # noqa: E402
from selfspec.tree import Law, TreeBuilder  # noqa: E402


def tree_and_probs(vocab: int = 49152, width: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(vocab, generator=g) * 3, -1)
    b = TreeBuilder(0)
    parent = 0
    for _ in range(3):
        b.set_draft_probs(parent, q)
        kids = [b.add(parent, int(t), Law.WOR) for t in torch.multinomial(q, width, replacement=False, generator=g)]
        parent = kids[0]
    tree = b.build()
    probs = target_probs(torch.randn(tree.num_nodes, vocab, generator=g) * 3, SamplingConfig(0.7))
    return tree, probs


def old_verifier(commit: str):
    """``_verify_sampled`` of ``selfspec/verify.py`` at ``commit`` (imported from a temporary copy)."""
    text = subprocess.run(["git", "show", f"{commit}:selfspec/verify.py"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    text = text.replace("from .sampling import", "from selfspec.sampling import").replace("from .tree import",
                                                                                          "from selfspec.tree import")
    path = Path(tempfile.mkdtemp()) / "old_verify.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("old_verify", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_verify"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module._verify_sampled


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="an earlier commit whose verify.py runs side by side")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    tree, probs = tree_and_probs()
    fns = {"this checkout": verify._verify_sampled}
    if args.against:
        fns[f"verify.py at {args.against}"] = old_verifier(args.against)
    for _ in range(args.rounds):
        for name, fn in fns.items():
            gen = torch.Generator().manual_seed(1)
            t = time.perf_counter()
            for _ in range(args.calls):
                fn(tree, probs, gen)
            print(f"{name}: {(time.perf_counter() - t) / args.calls * 1e3:.2f} ms per call "
                  f"({tree.num_nodes} nodes, V = {probs.shape[-1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
