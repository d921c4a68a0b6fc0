"""Benchmark selfspec drafters and transformers peers against plain decoding, side by side.

    selfspec bench --questions selfspec/prompts/mt_bench_question.jsonl --per-category 1 \
        --methods medusa layerskip ngram hf-greedy hf-prompt-lookup hf-early-exit:10 --out runs/bench

Question files: Spec-Bench format (``question_id``, ``category``, ``turns``; multi-turn replayed
turn by turn) or BFCL format (``question`` messages + ``function`` tools in the system message).
Methods: selfspec drafter specs (``ngram``, ``medusa`` / ``layerskip`` = the shipped checkpoints, a
checkpoint folder, ``kind:key=value``, ``a+b`` unions, ``spec@key=value`` policy options, ``spec#fixed``
to draft whole trees every step (no controller decisions), ``spec%dtype`` to run it on a copy of the target
loaded in that dtype, e.g. ``none%bfloat16`` = plain bf16 decoding, against the main ``--dtype``
baseline) and peers on the same model through
``transformers.generate``: ``hf-greedy``, ``hf-prompt-lookup[:N]``, ``hf-early-exit:E``.
Writes <out>.json (args, command, summary, records), <out>.md (command + table) and
<out>_speedup.png / <out>_acceptance.png.

Throughput mode (batches, :mod:`selfspec.measurement.throughput`): ``--batch-sizes 1 2 4 8 16 32``
sweeps the methods (``hf-greedy`` = transformers' batched generate, ``none`` = selfspec's plain
loop, drafter specs) over batch sizes in each of ``--dtypes``; ``--arrival-rate R --requests N``
runs a stream of N requests arriving at R per second into a pool of ``--max-batch`` rows; a spec
ending in ``#nogate`` runs without the batch gate (:mod:`selfspec.control.gate`):

    selfspec bench --questions selfspec/prompts/heldout/mt_bench_question.jsonl --batch-sizes 1 2 4 8 16 32 \
        --dtypes bfloat16 float32 --methods hf-greedy none ngram eagle3+ngram --max-new-tokens 64 --out runs/batch

Outside the throughput mode, finished turns are appended to <out>.partial.jsonl as they
complete: rerun the same command with --resume after an interruption.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


from selfspec.commands.common import add_model_args, fail, load_model
from selfspec.measurement import benchmark
from selfspec.measurement.workloads import load_questions, take_per_category


def distilled_ids(configs: Path = Path("configs/distill")) -> set[str]:
    """Ids of every shipped tool prompt that a distillation recipe in ``configs`` answers (their
    drafters trained on them), read from the recipes themselves, so it holds without the distilled data."""
    from selfspec.training.config import load_config
    from selfspec.training.distill import DistillJob, collect_prompts

    ids: set[str] = set()
    for path in sorted(configs.glob("*.yaml")):
        job = load_config(DistillJob, path)
        if job.distill.sources.get("tools"):
            ids |= {p["source_id"] for p in collect_prompts(job.distill) if p["source"] == "tools"}
    return ids


def parser() -> argparse.ArgumentParser:
    """The command line of this command (the README test parses its examples with it)."""
    ap = argparse.ArgumentParser(prog="selfspec bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", action="append", required=True, help="question file (repeatable)")
    add_model_args(ap)
    ap.add_argument("--methods", nargs="+", default=["ngram"], help="method specs (see above)")
    ap.add_argument("--limit", type=int, default=None, help="questions per file")
    ap.add_argument("--per-category", type=int, default=None, help="first N questions of each category")
    ap.add_argument("--categories", nargs="+", default=None, help="only these categories (after --per-category)")
    ap.add_argument("--first-turn-only", action="store_true")
    ap.add_argument("--max-turns", type=int, default=None, help="first N user turns of each conversation")
    ap.add_argument("--by-turn", action="store_true", help="also summarise per turn (turn 1 = cold caches)")
    ap.add_argument("--constrain", choices=["tool-call"], default=None,
                    help="tool-call: every run (baseline too) must answer with one call to the question's tools "
                         "(grammar mask at every tree node; the baseline is constrained plain decoding)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every turn's methods N times (order rotated between rounds) and keep each "
                         "method's median run: steadier ratios on a shared machine, at N times the cost")
    ap.add_argument("--out", default=None, help="output path prefix (writes .json, .md, .png)")
    ap.add_argument("--resume", action="store_true", help="skip turns already in <out>.partial.jsonl")
    ap.add_argument("--title", default="", help="plot title")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                    help="throughput mode: sweep these batch sizes (see above)")
    ap.add_argument("--sweep-prompts", type=int, default=4,
                    help="throughput mode: at least this many prompts per batch size (batches of B; more batches give "
                         "the ratios intervals)")
    ap.add_argument("--dtypes", nargs="+", default=None, help="throughput mode: target dtypes (default: --dtype)")
    ap.add_argument("--arrival-rate", type=float, default=None,
                    help="throughput mode: requests per second arriving into a pool (continuous batching)")
    ap.add_argument("--requests", type=int, default=32, help="requests in an --arrival-rate run")
    ap.add_argument("--max-batch", type=int, default=8, help="pool rows in an --arrival-rate run")
    ap.add_argument("--stream-repeats", type=int, default=1,
                    help="--arrival-rate streams per method (fresh prompts and arrivals each, order rotated); 3 or "
                         "more give the ratios to plain intervals over whole streams")
    ap.add_argument("--resummarise", action="store_true",
                    help="recompute <out>.json's summary, <out>.md and plots from its stored records, run nothing")
    return ap


def main(argv=None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    with fail("bench", args):
        run(ap, args, argv)


def run(ap, args, argv) -> None:
    if args.resummarise:
        with open(args.out + ".json") as f:
            stored = json.load(f)
        print(benchmark.markdown_table(benchmark.write_report(
            args.out, stored["args"], benchmark.from_rows(stored["records"]), stored.get("command", ""),
            args.title or stored["args"].get("title", ""), stored.get("provenance"))))
        return
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.stream_repeats < 1:
        ap.error(f"--stream-repeats must be >= 1, got {args.stream_repeats}")
    if args.resume and not args.out:
        ap.error("--resume needs --out")

    prov = benchmark.provenance()  # the code as it is when the run starts
    if args.batch_sizes or args.arrival_rate:
        return throughput_main(args, argv, prov)
    model, tokenizer = load_model(args)
    args.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # what "auto" chose
    questions = []
    for path in args.questions:
        qs = load_questions(path)
        if Path(path).name.startswith("tool_prompts"):  # never measure on prompts a drafter was distilled on
            distilled = distilled_ids()
            qs = [q for q in qs if q.question_id not in distilled]
        if args.per_category:
            qs = take_per_category(qs, args.per_category)
        if args.categories:
            qs = [q for q in qs if q.category in args.categories]
        qs = qs[: args.limit]
        if args.first_turn_only or args.max_turns:
            keep = 1 if args.first_turn_only else args.max_turns
            qs = [q.__class__(q.question_id, q.category, q.turns[:keep], q.system, q.meta) for q in qs]
        questions += qs
    if not questions:
        ap.error("no questions left to run (check --categories / --limit)")
    others: dict[str, object] = {}  # dtype -> another copy of the target, for `spec%dtype` methods

    def method(name: str):
        spec = benchmark.MethodSpec.parse(name)
        if spec.dtype is None:
            return benchmark.method_from_spec(model, spec, args.model, tokenizer)
        if spec.dtype not in others:
            others[spec.dtype] = load_model(args, dtype=spec.dtype)[0]
        return benchmark.OnModel(others[spec.dtype], benchmark.method_from_spec(
            others[spec.dtype], spec, args.model, tokenizer))

    methods = {spec: method(spec) for spec in args.methods}
    partial = args.out + ".partial.jsonl" if args.out else None
    settings = {k: vars(args)[k] for k in ("model", "max_new_tokens", "temperature", "dtype", "constrain")}
    settings["fixed"] = False  # (whole trees every step is the method's own #fixed)
    if args.repeats != 1:  # (files written before --repeats existed resume as before)
        settings["repeats"] = args.repeats
    done = []
    if partial and args.resume and os.path.exists(partial):
        with open(partial) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        if not lines or lines[0].get("settings") != settings:
            raise ValueError(f"{partial} was written with other settings ({lines[0].get('settings') if lines else None}); "
                             "rerun without --resume to start over")
        done = benchmark.from_rows(lines[1:])
        print(f"resuming: {len(done)} records from {partial}")
    elif partial:
        os.makedirs(os.path.dirname(partial) or ".", exist_ok=True)
        with open(partial, "w") as f:
            f.write(json.dumps({"settings": settings}) + "\n")

    def persist(turn_records) -> None:
        if partial:
            with open(partial, "a") as f:
                for row in benchmark.as_rows(turn_records):
                    f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())

    constrain = None
    if args.constrain == "tool-call":
        from selfspec.decoding.constraint import ToolCallConstraint

        def constrain(q):
            if not q.meta.get("tools"):
                raise ValueError(f"--constrain tool-call: question {q.question_id} offers no tools")
            return ToolCallConstraint(q.meta["tools"], tokenizer, vocab=model.config.vocab_size)
    records = benchmark.run(model, tokenizer, questions, methods, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, done=done, on_turn=persist, constrain=constrain,
                            repeats=args.repeats)
    command = "selfspec bench " + " ".join(argv or sys.argv[1:])
    if args.out:
        print(benchmark.markdown_table(benchmark.write_report(args.out, vars(args), records, command, args.title, prov)))
    else:
        print(benchmark.markdown_table(benchmark.summarise(records, by_turn=args.by_turn)))


def throughput_main(args, argv, prov) -> None:
    """The throughput mode (module docstring): writes <out>.json, <out>.md and <out>.png."""
    from selfspec.control import ControlConfig, Controller
    from selfspec.drafters import drafter_from_spec
    from selfspec.measurement import throughput
    from selfspec.measurement.measure import write_result

    questions = []
    for path in args.questions:
        questions += load_questions(path)
    command = "selfspec bench " + " ".join(argv or sys.argv[1:])
    records, streams, tables = [], {}, []
    for dtype in args.dtypes or [args.dtype]:
        model, tokenizer = load_model(args, dtype=dtype)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        methods = {}
        for spec in args.methods:
            if spec == "hf-greedy":
                methods[spec] = "hf"
            else:  # "spec#nogate": the batch gate off (ControlConfig.batch_gate), to measure what it does
                parsed = benchmark.MethodSpec.parse(spec)
                drafter = drafter_from_spec(model, parsed.drafter, args.model, tokenizer)
                config = ControlConfig(batch_gate=parsed.gate, fixed=parsed.fixed)
                methods[spec] = None if drafter is None else Controller(drafter, config)
        if args.batch_sizes:
            prompts = throughput.prompts_from(tokenizer, questions, max(max(args.batch_sizes), args.sweep_prompts))
            for name, m in methods.items():  # untimed: kernels, weight packing, the verify cost curve
                if m != "hf":
                    throughput._pool_batch(model, m, prompts[:2], 8)
            rows = throughput.sweep(model, methods, prompts, sorted(args.batch_sizes),
                                    max_new_tokens=args.max_new_tokens, min_prompts=args.sweep_prompts,
                                    progress=lambda r: print(f"{dtype} B={r['batch']} {r['method']}: "
                                                             f"{r['tokens_per_s']:.1f} tok/s", flush=True))
            for r in rows:
                r["dtype"] = dtype
            records += rows
        if args.arrival_rate:
            prompts = throughput.prompts_from(tokenizer, questions, args.requests * args.stream_repeats)
            pooled = {name: m for name, m in methods.items() if m != "hf"}  # transformers has no request pool
            for m in pooled.values():  # untimed: kernels, weight packing, the verify cost curve
                throughput._pool_batch(model, m, prompts[:2], 8)
            runs = throughput.stream_runs(model, pooled, prompts, requests=args.requests, rate=args.arrival_rate,
                                          repeats=args.stream_repeats, max_batch=args.max_batch,
                                          max_new_tokens=args.max_new_tokens,
                                          progress=lambda name, r, x: print(f"stream {r} {name} ({dtype}): "
                                                                            f"{x['tokens_per_s']:.1f} tok/s", flush=True))
            streams |= {f"{name} ({dtype})": r for name, r in runs.items()}
        del model
    if records:
        tables.append(throughput.sweep_table(records))
        cross = {f"{m} ({d})": throughput.crossover(records, m, d)
                 for d in dict.fromkeys(r["dtype"] for r in records) for m in args.methods if m not in ("none", "hf-greedy")}
        tables.append("Smallest batch where a method runs below plain batched selfspec: "
                      + ", ".join(f"{k}: {v if v is not None else 'never (up to the largest B)'}" for k, v in cross.items()))
    else:
        cross = {}
    if streams:
        tables.append(f"Stream: {args.stream_repeats} x {args.requests} requests at {args.arrival_rate}/s, pool of "
                      f"{args.max_batch} rows\n\n" + throughput.stream_table(streams))
    text = "\n\n".join(tables)
    print(text)
    if args.out:
        write_result(args.out, dict(args=vars(args), command=command, provenance=prov, sweep=records,
                                    crossover=cross, stream=streams), f"`{command}`\n\n{text}\n")
        if records:
            throughput.plot_sweep(records, args.out + ".png", args.title)


if __name__ == "__main__":
    main()
