"""Benchmarking methods side by side on a prompt set (greedy or sampled, batch 1).

Methods: ``baseline`` (plain decoding through selfspec's own loop), any selfspec drafter, and
peers run on the same model object and prompts through ``transformers.generate`` (plain greedy or
sampling, prompt lookup, ``assistant_early_exit``), see :class:`HFMethod`.

For every turn of every question the baseline runs first and its reply becomes the conversation
history of the next turn for every method, so all methods see identical prompts; the methods then
run in turn on that prompt (machine noise hits all alike).

Metric conventions (per group of prompts, summed over the group's runs):

* TTFT: seconds from the call (``selfspec.generate`` / ``model.generate``, setup included) to the
  first step's output (prefill + first step);
* TPOT: seconds per output token after the first step (a speculative first step may emit several
  tokens; they are counted in TTFT, not here); tokens/s = 1 / TPOT;
* speedup = the method's tokens/s / the baseline's tokens/s on the same prompts (greedy: the same
  tokens, so a ratio of times; sampling: rates, since lengths differ);
* MAT = new tokens / target passes (peers: passes of the full model, counted by a forward hook);
* acceptance per depth: see :mod:`selfspec.decoding.metrics` (selfspec methods only);
* peak memory: the largest growth of the process's resident memory (CPU) or of allocated CUDA
  memory (GPU) during the run, over its value at the start, in MiB;
* identical: the output equals the baseline's token for token;
* 95% CI of a speedup: a paired bootstrap over whole conversations (each resample draws
  questions with replacement, keeping every turn and every method's runs of a question together,
  since turns of one conversation and a controller learning along it are correlated, and
  recomputes the ratio of rates), seeded, so tables regenerate identically;
* unions against their members: a union ``a+b`` (same dtype suffix) is compared with each of its
  members measured in the same file, on the same runs, as a paired ratio with its 95% CI
  (:func:`union_vs_members`): a union must never lose to its best member. The comparison says on
  how many of those runs the two wrote the same text (``output_sha``: a digest of the tokens of
  each method's kept run, the one whose time the ratio uses): in bf16 a greedy union and its
  member (or one method's repeats) can leave each other at a near-tie (batched and sequential
  passes round differently) and then write different texts, one of which may be far easier to
  draft (a reply that falls into a repeated sentence); a ratio over different texts is not a loss
  of the union's arm choice.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Iterable

import torch
from tqdm.auto import tqdm

from ..chat import encode_chat
from ..control import ControlConfig, Controller
from ..drafters.base import Drafter
from ..engine import generate
from .measure import divergence, warm_up_drafting
from .workloads import Question


@dataclass
class Record:
    """One (prompt, method) run."""

    question_id: str
    category: str
    turn: int
    method: str
    prompt_tokens: int
    new_tokens: int
    steps: int
    decode_time_s: float
    prefill_time_s: float
    identical_to_baseline: bool
    tested_per_depth: list[int]
    accepted_per_depth: list[int]
    ttft_s: float = 0.0
    wall_time_s: float = 0.0
    first_tokens: int = 1
    peak_mem_mib: float = 0.0
    reply: str | None = None  # the baseline's reply text (conversation history on resume)
    divergence: dict | None = None  # greedy only: where and why the output left the baseline
    repeat_s_per_token: list[float] | None = None  # with repeats: every run's (the record is the median one)
    output_sha: str | None = None  # digest of the generated token ids (same text <=> same digest)
    @property
    def after_first_s(self) -> float:
        """Seconds spent on tokens after the first."""
        return self.wall_time_s - self.ttft_s if self.wall_time_s else self.decode_time_s


@dataclass
class RunResult:
    sequences: torch.Tensor
    new_tokens: int
    steps: int
    wall_time_s: float
    ttft_s: float
    first_tokens: int = 1
    prefill_time_s: float = 0.0
    tested_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)


class SelfspecMethod:
    """``selfspec.generate`` with a drafter or several (``None``: the baseline) under one
    :class:`~selfspec.control.Controller` kept across the benchmark's calls, as a server keeps
    one (``fixed``: every step drafts the whole trees); with ``prefix_cache`` a
    :class:`~selfspec.decoding.prefix_cache.PrefixCache` per session (conversation), new at each
    :meth:`new_session`, so later turns reuse the earlier turns' keys/values."""

    def __init__(self, drafter, fixed: bool = False, prefix_cache: bool = False):
        self.drafter, self.prefix_cache = drafter, prefix_cache
        self.controller = None if drafter is None else Controller(drafter, ControlConfig(fixed=fixed))
        self.cache = None

    @property
    def learns_text(self) -> bool:
        """Whether a drafter keeps earlier outputs (a repeat of a prompt is then easier)."""
        return self.controller is not None and self.controller.requires.learns

    def new_session(self) -> None:
        if self.prefix_cache:
            from ..decoding.prefix_cache import PrefixCache

            self.cache = PrefixCache()

    def warm_up(self, model, ids, *, temperature: float, seed: int) -> None:
        """Untimed: each drafter alone drafts every step of a short generation, so first-call costs
        (kernel selection, weight packing) land here, not in the controller's measurements."""
        warm_up_drafting(model, ids, self.drafter, temperature=temperature, seed=seed)

    def __call__(self, model, ids, *, max_new_tokens: int, temperature: float, seed: int, tools=None,
                 constraint=None) -> RunResult:
        start = time.perf_counter()
        out = generate(model, ids, drafter=self.controller, max_new_tokens=max_new_tokens, temperature=temperature,
                       seed=seed, prefix_cache=self.cache, tools=tools, constraint=constraint)
        wall = time.perf_counter() - start
        s = out.stats
        setup = wall - s.wall_time_s  # argument checks, target wrapper: counted like HF's setup
        return RunResult(out.sequences, s.new_tokens, s.steps, wall, setup + s.first_token_s, s.first_step_tokens,
                         setup + s.prefill_time_s, list(s.tested_per_depth), list(s.accepted_per_depth))


