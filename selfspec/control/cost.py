"""Cost model: seconds of a verify pass by tree size, and of each member's drafting.

The verify curve ``c(n)`` (seconds of one tree pass over ``n`` nodes, root included, plus
verification and commit) is measured on this machine, for this model shape and dtype, the first
time it is needed (:func:`verify_curve`: a few seconds) and cached in the user's cache folder
(``$SELFSPEC_CACHE`` or ``~/.cache/selfspec``) under a key naming the model shape, dtype, device,
CPU model, thread count and torch version: a curve is never borrowed from another machine. The
engine's own clock then corrects it online: every step's verify seconds over ``c(n)`` feed a
moving scale (the context grows, other load comes and goes).

In a batch (:mod:`selfspec.batch`) one pass scores every row's tree, so a row's share of a pass
over ``n`` nodes per row is ``c(rows * n) / rows`` (``rows`` is an argument of every read): a
row's controller weighs its tree against that share, and speculation turns itself down where the
pass stops being memory bound.

Members' drafting seconds are moving averages of the engine-timed ``propose`` calls; a call that
first had to catch up on many skipped positions is charged apart, per position (*catch-up*), so
both costs stay what a step of that member costs now.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

#: Tree sizes (nodes, root included) the curve is measured at; others are interpolated.
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: Weight of the newest timing in the verify scale and the drafting seconds (moving averages).
COST_EMA = 0.1
#: A timing counts at most this many times the current estimate (one preempted step must not
#: make a member or the pass look several times dearer for many steps).
OUTLIER = 4.0
#: A drafting call more than ``CATCH_UP_SLACK[0] * usual + CATCH_UP_SLACK[1]`` positions behind
#: (``usual``: tokens a step commits) is a catch-up, timed apart from drafting.
CATCH_UP_SLACK = (2, 2)


class CostModel:
    """Verify seconds by tree size and drafting / catch-up seconds per member."""

    def __init__(self, curve: dict[int, float], *, source: str = "given", ema: float = COST_EMA):
        if not curve or any(n < 1 or s <= 0 for n, s in curve.items()):
            raise ValueError(f"a verify cost curve needs positive seconds for sizes >= 1, got {curve}")
        self.sizes = sorted(curve)
        self.curve = {n: float(curve[n]) for n in self.sizes}
        self.source, self.ema = source, ema
        self.scale = 1.0
        self.draft_s: dict[int, float] = {}  # member -> seconds of a call per level drafted
        self.catch_up_s: dict[int, float] = {}  # member -> seconds per position caught up
        self.draft_calls: dict[int, int] = {}
        self.catch_up_calls: dict[int, int] = {}
        self.verify_calls = 0

    def verify(self, n: int, rows: int = 1) -> float:
        """Predicted seconds of a step verifying ``n`` nodes (linear between measured sizes); with
        ``rows`` sequences per pass, one row's share of a pass over ``n`` nodes per row."""
        if rows > 1:
            return self._verify(n * rows) / rows
        return self._verify(n)

    def _verify(self, n: int) -> float:
        s = self.sizes
        if n <= s[0]:
            base = self.curve[s[0]]
        elif n >= s[-1]:
            base = self.curve[s[-1]] * n / s[-1]
        else:
            hi = next(i for i in range(len(s)) if s[i] >= n)
            a, b = s[hi - 1], s[hi]
            base = self.curve[a] + (self.curve[b] - self.curve[a]) * (n - a) / (b - a)
        return base * self.scale

    def draft(self, member: int, behind: int = 0, levels: int = 1) -> float:
        """Predicted seconds of ``member``'s next call drafting ``levels`` levels, ``behind``
        positions to catch up first."""
        return self.draft_s.get(member, 0.0) * levels + self.catch_up_s.get(member, 0.0) * behind

    def record_verify(self, n: int, seconds: float, rows: int = 1) -> None:
        """One step's verify ``seconds`` for ``n`` nodes (with ``rows`` sequences in the pass: a
        row's share of it, ``n`` nodes per row): moves the curve's scale."""
        self.verify_calls += 1
        ratio = seconds / max(self.verify(n, rows) / self.scale, 1e-9)
        self.scale += max(self.ema, 1 / self.verify_calls) * (min(ratio, OUTLIER * self.scale) - self.scale)

    def record_draft(self, member: int, seconds: float, behind: int, usual: int, levels: int = 1) -> None:
        """One timed call that drafted ``levels`` levels (a model drafter runs about one call per
        level; its cost is kept per level); ``behind``: positions it caught up on, ``usual``: what
        a step commits. A running mean over the first calls, then a moving average; a call far
        behind (a generation's first, or after steps the member did not draft) counts as catch-up."""
        levels = max(1, levels)
        if behind > CATCH_UP_SLACK[0] * usual + CATCH_UP_SLACK[1]:
            extra = max(0.0, seconds - self.draft_s.get(member, 0.0) * levels) / behind
            n = self.catch_up_calls[member] = self.catch_up_calls.get(member, 0) + 1
            old = self.catch_up_s.get(member, extra)
            self.catch_up_s[member] = old + max(self.ema, 1 / n) * (extra - old)
            return
        n = self.draft_calls[member] = self.draft_calls.get(member, 0) + 1
        per_level = seconds / levels
        old = self.draft_s.get(member, per_level)
        self.draft_s[member] = old + max(self.ema, 1 / n) * (min(per_level, OUTLIER * old + 1e-3) - old)

    @classmethod
    def flat(cls, seconds: float = 1.0) -> "CostModel":
        """Every tree costs ``seconds`` (tests, and targets that are not transformers models)."""
        return cls({1: seconds, 64: seconds}, source="flat")


