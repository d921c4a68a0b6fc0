"""Drafting time for a batch: every row's tree in one ``propose_many`` call against one ``propose``
per row, for the shipped model drafters, side by side in one process.

Contexts are real: the first turns of held-out MT-Bench questions, run through the target once
(taps and hidden states as the engine records them); each repeat gives both ways fresh forks of
the drafter (so both catch up on the whole prompt, then draft a second step after 4 more tokens,
which is what a running batch pays per step) and alternates which goes first. Trees are checked
equal (the batched call is an implementation of the same drafts). Writes ``OUT.json`` and
``OUT.md``.

    python scripts/dev/batch_drafting.py --out docs/results/batch_drafting
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def contexts(model, tokenizer, drafter, questions, extra: int):
    """One draft context per question (its prompt plus ``extra`` tokens of its greedy answer)."""
    import selfspec
    from selfspec.chat import encode_chat
    from selfspec.drafters.base import DraftContext
    from selfspec.decoding.sampling import SamplingConfig
    from selfspec.model.taps import capture_taps

    out = []
    for i, q in enumerate(questions):
        ids = encode_chat(tokenizer, q["turns"][0])[0]
        if extra:
            ids = selfspec.generate(model, ids, max_new_tokens=extra, eos_token_id=[]).sequences[0]
        with torch.no_grad(), capture_taps(model, drafter.requires.taps) as rec:
            hidden = model(ids[None], output_hidden_states=True).hidden_states[-1][0, -2]
        feats = rec.get()[0, :-1] if drafter.requires.taps else None
        out.append(DraftContext(ids, hidden, 5, SamplingConfig(), torch.Generator().manual_seed(i),
                                features=feats, prompt_len=ids.shape[0]))
    return out


def time_both(drafter, first, second, repeats: int) -> dict:
    """Seconds of the second step (after a first one on ``first``) per row alone and batched."""
    alone_s, batch_s = [], []
    for r in range(repeats):
        for way in ((0, 1) if r % 2 == 0 else (1, 0)):
            forks = [drafter.fork() for _ in first]
            if way == 0:
                [f.propose(c) for f, c in zip(forks, first)]
                t = time.perf_counter()
                trees = [f.propose(c) for f, c in zip(forks, second)]
                alone_s.append(time.perf_counter() - t)
                alone_trees = trees
            else:
                type(drafter).propose_many(forks, first)
                t = time.perf_counter()
                trees = type(drafter).propose_many(forks, second)
                batch_s.append(time.perf_counter() - t)
                batch_trees = trees
    same = sum(torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
               for a, b in zip(alone_trees, batch_trees))
    return dict(alone_s=statistics.median(alone_s), batch_s=statistics.median(batch_s), same_trees=same)


def main(argv=None) -> None:
    import selfspec
    from selfspec.drafters import drafter_from_spec
    from selfspec.measurement.benchmark import provenance
    from selfspec.measurement.measure import write_result

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--questions", default="selfspec/prompts/heldout/mt_bench_question.jsonl")
    ap.add_argument("--kinds", nargs="+", default=["eagle3", "medusa", "layerskip"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model, tokenizer = selfspec.load_target(args.model, dtype=args.dtype)
    questions = [json.loads(line) for line in open(ROOT / args.questions)][: max(args.batch_sizes)]
    rows = []
    for kind in args.kinds:
        drafter = drafter_from_spec(model, kind, args.model, tokenizer)
        first = contexts(model, tokenizer, drafter, questions, 0)
        second = contexts(model, tokenizer, drafter, questions, 4)
        for B in args.batch_sizes:
            r = time_both(drafter, first[:B], second[:B], args.repeats)
            rows.append(dict(kind=kind, batch=B, **r))
            print(f"{kind} B={B}: alone {1000 * r['alone_s']:.1f} ms, batched {1000 * r['batch_s']:.1f} ms, "
                  f"same trees {r['same_trees']}/{B}", flush=True)
    command = "python scripts/dev/batch_drafting.py " + " ".join(argv or sys.argv[1:])
    lines = ["| drafter | B | per row, ms | one call, ms | per row / one call | same trees |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['batch']} | {1000 * r['alone_s']:.1f} | {1000 * r['batch_s']:.1f} | "
                     f"{r['alone_s'] / r['batch_s']:.2f}x | {r['same_trees']}/{r['batch']} |")
    text = f"`{command}`\n\nOne draft step for B rows (median of {args.repeats}), {args.dtype}:\n\n" + "\n".join(lines)
    print(text)
    if args.out:
        write_result(args.out, dict(args=vars(args), command=command, provenance=provenance(), rows=rows), text + "\n")


if __name__ == "__main__":
    main()
