"""Throughput of batched decoding: plain against speculative, at every batch size, and under a
stream of requests arriving over time (the benchmark's throughput mode, ``selfspec bench
--batch-sizes ...`` / ``--arrival-rate ...``).

Sweep: for each dtype and batch size B, every method decodes the same prompts (the first
``max(B, min_prompts)`` held-out prompts, in batches of B, all rows starting together), side by
side in one process: ``hf-greedy`` (transformers' batched ``generate``, left-padded), ``none``
(selfspec's own loop, plain) and selfspec drafter specs through :class:`selfspec.batch.Pool`.
Recorded per method and B: new tokens summed over the batch per second of wall time (and per
batch, so a method's ratio to plain has a paired-bootstrap interval over batches), each
request's latency, rows whose greedy text equals that prompt decoded alone by plain selfspec in
the same dtype, and where the pool's time went (draft, pass, verify, realignment).

Stream: ``requests`` prompts arrive at exponential intervals (rate ``arrival_rate`` per second,
seeded, the same arrival times for every method) into a pool of ``max_batch`` rows; throughput is
tokens over the makespan, latency is finish minus arrival (percentiles). Repeated streams take
fresh prompts and arrival times and rotate the methods' order; ratios to plain get intervals
over whole streams (requests of one stream share its pool, so they are not independent units).
"""

from __future__ import annotations

import random
import time

import torch

from ..batch import Pool
from ..chat import encode_chat
from .benchmark import bootstrap_ci


def prompts_from(tokenizer, questions, n: int) -> list[torch.Tensor]:
    """The first user turn of the first ``n`` questions, encoded as the benchmark does."""
    out = [encode_chat(tokenizer, q.turns[0], system=q.system)[0] for q in questions[:n]]
    if len(out) < n:
        raise ValueError(f"{n} prompts needed, the question files hold {len(out)}")
    return out


def _hf_batch(model, prompts, max_new_tokens: int) -> tuple[list[torch.Tensor], list[float], float]:
    eos = model.generation_config.eos_token_id
    eos_set = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    pad = next(iter(eos_set), 0)
    width = max(p.shape[0] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[0]:], mask[b, width - p.shape[0]:] = p, 1
    start = time.perf_counter()
    seq = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         temperature=None, top_k=None, top_p=None, pad_token_id=pad)
    wall = time.perf_counter() - start
    outs = []
    for b, p in enumerate(prompts):
        new = seq[b, width:].tolist()
        cut = next((i + 1 for i, t in enumerate(new) if t in eos_set), len(new))
        outs.append(torch.cat([p, torch.tensor(new[:cut], dtype=torch.long)]))
    return outs, [wall] * len(prompts), wall


def _pool_batch(model, controller, prompts, max_new_tokens: int):
    pool = Pool(model, controller, max_batch=len(prompts))
    start = time.perf_counter()
    handles = [pool.submit(p, max_new_tokens=max_new_tokens) for p in prompts]
    pool.run()
    wall = time.perf_counter() - start
    return [h.result().sequences[0] for h in handles], [h.finished - h.submitted for h in handles], wall, pool.stats


def _stats_dict(stats) -> dict:
    return dict(steps=stats.steps, draft_s=stats.draft_s, pass_s=stats.pass_s, verify_s=stats.verify_s,
                commit_s=stats.commit_s, leave_s=stats.leave_s, prefill_s=stats.prefill_s,
                pass_tokens=stats.pass_tokens, real_tokens=stats.real_tokens, slots=stats.slots,
                hole_slots=stats.hole_slots, realign_share=stats.realign_share)


def sweep(model, methods: dict, prompts: list[torch.Tensor], batch_sizes: list[int], *, max_new_tokens: int,
          min_prompts: int = 4, progress=None) -> list[dict]:
    """One record per (B, method): see the module docstring. ``methods``: name -> ``"hf"`` or a
    :class:`~selfspec.control.Controller` / ``None`` (plain). Every row's text is compared with
    plain selfspec alone on that prompt (``none`` at B = 1, run first for each prompt)."""
    alone: dict[int, torch.Tensor] = {}
    records = []
    for B in batch_sizes:
        count = max(B, min_prompts)
        chunks = [prompts[i: i + B] for i in range(0, count, B)]
        for i in range(count):
            if i not in alone:
                alone[i] = _pool_batch(model, None, [prompts[i]], max_new_tokens)[0][0]
        names = list(methods)
        acc = {name: dict(tokens=0, wall=0.0, latencies=[], same=0, pool=[], chunks=[]) for name in names}
        for c, chunk in enumerate(chunks):
            for k in range(len(names)):  # the order rotated by one per batch: position effects cancel
                name = names[(k + c) % len(names)]
                method, a = methods[name], acc[name]
                if method == "hf":
                    outs, lat, seconds = _hf_batch(model, chunk, max_new_tokens)
                else:
                    outs, lat, seconds, stats = _pool_batch(model, method, chunk, max_new_tokens)
                    a["pool"].append(_stats_dict(stats))
                new = sum(o.shape[0] - p.shape[0] for o, p in zip(outs, chunk))
                a["same"] += sum(torch.equal(o, alone[c * B + j]) for j, o in enumerate(outs))
                a["chunks"].append([new, seconds])
                a["tokens"] += new
                a["wall"] += seconds
                a["latencies"] += lat
        for name in names:
            a = acc[name]
            rec = dict(batch=B, method=name, prompts=count, tokens=a["tokens"], seconds=a["wall"],
                       tokens_per_s=a["tokens"] / a["wall"], latency_s=sorted(a["latencies"]),
                       identical_rows=a["same"], pool=a["pool"], chunks=a["chunks"])
            records.append(rec)
            if progress is not None:
                progress(rec)
    return records