class OnModel:
    """A method run on another copy of the target, e.g. loaded in another dtype (``spec%bfloat16``):
    the benchmark's baseline stays the main model's plain decoding, so this method's speedup is
    against that baseline, measured side by side on the same prompts. Its "identical" column
    compares with the main baseline too (another dtype's greedy text differs at near-ties); no
    divergence is diagnosed on the main model for it."""

    def __init__(self, model, method: Method):
        self.model, self.method = model, method

    def new_session(self) -> None:
        if hasattr(self.method, "new_session"):
            self.method.new_session()

    def warm_up(self, model, ids, **kwargs) -> None:
        if hasattr(self.method, "warm_up"):
            self.method.warm_up(self.model, ids, **kwargs)

    def __call__(self, model, ids, **kwargs) -> RunResult:
        return self.method(self.model, ids, **kwargs)


class _FirstToken:
    """A ``generate`` streamer noting when the first new token arrives (the first ``put`` is the prompt)."""

    def __init__(self):
        self.calls, self.first, self.first_tokens = 0, None, 1

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first, self.first_tokens = time.perf_counter(), max(1, int(value.numel()))

    def end(self) -> None:
        pass


class HFMethod:
    """A transformers ``generate`` peer on the same model: ``options`` are generate kwargs
    (``{}``: plain; ``{"prompt_lookup_num_tokens": 10}``; ``{"assistant_early_exit": 8}``)."""

    def __init__(self, options: dict):
        self.options = options

    def __call__(self, model, ids, *, max_new_tokens: int, temperature: float, seed: int, tools=None,
                 constraint=None) -> RunResult:
        from transformers.generation.streamers import BaseStreamer

        if constraint is not None:
            raise ValueError("transformers peers do not run with a selfspec constraint; drop them or --constrain")

        streamer = type("FirstToken", (_FirstToken, BaseStreamer), {})()
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        passes = [0]

        def count(module, args, kwargs):  # full-depth passes only (the early exit reuses the model)
            passes[0] += module.config.get_text_config(decoder=True).num_hidden_layers == layers

        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(
            do_sample=False, temperature=None, top_k=None, top_p=None)
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
        handle = model.register_forward_pre_hook(count, with_kwargs=True)
        torch.manual_seed(seed)  # transformers' generate samples from the global generator
        try:
            start = time.perf_counter()
            seq = model.generate(ids.to(next(model.parameters()).device), max_new_tokens=max_new_tokens,
                                 streamer=streamer, pad_token_id=pad, **sampling, **self.options)
            wall = time.perf_counter() - start
        finally:
            handle.remove()
        new = int(seq.shape[1] - ids.shape[1])
        ttft = (streamer.first - start) if streamer.first is not None else wall
        return RunResult(seq.cpu(), new, passes[0], wall, ttft, streamer.first_tokens)


