"""Where an EAGLE-3 speculative step's time goes: catch-up, tree layer calls, LM-head calls, the rest
of drafting (tree building in Python), and the verify pass, against a plain decoding step.

    python scripts/draft_cost.py checkpoints/smollm2-135m-instruct-eagle3 --out docs/results/r16_draft_cost

Loads the target in ``--dtype`` (default bfloat16, prepacked where the CPU has native bf16, as
``load_target`` does by default) and the checkpoint as ``load_drafter`` does (its tree and head
weights for that dtype), then generates on held-out chat prompts
(never the head's training prompts nor a benchmark prompt), drafting at every step
(``adaptive=False``), after one untimed warm-up generation. The head's calls are timed by wrapping
them (``time.perf_counter`` around each call, so the split adds a few microseconds per call):

* **catch-up**: :meth:`Eagle3Drafter.catch_up`, the draft layer over the newly committed positions
  (fusing their taps with ``fc``); its output is the root's draft feature;
* **tree layers**: the draft layer over each tree level's frontier (``Eagle3Head.step`` outside
  catch-up);
* **LM head**: ``norm`` + ``lm_head`` over the reduced draft vocabulary (``Eagle3Head.logits``);
* **other drafting**: the rest of ``propose`` (top-k, tree bookkeeping in Python);
* **verify and engine**: the rest of the step, from the end of one ``propose`` to the start of the
  next (the target's pass over the tree, acceptance, cache compaction, the engine's bookkeeping);
  a generation's last step, which follows no later proposal, is not counted.

Plain decoding of the same prompts is interleaved per prompt and round; its decode seconds per
step are the reference. Medians per speculative step (the split's parts do not sum to the median
total). The mean accepted length counts speculative steps only. Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.chat import encode_chat  # noqa: E402
from selfspec.drafters import load_drafter  # noqa: E402
from selfspec.measurement import benchmark  # noqa: E402
from selfspec.measurement.measure import write_result  # noqa: E402

PARTS = ("catch-up", "tree layers", "LM head", "other drafting", "verify and engine")


class _Timers:
    """Seconds per part, accumulated over one step (the engine calls ``propose`` once per step)."""

    def __init__(self):
        self.step = dict.fromkeys(PARTS[:3], 0.0)
        self.in_catch_up = False

    def wrap(self, obj, name: str, part: str | None) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            outer = self.in_catch_up
            if part == "catch-up":
                self.in_catch_up = True
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self.in_catch_up = outer
                if part == "catch-up":
                    self.step["catch-up"] += spent
                elif part is not None and not (part == "tree layers" and self.in_catch_up):
                    self.step[part] += spent

        setattr(obj, name, timed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--target", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    prov = benchmark.provenance()
    model, tok = selfspec.load_target(args.target, dtype=args.dtype)
    drafter = load_drafter(args.checkpoint, model)
    if drafter.kind != "eagle3":
        raise SystemExit(f"draft_cost splits EAGLE-3 steps; {args.checkpoint} holds a {drafter.kind} drafter")
    from calibrate import heldout_prompts

    texts = heldout_prompts(drafter.checkpoint_meta, args.prompts)
    prompts = [encode_chat(tok, t) for t in texts]
    timers, head = _Timers(), drafter.run_head
    timers.wrap(drafter, "catch_up", "catch-up")
    timers.wrap(head, "step", "tree layers")
    timers.wrap(head, "logits", "LM head")
    per_step = {part: [] for part in (*PARTS, "draft total")}
    inner_propose = drafter.propose

    last_end = [None]  # when the previous proposal of this generation returned

    def propose(ctx):
        timers.step = dict.fromkeys(PARTS[:3], 0.0)
        start = time.perf_counter()
        if last_end[0] is not None:  # the previous step's verify and engine work
            per_step["verify and engine"].append(start - last_end[0])
        tree = inner_propose(ctx)
        last_end[0] = end = time.perf_counter()
        for part, spent in timers.step.items():
            per_step[part].append(spent)
        per_step["other drafting"].append(end - start - sum(timers.step.values()))
        per_step["draft total"].append(end - start)
        return tree

    inner_reset = drafter.reset

    def reset():
        last_end[0] = None
        inner_reset()

    drafter.propose, drafter.reset = propose, reset
    selfspec.generate(model, prompts[0], drafter=drafter, max_new_tokens=8, adaptive=False)  # warm-up
    selfspec.generate(model, prompts[0], max_new_tokens=8)
    for part in per_step:
        per_step[part].clear()
    plain_step, tokens, steps = [], 0, 0
    for _ in range(args.rounds):
        for ids in prompts:
            plain = selfspec.generate(model, ids, max_new_tokens=args.new_tokens).stats
            plain_step.append(plain.decode_time_s / max(1, plain.steps))
            before = len(per_step["draft total"])
            s = selfspec.generate(model, ids, drafter=drafter, max_new_tokens=args.new_tokens, adaptive=False).stats
            spec = len(per_step["draft total"]) - before  # steps that drafted (the last one may not)
            tokens, steps = tokens + s.new_tokens - (s.steps - spec), steps + spec
    ms = {part: 1000 * statistics.median(v) for part, v in per_step.items()}
    ms["plain step"] = 1000 * statistics.median(plain_step)
    mat = tokens / steps
    cfg = drafter.config_dict()
    command = "python scripts/draft_cost.py " + " ".join(argv or sys.argv[1:])
    rows = "\n".join(f"| {part} | {ms[part]:.1f} |" for part in (*PARTS, "draft total", "plain step"))
    text = (f"`{command}`\n\nMedian milliseconds per speculative step ({args.rounds} x {args.prompts} generations of "
            f"{args.new_tokens} tokens on held-out chat prompts, drafting every step), EAGLE-3 tree "
            f"{cfg['max_depth']}/{cfg['width']}/{cfg['max_nodes']} (depth/width/nodes), head weights "
            f"{cfg['head_weights']}, {args.dtype} target, {torch.get_num_threads()} threads; mean accepted length "
            f"{mat:.2f}:\n\n| part | ms / step |\n|---|---|\n{rows}\n")
    print(text)
    write_result(args.out, {"command": command, "provenance": prov, "dtype": args.dtype, "threads": torch.get_num_threads(),
                            "tree": cfg, "ms_per_step": ms, "mean_accepted_length": mat, "prompts": texts}, text)


if __name__ == "__main__":
    main()