def arrival_times(requests: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request arrives (exponential gaps, mean 1 / rate)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def stream_runs(model, methods: dict, prompts: list[torch.Tensor], *, requests: int, rate: float, repeats: int,
                max_batch: int, max_new_tokens: int, progress=None) -> dict:
    """``repeats`` streams of ``requests`` requests each: stream r takes the next ``requests``
    prompts and arrival times seeded r, and runs every method on them in an order rotated by r (so
    no method always runs first or last). Returns, per method, the pooled result (tokens over the
    summed makespans, every request's latency) with each stream in ``runs``."""
    if len(prompts) < requests * repeats:
        raise ValueError(f"{requests * repeats} prompts needed for {repeats} streams of {requests}, got {len(prompts)}")
    names = list(methods)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(repeats):
        part, arrivals = prompts[r * requests:(r + 1) * requests], arrival_times(requests, rate, seed=r)
        for name in names[r % len(names):] + names[: r % len(names)]:
            runs[name].append(stream_run(model, methods[name], part, arrivals, max_batch=max_batch,
                                         max_new_tokens=max_new_tokens))
            if progress is not None:
                progress(name, r, runs[name][-1])
    out = {}
    for name, rs in runs.items():
        tokens, makespan = sum(x["tokens"] for x in rs), sum(x["makespan_s"] for x in rs)
        out[name] = dict(tokens=tokens, makespan_s=makespan, tokens_per_s=tokens / makespan,
                         latency_s=sorted(v for x in rs for v in x["latency_s"]),
                         rows_per_step=_mean([x["rows_per_step"] for x in rs]),
                         realign_share=_mean([x["pool"]["realign_share"] for x in rs]), runs=rs)
    return out


def stream_run(model, controller, prompts: list[torch.Tensor], arrivals: list[float], *, max_batch: int,
               max_new_tokens: int) -> dict:
    """Requests arrive at ``arrivals`` (seconds) into a pool of ``max_batch`` rows; returns tokens,
    makespan, latencies (finish - arrival) and the pool's time split."""
    pool = Pool(model, controller, max_batch=max_batch)
    start = time.perf_counter()
    pending = list(zip(arrivals, prompts))
    handles = []
    while pending or not pool.idle:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, p = pending.pop(0)
            handles.append((at, pool.submit(p, max_new_tokens=max_new_tokens)))
        if pool.idle:
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))
            continue
        pool.step()
    makespan = time.perf_counter() - start
    tokens = sum(h.result().stats.new_tokens for _, h in handles)
    latency = sorted(h.finished - start - at for at, h in handles)
    wait = sorted(h.admitted - start - at for at, h in handles)
    return dict(tokens=tokens, makespan_s=makespan, tokens_per_s=tokens / makespan, latency_s=latency,
                queue_wait_s=wait, rows_per_step=_mean(pool.stats.rows_per_step), pool=_stats_dict(pool.stats),
                outputs=[h.result().sequences[0].tolist() for _, h in handles])


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``xs`` by linear interpolation."""
    xs = sorted(xs)
    if not xs:
        return 0.0
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ratio_ci(record: dict, base: dict) -> list[float] | None:
    """95% paired-bootstrap interval of ``record``'s tokens/s over ``base``'s on the same batches
    (the prompts of one batch decoded by both; resampling whole batches). ``None`` under 3 batches."""
    a, b = record.get("chunks") or [], base.get("chunks") or []
    if len(a) != len(b):
        return None

    def ratio(picked):
        den = sum(b[i][0] for i in picked) / sum(b[i][1] for i in picked)
        return sum(a[i][0] for i in picked) / sum(a[i][1] for i in picked) / den

    return bootstrap_ci(len(a), ratio)


def sweep_table(records: list[dict]) -> str:
    """Markdown: tokens/s summed over the batch per method and B, the ratio to plain batched
    ``generate`` and to selfspec's plain loop (with its paired-bootstrap interval over batches
    where there are 3 or more), p50 latency, identical rows and realignment share."""
    lines = ["| dtype | B | method | tokens/s | vs hf-greedy | vs plain loop (95% CI) | p50 latency s | identical rows | "
             "realign share |", "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["dtype"], r["batch"], r["method"]): r for r in records}
    for r in records:
        hf = by.get((r["dtype"], r["batch"], "hf-greedy"))
        plain = by.get((r["dtype"], r["batch"], "none"))
        share = _mean([p["realign_share"] for p in r["pool"]]) if r["pool"] else None
        cells = [r["dtype"], str(r["batch"]), r["method"], f"{r['tokens_per_s']:.1f}",
                 f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if hf else "-",
                 _vs(r, plain),
                 f"{percentile(r['latency_s'], 0.5):.2f}", f"{r['identical_rows']}/{r['prompts']}",
                 "-" if share is None else f"{100 * share:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _vs(record: dict, plain: dict | None) -> str:
    if plain is None:
        return "-"
    text = f"{record['tokens_per_s'] / plain['tokens_per_s']:.2f}x"
    ci = None if record is plain else ratio_ci(record, plain)
    return text + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def crossover(records: list[dict], method: str, dtype: str) -> int | None:
    """Smallest batch size at which ``method`` runs below plain batched selfspec (``None``: never)."""
    by = {(r["batch"], r["method"]): r for r in records if r["dtype"] == dtype}
    for B in sorted({b for b, _ in by}):
        if (B, method) in by and (B, "none") in by and by[(B, method)]["tokens_per_s"] < by[(B, "none")]["tokens_per_s"]:
            return B
    return None


def stream_table(results: dict, plain: str = "none") -> str:
    """Markdown: per method (``"name (dtype)"`` keys), tokens/s over the makespans, latency
    percentiles over every request, and the ratios of tokens/s and mean latency to ``plain`` in the
    same dtype, with 95% paired-bootstrap intervals over whole streams (3 or more)."""
    lines = ["| method | tokens/s | vs plain (95% CI) | p50 latency s | p90 | p99 | mean latency vs plain (95% CI) | "
             "mean rows per step | realign share |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        base = plain + name[name.index(" ("):] if " (" in name else plain
        ref = results.get(base)
        lat = r["latency_s"]
        rate = latency = "-"
        if ref is not None and name != base:
            rate = _with_ci(r["tokens_per_s"] / ref["tokens_per_s"], _runs_ci(r, ref, _rate_ratio))
            latency = _with_ci(sum(lat) / sum(ref["latency_s"]), _runs_ci(r, ref, _latency_ratio))
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {rate} | {percentile(lat, .5):.2f} | "
                     f"{percentile(lat, .9):.2f} | {percentile(lat, .99):.2f} | {latency} | {r['rows_per_step']:.1f} | "
                     f"{100 * r['realign_share']:.1f}% |")
    return "\n".join(lines)


def _rate_ratio(a: list[dict], b: list[dict]) -> float:
    return (sum(x["tokens"] for x in a) / sum(x["makespan_s"] for x in a)) / \
        (sum(x["tokens"] for x in b) / sum(x["makespan_s"] for x in b))


def _latency_ratio(a: list[dict], b: list[dict]) -> float:
    return sum(sum(x["latency_s"]) for x in a) / sum(sum(x["latency_s"]) for x in b)


def _runs_ci(record: dict, base: dict, statistic) -> list[float] | None:
    """95% paired-bootstrap interval of ``statistic(record's streams, base's streams)``, resampling
    whole streams (the same arrivals and prompts for both)."""
    a, b = record.get("runs") or [], base.get("runs") or []
    if len(a) != len(b):
        return None
    return bootstrap_ci(len(a), lambda picked: statistic([a[i] for i in picked], [b[i] for i in picked]))


def _with_ci(value: float, ci: list[float] | None) -> str:
    return f"{value:.2f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def plot_sweep(records: list[dict], path: str, title: str = "") -> None:
    """Tokens/s summed over the batch against batch size, one line per method and dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dtype in sorted({r["dtype"] for r in records}):
        for method in dict.fromkeys(r["method"] for r in records):
            rs = sorted((r for r in records if r["dtype"] == dtype and r["method"] == method), key=lambda r: r["batch"])
            if rs:
                ax.plot([r["batch"] for r in rs], [r["tokens_per_s"] for r in rs], marker="o",
                        linestyle="-" if dtype == "bfloat16" else "--", label=f"{method} ({dtype})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows decoding together)")
    ax.set_ylabel("new tokens / s, summed over the batch")
    ax.set_title(title or "batched decoding throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