class PeakMemory:
    """Context manager: peak growth of resident (CPU) or allocated (CUDA) memory, in MiB."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.peak_mib = 0.0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def __enter__(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return self
        self.start, self.peak, self.stop = self._rss(), 0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self) -> None:
        while not self.stop.wait(0.02):  # rare wake-ups: the sampler must not slow the run it measures
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.peak_mib = (torch.cuda.max_memory_allocated() - self.start) / 2**20
            return
        self.stop.set()
        self.thread.join()
        self.peak_mib = max(0, max(self.peak, self._rss()) - self.start) / 2**20


Method = Callable[..., RunResult]


@dataclass(frozen=True)
class MethodSpec:
    """A benchmark method name, parsed once: ``DRAFTER[#fixed][#nogate][~cache][%DTYPE]``.

    Attributes:
        drafter: a selfspec drafter spec (:func:`selfspec.drafters.drafter_from_spec`; ``none`` =
            plain decoding) or a transformers peer (``hf-greedy``, ``hf-prompt-lookup[:N]``,
            ``hf-early-exit:E``).
        fixed: draft whole trees every step (no controller decisions).
        gate: the batch gate on (``#nogate`` turns it off; throughput mode).
        cache: keep a prefix KV cache per session (``~cache``).
        dtype: run on another copy of the target loaded in this dtype (``%bfloat16``), against
            plain decoding in the main dtype; ``None``: the main copy.
    """

    drafter: str
    fixed: bool = False
    gate: bool = True
    cache: bool = False
    dtype: str | None = None

    @classmethod
    def parse(cls, name: str) -> "MethodSpec":
        spec, _, dtype = name.partition("%")
        flags = {}
        for suffix, key, value in (("~cache", "cache", True), ("#nogate", "gate", False), ("#fixed", "fixed", True)):
            if spec.endswith(suffix):
                spec, flags[key] = spec.removesuffix(suffix), value
        if spec.startswith("hf-") and (flags.get("cache") or flags.get("fixed")):
            raise ValueError(f"~cache and #fixed are for selfspec methods, not {spec}")
        return cls(spec, dtype=dtype or None, **flags)

    @property
    def peer(self) -> bool:
        return self.drafter.startswith("hf-")


def method_from_spec(model, spec: "str | MethodSpec", target: str | None = None, tokenizer=None) -> Method:
    """The method a :class:`MethodSpec` (or its name) names, on ``model`` (its ``dtype`` part is
    the caller's: :class:`OnModel`)."""
    from ..drafters import drafter_from_spec

    m = MethodSpec.parse(spec) if isinstance(spec, str) else spec
    name, _, arg = m.drafter.partition(":")
    if name == "hf-greedy":
        return HFMethod({})
    if name == "hf-prompt-lookup":
        return HFMethod({"prompt_lookup_num_tokens": int(arg or 10)})
    if name == "hf-early-exit":
        if not arg:
            raise ValueError("hf-early-exit needs an exit layer: hf-early-exit:8")
        return HFMethod({"assistant_early_exit": int(arg)})
    return SelfspecMethod(drafter_from_spec(model, m.drafter, target, tokenizer), m.fixed, prefix_cache=m.cache)


def run(
    model,
    tokenizer,
    questions: Iterable[Question],
    methods: dict[str, Method | Drafter | None],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    done: list[Record] | None = None,
    on_turn: Callable[[list[Record]], None] | None = None,
    constrain: Callable[[Question], object] | None = None,
    repeats: int = 1,
) -> list[Record]:
    """Run ``baseline`` and each method ({name: method, drafter or ``None``}) on every turn, in an
    order rotated by one from turn to turn (so position effects cancel in the paired ratios).

    ``repeats``: every turn runs all methods this many times, the order rotated by one between
    rounds; each method's record is its run with the median seconds per token after the first
    (``repeat_s_per_token`` keeps every run's), so a burst of load on this shared machine during
    one run moves no result. Every repeat starts from the controller's state before the turn
    (:meth:`~selfspec.control.Controller.state`), so no repeat learns from another. Refused for
    methods whose second run of a prompt is not the same work (a drafter that keeps earlier
    outputs, a prefix cache per session). A greedy run counts as identical to the baseline only if
    every repeat was.

    ``done``: records of an interrupted run; turns whose every method is recorded there are not
    run again (their stored baseline reply continues the conversation). ``on_turn`` receives each
    newly finished turn's records (to persist them). ``constrain(question)``: a fresh
    :class:`~selfspec.decoding.constraint.Constraint` for every run (baseline included: constrained plain
    decoding is then the reference). Returns all records, ``done`` ones included.
    """
    runners = {name: m if callable(m) and not isinstance(m, Drafter) else SelfspecMethod(m)
               for name, m in methods.items()}
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if repeats > 1:
        for name, runner in runners.items():
            inner = getattr(runner, "method", runner)
            if getattr(inner, "prefix_cache", False) or getattr(inner, "learns_text", False):
                raise ValueError(f"--repeats {repeats}: method {name!r} remembers earlier runs (a prefix cache or "
                                 "a drafter that learns from outputs), so a repeat of a prompt is not the same work")
    baseline = SelfspecMethod(None)
    questions = list(questions)
    finished = _finished_turns(done or [], ["baseline", *runners])
    # keep only the finished turns' rows of the methods run now (no double counting on resume)
    records: list[Record] = [r for r in done or [] if (r.question_id, r.turn) in finished
                             and r.method in {"baseline", *runners}]
    bar = tqdm(total=sum(len(q.turns) for q in questions), desc="benchmark", disable=not progress, unit="turn")
    gen = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    device = next(model.parameters()).device
    for runner in [baseline, *runners.values()]:  # warm-up: first-call costs hit no measured run
        warm_up_runner(model, runner, temperature=temperature, seed=seed)
    rotation = 0
    for q in questions:
        for runner in runners.values():
            if hasattr(runner, "new_session"):
                runner.new_session()
        history: list[dict] = []
        for turn, user in enumerate(q.turns):
            history.append({"role": "user", "content": user})
            key = (q.question_id, turn)
            if key in finished:
                reply = finished[key]
            else:
                ids = encode_chat(tokenizer, history, system=q.system)
                limit = (lambda: dict(constraint=constrain(q))) if constrain is not None else dict
                # the methods run in an order rotated from turn to turn (baseline included), so no
                # method always runs right after another one (allocator and cache state, a
                # drafter's one-off costs) or first: such order effects cancel over the turns
                names = ["baseline", *runners]
                runs: dict[str, list[RunResult]] = {name: [] for name in names}
                peaks = dict.fromkeys(names, 0.0)
                before = {name: _controller(r).state() for name, r in runners.items() if _controller(r) is not None}
                for _ in range(repeats):
                    for name, state in before.items():  # every repeat starts where the turn started
                        _controller(runners[name]).load_state(state)
                    shift = rotation % len(names)
                    rotation += 1
                    for name in names[shift:] + names[:shift]:
                        runner = baseline if name == "baseline" else runners[name]
                        extra = {} if name == "baseline" else dict(tools=q.meta.get("tools"))
                        with PeakMemory(device) as mem:
                            runs[name].append(runner(model, ids, **gen, **extra, **limit()))
                        peaks[name] = max(peaks[name], mem.peak_mib)
                outs = {name: _median_run(r) for name, r in runs.items()}
                base = outs["baseline"]
                reply = tokenizer.decode(base.sequences[0, ids.shape[1]:], skip_special_tokens=True)
                turn_records = [_record(q, turn, "baseline", ids, base, True, peaks["baseline"], reply)]
                for name, runner in runners.items():
                    out = outs[name]
                    # greedy: identical only if every repeat was (the first one that was not is diagnosed)
                    differ = [r for r in runs[name] if not torch.equal(r.sequences.cpu(), base.sequences.cpu())]
                    same = not differ if temperature == 0 else torch.equal(out.sequences.cpu(), base.sequences.cpu())
                    rec = _record(q, turn, name, ids, out, same, peaks[name])
                    if not same and temperature == 0 and not isinstance(runner, OnModel):
                        why = divergence(model, base.sequences, differ[0].sequences, ids.shape[1])
                        rec.divergence = None if why is None else asdict(why) | {"explained": why.explained}
                    turn_records.append(rec)
                if repeats > 1:
                    for rec in turn_records:
                        rec.repeat_s_per_token = [_s_per_token(r) for r in runs[rec.method]]
                records += turn_records
                if on_turn is not None:
                    on_turn(turn_records)
            history.append({"role": "assistant", "content": reply})
            bar.update(1)
    bar.close()
    return records


def _controller(runner) -> Controller | None:
    return getattr(getattr(runner, "method", runner), "controller", None)


def warm_up_runner(model, runner, *, temperature: float, seed: int) -> None:
    """Untimed, before a benchmark's first measured run: the runner's drafting warm-up where it has
    one, then a 2-token run on the prompt ``[0, 1]``, so first-call costs hit no measured run."""
    warm = torch.tensor([[0, 1]])
    if hasattr(runner, "warm_up"):
        runner.warm_up(model, warm, temperature=temperature, seed=seed)
    runner(model, warm, max_new_tokens=2, temperature=temperature, seed=seed)


def _s_per_token(out: RunResult) -> float:
    """Seconds per output token after the first step (what :func:`_rate` pools)."""
    return (out.wall_time_s - out.ttft_s) / max(1, out.new_tokens - out.first_tokens)


def _median_run(runs: list[RunResult]) -> RunResult:
    """The run with the median seconds per token (the lower middle one of an even count)."""
    return sorted(runs, key=_s_per_token)[(len(runs) - 1) // 2]


def _finished_turns(done: list[Record], methods: list[str]) -> dict[tuple[str, int], str]:
    """``{(question_id, turn): baseline reply}`` of turns recorded for every method."""
    seen: dict[tuple[str, int], set[str]] = {}
    replies = {}
    for r in done:
        seen.setdefault((r.question_id, r.turn), set()).add(r.method)
        if r.method == "baseline" and r.reply is not None:
            replies[(r.question_id, r.turn)] = r.reply
    return {k: replies[k] for k, ms in seen.items() if set(methods) <= ms and k in replies}


def _record(q: Question, turn: int, method: str, ids, out: RunResult, identical: bool, peak_mib: float,
            reply: str | None = None) -> Record:
    return Record(q.question_id, q.category, turn, method, int(ids.shape[1]), out.new_tokens, out.steps,
                  out.wall_time_s - out.prefill_time_s, out.prefill_time_s, identical, out.tested_per_depth,
                  out.accepted_per_depth, out.ttft_s, out.wall_time_s, out.first_tokens, peak_mib, reply,
                  output_sha=output_digest(out.sequences[0, ids.shape[1]:]))


def output_digest(new_tokens: torch.Tensor) -> str:
    """A short digest of generated token ids ``[n]`` (equal texts, equal digests; 64 bits)."""
    data = new_tokens.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def same_text(records: list[Record], a: str, b: str) -> list[int] | None:
    """``[k, n]``: of the ``n`` (question, turn) units where both ``a`` and ``b`` ran with a
    recorded digest, ``k`` where they wrote the same tokens (``None`` where no unit has digests:
    results stored before digests were kept)."""
    units = [u for u in _units(records).values() if a in u and b in u and u[a].output_sha and u[b].output_sha]
    if not units:
        return None
    return [sum(u[a].output_sha == u[b].output_sha for u in units), len(units)]


def summarise(records: list[Record], by_turn: bool = False) -> dict[str, dict[str, dict]]:
    """``{category or "overall": {method: metrics}}`` with speedup against the baseline; with
    ``by_turn`` also ``"turn N"`` groups (every conversation's N-th turn: cold vs warm caches)."""
    groups: dict[str, list[Record]] = {}
    for r in records:
        groups.setdefault(r.category, []).append(r)
    if by_turn:
        for r in sorted(records, key=lambda r: r.turn):
            groups.setdefault(f"turn {r.turn + 1}", []).append(r)
    groups["overall"] = list(records)
    out: dict[str, dict[str, dict]] = {}
    for cat, recs in groups.items():
        base_rate = _rate([r for r in recs if r.method == "baseline"])
        out[cat] = {}
        for method in dict.fromkeys(r.method for r in recs):
            mine = [r for r in recs if r.method == method]
            rate = _rate(mine)
            depth = max(len(r.tested_per_depth) for r in mine)
            tested = [sum(r.tested_per_depth[d] for r in mine if d < len(r.tested_per_depth)) for d in range(depth)]
            acc = [sum(r.accepted_per_depth[d] for r in mine if d < len(r.accepted_per_depth)) for d in range(depth)]
            out[cat][method] = dict(
                prompts=len(mine),
                new_tokens=sum(r.new_tokens for r in mine),
                tokens_per_s=rate,
                speedup=rate / base_rate if rate and base_rate else 0.0,
                mean_accepted_length=sum(r.new_tokens for r in mine) / max(1, sum(r.steps for r in mine)),
                acceptance_per_depth=[a / t if t else 0.0 for a, t in zip(acc, tested)],
                ttft_s=sum(r.ttft_s for r in mine) / len(mine),
                tpot_s=1.0 / rate if rate else 0.0,
                peak_mem_mib=max(r.peak_mem_mib for r in mine),
                identical_share=sum(r.identical_to_baseline for r in mine) / len(mine),
                divergences=[dict(question=r.question_id, turn=r.turn) | r.divergence for r in mine if r.divergence],
                speedup_ci=ratio_ci(recs, method, "baseline"),
            )
    if "baseline" in out["overall"]:
        out["overall"]["baseline"]["unions"] = union_vs_members(records)
        out["overall"]["baseline"]["same_dtype"] = against_plain_in_dtype(records)
    return out


def _conversations(records: list[Record]) -> dict[str, list[dict[str, Record]]]:
    """``{question: [{method: record} per turn]}``: the bootstrap's units."""
    out: dict[str, list[dict[str, Record]]] = {}
    for (question, _), unit in _units(records).items():
        out.setdefault(question, []).append(unit)
    return out


def _units(records: list[Record]) -> dict[tuple, dict[str, Record]]:
    """``{(question, turn): {method: record}}``."""
    units: dict[tuple, dict[str, Record]] = {}
    for r in records:
        units.setdefault((r.question_id, r.turn), {})[r.method] = r
    return units


def bootstrap_ci(count: int, statistic, resamples: int = 1000, seed: int = 0) -> list[float] | None:
    """95% percentile-bootstrap interval of ``statistic(picked)`` over ``count`` units, each
    resample ``count`` unit indices drawn with replacement (``statistic`` returns ``None`` for a
    resample it cannot score, which is skipped). ``None`` with fewer than 3 units or no scored
    resample. Deterministic (seeded)."""
    if count < 3:
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        value = statistic([rng.randrange(count) for _ in range(count)])
        if value is not None:
            values.append(value)
    if not values:
        return None
    values.sort()
    return [values[int(0.025 * (len(values) - 1))], values[int(0.975 * (len(values) - 1))]]


def ratio_ci(records: list[Record], a: str, b: str, resamples: int = 1000, seed: int = 0) -> list[float] | None:
    """95% paired-bootstrap interval of ``rate(a) / rate(b)`` over whole conversations (every turn
    of a question where both ran resampled together; ``None`` with fewer than 3 conversations).
    Deterministic (seeded)."""
    convs = [turns for turns in ([u for u in c if a in u and b in u] for c in _conversations(records).values()) if turns]

    def ratio(picked: list[int]) -> float | None:
        units = [u for i in picked for u in convs[i]]
        ra, rb = _rate([u[a] for u in units]), _rate([u[b] for u in units])
        return ra / rb if ra > 0 and rb > 0 else None

    return bootstrap_ci(len(convs), ratio, resamples, seed)


def union_vs_members(records: list[Record]) -> list[dict]:
    """Each measured union ``a+b[%dtype]`` against each member ``a[%dtype]`` measured in the same
    records: ``{union, member, ratio, ci, same_text}`` (ratio = the union's rate / the member's on
    the runs both made; ``ci`` see :func:`ratio_ci`; ``same_text`` see :func:`same_text`)."""
    methods = list(dict.fromkeys(r.method for r in records))
    out = []
    for m in methods:
        parsed = MethodSpec.parse(m)
        if "+" not in parsed.drafter or parsed.peer:
            continue
        for member in parsed.drafter.split("+"):
            name = member + ("" if parsed.dtype is None else f"%{parsed.dtype}")
            if name not in methods:
                continue
            units = [u for u in _units(records).values() if m in u and name in u]
            ra, rb = _rate([u[m] for u in units]), _rate([u[name] for u in units])
            out.append(dict(union=m, member=name, ratio=ra / rb if ra and rb else 0.0,
                            ci=ratio_ci(records, m, name), same_text=same_text(records, m, name)))
    return out


def against_plain_in_dtype(records: list[Record]) -> list[dict]:
    """Each method run on another dtype's copy (``spec%dtype``) against plain decoding on that copy
    (``none%dtype``) in the same records: ``{method, plain, ratio, ci}``. The table's speedup column
    is against the main baseline, so it credits the dtype's own speed to the method; this says what
    speculation adds on top of it."""
    methods = list(dict.fromkeys(r.method for r in records))
    out = []
    for m in methods:
        dtype = MethodSpec.parse(m).dtype
        plain = f"none%{dtype}"
        if dtype is None or m == plain or plain not in methods:
            continue
        units = [u for u in _units(records).values() if m in u and plain in u]
        ra, rb = _rate([u[m] for u in units]), _rate([u[plain] for u in units])
        out.append(dict(method=m, plain=plain, ratio=ra / rb if ra and rb else 0.0, ci=ratio_ci(records, m, plain)))
    return out


def _rate(records: list[Record]) -> float:
    """Output tokens per second after the first step (records without a TTFT: after prefill)."""
    tokens = sum(r.new_tokens - (r.first_tokens if r.wall_time_s else 0) for r in records)
    seconds = sum(r.after_first_s for r in records)
    return tokens / seconds if seconds > 0 else 0.0


def _identical(v: dict) -> str:
    """``100%``, or the share with how many divergences were near-ties the dtype's rounding flips
    and the largest top-2 margin of the plain pass among them (where each one happened:
    :func:`divergence_table`)."""
    divs = v.get("divergences") or []
    if not divs:
        return f"{v['identical_share']:.0%}"
    explained = sum(bool(d.get("explained")) for d in divs)
    widest = max(d.get("margin", 0.0) for d in divs)
    return f"{v['identical_share']:.0%} ({explained}/{len(divs)} near-ties, margin <= {widest:.2g})"


def divergence_table(summary: dict[str, dict[str, dict]]) -> str:
    """Where and why each greedy output left the baseline's (``""`` when none did): per method and
    turn, the first divergent new token, the plain pass's top-1 minus top-2 logit there, how far
    this dtype's rounding moves those logits across the schedules a run computes them by, and
    whether that explains it (:class:`~selfspec.measurement.measure.Divergence`)."""
    rows = [(m, d) for m, v in summary.get("overall", {}).items() for d in v.get("divergences") or []]
    if not rows:
        return ""
    lines = ["Where greedy outputs left plain greedy (first divergent new token; the plain pass's top-2 logit "
             "margin there against the rounding gap between the sequential, batched and tree-pass schedules; "
             "near-tie: margin <= 2 x max(gap, ulp)):", "",
             "| method | question | turn | first divergent token | top-2 margin | rounding gap | near-tie |",
             "|---|---|---|---|---|---|---|"]
    for m, d in rows:
        lines.append(f"| {m} | {d['question']} | {d['turn'] + 1} | {d['position']} | {d['margin']:.3g} | "
                     f"{d['rounding_gap']:.3g} | {'yes' if d.get('explained') else 'NO'} |")
    return "\n".join(lines)


def _fraction(counts: list[int] | None) -> str:
    return "-" if not counts else f"{counts[0]}/{counts[1]}"


def as_rows(records: list[Record]) -> list[dict]:
    return [asdict(r) for r in records]


def from_rows(rows: list[dict]) -> list[Record]:
    names = {f.name for f in fields(Record)}
    return [Record(**{k: v for k, v in r.items() if k in names}) for r in rows]


def markdown_table(summary: dict[str, dict[str, dict]]) -> str:
    """The per-category table (a 95% CI column when the summary has intervals), followed by the
    unions-against-members table when the summary has unions with measured members."""
    with_ci = any("speedup_ci" in v for methods in summary.values() for v in methods.values())
    ci_head, ci_rule = (" 95% CI |", "---|") if with_ci else ("", "")
    lines = [f"| category | method | prompts | tokens/s | speedup |{ci_head} MAT | accept d1/d2/d3 | TTFT ms | "
             "TPOT ms | peak MiB | identical |", f"|---|---|---|---|---|{ci_rule}---|---|---|---|---|---|"]
    for cat, methods in summary.items():
        for m, v in methods.items():
            acc = "/".join(f"{a:.2f}" for a in v["acceptance_per_depth"][:3]) or "-"
            ci = ""
            if with_ci:
                ci = " - |" if m == "baseline" or not v.get("speedup_ci") else \
                    " {:.2f}-{:.2f} |".format(*v["speedup_ci"])
            lines.append(
                f"| {cat} | {m} | {v['prompts']} | {v['tokens_per_s']:.1f} | {v['speedup']:.2f}x |{ci} "
                f"{v['mean_accepted_length']:.2f} | {acc} | {v.get('ttft_s', 0) * 1e3:.0f} | "
                f"{v.get('tpot_s', 0) * 1e3:.1f} | {v.get('peak_mem_mib', 0):.0f} | {_identical(v)} |"
            )
    unions = (summary.get("overall", {}).get("baseline") or {}).get("unions")
    if unions:
        lines += ["", "Unions against their members (same runs, paired; a union must not lose to its best member; "
                  "same text: turns where both wrote the same tokens):",
                  "", "| union | member | union / member | 95% CI | same text |", "|---|---|---|---|---|"]
        for u in unions:
            ci = "-" if not u["ci"] else "{:.2f}-{:.2f}".format(*u["ci"])
            lines.append(f"| {u['union']} | {u['member']} | {u['ratio']:.2f}x | {ci} | {_fraction(u.get('same_text'))} |")
    same = (summary.get("overall", {}).get("baseline") or {}).get("same_dtype")
    if same:
        lines += ["", "Against plain decoding in the same dtype (same runs, paired; the speedup column above "
                  "is against the main baseline and so includes the dtype's own speed):",
                  "", "| method | plain | method / plain | 95% CI |", "|---|---|---|---|"]
        for u in same:
            ci = "-" if not u["ci"] else "{:.2f}-{:.2f}".format(*u["ci"])
            lines.append(f"| {u['method']} | {u['plain']} | {u['ratio']:.2f}x | {ci} |")
    return "\n".join(lines)


def plot(summary: dict[str, dict[str, dict]], prefix: str, title: str = "") -> list[str]:
    """``<prefix>_speedup.png`` (per category and method) and ``<prefix>_acceptance.png``
    (overall acceptance per depth per method); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(summary)
    methods = [m for m in summary["overall"] if m != "baseline"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) * max(1, len(methods)) / 2), 4))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(cats))]
        ax.bar(xs, [summary[c].get(m, {}).get("speedup", 0) for c in cats], width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set(ylabel="speedup vs plain decoding", title=title or "speedup per category")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [f"{prefix}_speedup.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        acc = summary["overall"][m]["acceptance_per_depth"]
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=m)
    ax.set(xlabel="draft depth", ylabel="acceptance (given the walk got there)", ylim=(0, 1),
           title=(title + ": " if title else "") + "acceptance per depth")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(f"{prefix}_acceptance.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def provenance() -> dict:
    """Commit, package versions and machine of this run (so a number can be traced)."""
    import os
    import platform
    import subprocess

    import torch
    import transformers

    from ..model.machine import cpu_label

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    return {"commit": commit, "dirty": dirty, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "machine": f"{platform.machine()} {os.cpu_count()} cpus",
            "torch_threads": torch.get_num_threads(), "cpu": cpu_label()}


def write_report(out: str, args: dict, records, command: str, title: str = "", prov: dict | None = None) -> dict:
    """Write <out>.json (args, command, provenance, summary, records), <out>.md (command + table),
    <out>_overall.md (command + the overall rows only) and plots. ``prov``: the run's stored
    provenance when re-summarising (default: this process's). Returns the summary."""
    summary = summarise(records, by_turn=bool(args.get("by_turn")))
    table = markdown_table(summary)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tmp = out + ".json.tmp"
    with open(tmp, "w") as f:
        json.dump({"args": args, "command": command, "provenance": prov or provenance(), "summary": summary,
                   "records": as_rows(records)}, f, indent=1)
    os.replace(tmp, out + ".json")
    where = divergence_table(summary)  # (the full report only: where each greedy output left plain's)
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(f"`{command}`\n\n{table}\n" + (f"\n{where}\n" if where else ""))
    overall = markdown_table({"overall": summary["overall"]})
    with open(out + "_overall.md", "w", encoding="utf-8") as f:
        f.write(f"`{command}`\n\n{overall}\n")
    plot(summary, out, title)
    return summary
