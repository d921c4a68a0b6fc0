"""Recipe: train an EAGLE-3 draft head on a frozen target from self-distilled conversations.

On the shared loop (:mod:`selfspec.training.loop`): prepare (data split, draft vocabulary, head) -> train
(online target features, training-time test, seeded and resumable, logged, checkpointed, sharded
over processes) -> export (held-out acceptance per unrolled step, drafter checkpoint, curves plot).
Items are examples; the global batch of a step is one length bucket of at most
``tokens_per_batch`` padded tokens.

Online features: every batch runs the frozen target once under ``torch.no_grad`` (in
``target_dtype``), recording its taps (:mod:`selfspec.model.taps`) and its next-token law; nothing is
cached on disk, so the data may grow to millions of tokens.

Loss: at unrolled step j (0-based) and chain t the head predicts token t + j + 2; the loss is the
soft cross-entropy ``-sum_v p(v) log q_j(v)`` over the draft vocabulary, with p the target's law at
position t + j + 1 (restricted to the draft vocabulary, not renormalised: mass outside it is
unreachable), weighted ``step_decay ** j``. Only positions whose next token the target wrote
(the response) count. Held-out metrics per step: top-1 agreement with the target's argmax
(greedy acceptance of a chain, teacher-forced) and ``sum_v min(p, q)`` (acceptance at T = 1).

Draft vocabulary: the ``draft_vocab_size`` most frequent tokens of the target's own responses in
the training split (coverage of several sizes is recorded in the summary).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

import selfspec
from selfspec.drafters import save_drafter
from selfspec.drafters.eagle3 import Eagle3Config
from selfspec.model.lm_head import lm_logits
from selfspec.model.taps import capture_taps

from ..batching import batch_at, collate, held_out_dataset, length_buckets, load_distilled, split_examples
from ..loop import OptimConfig, RunConfig, TrainingRun, check_dtype, check_example_limits, positive

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class Eagle3TrainConfig:
    """``selfspec train`` config for ``kind: eagle3`` (YAML copies live in configs/).

    Attributes:
        recipe: always ``train_heads``.
        kind: always ``eagle3``.
        target: target alias or path.
        dataset: a distillation output folder (``shards/*.jsonl``, possibly partial), a shard
            range of one (``folder[6:]``, :func:`selfspec.training.batching.shard_selection`) or a
            ``datasets`` folder, as written by ``selfspec distill``; or a list of those,
            trained on together (e.g. an earlier window again with a new one).
        eagle3: head shape and tree policy of the exported drafter.
        ttt_steps: K >= 1 unrolled steps of the training-time test.
        step_decay: loss weight of step j is ``step_decay ** j``.
        hard_weight: share ``w`` of a hard-label term in each step's loss: ``(1 - w)`` times the
            soft cross-entropy plus ``w`` times ``-log q_j(argmax p)``, the target's greedy token
            (positions whose greedy token is outside the draft vocabulary get the soft term
            only). Greedy verification accepts a draft exactly when it is that token; 0 (the
            default, every head so far) is pure distillation.
        tv_weight: share ``a`` of an acceptance term in each step's loss: ``(1 - a)`` times the
            loss above plus ``a`` times ``1 - sum_v min(p(v), q_j(v))``, the total-variation
            distance over the draft vocabulary, which is one minus the probability that
            verification at T = 1 accepts a draft sampled from ``q_j`` (p restricted, not
            renormalised, as in the soft term). 0 (the default) leaves the loss unchanged.
        eval_fraction: share of examples held out for evaluation (when ``eval_dataset`` is unset).
        max_eval_examples: cap on held-out examples evaluated.
        eval_dataset: a distillation folder evaluated instead of a split of ``dataset``, which is
            then trained on whole. A split drawn from a dataset that grows between runs moves, so
            a run continued (``init_from``) on grown data would be evaluated on answers it was
            trained on; a separate window of prompts (``skip``) is held out for every head alike.
            Its answers whose prompt also occurs in ``dataset`` are dropped (and counted). A shard
            range (``folder[:6]``) holds out part of a window whose other shards train.
        max_len: longest example (tokens) used; longer ones are cut.
        tokens_per_batch: padded tokens per training batch (examples are bucketed by length).
        target_dtype: dtype of the frozen target's feature pass (``float32`` / ``bfloat16``).
        init: ``exit`` (the head starts as the target's early exit at its highest tap, see
            ``Eagle3Recipe._init_from_target``) or ``random`` (fc and mid layer randomly initialised).
        init_from: a trained ``eagle3`` drafter folder to continue from (warm start on new data):
            its weights, tap scale and draft vocabulary replace ``init``; ``load_drafter`` refuses
            one made for another target, and a head shape other than ``eagle3``'s is refused too.
            Unlike ``--resume`` (same run, exact), this starts a new run with a fresh optimizer.
        init_grow: let ``init_from`` be a *smaller* head than ``eagle3`` asks for (a larger
            ``draft_vocab_size`` and/or ``intermediate_size``) and grow it, its features and its
            old tokens' logits unchanged (:meth:`Eagle3Recipe._grow`); without it a shape mismatch
            is refused.
        export: where the final drafter checkpoint is written (``null`` to skip).
        overwrite_export: allow ``export`` to replace an existing folder (refused otherwise, at
            setup, before any training).
        export_dtype: dtype of the exported weights (``bfloat16`` halves a shipped file; loading
            casts to the target's dtype).
    """

    recipe: str = "train_heads"
    kind: str = "eagle3"
    target: str = selfspec.DEFAULT_TARGET
    dataset: str | list[str] = "runs/distill/smollm2-chat"
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    ttt_steps: int = 3
    step_decay: float = 0.8
    hard_weight: float = 0.0
    tv_weight: float = 0.0
    eval_fraction: float = 0.03
    max_eval_examples: int = 96
    eval_dataset: str | None = None
    max_len: int = 768
    tokens_per_batch: int = 4096
    target_dtype: str = "float32"
    init: str = "random"
    init_from: str | None = None
    init_grow: bool = False
    export: str | None = None
    overwrite_export: bool = False
    export_dtype: str = "float32"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=20, epochs=1.0, batch_size=0))
    run: RunConfig = field(default_factory=lambda: RunConfig(out_dir="runs/eagle3-smollm2"))

    def __post_init__(self) -> None:
        if self.recipe != "train_heads" or self.kind != "eagle3":
            raise ValueError("Eagle3TrainConfig is for recipe 'train_heads' with kind 'eagle3'")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        if not 0.0 <= self.hard_weight <= 1.0:
            raise ValueError(f"hard_weight must be in [0, 1], got {self.hard_weight}")
        if not 0.0 <= self.tv_weight <= 1.0:
            raise ValueError(f"tv_weight must be in [0, 1], got {self.tv_weight}")
        if self.init not in ("exit", "random"):
            raise ValueError(f"init must be 'exit' or 'random', got {self.init!r}")
        check_dtype("target_dtype", self.target_dtype)
        check_dtype("export_dtype", self.export_dtype)
        check_example_limits(self)
        positive("step_decay", self.step_decay)


def token_counts(examples: list[dict], vocab: int) -> torch.Tensor:
    """``[vocab]`` counts of the response tokens of ``examples``."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for ex in examples:
        counts += torch.bincount(torch.tensor(ex["response_ids"], dtype=torch.long), minlength=vocab)[:vocab]
    return counts


def draft_vocabulary(examples: list[dict], size: int, vocab: int, held_out: list[dict] | None = None
                     ) -> tuple[torch.Tensor, dict]:
    """The ``size`` most frequent response tokens of ``examples`` (increasing ids) and the share of
    ``held_out`` response tokens (default: ``examples``) that the top-n tokens cover, for several n."""
    order = token_counts(examples, vocab).argsort(descending=True, stable=True)
    test = token_counts(held_out if held_out else examples, vocab)
    total = max(1, int(test.sum()))
    coverage = {n: round(float(test[order[:n]].sum()) / total, 5) for n in sorted(set(COVERAGE_SIZES + (size,))) if n <= vocab}
    return order[:size].sort().values, coverage


def _coverage_of(draft_ids: torch.Tensor, examples: list[dict], vocab: int) -> float:
    """Share of the response tokens of ``examples`` that lie in ``draft_ids``."""
    counts = token_counts(examples, vocab)
    return float(counts[draft_ids].sum()) / max(1, int(counts.sum()))


class Eagle3Recipe(TrainingRun):
    """One training run of an EAGLE-3 head (see the module docstring)."""

    name = "eagle3"

    def __init__(self, cfg: Eagle3TrainConfig, *, model=None, tokenizer=None, examples=None):
        super().__init__(cfg, model=model, tokenizer=tokenizer)
        self.examples = examples

    # ---------------------------------------------------------------- data and head
    def prepare(self) -> None:
        cfg = self.cfg
        if self.examples is None:
            self.examples = load_distilled(cfg.dataset)
        if cfg.eval_dataset:
            self.train_set, self.eval_set, self.eval_dropped = held_out_dataset(
                self.examples, load_distilled(cfg.eval_dataset), cfg.run.seed, cfg.max_eval_examples)
        else:
            self.train_set, self.eval_set = split_examples(self.examples, cfg.eval_fraction, cfg.run.seed,
                                                           cfg.max_eval_examples)
            self.eval_dropped = 0
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        draft_ids, self.coverage = draft_vocabulary(self.train_set, cfg.eagle3.draft_vocab_size, vocab, self.eval_set)
        self.vocab_coverage = self.coverage.get(cfg.eagle3.draft_vocab_size)  # of the vocabulary in use
        self.lineage: list[dict] = []  # the runs an init_from head came from, newest first
        self.drafter = selfspec.build_drafter(self.model, "eagle3", **asdict(cfg.eagle3))
        self.head = self.trainable = self.drafter.head.float()
        if cfg.init_from:
            self._init_from_drafter(cfg.init_from, vocab)
        else:
            self.head.set_vocab(draft_ids)
            self._init_from_target()
            self._measure_tap_scale()
        self.drafter._draft_ids = self.head.draft_ids.cpu()
        self._t2d = torch.full((vocab,), -1, dtype=torch.long)  # target id -> draft slot, -1 outside
        self._t2d[self.drafter._draft_ids] = torch.arange(self.drafter._draft_ids.shape[0])
        self.batches = length_buckets(self.train_set, cfg.max_len, cfg.tokens_per_batch)

    def forward(self, head, taps: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The head unrolled ``steps`` times (training-time test): per step ``[B, T, V_d]`` logits."""
        return head(taps, embeds, steps)

    def steps_per_epoch(self) -> int:
        return len(self.batches)

    def step_items(self, step: int) -> list[int]:
        return batch_at(self.batches, step, self.cfg.run.seed)

    @torch.no_grad()
    def _init_from_drafter(self, path: str, vocab: int) -> None:
        """Warm start: every weight and buffer of the trained head at ``path`` (its draft
        vocabulary, whose coverage of the held-out answers is reported, and tap scale included)."""
        from selfspec.checkpoint import CheckpointError, adapter_state, read_checkpoint

        init = selfspec.load_drafter(path, self.model)
        if init.kind != "eagle3":
            raise CheckpointError(f"init_from {path!r} holds a {init.kind!r} drafter, not an eagle3 head")
        try:
            if list(init.requires.taps) != list(self.drafter.requires.taps):
                raise ValueError(f"taps {list(init.requires.taps)} vs {list(self.drafter.requires.taps)}")
            if self.cfg.init_grow:
                theirs = self._grow(init.head, vocab)
            else:
                theirs = adapter_state(init.head.state_dict(), "", self.head.state_dict())
        except ValueError as err:
            hint = "" if self.cfg.init_grow else " (init_grow: true grows a smaller head into it)"
            raise CheckpointError(f"init_from {path!r} has another head shape than this config's eagle3 "
                                  f"section: {err}{hint}") from None
        self.head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in theirs.items()})
        before = (read_checkpoint(path)[0].get("extra") or {})
        self.lineage = [{"checkpoint": str(path), "steps": before.get("steps"),
                         "dataset": (before.get("training") or {}).get("dataset"),
                         "train_response_tokens": before.get("train_response_tokens"),
                         "eval": before.get("eval")}] + list(before.get("lineage") or [])
        self.vocab_coverage = round(_coverage_of(self.head.draft_ids.cpu(), self.eval_set, vocab), 5)

    @torch.no_grad()
    def _grow(self, small, vocab: int) -> dict:
        """The state of this config's head grown from the trained head ``small``: before training
        its features and the logits of ``small``'s draft tokens are ``small``'s (function-preserving
        growth, as Net2Net's; only new draft tokens can change a draft):

        * draft vocabulary: ``small``'s ids plus the most frequent other response tokens of the
          training split, up to ``draft_vocab_size``; the old ids keep their ``lm_head`` rows, the
          new ones all start as the mean of the old rows, so each new token is as likely as an
          average old one and rarely outranks the old head's choice (the data breaks the tie).
          Mean rows start the grown head closest to ``small``; zero rows do worse (logit 0 is
          high for a trained head) and the target's own LM-head rows (what a new head starts
          from, :meth:`_init_from_target`) far worse, since a trained head's output space has
          drifted from the target's (the measurement is
          in docs/decisions.md);
        * MLP: ``small``'s ``intermediate_size`` neurons kept, new neurons with fresh ``gate_proj``
          and ``up_proj`` rows and zero ``down_proj`` columns (no output until trained).

        Every other tensor must have the same shape. Raises ``ValueError`` naming what differs."""
        head = self.head
        mine, theirs = head.state_dict(), small.state_dict()
        if set(mine) != set(theirs):
            raise ValueError(f"tensor names differ: {sorted(set(mine) ^ set(theirs))[:4]}")
        out = {k: v.detach().float().clone() if v.is_floating_point() else v.clone() for k, v in theirs.items()}
        old_ids = small.draft_ids.cpu()
        size = head.d2t.shape[0]
        if size < old_ids.shape[0]:
            raise ValueError(f"draft_vocab_size {size} is smaller than init_from's {old_ids.shape[0]}")
        counts = token_counts(self.train_set, vocab).float()
        counts[old_ids] = -1.0
        extra = counts.argsort(descending=True, stable=True)[: size - old_ids.shape[0]]
        ids = torch.cat([old_ids, extra]).sort().values
        head.set_vocab(ids)  # checks the ids and derives d2t / t2d (loaded again by the caller)
        old_rows = theirs["lm_head.weight"].float().cpu()
        rows = old_rows.mean(0, keepdim=True).repeat(size, 1)
        rows[torch.searchsorted(ids, old_ids)] = old_rows
        out["lm_head.weight"], out["d2t"], out["t2d"] = rows, head.d2t.clone(), head.t2d.clone()
        mlp = "midlayer.mlp."
        width = theirs[mlp + "down_proj.weight"].shape[1]
        if mine[mlp + "down_proj.weight"].shape[1] < width:
            raise ValueError(f"intermediate_size {mine[mlp + 'down_proj.weight'].shape[1]} is smaller than "
                             f"init_from's {width}")
        for name in ("gate_proj.weight", "up_proj.weight"):
            grown = mine[mlp + name].detach().float().clone()  # fresh rows: this head's own init
            grown[:width] = theirs[mlp + name].float()
            out[mlp + name] = grown
        down = torch.zeros_like(mine[mlp + "down_proj.weight"], dtype=torch.float32)
        down[:, :width] = theirs[mlp + "down_proj.weight"].float()
        out[mlp + "down_proj.weight"] = down
        bad = [k for k in mine if out[k].shape != mine[k].shape]
        if bad:
            raise ValueError(f"cannot grow {bad[:4]}: only the draft vocabulary and the MLP width may grow")
        return out

    @torch.no_grad()
    def _init_from_target(self) -> None:
        """LM head rows and final norm from the target; with ``init: exit`` also a head that starts
        as the target's early exit at its highest tap: ``fc`` passes that tap through and the mid
        layer's output projections are zero, so the first draft is the target's own guess from
        that layer (the residual stream stays in the LM head's space, as Medusa's zero-initialised
        blocks do) and training only has to learn the step to the token after."""
        head = self.head
        target_head = self.model.get_output_embeddings().weight
        head.lm_head.weight.copy_(target_head[head.draft_ids.to(target_head.device)].float())
        norm = getattr(self.model.get_decoder(), "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm.weight.float())
        if self.cfg.init == "exit":
            h = head.fc.weight.shape[0]
            head.fc.weight.zero_()
            head.fc.weight[:, -h:] = torch.eye(h)  # times tap_scale once measured (see _measure_tap_scale)
            head.midlayer.self_attn.o_proj.weight.zero_()
            head.midlayer.mlp.down_proj.weight.zero_()

    @torch.no_grad()
    def _measure_tap_scale(self, examples: int = 16) -> None:
        """Per-channel RMS of the taps over a few training examples (position 0, where targets put
        their massive attention-sink activations, excluded), floored at 1e-3 of the median."""
        batch = self.train_set[: examples]
        ids, lengths, _ = collate(batch, self.cfg.max_len)
        taps, _, _ = self._target(ids)
        keep = (torch.arange(ids.shape[1])[None] < lengths[:, None]) & (torch.arange(ids.shape[1])[None] > 0)
        rms = taps[keep.to(taps.device)].float().pow(2).mean(0).sqrt()
        self.head.tap_scale.copy_(rms.clamp_min(float(rms.median()) * 1e-3))
        if self.cfg.init == "exit":  # keep fc(taps / tap_scale) == the highest tap
            self.head.fc.weight.mul_(self.head.tap_scale[None, :])

    @torch.no_grad()
    def _target(self, ids: torch.Tensor):
        """Right-padded ``ids [B, T]`` -> taps ``[B, T, 3H]``, the target's log-law over the draft
        vocabulary ``[B, T, V_d]`` and its argmax over the full vocabulary ``[B, T]``."""
        device = self.acc.device
        head = self.head
        with capture_taps(self.model, self.drafter.requires.taps) as record:
            last = self.model.get_decoder()(input_ids=ids.to(device)).last_hidden_state
        logits = lm_logits(self.model, last).float()  # [B, T, V]
        lse = logits.logsumexp(-1, keepdim=True)
        logp = logits.index_select(-1, head.draft_ids) - lse
        return record.get().float(), logp, logits.argmax(-1)

    def _valid_counts(self, examples: list[dict]) -> list[int]:
        """Positions per unrolled step j whose loss counts (see :meth:`_losses`), from lengths alone."""
        out = []
        for j in range(self.cfg.ttt_steps):
            n = 0
            for e in examples:
                length = min(len(e["prompt_ids"]) + len(e["response_ids"]), self.cfg.max_len)
                n += max(0, (length - j - 1) - max(0, len(e["prompt_ids"]) - 2 - j))
            out.append(n)
        return out

    def _losses(self, examples: list[dict], module=None, counts: list[int] | None = None):
        """Per-step loss, top-1 agreement and T=1 acceptance (sums and counts) for one batch,
        through ``module`` (default: the plain head; training passes the prepared module). Step
        j's loss is divided by ``counts[j]`` (default: this batch's valid positions)."""
        ids, lengths, prompts = collate(examples, self.cfg.max_len)
        taps, logp, argmax = self._target(ids)
        head = self.head
        dtype = head.fc.weight.dtype
        taps = taps.to(dtype)
        with torch.no_grad():
            embeds = self.model.get_input_embeddings()(ids.to(self.acc.device)).to(dtype)
        run = module if module is not None else (lambda *a: self.forward(head, *a))
        step_logits = run(taps, embeds, self.cfg.ttt_steps)
        t = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)  # [B, T]: gather needs every row
        t2d = self._t2d.to(self.acc.device)
        losses, stats = [], []
        for j, logits in enumerate(step_logits):
            src = t + j + 1  # [B, T] position whose law step j learns
            valid = ((src < lengths[:, None]) & (src >= prompts[:, None] - 1)).to(self.acc.device)
            idx = src.clamp_max(ids.shape[1] - 1).to(self.acc.device)
            p = logp.gather(1, idx[..., None].expand(-1, -1, logp.shape[-1])).exp()  # [B, T, V_d]
            logq = logits.float().log_softmax(-1)
            per = -(p * logq).sum(-1)
            greedy = argmax.gather(1, idx)  # [B, T] the target's greedy token at the learned position
            if self.cfg.hard_weight > 0:  # where the head can draft it
                slot = t2d[greedy]  # [B, T] its draft slot, -1 outside the draft vocabulary
                hard = -logq.gather(-1, slot.clamp_min(0)[..., None])[..., 0]
                w = self.cfg.hard_weight * (slot >= 0)
                per = (1 - w) * per + w * hard
            with torch.set_grad_enabled(self.cfg.tv_weight > 0 and torch.is_grad_enabled()):
                accept = torch.minimum(p, logq.exp()).sum(-1)  # T = 1 acceptance of a draft from q
            if self.cfg.tv_weight > 0:
                a = self.cfg.tv_weight
                per = (1 - a) * per + a * (1 - accept)
            n = valid.sum().clamp_min(1) if counts is None else max(1, counts[j])
            losses.append((per * valid).sum() / n)
            with torch.no_grad():
                agree = head.draft_ids[logq.argmax(-1)] == greedy
                accept = accept.detach()
                stats.append((float((agree & valid).sum()), float((accept * valid).sum()), float(valid.sum())))
        weights = self.cfg.step_decay ** torch.arange(len(losses), dtype=torch.float32)
        total = sum(w * l for w, l in zip(weights.tolist(), losses)) / float(weights.sum())
        return total, [float(l.detach()) for l in losses], stats

    def loss(self, items: list[int], batch: list[int]) -> tuple[torch.Tensor, dict]:
        """Per unrolled step: the items' loss sum over the global batch's count of valid positions."""
        counts = self._valid_counts([self.train_set[i] for i in batch])
        mine = [self.train_set[i] for i in items]
        loss, per_step, stats = self._losses(mine, self.module, counts)
        row = {f"train/loss_step{j}": v for j, v in enumerate(per_step)}
        row |= {f"train/top1_step{j}": a / max(n, 1) for j, ((a, _, _), n) in enumerate(zip(stats, counts))}
        row["_tokens"] = sum(len(e["prompt_ids"]) + len(e["response_ids"]) for e in mine)
        return loss, row

    # ---------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss, top-1 agreement and T=1 acceptance per unrolled step, and the expected
        mean accepted length of a greedy chain of ``ttt_steps`` (teacher-forced agreement)."""
        head = self.head
        head.eval()
        K = self.cfg.ttt_steps
        agree, accept, count, loss = [0.0] * K, [0.0] * K, [0.0] * K, [0.0] * K
        for s in range(0, len(self.eval_set), 8):
            _, per_step, stats = self._losses(self.eval_set[s: s + 8])
            for j, (a, c, n) in enumerate(stats):
                agree[j], accept[j], count[j] = agree[j] + a, accept[j] + c, count[j] + n
                loss[j] += per_step[j] * n
        head.train()
        top1 = [a / max(n, 1) for a, n in zip(agree, count)]
        out = {"eval/loss": sum(loss) / max(sum(count), 1), "eval/top1_per_step": top1,
               "eval/accept_t1_per_step": [a / max(n, 1) for a, n in zip(accept, count)]}
        prod, mat = 1.0, 1.0
        for a in top1:
            prod *= a
            mat += prod
        out["eval/expected_mat_chain"] = mat
        out |= {f"eval/top1_step{j}": a for j, a in enumerate(top1)}
        out |= {f"eval/accept_t1_step{j}": a for j, a in enumerate(out["eval/accept_t1_per_step"])}
        return out

    def load_weights(self, drafter) -> None:
        if not torch.equal(drafter.head.d2t.cpu(), self.head.d2t.cpu()):
            raise ValueError(f"{self.out / 'checkpoint'} was trained with another draft vocabulary (other data?); "
                             "refusing to resume")
        self.head.load_state_dict(drafter.head.float().state_dict())

    # ---------------------------------------------------------------- export
    def export(self) -> dict:
        metrics = self.final_metrics()
        summary = {"steps": self.step, "train_examples": len(self.train_set), "eval_examples": len(self.eval_set),
                   "eval_dropped_as_seen": self.eval_dropped,
                   "train_response_tokens": sum(len(e["response_ids"]) for e in self.train_set),
                   "draft_vocab_coverage": self.coverage, "vocab_in_use_coverage": self.vocab_coverage,
                   "metrics": metrics}
        self.write_summary(summary)
        if self.cfg.export and self.acc.is_main_process:
            extra = {"training": asdict(self.cfg), "eval": metrics, "steps": self.step,
                     "draft_vocab_coverage": self.coverage, "vocab_in_use_coverage": self.vocab_coverage,
                     "train_response_tokens": summary["train_response_tokens"], "lineage": self.lineage}
            save_drafter(self.drafter, self.cfg.export, tokenizer=self.tokenizer, extra=extra,
                         weights_dtype=getattr(torch, self.cfg.export_dtype))
        return summary

    def plot(self) -> None:
        steps = range(self.cfg.ttt_steps)
        self.plot_curves({f"step {j}": f"train/loss_step{j}" for j in steps},
                         {f"step {j}": f"eval/top1_step{j}" for j in steps},
                         ("train loss (soft CE)", "loss per unrolled step", "held-out top-1 agreement",
                          "acceptance per unrolled step"))


#: what the registry entry of this kind points to (selfspec.drafters.register(..., recipe=...))
RECIPE, CONFIG = Eagle3Recipe, Eagle3TrainConfig
