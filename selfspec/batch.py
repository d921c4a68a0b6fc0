"""Exact speculation for a batch: every row's tree in one target pass, requests joining and leaving.

**Cache layout.** :class:`BatchTarget` keeps one ``transformers.DynamicCache`` of ``[B, kv_heads,
T, head_dim]`` per layer for B rows. Row b's committed tokens sit in slots ``0 .. len_b - 1``
(position = slot), so its key positions need no table; slots ``len_b .. T - 1`` are *holes*,
hidden from every query by the mask. ``T`` is always ``max_b len_b``.

**One pass.** Each row's tree (its own drafter, its own size) is padded to the batch's largest
``N`` nodes with masked *pad nodes* (they see their row's prefix and themselves; their logits are
never read) and all ``B * N`` nodes go through the unmodified model in one forward: tokens ``[B,
N]``, ``position_ids[b, i] = len_b + depth_i``, a 4D mask ``[B, 1, N, T + N]`` per row (its
committed slots, then its own tree's ancestor matrix; sliding windows as in
:mod:`selfspec.model.attention_mask`). The pass appends the nodes at slots ``T .. T + N - 1`` of every
row.

**Commit, per row.** Row b's accepted path ``p_0 .. p_a`` moves from slots ``T + p_k`` to ``len_b +
k``: one indexed copy of only the accepted tokens' keys and values, for all rows at once (the
destination never lies after its source, so the copy reads before it writes), then the cache is
cut to the new ``max len_b``. No row's other slots move: there is no realignment pass over the
batch; what remains of one is this indexed copy and, when a row leaves, one gather of the
surviving rows (timed as ``commit_s`` / ``leave_s`` in :class:`PoolStats`). The cost is the holes:
every row attends over ``T`` slots; a row far shorter than the longest one pays for the gap.

**Requests.** Each row is a :class:`selfspec.decoding.request.Request` with its own controller (a fork of
the pool's: own drafters' state and arm draws, shared acceptance and cost models), sampling
settings, generator, stop conditions and budget; every step is the one decode step
(:func:`selfspec.decoding.step.step`): the same pure verifier as alone, each row weighing its tree against
its share of the pass (the cost model is read with the row count), one node budget for all rows
(:mod:`selfspec.control.budget`), and the controller's :class:`~selfspec.control.gate.BatchGate`
running plain steps while speculative steps measure slower per batch size.

**Continuous batching.** :class:`Pool` holds waiting requests; between steps, finished rows leave
and waiting ones join (each prefilled alone, then merged into the batch cache), up to
``max_batch`` rows.

Exactness: a row's output depends only on its own prompt, settings, generator and its nodes'
logits, which its mask makes functions of its own tokens only; so every row decodes as it would
alone (greedy: token-identical up to floating-point differences between kernels of other shapes;
tests in float64 / float32 with a negative control whose rows see a neighbour's slots).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .decoding.arguments import controller_for
from .decoding.request import Request, SpecOutput
from .decoding.step import step, sync
from .model.lm_head import head_matches_forward
from .model.attention_mask import MaskBuilder
from .model.kv_cache import new_cache
from .model.target import TreeOutput, TreeTarget, forward_model, model_lock
from .decoding.tree import DraftTree


class BatchTarget:
    """Runs a causal LM over the draft trees of many sequences at once (module docstring).

    Attributes:
        lengths: committed slots per row.
        cache: the batch's ``DynamicCache`` (``None`` with no rows).
    """

    def __init__(self, model, *, want_hidden: bool = False, taps: tuple[int, ...] = ()):
        self.model, self.want_hidden, self.taps = model, want_hidden, tuple(taps)
        self.masks = MaskBuilder(model)
        self.device, self.dtype = self.masks.device, self.masks.dtype
        self.decoder = model.get_decoder() if head_matches_forward(model) else None
        self.cache = None
        self.lengths: list[int] = []
        self.reused = 0
        self.supports_handoff = False

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Cache slots per row (``max_b len_b``)."""
        return max(self.lengths, default=0)

    # ------------------------------------------------------------------ rows joining and leaving
    @torch.no_grad()
    def add(self, prompts: list[torch.Tensor]) -> list[TreeOutput]:
        """Prefill new rows together and append them to the batch. ``prompts``: ``[L_b]`` each;
        row b caches ``prompts[b][:-1]`` (right-padded to the longest, pads masked) and its last
        token is its first root. Returns each row's prefill output (see
        :meth:`selfspec.model.target.TreeTarget.prefill`: ``hidden`` ``[1, H]`` at its last cached
        position, ``taps`` ``[L_b - 1, D]``; ``None`` for a one-token prompt)."""
        lengths = [int(p.shape[0]) - 1 for p in prompts]
        W, k = max(lengths), len(prompts)
        if W == 0:
            self._append(None, lengths)
            return [TreeOutput(None, None, None) for _ in prompts]
        tokens = torch.zeros(k, W, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens[b, : lengths[b]] = p[:-1]
        pos = torch.arange(W)
        own = pos[None, :] < torch.tensor(lengths)[:, None]  # [k, W] real slots
        visible = (pos[None, :, None] >= pos[None, None, :]) & own[:, None, :]  # causal over own tokens
        visible |= torch.eye(W, dtype=torch.bool)  # pads see themselves (never read)
        cache = new_cache()
        inputs = dict(input_ids=tokens.to(self.device), position_ids=pos.expand(k, W).to(self.device), cache=cache,
                      attention_mask=self.masks.build(visible, pos.expand(k, W), pos.expand(k, W)), use_cache=True)
        out = forward_model(self.model, self.decoder, inputs, want_hidden=self.want_hidden, taps=self.taps,
                            logits=False)
        self._append(cache, lengths)
        outs = []
        for b, n in enumerate(lengths):
            if n == 0:
                outs.append(TreeOutput(None, None, None))
                continue
            last = b * W + n - 1
            outs.append(TreeOutput(None, out.hidden[last: last + 1] if self.want_hidden else None,
                                   out.taps[b * W: b * W + n] if out.taps is not None else None))
        return outs

    def _append(self, cache, lengths: list[int]) -> None:
        """Append rows whose keys / values are ``cache`` (``[k, H, W, D]`` per layer, or nothing
        cached) with ``lengths`` committed slots each."""
        new = _layers(cache)
        old = _layers(self.cache)
        rows, width = self.rows, max([self.width] + lengths)
        if new is None and old is None:
            self.cache = self.cache if self.cache is not None else cache
        elif old is None:  # earlier rows (if any) cached nothing: they become holes
            for layer in new:
                layer.keys, layer.values = (_join(None, t, rows, width) for t in (layer.keys, layer.values))
            self.cache = cache
        else:
            for i, layer in enumerate(old):
                extra = new[i] if new is not None else None
                layer.keys = _join(layer.keys, None if extra is None else extra.keys, len(lengths), width)
                layer.values = _join(layer.values, None if extra is None else extra.values, len(lengths), width)
        self.lengths += lengths

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in this order): the others leave the batch."""
        self.lengths = [self.lengths[r] for r in rows]
        if not rows:
            self.cache = None
            return
        layers = _layers(self.cache)
        if layers is None:
            return
        index, width = torch.tensor(rows, dtype=torch.long), self.width
        for layer in layers:
            idx = index.to(layer.keys.device)
            layer.keys = layer.keys.index_select(0, idx)[:, :, :width]
            layer.values = layer.values.index_select(0, idx)[:, :, :width]

    # ------------------------------------------------------------------ one pass
    def pass_mask(self, trees: list[DraftTree]):
        """``(mask, tokens [B, N], positions [B, N])`` of one pass over ``trees`` (one per row)."""
        B, T, N = self.rows, self.width, max(t.num_nodes for t in trees)
        tokens = torch.empty(B, N, dtype=torch.long)
        depth = torch.zeros(B, N, dtype=torch.long)
        visible = torch.zeros(B, N, T + N, dtype=torch.bool)
        visible[:, :, T:] = torch.eye(N, dtype=torch.bool)  # pad nodes: themselves only
        for b, (tree, length) in enumerate(zip(trees, self.lengths)):
            n = tree.num_nodes
            tokens[b] = tree.tokens[0]
            tokens[b, :n] = tree.tokens
            depth[b, :n] = tree.depths
            visible[b, :, :length] = True
            visible[b, :n, T: T + n] = tree.ancestors()
        positions = torch.tensor(self.lengths, dtype=torch.long)[:, None] + depth
        k_pos = torch.cat([torch.arange(T).expand(B, T), positions], dim=1)
        return self.masks.build(visible, positions, k_pos), tokens, positions

    @torch.no_grad()
    def forward_trees(self, trees: list[DraftTree], handoffs: list | None = None) -> list[TreeOutput]:
        """One forward over every row's tree (``trees[b]`` rooted at row b's last token); the
        nodes' KV is appended to every row until :meth:`commit`. Returns each row's
        :class:`~selfspec.model.target.TreeOutput` (``logits`` ``[n_b, V]``). No layer handoffs."""
        if len(trees) != self.rows:
            raise ValueError(f"got {len(trees)} trees for {self.rows} rows")
        if handoffs and any(h is not None for h in handoffs):
            raise ValueError("a batch pass takes no layer handoff")
        mask, tokens, positions = self.pass_mask(trees)
        if self.cache is None:
            self.cache = new_cache()
        inputs = dict(input_ids=tokens.to(self.device), attention_mask=mask, position_ids=positions.to(self.device),
                      use_cache=True, cache=self.cache)
        sizes = [t.num_nodes for t in trees]
        real = torch.cat([b * tokens.shape[1] + torch.arange(n) for b, n in enumerate(sizes)]).to(self.device)
        out = forward_model(self.model, self.decoder, inputs, want_hidden=self.want_hidden, taps=self.taps, select=real)
        self._pending = (self.width, sizes)
        outs, start = [], 0
        for n in sizes:
            rows = slice(start, start + n)
            outs.append(TreeOutput(out.logits[rows], out.hidden[rows] if self.want_hidden else None,
                                   out.taps[rows] if out.taps is not None else None))
            start += n
        return outs

    def rollback(self) -> None:
        """Drop the slots a pass appended (every row back to its committed slots)."""
        width = self.width
        for layer in _layers(self.cache) or ():
            layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]

    def commit(self, paths: list[list[int]]) -> None:
        """Keep each row's accepted ``paths[b]`` (node indices, root first) after its committed
        slots (module docstring)."""
        width, sizes = self._pending
        rows, dst, src = [], [], []
        for b, path in enumerate(paths):
            for k, node in enumerate(path):
                if self.lengths[b] + k != width + node:
                    rows.append(b), dst.append(self.lengths[b] + k), src.append(width + node)
        lengths = [n + len(p) for n, p in zip(self.lengths, paths)]
        new_width = max(lengths, default=0)
        index = [torch.tensor(v, dtype=torch.long) for v in (rows, dst, src)] if rows else None
        for layer in _layers(self.cache) or ():
            for name in ("keys", "values"):
                t = getattr(layer, name)
                if index is not None:
                    r, d, s = (v.to(t.device) for v in index)
                    t[r, :, d] = t[r, :, s]
                setattr(layer, name, t[:, :, :new_width])
        self.lengths = lengths


def _layers(cache):
    """The cache's initialised layers, or ``None`` when nothing is cached yet."""
    if cache is None:
        return None
    layers = [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]
    return layers or None


