"""Cross-check selfspec's suffix index against ArcticInference's ``SuffixDecodingCache``.

``arctic-inference`` ships only as a source package whose build needs PyTorch in the build
environment, nanobind, CMake and a C++ compiler; ``pip install arctic-inference`` in the README's
set-up fails here (build isolation and CMake pick the wrong Python). It builds in a side
environment (CPU, about 1 minute)::

    python -m venv /tmp/arcenv && /tmp/arcenv/bin/pip install torch==2.13.0 numpy nanobind==2.9.2 \\
        cmake ninja protobuf==5.29.6 grpcio-tools setuptools wheel
    PATH=/tmp/arcenv/bin:$PATH /tmp/arcenv/bin/pip install --no-build-isolation --no-deps arctic-inference
    /tmp/arcenv/bin/python scripts/crosscheck_arctic_suffix.py runs/distill/smollm2-chat-b

Both index the first ``--history`` distilled responses, then replay the next ``--replay`` examples
token by token (prompt and response so far in the per-request index) and compare, at every step,
the match length and the first drafted token with the same budget (12 nodes, min_prob 0.1,
spec_factor 1). This file imports only ``selfspec/suffix_trie.py`` (pure Python), not selfspec.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="a scripts/distill_data.py output folder (shards/*.jsonl)")
    ap.add_argument("--history", type=int, default=150)
    ap.add_argument("--replay", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=80, help="response tokens replayed per example")
    args = ap.parse_args()
    path = Path(__file__).resolve().parents[1] / "selfspec" / "suffix_trie.py"
    spec = importlib.util.spec_from_file_location("suffix_trie", path)
    st = sys.modules["suffix_trie"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(st)
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    rows = [json.loads(line) for f in sorted(glob.glob(f"{args.data}/shards/*.jsonl")) for line in open(f)]
    hist, tests = rows[: args.history], rows[args.history : args.history + args.replay]
    depth, nodes = 24, 12
    cache, ours = SuffixDecodingCache(max_tree_depth=depth), st.SuffixTrie(depth)
    for i, r in enumerate(hist):
        cache.start_request(i, r["prompt_ids"])
        cache.add_active_response(i, r["response_ids"])
        cache.stop_request(i)
        ours.insert(r["response_ids"])
    total = same_len = same_tok = 0
    for j, r in enumerate(tests):
        rid = len(hist) + j
        cache.start_request(rid, r["prompt_ids"])
        local, cursor = st.SuffixTrie(depth), st.TrieCursor()
        local.extend(cursor, r["prompt_ids"])
        ctx = list(r["prompt_ids"])
        for t in r["response_ids"][: args.tokens]:
            theirs = cache.speculate(rid, ctx, max_spec_tokens=nodes, max_spec_factor=1.0, min_token_prob=0.1,
                                     use_tree_spec=True)
            best = None
            for trie in (local, ours):
                node, n = trie.match(ctx, 1, depth - nodes)
                if node is not None:
                    d = trie.draft(node, n, min(nodes, n), depth, 0.1)
                    if d.tokens and (best is None or d.score > best.score):
                        best = d
            total += 1
            if best is None:
                same_len += not theirs.token_ids
                same_tok += not theirs.token_ids
            else:
                same_len += best.match_length == theirs.match_len
                same_tok += best.tokens[:1] == list(theirs.token_ids[:1])
            cache.add_active_response(rid, [t])
            ctx.append(t)
            local.extend(cursor, [t])
        cache.stop_request(rid)
    print(json.dumps({"steps": total, "same_match_length": round(same_len / total, 4),
                      "same_first_token": round(same_tok / total, 4)}))


if __name__ == "__main__":
    main()