def cache_folder() -> Path:
    return Path(os.environ.get("SELFSPEC_CACHE") or Path.home() / ".cache" / "selfspec")


def machine_key(model) -> str:
    """What a verify curve depends on: model shape, dtype, device, CPU, threads, torch."""
    cfg = model.config.get_text_config(decoder=True)
    param = next(model.parameters())
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    device = param.device.type if param.device.type == "cpu" else torch.cuda.get_device_name(param.device)
    shape = f"{cfg.model_type}-{cfg.num_hidden_layers}x{cfg.hidden_size}-v{cfg.vocab_size}"
    return f"{shape}|{str(param.dtype).removeprefix('torch.')}|{device}|{cpu}|t{torch.get_num_threads()}|torch{torch.__version__}"


_CURVES: dict[str, dict[int, float]] = {}


def verify_curve(model, *, context: int = 256, repeats: int = 3) -> tuple[dict[int, float], str]:
    """``(curve, source)``: this machine's verify seconds per tree size for ``model``, from the cache
    folder or measured now (and stored there atomically). ``source`` says which."""
    key = machine_key(model)
    if key in _CURVES:
        return _CURVES[key], "measured this process"
    path = cache_folder() / "verify_cost.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stored = {}
    if isinstance(stored.get(key), dict):
        curve = {int(n): float(s) for n, s in stored[key].items()}
        _CURVES[key] = curve
        return curve, f"cached in {path}"
    curve = measure_verify_curve(model, context=context, repeats=repeats)
    _CURVES[key] = curve
    stored[key] = {str(n): s for n, s in curve.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(stored, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the curve is still used for this process
    return curve, "measured now"


@torch.no_grad()
def measure_verify_curve(model, *, context: int = 256, repeats: int = 3) -> dict[int, float]:
    """Median seconds of a tree pass (a chain of n nodes) plus commit over a ``context``-token
    prefix, for each size of :data:`SIZES` the model's context allows."""
    from ..model.target import TreeTarget, context_length
    from ..decoding.tree import TreeBuilder

    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    limit = context_length(model) or context + SIZES[-1] + 1
    context = max(1, min(context, limit - SIZES[-1] - 1))
    target = TreeTarget(model)
    target.prefill(torch.arange(context + 1) % vocab)
    prefix = target.prefix_len
    curve = {}
    for n in SIZES:
        if prefix + n >= limit:
            break
        b = TreeBuilder(1)
        for i in range(1, n):
            b.add(i - 1, (7 * i) % vocab)
        tree, times = b.build(), []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            target.forward_tree(tree)
            target.rollback()  # (the commit of a chain: a crop)
            times.append(time.perf_counter() - t)
        curve[n] = sorted(times[1:])[repeats // 2]
    return curve