def _join(old: torch.Tensor | None, new: torch.Tensor | None, count: int, width: int) -> torch.Tensor:
    """Rows ``old`` ``[B, H, T, D]`` then ``count`` new rows ``new`` ``[count, H, L, D]``, each with
    ``width`` slots (holes zero). ``old`` ``None`` with ``new``: ``count`` is the number of empty
    rows *before* ``new``; ``new`` ``None``: ``count`` empty rows after ``old``."""
    if old is None:
        out = new.new_zeros((count + new.shape[0], new.shape[1], width, new.shape[3]))
        out[count:, :, : new.shape[2]] = new
        return out
    out = old.new_zeros((old.shape[0] + count, old.shape[1], width, old.shape[3]))
    out[: old.shape[0], :, : old.shape[2]] = old
    if new is not None:
        out[old.shape[0]:, :, : new.shape[2]] = new
    return out


# ---------------------------------------------------------------------- requests
@dataclass
class PoolStats:
    """Where a pool's time went (seconds on the pool's clock) and how full its passes were.

    ``pass_tokens``: tree nodes scored, pads included; ``real_tokens``: nodes of real trees;
    ``slots``: key slots attended over (rows x width, summed over passes) and ``hole_slots`` the
    masked holes among them. ``commit_s`` / ``leave_s`` are the realignment the layout needs (the
    indexed copy of accepted tokens; rows leaving)."""

    steps: int = 0
    rows_per_step: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    pass_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    leave_s: float = 0.0
    pass_tokens: int = 0
    real_tokens: int = 0
    slots: int = 0
    hole_slots: int = 0

    @property
    def realign_share(self) -> float:
        """Share of step time spent moving cache slots (commit copies and rows leaving)."""
        total = self.draft_s + self.pass_s + self.verify_s + self.commit_s + self.leave_s
        return (self.commit_s + self.leave_s) / total if total > 0 else 0.0


