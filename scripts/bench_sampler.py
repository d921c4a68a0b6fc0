"""Sampled decoding with selfspec's inverse-CDF draws against ``torch.multinomial``, side by side.

    python scripts/bench_sampler.py checkpoints/smollm2-135m-instruct-eagle3 --out docs/results/r14_sampler

Both samplers draw the same law (:func:`selfspec.sampling.draw`); ``torch.multinomial`` spends
one random number per vocabulary entry (about 1.3 ms a draw over SmolLM2's 49,152 tokens here).
Loads the target once (bfloat16) and generates at T = 0.7 on held-out chat prompts, plain and
with the EAGLE-3 checkpoint, each once with the draws as shipped and once with
``torch.multinomial`` patched in (the verifier's bonus / recovered draws and the drafter's
without-replacement children), interleaved per round so load drifts hit both alike. Reports
milliseconds per generated token and the speedup over plain decoding with the same sampler.
Writes <out>.json (command, provenance, timings) and <out>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec import verify  # noqa: E402
from selfspec.chat import encode_chat  # noqa: E402
from selfspec.drafters import eagle3, layerskip, load_drafter  # noqa: E402
from selfspec.measurement import benchmark  # noqa: E402
from selfspec.measurement.measure import write_result  # noqa: E402
from selfspec.measurement.workloads import heldout_chat_prompts  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def _multinomial_rows(probs, generator):
    return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(probs.device)


def _multinomial_wor(probs, count, generator):
    return torch.multinomial(probs.to(generator.device), count, replacement=False, generator=generator).tolist()


@contextlib.contextmanager
def multinomial_draws():
    """``torch.multinomial`` in place of the inverse-CDF draws (verifier and drafters)."""
    saved = verify.draw, eagle3.draw_without_replacement, layerskip.draw_without_replacement
    verify.draw, eagle3.draw_without_replacement, layerskip.draw_without_replacement = (
        _multinomial_rows, _multinomial_wor, _multinomial_wor)
    try:
        yield
    finally:
        verify.draw, eagle3.draw_without_replacement, layerskip.draw_without_replacement = saved


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--target", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    prov = benchmark.provenance()
    model, tok = selfspec.load_target(args.target, dtype="bfloat16")
    drafter = load_drafter(args.checkpoint, model)
    prompts = [encode_chat(tok, t) for t in heldout_chat_prompts(SHARED, args.prompts)]
    samplers = {"inverse CDF (selfspec)": contextlib.nullcontext, "torch.multinomial": multinomial_draws}
    methods = {"plain": None, "eagle3": drafter}
    ms = {(s, m): [] for s in samplers for m in methods}

    def run(ids, d, seed):
        t = time.perf_counter()
        out = selfspec.generate(model, ids, drafter=d, max_new_tokens=args.new_tokens, temperature=args.temperature,
                                seed=seed)
        return (time.perf_counter() - t) / max(1, out.sequences.shape[1] - ids.shape[1])

    run(prompts[0], drafter, 0)  # warm-up
    for r in range(args.rounds):
        for i, ids in enumerate(prompts):
            order = list(samplers.items())[r % 2:] + list(samplers.items())[: r % 2]
            for s, ctx in order:
                with ctx():
                    for m, d in methods.items():
                        ms[(s, m)].append(1000 * run(ids, d, seed=1000 * r + i))
    med = {k: statistics.median(v) for k, v in ms.items()}
    command = "python scripts/bench_sampler.py " + " ".join(argv or sys.argv[1:])
    rows = "\n".join(f"| {s} | {med[(s, 'plain')]:.1f} | {med[(s, 'eagle3')]:.1f} | "
                     f"{med[(s, 'plain')] / med[(s, 'eagle3')]:.2f}x |" for s in samplers)
    text = (f"`{command}`\n\nMilliseconds per generated token at T = {args.temperature} (median over {args.rounds} x "
            f"{args.prompts} held-out chat prompts, {args.new_tokens} new tokens), bf16 target, "
            f"{torch.get_num_threads()} threads:\n\n| sampler | plain ms / token | eagle3 ms / token | eagle3 speedup |\n"
            f"|---|---|---|---|\n{rows}\n")
    print(text)
    write_result(args.out, {"command": command, "provenance": prov, "threads": torch.get_num_threads(),
                            "ms_per_token": {f"{s} / {m}": v for (s, m), v in med.items()}}, text)


if __name__ == "__main__":
    main()
