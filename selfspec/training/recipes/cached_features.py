"""What the kinds trained on frozen-target features share (Medusa heads, the layer-skip exit).

Two ways to get the target's hidden states (``features``):

* ``cached`` (small targets): the frozen target runs once per example
  (:func:`selfspec.training.features.build_features`, on the main process) and its hidden states are cached
  in the run folder as safetensors, keyed by the target's weight fingerprint, the dataset, the kind
  and the feature options (never silently reused for another). Items are training positions; the
  global batch of step s is a slice of a seeded permutation of them (a pure function of seed,
  epoch and s).
* ``online`` (large targets, the GPU recipes): nothing is cached; items are examples, the global
  batch of step s is a length bucket of at most ``tokens_per_batch`` padded tokens in a seeded
  order (:mod:`selfspec.training.batching`), and each process runs the frozen target over its share of it
  in one padded pass under ``torch.no_grad`` (:func:`selfspec.training.features.batch_features`, in
  ``target_dtype``), then trains on the positions exactly as the cached mode does.

Held-out positions are those of a seeded share of the examples (their features are computed once,
in memory, in online mode). A kind subclasses :class:`CachedFeatureRecipe` with the number of
predictions per position, its label offset, its forward and its own evaluation and export.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

import selfspec
from selfspec.drafters.layerskip import LayerSkipConfig
from selfspec.drafters.medusa import MedusaConfig
from selfspec.model.lm_head import lm_logits

from ..batching import batch_at, length_buckets, load_distilled
from ..features import IGNORE, FeatureCache, batch_features, build_features, label_counts
from ..loop import OptimConfig, RunConfig, TrainingRun, check_dtype, check_example_limits, positive
from ..losses import head_loss, rank_hits


@dataclass
class HeadsTrainConfig:
    """``selfspec train`` config of the cached-feature kinds (YAML copies in configs/).

    Attributes:
        recipe: always ``train_heads`` (tells config files apart).
        target: target alias or path (see ``selfspec.load_target``).
        dataset: a self-distilled ``datasets`` folder or distillation output folder (its finished
            shards), as ``selfspec distill`` writes them.
        kind: drafter kind to train: ``medusa`` or ``layerskip``.
        medusa: head shape (kind ``medusa``).
        layerskip: exit layer and adapter (kind ``layerskip``; ``block`` trains on cached or online
            features, ``lora`` always online through the adapted layers
            (:mod:`selfspec.training.recipes.layerskip_peft`); the plain early exit has nothing to train).
        loss: ``ce`` (self-distilled tokens) or ``kl`` (target's full law).
        head_decay: loss weight of head k is ``head_decay ** (k - 1)``.
        eval_fraction: share of examples held out for evaluation.
        max_eval_examples: cap on the held-out examples (``None``: no cap).
        eval_ranks: candidates per head measured (tree width limit).
        tree_budget: draft nodes of the exported tree.
        max_len: longest example (tokens) used.
        features: ``cached`` (computed once, stored in the run folder) or ``online`` (computed in
            every step from the frozen target; the default for large targets).
        tokens_per_batch: padded tokens per global batch in ``online`` mode (``optim.batch_size``
            counts positions in ``cached`` mode).
        target_dtype: dtype the frozen target is loaded in to compute the cached features
            (``bfloat16`` halves a large target's memory; the heads train in float32).
        export: where the final drafter checkpoint is written (``null`` to skip).
        overwrite_export: allow ``export`` to replace an existing folder (refused otherwise, at
            setup, before any training).
    """

    recipe: str = "train_heads"
    target: str = selfspec.DEFAULT_TARGET
    dataset: str = "runs/distill/smollm2/dataset"
    kind: str = "medusa"
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    layerskip: LayerSkipConfig = field(default_factory=LayerSkipConfig)
    loss: str = "ce"
    head_decay: float = 0.8
    eval_fraction: float = 0.05
    max_eval_examples: int | None = None
    eval_ranks: int = 4
    tree_budget: int = 10
    max_len: int = 1024
    features: str = "cached"
    tokens_per_batch: int = 8192
    target_dtype: str = "float32"
    export: str | None = None
    overwrite_export: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        if self.recipe != "train_heads":
            raise ValueError(f"this config is for recipe {self.recipe!r}, not 'train_heads'")
        if self.kind not in ("medusa", "layerskip"):
            raise ValueError(f"this config trains kind 'medusa' or 'layerskip', got {self.kind!r}")
        if self.kind == "layerskip":
            if self.layerskip.adapter == "none":
                raise ValueError("layerskip.adapter must be 'block' or 'lora' to train (the plain early exit has "
                                 "no weights: pick its exit layer with scripts/pick_exit_layer.py)")
            if self.layerskip.layers is not None:
                raise ValueError("training supports exit layers (layerskip.exit_layer), not layer subsets")
        check_dtype("target_dtype", self.target_dtype)
        check_example_limits(self)
        positive("head_decay", self.head_decay)
        if self.features not in ("cached", "online"):
            raise ValueError(f"features must be 'cached' or 'online', got {self.features!r}")
        if self.features == "online" and self.tokens_per_batch < self.max_len:
            raise ValueError(f"tokens_per_batch ({self.tokens_per_batch}) must hold one max_len ({self.max_len}) example")
        if self.loss not in ("ce", "kl"):
            raise ValueError(f"loss must be 'ce' or 'kl', got {self.loss!r}")


class CachedFeatureRecipe(TrainingRun):
    """Training on cached target features; items are positions (see the module docstring).

    Subclasses set :attr:`num_outputs` (predictions per position), :attr:`first` (label offset of
    the first prediction, see :func:`selfspec.training.features.head_labels`), :attr:`exit_layer` (cache the
    first E layers' output too, or ``None``), :meth:`options` (drafter options), :meth:`trainable_of`
    and :meth:`forward`.
    """

    num_outputs = 1
    first = 1
    exit_layer: int | None = None

    def __init__(self, cfg: HeadsTrainConfig, *, model=None, tokenizer=None, dataset=None):
        super().__init__(cfg, model=model, tokenizer=tokenizer)
        self.dataset = dataset

    def options(self) -> dict:
        raise NotImplementedError

    def trainable_of(self, drafter) -> torch.nn.Module:
        raise NotImplementedError

    # ------------------------------------------------------------------ data
    @property
    def online(self) -> bool:
        return self.cfg.features == "online"

    def prepare(self) -> None:
        if self.dataset is None:  # a datasets folder or distillation shards (possibly still growing)
            self.dataset = load_distilled(self.cfg.dataset)
        if self.online:
            self._prepare_online()
        else:
            self.features = self._features()
            self.train_set, self.eval_set = self._split(self.features)
        self.drafter = selfspec.build_drafter(self.model, self.cfg.kind, **self.options())
        self.trainable = self.trainable_of(self.drafter)

    def _features(self) -> FeatureCache:
        """Target hidden states, cached in the run folder as safetensors, reused only when the
        recorded key (target fingerprint, dataset path and size, kind, outputs, exit layer,
        max_len, dtype) equals this run's; otherwise rebuilt (by the main process only)."""
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        from selfspec.model.fingerprint import target_fingerprint

        cfg = self.cfg
        key = json.dumps([target_fingerprint(self.model), str(cfg.dataset), len(self.dataset), cfg.kind,
                          self.num_outputs, self.exit_layer, cfg.max_len, cfg.run.feature_dtype])
        path = self.out / "features.safetensors"
        if path.exists():
            with safe_open(str(path), "pt") as f:
                cached_key = (f.metadata() or {}).get("key")
            if cached_key == key:
                t = load_file(str(path))
                return FeatureCache(t["hidden"], t["positions"], t["labels"], t["example"], t.get("exit_hidden"))
        dtype = getattr(torch, cfg.run.feature_dtype)
        feats = build_features(self.model, self.dataset, self.num_outputs, max_len=cfg.max_len, dtype=dtype,
                               exit_layer=self.exit_layer, first=self.first,
                               progress=self.acc.is_local_main_process)
        if self.acc.is_main_process:
            tmp = path.with_suffix(".tmp")
            names = ("hidden", "positions", "labels", "example") + (("exit_hidden",) if feats.exit_hidden is not None else ())
            save_file({k: getattr(feats, k).contiguous() for k in names}, str(tmp), metadata={"key": key})
            tmp.replace(path)
        return feats

    def _held_out(self, n_examples: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg.run.seed)
        held = torch.randperm(n_examples, generator=g)[: max(1, int(n_examples * self.cfg.eval_fraction))]
        return held if self.cfg.max_eval_examples is None else held[: self.cfg.max_eval_examples]

    def _prepare_online(self) -> None:
        """Examples split as the cached mode splits them; held-out features computed once."""
        cfg = self.cfg
        rows = [{"prompt_ids": list(r["prompt_ids"]), "response_ids": list(r["response_ids"])} for r in self.dataset]
        held = set(self._held_out(len(rows)).tolist())
        usable = [i for i, r in enumerate(rows) if r["response_ids"] and r["prompt_ids"]]
        self.examples = [rows[i] for i in usable if i not in held]
        evals = [rows[i] for i in usable if i in held]
        self.batches = length_buckets(self.examples, cfg.max_len, cfg.tokens_per_batch)
        self.eval_set = build_features(self.model, evals, self.num_outputs, max_len=cfg.max_len,
                                       dtype=getattr(torch, cfg.run.feature_dtype), exit_layer=self.exit_layer,
                                       first=self.first, progress=False)

    def _online_features(self, examples: list[dict]) -> FeatureCache:
        """The target's features for ``examples``, in one padded pass (this step's items)."""
        return batch_features(self.model, examples, self.num_outputs, max_len=self.cfg.max_len,
                              dtype=getattr(torch, self.cfg.run.feature_dtype), exit_layer=self.exit_layer,
                              first=self.first)

    def _split(self, feats: FeatureCache) -> tuple[FeatureCache, FeatureCache]:
        held = self._held_out(int(feats.example.max()) + 1)
        is_eval = torch.isin(feats.example, held)
        return feats.subset(~is_eval), feats.subset(is_eval)

    def steps_per_epoch(self) -> int:
        if self.online:
            return len(self.batches)
        return max(1, len(self.train_set.positions) // self.cfg.optim.batch_size)

    def step_items(self, step: int) -> list[int]:
        """Position indices (cached) or example indices (online) of ``step``: a pure function of
        (seed, epoch, step) for exact resume."""
        if self.online:
            return batch_at(self.batches, step, self.cfg.run.seed)
        n, bs = len(self.train_set.positions), self.cfg.optim.batch_size
        epoch, i = divmod(step, self.steps_per_epoch())
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.run.seed * 7919 + epoch))
        return order[i * bs: (i + 1) * bs].tolist()

    # ------------------------------------------------------------------ loss
    def inputs(self, cache: FeatureCache, rows: torch.Tensor) -> torch.Tensor:
        """What the forward reads at ``rows``: the cached last hidden states (the exit recipe
        overrides this with the first E layers' outputs)."""
        return cache.hidden[rows].to(self.acc.device, torch.float32)

    def _outputs(self, cache: FeatureCache, idx: torch.Tensor, module):
        device = self.acc.device
        rows = cache.positions[idx]
        labels = cache.labels[idx].to(device)
        logits = module(self.inputs(cache, rows))  # [B, K, V]
        target = None
        if self.cfg.loss == "kl":
            k = torch.arange(labels.shape[1]) + self.first - 1  # the target's law for label k sits here
            nxt = (rows[:, None] + k[None]).clamp_max(cache.hidden.shape[0] - 1)
            with torch.no_grad():
                target = lm_logits(self.model, cache.hidden[nxt].to(device, torch.float32))
        return logits, labels, target

    def loss(self, items: list[int], batch: list[int]) -> tuple[torch.Tensor, dict]:
        """Per head: the items' loss sum over the global batch's count of valid labels."""
        if self.online:  # the items' features now, from the frozen target; the counts from the ids alone
            cfg = self.cfg
            counts = label_counts([self.examples[i] for i in batch], self.num_outputs, cfg.max_len, self.first)
            cache = self._online_features([self.examples[i] for i in items])
            logits, labels, target = self._outputs(cache, torch.arange(len(cache.positions)), self.module)
            loss, per_head = head_loss(logits, labels, cfg.head_decay, target, counts=counts)
            return loss, {f"train/loss_head{k + 1}": float(v) for k, v in enumerate(per_head)} | {
                "_tokens": len(cache.positions)}
        counts = (self.train_set.labels[torch.tensor(batch)] != IGNORE).sum(0)
        logits, labels, target = self._outputs(self.train_set, torch.tensor(items), self.module)
        loss, per_head = head_loss(logits, labels, self.cfg.head_decay, target, counts=counts)
        return loss, {f"train/loss_head{k + 1}": float(v) for k, v in enumerate(per_head)} | {"_tokens": len(items)}

    def load_weights(self, drafter) -> None:
        self.trainable.load_state_dict(self.trainable_of(drafter).float().state_dict())

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self, batch: int = 512) -> dict:
        """Rank-wise accuracy of each prediction on held-out positions (plus the kind's extras)."""
        self.trainable.eval()
        plain = lambda h: self.forward(self.trainable, h)  # noqa: E731 (no DDP on the main process alone)
        K, R = self.num_outputs, self.cfg.eval_ranks
        hits, valid = torch.zeros(K, R), torch.zeros(K)
        loss_sum, n = 0.0, 0
        for s in range(0, len(self.eval_set.positions), batch):
            idx = torch.arange(s, min(s + batch, len(self.eval_set.positions)))
            logits, labels, target = self._outputs(self.eval_set, idx, plain)
            loss, _ = head_loss(logits, labels, self.cfg.head_decay, target)
            h, v = rank_hits(logits, labels, R)
            hits += h.cpu()
            valid += v.cpu()
            loss_sum, n = loss_sum + float(loss) * len(idx), n + len(idx)
        self.trainable.train()
        acc = (hits / valid.clamp_min(1)[:, None]).tolist()
        out = {"eval/loss": loss_sum / max(1, n), "eval/rank_accuracy": acc}
        out |= self.eval_extras(acc)
        out |= {f"eval/top1_head{k + 1}": acc[k][0] for k in range(K)}
        out |= {f"eval/top{R}_head{k + 1}": sum(acc[k]) for k in range(K)}
        return out

    def eval_extras(self, rank_accuracy: list[list[float]]) -> dict:
        return {}

    # ------------------------------------------------------------------ export
    def export(self) -> dict:
        """Held-out metrics, the kind's export choices (:meth:`finalize`), summary, plot, drafter."""
        from selfspec.drafters import save_drafter

        metrics = self.final_metrics()
        train_positions = (int(label_counts(self.examples, 1, self.cfg.max_len, 1)[0]) if self.online
                           else len(self.train_set.positions))
        summary = {"steps": self.step, "train_positions": train_positions, "features": self.cfg.features,
                   "eval_positions": len(self.eval_set.positions), "metrics": metrics, "tree": None}
        if self.acc.is_main_process:
            summary |= self.finalize(metrics)
            self.write_summary(summary)
            if self.cfg.export:
                save_drafter(self.drafter, self.cfg.export, tokenizer=self.tokenizer,
                             extra={"training": asdict(self.cfg), "eval": metrics, "steps": self.step})
        return summary

    def finalize(self, metrics: dict) -> dict:
        """Set the exported drafter's options from measured accuracies; extra summary fields."""
        return {}

    def plot(self) -> None:
        heads = range(1, self.num_outputs + 1)
        self.plot_curves({f"head {k}": f"train/loss_head{k}" for k in heads},
                         {f"head {k}": f"eval/top1_head{k}" for k in heads},
                         ("train loss", "loss per head", "held-out top-1 accuracy", "accuracy per head"))