@dataclass
class Handle:
    """A submitted request: ``output`` (a :class:`~selfspec.decoding.request.SpecOutput`) once done, or
    ``error`` when its own code raised (its drafter, constraint, processors, stopping criteria or
    streamer: nothing else in the pool was changed by it), and its times on the pool's clock
    (``submitted`` <= ``admitted`` <= ``finished``)."""

    index: int
    request: Request
    submitted: float
    admitted: float | None = None
    finished: float | None = None
    output: SpecOutput | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.finished is not None

    def result(self) -> SpecOutput:
        """The output, or the request's error raised."""
        if self.error is not None:
            raise self.error
        if self.output is None:
            raise RuntimeError(f"request {self.index} has not finished")
        return self.output


class Pool:
    """Continuous batching over one model: :meth:`submit` requests, then :meth:`step` (or
    :meth:`run`); each step retires finished rows, admits waiting requests up to ``max_batch``
    (the joiners prefilled together in one pass, between the others' steps) and runs the decode
    step (:func:`selfspec.decoding.step.step`) over every row. A pool of one row (``max_batch=1``) decodes
    its requests one after another with the pool's own controller (what ``selfspec.generate``
    runs for one prompt); wider pools give each request a fork of it.

    Args:
        model: the target (transformers causal LM, eval mode).
        drafter: a drafter, a list of them (their union) or a :class:`~selfspec.control.Controller`;
            ``None``: plain decoding.
        control: as in :func:`selfspec.generate`.
        max_batch: most rows decoding at once.
        clock: the pool's clock (seconds).
        prefix_cache: a :class:`~selfspec.decoding.prefix_cache.PrefixCache` (``max_batch=1`` only): each
            prompt's longest cached prefix is not prefilled again; each output is stored.
        target: the :class:`~selfspec.model.target.Target` to decode on (default: built for ``model``;
            tests plug in table-driven targets, with ``model=None`` and requests built by hand).
    """

    def __init__(self, model, drafter=None, *, control=None, max_batch: int = 8, clock=time.perf_counter,
                 prefix_cache=None, target=None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if prefix_cache is not None:
            from .decoding.prefix_cache import PrefixCache

            if not isinstance(prefix_cache, PrefixCache):
                raise ValueError(f"prefix_cache must be a selfspec PrefixCache, got {type(prefix_cache).__name__}")
            if max_batch != 1:
                raise ValueError("prefix_cache takes a pool of one row (max_batch=1)")
            prefix_cache.check_model(model)
        self.model, self.max_batch, self.clock, self.prefix_cache = model, max_batch, clock, prefix_cache
        self.lock = model_lock(model) if model is not None else contextlib.nullcontext()
        self.controller = controller_for(drafter, control)
        if self.controller is not None:
            if model is not None:
                self.controller.check_target(model)
            if self.controller.cost is None:
                with self.lock:  # (measuring the cost model runs the model)
                    self.controller.cost = self.controller.measured_cost(model)
        needs = self.controller.requires if self.controller is not None else None
        if target is None:
            kind = TreeTarget if max_batch == 1 else BatchTarget
            target = kind(model, want_hidden=needs is not None and needs.hidden, taps=needs.taps if needs else ())
        self.target = target
        self.waiting: deque[Handle] = deque()
        self.running: list[Handle] = []
        self.stats = PoolStats()
        self.gate = None
        if self.controller is not None and self.controller.config.batch_gate and max_batch > 1:
            self.gate = self.controller.gate
            self.gate.reset_warmth()
        self._count = itertools.count()

    def submit(self, input_ids, *, streamer=None, **options) -> Handle:
        """Queue one request: ``input_ids`` ``[L]`` / ``[1, L]`` and :func:`selfspec.generate`'s
        per-request options (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed`` /
        ``generator``, ``eos_token_id``, ``generation_config``, ``logits_processor``,
        ``stopping_criteria``, ``stop_strings`` + ``tokenizer``, ``constraint``, ``tools``), checked
        here. Returns its :class:`Handle`."""
        return self.add(Request.create(self.model, input_ids, None, streamer, **options))

    def add(self, request: Request) -> Handle:
        """Queue an already validated :class:`~selfspec.decoding.request.Request` (its controller is set
        here: the pool's own in a pool of one row, a fork of it otherwise)."""
        index = next(self._count)
        if self.controller is not None:
            request.controller = self.controller if self.max_batch == 1 else \
                self.controller.fork(seed=self.controller.config.seed + 1 + index)
        handle = Handle(index, request, self.clock())
        self.waiting.append(handle)
        return handle

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> list[Handle]:
        """Admit waiting requests, run one decode step, retire finished rows; returns the
        requests that finished in this step (with their output or their error)."""
        with self.lock:
            finished = self._admit()
            if self.running:
                try:
                    finished += self._step()
                except BaseException:
                    self._retire()  # (rows that finished or failed in the step leave; the rest are intact)
                    raise
            return finished

    def run(self) -> list[Handle]:
        """Step until no request waits or runs; returns every finished handle in finishing order."""
        done: list[Handle] = []
        with self.lock:
            while not self.idle:
                done += self.step()
        return done

    def abandon(self, error: BaseException) -> None:
        """End every waiting and running request with ``error`` (their controllers released, their
        rows dropped): what a caller does when it gives the pool up after ``error``."""
        with self.lock:
            for h in list(self.waiting) + self.running:
                h.request.fail(error)
                self._finish(h)
            self.waiting.clear()
            self.running = []
            self.target.keep([])

    def _admit(self) -> list[Handle]:
        """Admit waiting requests up to ``max_batch`` rows: one prefill pass over all of them."""
        joining, failed = [], []
        while self.waiting and len(self.running) + len(joining) < self.max_batch:
            h = self.waiting.popleft()
            try:
                h.admitted = self.clock()
                h.request.begin(self.model, self.clock)
                joining.append(h)
            except Exception as err:  # e.g. its controller is held by another generation
                h.request.fail(err)
                failed.append(h)
            except BaseException:
                h.request.release()
                self.waiting.appendleft(h)
                for j in reversed(joining):
                    j.request.release()
                    self.waiting.appendleft(j)
                raise
        done = [self._finish(h) for h in failed]
        if not joining:
            return done
        start = self.clock()
        prompts = [h.request.ids for h in joining]
        try:
            pres = self.target.add(prompts, self.prefix_cache) if self.prefix_cache is not None else \
                self.target.add(prompts)
        except BaseException:  # the prefill itself failed: they wait again, unchanged
            for h in reversed(joining):
                h.request.release()
                self.waiting.appendleft(h)
            raise
        sync(self.target.device)
        now = self.clock()
        self.stats.prefill_s += now - start
        for h, pre in zip(joining, pres):
            h.request.prefilled(pre, bool(self.target.taps), now, self.target.reused)
            h.request.check_budget()  # (a prompt that fills the context has nothing to generate)
        self.running += joining
        if self.gate is not None:  # the joiners' first drafts catch up on their prompts
            self.gate.reset_warmth()
        return done + self._retire()

    def _step(self) -> list[Handle]:
        stats, rows = self.stats, len(self.running)
        drafting = self.controller is not None and (self.gate is None or self.gate.draft(rows))
        t0 = self.clock()
        report = step(self.target, [h.request for h in self.running], self.clock,
                      cost=self.controller.cost if self.controller is not None else None, drafting=drafting,
                      budget=self.controller is not None)
        seconds = self.clock() - t0
        trees, width = report.trees, max(self.target.lengths, default=0)
        stats.steps += 1
        stats.rows_per_step.append(rows)
        stats.draft_s += sum(report.draft_s)
        stats.pass_s += report.pass_s
        stats.verify_s += report.verify_s
        stats.commit_s += report.commit_s
        stats.pass_tokens += rows * max(t.num_nodes for t in trees)
        stats.real_tokens += sum(t.num_nodes for t in trees)
        stats.slots += rows * width
        stats.hole_slots += rows * width - sum(self.target.lengths)
        if self.gate is not None:
            self.gate.record(rows, drafting, report.emitted, seconds)
        return self._retire()

    def _retire(self) -> list[Handle]:
        done = [i for i, h in enumerate(self.running) if h.request.done]
        if not done:
            return []
        if self.prefix_cache is not None:  # the committed state of prompt + output, for the next call
            for i in done:
                req = self.running[i].request
                if req.error is None:
                    keep = min(req.length - 1, self.target.lengths[i])
                    taps = req.taps
                    self.prefix_cache.store(req.tokens[:keep], self.target.cache,
                                            None if taps is None else taps.committed(keep), self.target.taps)
        t = self.clock()
        keep = [i for i in range(len(self.running)) if i not in done]
        self.target.keep(keep)
        self.stats.leave_s += self.clock() - t
        out = [self._finish(self.running[i]) for i in done]
        self.running = [self.running[i] for i in keep]
        return out

    def _finish(self, h: Handle) -> Handle:
        h.finished = self.clock()
        output = h.request.close(h.finished)
        h.output, h.error = (output, None) if h.request.error is None else (None, h.request.error)
        return h


@dataclass
class BatchOutput:
    """Result of :func:`selfspec.generate` on several prompts.

    Attributes:
        outputs: one :class:`~selfspec.decoding.request.SpecOutput` per prompt, in input order.
        stats: the pool's :class:`PoolStats`.
    """

    outputs: list[SpecOutput]
    stats: PoolStats

    @property
    def sequences(self) -> list[torch.Tensor]:
        """Each row's prompt and new tokens, ``[L_b + new_b]`` (rows differ in length)."""
        return [o.sequences[0] for o in self.outputs]

    def padded(self, pad_token_id: int) -> torch.Tensor:
        """``[B, max_len]`` right-padded sequences (as ``model.generate`` returns a batch, up to
        its padding side)."""
        seqs = self.sequences
        out = torch.full((len(seqs), max(s.shape[0] for s in seqs)), int(pad_token_id), dtype=torch.long)
        for b, s in enumerate(seqs):
            out[b, : s.shape[0]] = s
        return out


def split_prompts(input_ids, attention_mask=None) -> list[torch.Tensor]:
    """A batch of prompts as a list of ``[L_b]`` tensors: a list / tuple of id sequences, or
    ``[B, L]`` ids with an optional ``[B, L]`` attention mask (left or right padding, as
    transformers takes them; each row's unmasked tokens must be contiguous)."""
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a [B, L] tensor of ids, not a list of prompts")
        if not input_ids:
            raise ValueError("got an empty list of prompts")
        return [torch.as_tensor(p) for p in input_ids]
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 2:
        raise ValueError(f"a batch of prompts is [B, L] ids (or a list of prompts), got shape {tuple(ids.shape)}")
    if attention_mask is None:
        return list(ids)
    mask = torch.as_tensor(attention_mask)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}")
    if mask.dtype.is_floating_point or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token), as transformers takes it")
    out = []
    for b in range(ids.shape[0]):
        where = mask[b].nonzero().flatten()
        if where.numel() == 0:
            raise ValueError(f"row {b} of attention_mask masks every token: the prompt is empty")
        lo, hi = int(where[0]), int(where[-1]) + 1
        if int(mask[b, lo:hi].sum()) != hi - lo:
            raise ValueError(f"row {b} of attention_mask has holes inside the prompt; only left or right padding "
                             "is supported")
        out.append(ids[b, lo:hi])
    return out


