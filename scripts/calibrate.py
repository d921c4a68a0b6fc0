"""Calibrate a drafter checkpoint's tree to this machine and store it with the drafter.

    python scripts/calibrate.py checkpoints/smollm2-135m-instruct-medusa [--prompts 8] [--dry-run]

Measures the target's verify cost for n tree nodes here, and the drafter's acceptance on
calibration prompts (GSM8K train + HumanEval from ../shared/data, never the benchmark sets):

* Medusa heads: acceptance per depth and rank on the target's own greedy text; the tree that
  maximises expected tokens/s = MAT / (verify(n) + draft) is chosen (``selfspec.measurement.calibration``);
* layer-skip: the node budget (``max_nodes``) with the best measured speedup over plain decoding;
* EAGLE-3: depth, frontier width and node budget (chains and trees) with the best measured speedup,
  on held-out chat prompts (never the head's training prompts nor a benchmark set), with the head
  running in the weights ``--head-weights`` says (int8 where its kernel runs here; stored too).
  The grid is raced (``raced_choice``): every entry still in is measured on four more prompts at
  a time (each prompt runs every entry in turn), and an entry whose per-prompt speedups, paired
  with the leader's on the same prompts, are lower with 97.5% confidence (Student t) is out, until
  one is left or the prompts (at most ``--prompts``, 24 by default) run out; then the best
  geometric mean left wins.
  With ``--within SPEC`` (e.g. ``ngram``) every grid entry is measured as a member of the union
  with SPEC (a fresh union per entry), and the choice is stored as the tree the head uses inside
  unions (``extra.options_in_union_by_dtype``; ``eagle3+ngram`` loads it, ``eagle3`` alone keeps
  its own): a union spends one verify budget on both members' nodes, so its best member tree can
  differ from the head's best tree alone. It is the tree of the union's *merged* steps only
  (``Drafter.for_merging``): where the union runs the head alone, the head drafts its own tree,
  during calibration too.

  With ``--temperature T`` (> 0) the race runs sampled generation at T (plain and speculative
  with the same seed) over a grid of chains and small sampled trees (at T > 0 a second sampled
  child catches part of what the first misses, so a wider tree can pay where it does not greedy)
  and the incumbents (the stored tree of sampled steps and the head's own tree, which T > 0 steps
  draft where none is stored),
  and the choice is stored as the tree of the steps the head drafts alone at T > 0
  (``extra.options_sampled_by_dtype``, ``Drafter.for_sampling``); greedy steps keep the head's own
  tree, and a union's merged steps the tree calibrated ``--within``.

With ``--familiarity`` (EAGLE-3) nothing is raced: the head's familiarity read
(``Eagle3Config.min_familiar``: the share of a prompt's last tokens among its top three draft
tokens, teacher-forced) runs on ``--prompts`` held-out chat prompts (400 by default, as many as
there are), and the floor under which a union leaves the head out of a generation is stored in
the head's ``config`` (every dtype: the read is the head's, not the machine's), with the
distribution it came from in ``extra.familiarity``: three quarters of the lowest share, rounded
down to 0.01 (``selfspec.measurement.calibration.familiarity_floor``), so no held-out chat prompt
falls under it.

The choice and the measurements are written into the checkpoint (``drafter.json``) per target
dtype and class of CPU (``--dtype``; keys such as ``bfloat16@amx``,
``selfspec.measurement.machine.machine_key``: the verify cost curves differ by class, e.g. a bf16
decode step 30 ms with AMX and 37 ms with avx512_bf16 alone, a 16-node pass 1.24 and 1.38 steps),
so ``selfspec.load_drafter`` uses the tree calibrated for the dtype the target was loaded
in on this class of machine, else the one calibrated for that dtype elsewhere (entries of rounds
before CPU classes are keyed by the bare dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import selfspec  # noqa: E402
from selfspec.measurement.calibration import (choose_tree, familiarity_floor, heads_accuracy,  # noqa: E402
                                              heads_draft_cost, measured_search, measured_speedups,
                                              prompt_familiarity, raced_choice, verify_costs)
from selfspec.chat import encode_chat  # noqa: E402
from selfspec.checkpoint import CONFIG_FILE, atomic_write_text, read_checkpoint  # noqa: E402
from selfspec.drafters import UnionDrafter, drafter_from_spec, load_drafter, union_member  # noqa: E402
from selfspec.measurement.workloads import calibration_prompts, heldout_chat_prompts  # noqa: E402
from selfspec.measurement.machine import cpu_label, machine_key  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
#: options a calibration may change (tree shape, never the weights' shape)
TREE_OPTIONS = ("tree", "max_nodes", "max_depth", "width", "branch", "head_weights")


def training_prompts(meta: dict) -> set[str]:
    """User texts the drafter was trained on, to keep them out of calibration: the prompts of its
    own training data and of every run it was continued from (``lineage``), each read from the
    distillation folder's manifest or, where that folder is absent (``runs/`` of another
    session), from the distill config in configs/ that wrote it. A shard range (``folder[6:]``)
    keeps the whole window out except the prompts answered only in its shards outside the range
    (window d's first six shards, which no head trained on, are the last held-out chat prompts
    once every chat prompt has been distilled: round 34). Refuses a dataset it cannot trace."""
    from training.batching import shard_selection  # noqa: I001
    from training.config import load_any
    from training.distill import DistillConfig, collect_prompts

    extra = meta.get("extra") or {}
    datasets = [(extra.get("training") or {}).get("dataset")] + [r.get("dataset") for r in extra.get("lineage") or []]
    datasets = [d for entry in datasets for d in (entry if isinstance(entry, list) else [entry])]  # lists of windows
    configs = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "configs").glob("distill*.yaml")):
        job = load_any(path)
        configs[os.path.normpath(job.out)] = job.distill
    texts: set[str] = set()
    for spec in filter(None, datasets):
        folder, selected = shard_selection(spec)
        dataset = str(folder)
        manifest = folder / "manifest.json"
        if manifest.exists():
            cfg = DistillConfig(**json.loads(manifest.read_text(encoding="utf-8"))["config"])
        elif os.path.normpath(dataset) in configs:
            cfg = configs[os.path.normpath(dataset)]
            cfg = DistillConfig(**(cfg.__dict__ | {"data_dir": str(SHARED)}))
        else:
            raise SystemExit(f"the drafter was trained on {dataset!r}, which has no manifest here and no distill "
                             "config in configs/ writes it: its prompts cannot be kept out of calibration")
        # the window's prompts, less those answered only in shards outside the selection (a
        # window's held-out shards, e.g. window d's first six): every other prompt of the window
        # is kept out, answered in the selected shards or not (a range may have grown later)
        held = _outside_selection(folder, selected)
        texts |= {p["user"].strip() for p in collect_prompts(cfg) if (p["source"], str(p["source_id"])) not in held}
    return texts


def heldout_prompts(meta: dict, n: int) -> list[str]:
    """Up to ``n`` chat prompts that neither the drafter of ``meta`` nor its lineage trained on
    and no benchmark uses (:func:`training_prompts`); a clear error when fewer than
    ``min(4, n)`` are left (calibration and the EAGLE-3 cost scripts share it)."""
    texts = heldout_chat_prompts(SHARED, n, training_prompts(meta))
    _enough(texts, n)
    return texts


def _enough(texts: list[str], n: int) -> None:
    if len(texts) < min(4, n):
        raise SystemExit(f"only {len(texts)} calibration prompts are left that neither this drafter nor its lineage "
                         f"trained on and no benchmark uses (asked for {n}): distill from fewer prompts, or hold a "
                         "window's shards out of training (a dataset range such as folder[6:]); run from the "
                         "repository root, where the dataset paths resolve")


def _outside_selection(folder: Path, selected: slice | None) -> set[tuple[str, str]]:
    """``(source, source_id)`` of the records answered in ``folder``'s shards outside the shard
    range ``selected`` and in none inside it; empty without a range, without the shards here, or
    unless the shard files are numbered 0..n-1 without a gap (training selects by position in
    file-name order: with a shard missing here, positions would shift and a trained shard could
    look held out)."""
    shards = sorted((folder / "shards").glob("*.jsonl")) if selected is not None else []
    if not shards or [f.stem for f in shards] != [f"{i:05d}" for i in range(len(shards))]:
        return set()
    from training.batching import shard_records

    chosen = set(shards[selected])

    def ids(files) -> set[tuple[str, str]]:
        return {(rec["source"], str(rec["source_id"])) for rec in shard_records(files)}

    return ids([f for f in shards if f not in chosen]) - ids(chosen)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--target", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--prompts", type=int, default=None,
                    help="calibration prompts (default 8; eagle3: at most 24, raced in batches of 4)")
    ap.add_argument("--dtype", default="auto",
                    help="target dtype the tree is calibrated for: float32, bfloat16 or auto (default: the dtype "
                         "load_target picks here, bfloat16 where it runs natively and measures faster)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--max-nodes", type=int, default=16, help="largest tree measured (root excluded)")
    ap.add_argument("--width", type=int, default=None, help="layer-skip: widest level searched (default: the checkpoint's)")
    ap.add_argument("--head-weights", default="auto", choices=("auto", "native", "int8"),
                    help="eagle3: weights the draft head runs with in every grid entry (auto: int8 where the "
                         "int8 kernel runs here, else native; see selfspec/int8_linear.py)")
    ap.add_argument("--within", default=None, metavar="SPEC",
                    help="eagle3: calibrate the head's tree as a member of the union with SPEC (e.g. ngram) and "
                         "store it as its tree inside unions")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="eagle3: race the tree of sampled steps at this temperature (> 0; stored apart)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampled runs (--temperature)")
    ap.add_argument("--familiarity", action="store_true",
                    help="eagle3: measure the head's familiarity read on held-out chat prompts and store the floor "
                         "under which a union leaves it out of a generation (min_familiar)")
    ap.add_argument("--dry-run", action="store_true", help="print the choice, leave the checkpoint as it is")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = selfspec.load_target(args.target, dtype=args.dtype)
    args.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # what "auto" chose: the tree's key
    drafter = load_drafter(args.checkpoint, model)
    meta, _ = read_checkpoint(args.checkpoint)
    if args.familiarity:
        return calibrate_familiarity(args, model, tok, drafter, meta)
    if args.within and drafter.kind != "eagle3":
        raise SystemExit(f"--within calibrates eagle3 heads inside a union, not {drafter.kind} drafters")
    if args.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0, got {args.temperature}")
    sampled = args.temperature > 0
    if sampled and (drafter.kind != "eagle3" or args.within):
        raise SystemExit("--temperature calibrates the tree an eagle3 head drafts alone at T > 0 (not with "
                         f"--within, not for {drafter.kind} drafters): a union's merged steps keep their greedy-"
                         "calibrated tree")
    if args.prompts is None:
        args.prompts = 24 if drafter.kind == "eagle3" else 8
    if args.prompts < 1:
        raise SystemExit(f"--prompts must be >= 1, got {args.prompts}")
    if drafter.kind == "eagle3":
        texts = heldout_prompts(meta, args.prompts)
    else:
        texts = calibration_prompts(SHARED, args.prompts)
        _enough(texts, args.prompts)
    prompts = [encode_chat(tok, [{"role": "user", "content": p}]) for p in texts]
    verify = verify_costs(model, list(range(1, args.max_nodes + 2)))
    print("verify ms per n nodes:", {n: round(v * 1e3, 1) for n, v in verify.items()})
    record = {"machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus".strip(),
              "cpu": cpu_label(), "torch_threads": torch.get_num_threads(), "verify_cost_s": verify,
              "prompts": len(prompts)}
    if drafter.kind == "medusa":
        seqs = []
        for ids in prompts:
            out = selfspec.generate(model, ids, max_new_tokens=args.new_tokens)
            seqs.append((out.sequences[0], ids.shape[-1] - 1))
        acc = heads_accuracy(model, drafter, seqs, ranks=4)
        draft = heads_draft_cost(model, drafter)
        best, options = choose_tree(acc, verify, draft)
        for c in options:
            print(f"  budget {c.budget:2d}: expected MAT {c.expected_mat:.2f}, step {c.step_cost_s * 1e3:5.1f} ms, "
                  f"{c.tokens_per_s:6.1f} tok/s")
        print(f"acceptance per depth/rank: {[[round(a, 3) for a in row] for row in acc]}; draft {draft * 1e3:.1f} ms")
        if best.budget == 0:
            print("plain decoding is expected to be faster than any tree of these heads on this machine; "
                  "keeping the smallest tree (the adaptive policy falls back to plain steps on its own)")
            best = options[1]
        drafter.set_tree(best.tree)
        record |= {"acceptance": acc, "draft_cost_s": draft, "budget": best.budget, "tree": best.tree,
                   "expected_mat": best.expected_mat, "expected_tokens_per_s": best.tokens_per_s}
        print(f"chosen tree ({best.budget} nodes): {best.tree}")
    elif drafter.kind == "layerskip":
        width = args.width or drafter.cfg.width
        def make(b):  # noqa: E306  (a fresh drafter per budget: nothing carries over between them)
            return drafter.with_options(max_nodes=b, width=min(width, b))

        budgets = [b for b in (1, 2, 3, 4, 6, 8, 12) if b <= args.max_nodes]
        best, speedups = measured_search(model, make, prompts[:3], budgets)
        print("measured speedup per max_nodes:", {b: round(s, 3) for b, s in speedups.items()})
        chosen = best or max(speedups, key=speedups.get)
        drafter = make(chosen)
        record |= {"measured_speedup": speedups, "max_nodes": chosen, "width": drafter.cfg.width}
        print(f"chosen max_nodes: {chosen}" + ("" if best else " (nothing beat plain decoding here)"))
    elif drafter.kind == "eagle3":
        weights = args.head_weights
        if sampled and weights != "auto":
            raise SystemExit("--head-weights applies to every tree of the head (one head runs them all): "
                             "calibrate it greedy; --temperature races tree shapes with the head's own weights")
        if sampled:
            weights = drafter.cfg.head_weights
        elif weights == "auto":
            weights = "int8" if drafter.with_options(head_weights="int8").run_head.lm_head.kernel else "native"
        grid = [dict(max_depth=d, width=1, branch=1, max_nodes=d) for d in (2, 3, 4, 5)]
        if sampled:  # sampled trees draw level by level: (depth, width, nodes) 2/2/4 is two children
            # of the root and one of each, 3/2/5 one more level with one child
            shapes = ((2, 2, 3), (2, 2, 4), (3, 2, 5), (3, 2, 6))
        else:
            shapes = ((4, 2, 6), (5, 3, 8), (6, 4, 12), (6, 4, 16))  # 16 nodes: where a tree pass
            # costs little more than a step (bf16 with AMX: 1.24 steps)
        grid += [dict(max_depth=d, width=w, branch=w, max_nodes=n) for d, w, n in shapes]
        # the incumbents race too: at T > 0 the stored tree of sampled steps and the head's own tree
        # (which T > 0 steps draft where none is stored)
        for cfg in (drafter.sampled_cfg, drafter.cfg) if sampled else ():
            now = {k: getattr(cfg, k) for k in ("max_depth", "width", "branch", "max_nodes")} if cfg else None
            if now and now not in grid:
                grid.append(now)
        grid = [g | {"head_weights": weights} for g in grid if g["max_nodes"] <= args.max_nodes]
        def make(i):  # noqa: E306  (a fresh drafter, and a fresh union, per grid entry)
            if sampled:  # the tree of T > 0 steps; greedy steps keep the head's own
                return drafter.for_sampling(grid[i])
            if args.within is None:
                return drafter.with_options(**grid[i])
            # inside a union the entry is the tree of merged steps; the head alone keeps its own
            member = drafter.for_merging(grid[i])
            return UnionDrafter([member, union_member(drafter_from_spec(model, args.within, args.target, tok))])

        gen = dict(temperature=args.temperature, seed=args.seed) if sampled else {}

        def measure(keys, some):  # noqa: E306
            got = measured_speedups(model, make, some, keys, **gen)
            print(f"  race: {len(some)} prompts, entries {keys}: "
                  + ", ".join(f"{k}: {sum(v) / len(v):.3f}x" for k, v in got.items()), flush=True)
            return got

        chosen, speedups, rounds = raced_choice(measure, list(range(len(grid))), prompts, batch=4)
        for i, g in enumerate(grid):
            out = next((r["prompts"] for r in rounds if i not in r["left"]), None)
            print(f"  {g}: {speedups[i]:.3f}x" + (f" over the {out} prompts it ran (then out)" if out
                                                   else f" over {rounds[-1]['prompts']} prompts (left at the end)"))
        print(f"race: {[(r['prompts'], r['left']) for r in rounds]}")
        drafter = drafter.for_sampling(grid[chosen]) if sampled else drafter.with_options(**grid[chosen])
        record |= {"temperature": args.temperature, "seed": args.seed} if sampled else {}
        record |= {"grid": grid, "measured_speedup": [speedups[i] for i in range(len(grid))], "chosen": grid[chosen],
                   "race": rounds, "within": args.within}
        print(f"chosen {grid[chosen]}" + ("" if speedups[chosen] > 1.0 else " (nothing beat plain decoding here)"))
    else:
        raise SystemExit(f"no calibration for drafters of kind {drafter.kind!r}")
    if args.dry_run:
        return
    extra = meta.setdefault("extra", {})
    key = machine_key(args.dtype, next(model.parameters()).device)  # e.g. "bfloat16@amx"
    options = {k: v for k, v in drafter.config_dict().items() if k in TREE_OPTIONS}
    if sampled:  # the tree of T > 0 steps (its head_weights are the head's, set with its own tree)
        options = {k: v for k, v in asdict(drafter.sampled_cfg).items() if k in TREE_OPTIONS and k != "head_weights"}
    # which tree: of sampled steps, inside unions (the head's own tree left as it is either way), or its own
    part, what = (("_sampled", "tree of sampled steps") if sampled else
                  ("_in_union", "tree inside unions") if args.within is not None else ("", "own tree"))
    extra.setdefault(f"calibration{part}_by_dtype", {})[key] = json.loads(json.dumps(record))
    extra.setdefault(f"options{part}_by_dtype", {})[key] = options
    if not part and args.dtype == "float32":  # the weights are unchanged: rewrite drafter.json only
        meta["config"] = drafter.config_dict()
        extra["calibration"] = json.loads(json.dumps(record))
    atomic_write_text(Path(args.checkpoint) / CONFIG_FILE, json.dumps(meta, indent=1) + "\n")
    print(f"stored in {Path(args.checkpoint) / CONFIG_FILE} ({what}, {key})")


def calibrate_familiarity(args, model, tok, drafter, meta: dict) -> None:
    """``--familiarity``: the floor of the head's familiarity read, from held-out chat prompts."""
    if drafter.kind != "eagle3":
        raise SystemExit(f"--familiarity calibrates an eagle3 head's familiarity floor, not {drafter.kind} drafters")
    if args.within or args.temperature:
        raise SystemExit("--familiarity stores one floor for the head (no --within, no --temperature)")
    n = 400 if args.prompts is None else args.prompts
    if n < 1:
        raise SystemExit(f"--prompts must be >= 1, got {n}")
    texts = heldout_prompts(meta, n)
    prompts = [encode_chat(tok, [{"role": "user", "content": p}]) for p in texts]
    reads = prompt_familiarity(model, drafter, tqdm(prompts, desc="familiarity read"))
    decided = [h / k for h, k in reads if k >= drafter.cfg.familiar_window // 4]
    if not decided:
        raise SystemExit("no held-out prompt is long enough for a familiarity read")
    floor = familiarity_floor(decided)
    ordered = sorted(decided)
    record = {"prompts": len(prompts), "decided": len(decided), "window": drafter.cfg.familiar_window,
              "dtype": args.dtype, "lowest": ordered[0], "p1": ordered[len(ordered) // 100],
              "p5": ordered[len(ordered) // 20], "median": ordered[len(ordered) // 2], "floor": floor,
              "rule": "0.75 x the lowest held-out chat share, rounded down to 0.01"}
    print(f"familiarity over {len(decided)} held-out chat prompts (window {record['window']}): lowest "
          f"{record['lowest']:.3f}, 1% {record['p1']:.3f}, 5% {record['p5']:.3f}, median {record['median']:.3f}; "
          f"floor {floor:.2f}")
    if args.dry_run:
        return
    meta["config"]["min_familiar"] = floor
    meta["config"]["familiar_window"] = drafter.cfg.familiar_window
    meta.setdefault("extra", {})["familiarity"] = record
    atomic_write_text(Path(args.checkpoint) / CONFIG_FILE, json.dumps(meta, indent=1) + "\n")
    print(f"stored in {Path(args.checkpoint) / CONFIG_FILE} (config.min_familiar)")


if __name__ == "__main__":
    main()
