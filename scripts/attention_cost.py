"""What packed grouped-query attention (selfspec.attention) saves in tree passes, against
transformers' SDPA path, side by side in one process.

    python scripts/attention_cost.py --out docs/results/r18_attention_cost

Loads the target in bfloat16 (prepacked, as ``load_target`` does by default) and measures:

* **calls**: one attention call alone, on the model's shapes (its first attention layer; query
  heads, key/value heads and head size from the model, keys and values of ``--context`` positions),
  ``--calls`` calls per function and size in alternating blocks; median block, microseconds per call;
* **passes**: one target pass over a chain of n nodes (n = 1, 2, 4, 7, 8, 12; packed up to 8) on top of a cache
  of ``--context`` committed positions (held-out chat prompts, never a benchmark prompt), the cache
  cropped back after each pass; the two attention functions alternate pass by pass, ``--rounds``
  passes each; medians in milliseconds;
* **generation**: decode tokens/s of plain decoding and of the shipped EAGLE-3 head (its bf16 tree)
  on ``--prompts`` held-out chat prompts, ``--new-tokens`` each, alternating the two attention
  functions per prompt and round (plain decoding never makes a pass of more than one token, so it
  runs the same function either way: it is timed once per prompt and round as the reference).
  In bf16 the two functions may round a row differently, so their outputs can part at a near-tie
  and accept different lengths: milliseconds per speculative step (decode seconds over target
  passes) compare their cost, tokens/s what a user sees.

Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.attention import register  # noqa: E402
from selfspec.chat import encode_chat  # noqa: E402
from selfspec.drafters import load_drafter, shipped_checkpoint  # noqa: E402
from selfspec.measurement import benchmark  # noqa: E402
from selfspec.measurement.measure import write_result  # noqa: E402
from selfspec.measurement.workloads import heldout_chat_prompts  # noqa: E402
from selfspec.target import TreeTarget  # noqa: E402
from selfspec.tree import TreeBuilder  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SIZES = (1, 2, 4, 7, 8, 12)


def _chain(root: int, n: int, tokens: list[int]):
    b, node = TreeBuilder(root), 0
    for i in range(n - 1):
        node = b.add(node, tokens[i % len(tokens)])
    return b.build()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--gen-rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    prov = benchmark.provenance()
    model, tok = selfspec.load_target(args.target, dtype="bfloat16", packed_attention=False)
    impls = {"sdpa": "sdpa", "packed": register()}
    texts = heldout_chat_prompts(SHARED, 64)
    ids = torch.cat([encode_chat(tok, t).reshape(-1) for t in texts])[: args.context + 1]
    if ids.shape[0] < args.context + 1:
        raise SystemExit(f"held-out prompts give {ids.shape[0]} tokens, fewer than --context {args.context}")

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from selfspec.attention import packed_sdpa_attention

    layer = next(m for m in model.modules() if hasattr(m, "num_key_value_groups"))
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype, gen = next(model.parameters()).dtype, torch.Generator().manual_seed(0)
    calls = {("sdpa", n): [] for n in SIZES} | {("packed", n): [] for n in SIZES}
    for n in SIZES:
        k_len = args.context + n
        query = torch.randn(1, n, cfg.num_attention_heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
        key, value = (torch.randn(1, cfg.num_key_value_heads, k_len, head_dim, generator=gen).to(dtype) for _ in range(2))
        mask = torch.zeros(1, 1, n, k_len, dtype=dtype)
        mask[..., args.context:] = torch.triu(torch.full((n, n), torch.finfo(dtype).min, dtype=dtype), 1)
        for r in range(7):
            for name, fn in (("sdpa", sdpa_attention_forward), ("packed", packed_sdpa_attention)):
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn(layer, query, key, value, mask, scaling=head_dim ** -0.5)
                if r:  # the first block warms up
                    calls[(name, n)].append((time.perf_counter() - start) / args.calls)
    us = {impl: {n: 1e6 * statistics.median(calls[(impl, n)]) for n in SIZES} for impl in impls}

    target = TreeTarget(model)
    target.prefill(ids)
    prefix, filler = target.prefix_len, ids[1:40].tolist()
    passes = {(impl, n): [] for impl in impls for n in SIZES}
    for r in range(args.rounds + 2):  # the first two rounds warm up both functions at every size
        for n in SIZES:
            order = list(impls) if r % 2 == 0 else list(reversed(impls))
            for impl in order:
                model.set_attn_implementation(impls[impl])
                tree = _chain(int(ids[-1]), n, filler)
                start = time.perf_counter()
                target.forward_tree(tree)
                spent = time.perf_counter() - start
                target.commit([], prefix)  # crop the pass's keys and values
                if r >= 2:
                    passes[(impl, n)].append(spent)
    ms = {impl: {n: 1000 * statistics.median(passes[(impl, n)]) for n in SIZES} for impl in impls}

    ckpt = shipped_checkpoint(args.target, "eagle3")
    drafter = load_drafter(str(ckpt), model)
    prompts = [encode_chat(tok, t) for t in texts[: args.prompts]]
    rates = {"plain": [0, 0.0], "sdpa": [0, 0.0], "packed": [0, 0.0]}
    passes_run = {"plain": 0, "sdpa": 0, "packed": 0}
    mats = {"sdpa": [], "packed": []}
    for impl in impls:  # untimed warm-up of each
        model.set_attn_implementation(impls[impl])
        selfspec.generate(model, prompts[0], drafter=drafter, max_new_tokens=8, adaptive=False)
    for r in range(args.gen_rounds):
        for p in prompts:
            plain = selfspec.generate(model, p, max_new_tokens=args.new_tokens).stats
            rates["plain"][0] += plain.new_tokens
            rates["plain"][1] += plain.decode_time_s
            passes_run["plain"] += plain.steps
            for impl in (impls if r % 2 == 0 else list(reversed(impls))):
                model.set_attn_implementation(impls[impl])
                s = selfspec.generate(model, p, drafter=drafter, max_new_tokens=args.new_tokens).stats
                rates[impl][0] += s.new_tokens
                rates[impl][1] += s.decode_time_s
                passes_run[impl] += s.steps
                mats[impl].append(s.mean_accepted_length)
    tps = {k: v[0] / v[1] for k, v in rates.items()}
    step_ms = {k: 1000 * v[1] / passes_run[k] for k, v in rates.items()}

    command = "python scripts/attention_cost.py " + " ".join(argv or sys.argv[1:])
    rows = "\n".join(f"| {n} | {ms['sdpa'][n]:.1f} | {ms['packed'][n]:.1f} | {ms['sdpa'][n] / ms['packed'][n]:.2f}x |"
                     for n in SIZES)
    call_rows = "\n".join(f"| {n} | {us['sdpa'][n]:.0f} | {us['packed'][n]:.0f} | {us['sdpa'][n] / us['packed'][n]:.2f}x |"
                          for n in SIZES)
    gen = "\n".join(f"| {name} | {tps[key]:.1f} | {tps[key] / tps['plain']:.2f}x | {step_ms[key]:.1f} |"
                    + (f" {statistics.mean(mats[key]):.2f} |" if key in mats else " 1.00 |")
                    for name, key in (("plain decoding", "plain"), ("eagle3, transformers' SDPA", "sdpa"),
                                      ("eagle3, packed attention", "packed")))
    text = (f"`{command}`\n\nOne attention call on the model's shapes ({cfg.num_attention_heads} query heads, "
            f"{cfg.num_key_value_heads} key/value heads, head size {head_dim}, {args.context} cached positions plus the n "
            f"new, a tree-shaped mask), median of 6 blocks of {args.calls} calls, microseconds per call:\n\n"
            f"| tokens | transformers' SDPA (us) | packed (us) | ratio |\n|---|---|---|---|\n{call_rows}\n\n"
            f"One target pass (bf16, prepacked, {torch.get_num_threads()} threads) over a chain of "
            f"n nodes on {prefix} cached positions, median of {args.rounds} passes each, the two functions "
            f"alternating:\n\n| nodes | transformers' SDPA (ms) | packed (ms) | ratio |\n|---|---|---|---|\n{rows}\n\n"
            f"Decode speed, {args.gen_rounds} x {len(prompts)} generations of {args.new_tokens} tokens on held-out chat "
            f"prompts, the shipped EAGLE-3 head (its bf16 tree), the two functions alternating:\n\n"
            f"| run | tokens/s | against plain | ms per step | mean accepted length |\n|---|---|---|---|---|\n{gen}\n\n"
            f"eagle3 with packed attention against eagle3 with transformers' SDPA: **{tps['packed'] / tps['sdpa']:.3f}x** "
            f"in tokens/s, **{step_ms['sdpa'] / step_ms['packed']:.3f}x** in milliseconds per speculative step\n")
    print(text)
    write_result(args.out, {"command": command, "provenance": prov, "threads": torch.get_num_threads(),
                            "context": prefix, "pass_ms": {k: {str(n): v for n, v in d.items()} for k, d in ms.items()},
                            "call_us": {k: {str(n): v for n, v in d.items()} for k, d in us.items()},
                            "tokens_per_s": tps, "ms_per_step": step_ms, "mean_accepted_length": mats, "prompts": texts[: args.prompts]}, text)


if __name__ == "__main__":
    main()