def generate_batch(model, prompts: list[torch.Tensor], *, drafter=None, control=None, seed=None, generator=None,
                   streamers=None, **options) -> BatchOutput:
    """Decode several prompts together (all rows start at once; see :class:`Pool`). ``seed``:
    row b samples from ``seed + b``; ``generator``: every row draws from it (in row order), so
    rows' draws depend on each other's steps; neither: fresh random seeds. When a row's own code
    raised, the first such error is raised once every other row has finished."""
    pool, handles = batch_pool(model, prompts, drafter=drafter, control=control, seed=seed, generator=generator,
                               streamers=streamers, **options)
    run_to_end(pool)
    return BatchOutput([h.result() for h in handles], pool.stats)


def run_to_end(pool: Pool) -> None:
    """``pool.run()``; when it raises (a failed pass, an interrupt), every request left is ended
    with that error, so no controller stays held by a pool nobody will step again."""
    try:
        pool.run()
    except BaseException as err:
        pool.abandon(err)
        raise


def batch_pool(model, prompts: list[torch.Tensor], *, drafter=None, control=None, seed=None, generator=None,
               streamers=None, **options) -> tuple[Pool, list[Handle]]:
    """:func:`generate_batch`'s pool with every prompt submitted (arguments checked), not run."""
    if seed is not None and generator is not None:
        raise ValueError("give either seed or generator, not both")
    pool = Pool(model, drafter, control=control, max_batch=len(prompts))
    handles = []
    for b, ids in enumerate(prompts):
        row_seed = None if seed is None else int(seed) + b
        handles.append(pool.submit(ids, seed=row_seed, generator=generator,
                                   streamer=None if streamers is None else streamers[b], **options))
    return pool, handles
