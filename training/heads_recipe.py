"""Recipe: train a drafter on a frozen target from self-distilled data.

Two kinds share the recipe: Medusa-style heads (``kind: medusa``, K heads guessing t+2..t+K+1 from
the last hidden state) and the layer-skip exit adapter (``kind: layerskip``, one next-token
prediction from the first E layers' output through the adapter, final norm and LM head).

setup (target, data, cached target features, heads, optimizer, accelerate, wandb, resume) ->
train (seeded, resumable, logged, periodically checkpointed) -> export (tree chosen from measured
head accuracies, drafter checkpoint, curves plot) -> cleanup. ``scripts/train_heads.py`` is a thin
entry point over :func:`run`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

import selfspec
from selfspec.checkpoint import atomic_dir, atomic_write_text, recover_dir
from selfspec.drafters import save_drafter
from selfspec.drafters.layerskip import LayerSkipConfig
from selfspec.drafters.medusa import MedusaConfig
from selfspec.lm_head import lm_logits
from selfspec.tree_search import best_tree, expected_accepted_length

from .config import dump_config
from .features import FeatureCache, build_features
from .losses import head_loss, rank_hits
from .state import check_export_target, read_train_state, write_train_state


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay to 10%.

    Attributes:
        lr: peak learning rate.
        weight_decay: decoupled weight decay.
        warmup_steps: linear warm-up length.
        batch_size: training positions per step.
        epochs: passes over the training positions (may be fractional).
        grad_clip: max gradient norm (0 disables).
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 30
    batch_size: int = 256
    epochs: float = 2.0
    grad_clip: float = 1.0


def lr_at(o: OptimConfig, step: int, total_steps: int) -> float:
    """Linear warm-up to ``o.lr``, then cosine decay to 10% at ``total_steps``."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps)
    return o.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class RunConfig:
    """Bookkeeping.

    Attributes:
        out_dir: run folder (features cache, training checkpoint, logs, plots).
        seed: seeds initialisation, split and data order.
        log_every / eval_every / ckpt_every: intervals in steps.
        wandb_mode: ``offline`` (default), ``disabled`` or ``online``.
        wandb_project: wandb project name.
        mixed_precision: accelerate's ``no`` / ``bf16`` / ``fp16`` (GPU).
        feature_dtype: dtype of cached hidden states (``float32`` or ``bfloat16``).
    """

    out_dir: str = "runs/medusa-smollm2"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    ckpt_every: int = 100
    wandb_mode: str = "offline"
    wandb_project: str = "selfspec"
    mixed_precision: str = "no"
    feature_dtype: str = "float32"


@dataclass
class HeadsTrainConfig:
    """Everything ``scripts/train_heads.py`` needs (YAML copies live in configs/).

    Attributes:
        recipe: always ``train_heads`` (tells config files apart).
        target: target alias or path (see ``selfspec.load_target``).
        dataset: a self-distilled ``datasets`` folder (``scripts/distill_data.py``).
        kind: drafter kind to train: ``medusa`` or ``layerskip``.
        medusa: head shape (kind ``medusa``).
        layerskip: exit layer, adapter and tree policy (kind ``layerskip``; the adapter must be
            ``block``: the plain early exit has nothing to train).
        loss: ``ce`` (self-distilled tokens) or ``kl`` (target's full law).
        head_decay: loss weight of head k is ``head_decay ** (k - 1)``.
        eval_fraction: share of examples held out for evaluation.
        eval_ranks: candidates per head measured (tree width limit).
        tree_budget: draft nodes of the exported tree.
        max_len: longest example (tokens) used.
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
    eval_ranks: int = 4
    tree_budget: int = 10
    max_len: int = 1024
    export: str | None = None
    overwrite_export: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        if self.recipe != "train_heads":
            raise ValueError(f"this config is for recipe {self.recipe!r}, not 'train_heads'")
        if self.kind not in ("medusa", "layerskip"):
            raise ValueError(f"train_heads trains kind 'medusa' or 'layerskip', got {self.kind!r}")
        if self.kind == "layerskip":
            if self.layerskip.adapter != "block":
                raise ValueError("layerskip.adapter must be 'block' to train (the plain early exit has no "
                                 "weights: pick its exit layer with scripts/pick_exit_layer.py)")
            if self.layerskip.layers is not None:
                raise ValueError("training supports exit layers (layerskip.exit_layer), not layer subsets")
        if self.loss not in ("ce", "kl"):
            raise ValueError(f"loss must be 'ce' or 'kl', got {self.loss!r}")
        if self.run.wandb_mode not in ("offline", "disabled", "online"):
            raise ValueError(f"run.wandb_mode must be offline, disabled or online, got {self.run.wandb_mode!r}")


class HeadsRecipe:
    """One training run. Use :func:`run`, or call the stages yourself."""

    def __init__(self, cfg: HeadsTrainConfig, *, model=None, tokenizer=None, dataset=None):
        self.cfg, self.model, self.tokenizer, self.dataset = cfg, model, tokenizer, dataset
        self.out = Path(cfg.run.out_dir)
        self.step, self.history = 0, []

    # ---------------------------------------------------------------- setup
    def setup(self, resume: bool = False) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        cfg = self.cfg
        check_export_target(cfg.export, cfg.overwrite_export)
        self.out.mkdir(parents=True, exist_ok=True)
        set_seed(cfg.run.seed)
        self.acc = Accelerator(mixed_precision=cfg.run.mixed_precision, log_with="wandb")
        if self.model is None:
            self.model, self.tokenizer = selfspec.load_target(cfg.target, device=str(self.acc.device))
        self.model.requires_grad_(False).eval()
        if self.dataset is None:
            from datasets import load_from_disk

            self.dataset = load_from_disk(cfg.dataset)
        self.features = self._features()
        self.train_set, self.eval_set = self._split(self.features)
        options = asdict(cfg.medusa) if cfg.kind == "medusa" else asdict(cfg.layerskip)
        self.drafter = selfspec.build_drafter(self.model, cfg.kind, **options)
        # the trainable module: Medusa heads or the exit adapter (trained in float32)
        self.heads = (self.drafter.heads if cfg.kind == "medusa" else self.drafter.adapter).float().train()
        self.optimizer = torch.optim.AdamW(self.heads.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        self.heads, self.optimizer = self.acc.prepare(self.heads, self.optimizer)
        self.total_steps = max(1, math.ceil(cfg.optim.epochs * len(self.train_set.positions) / cfg.optim.batch_size))
        if resume:
            recover_dir(self.out / "checkpoint")  # finish a checkpoint write a crash interrupted
            if not (self.out / "checkpoint").exists():
                raise FileNotFoundError(f"--resume: no checkpoint in {self.out}; drop --resume to start a new run")
            self._resume()
        atomic_write_text(self.out / "config.yaml", dump_config(cfg))
        self.acc.init_trackers(cfg.run.wandb_project, config=asdict(cfg),
                               init_kwargs={"wandb": {"mode": cfg.run.wandb_mode, "dir": str(self.out)}})

    def _features(self) -> FeatureCache:
        """Target hidden states, cached in the run folder as safetensors.

        The cache is reused only when its recorded key (target fingerprint, dataset path and size,
        heads, max_len, dtype) equals this run's; otherwise it is rebuilt, never silently reused.
        """
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        from selfspec.fingerprint import target_fingerprint

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
                               exit_layer=self.exit_layer, first=self.first)
        tmp = path.with_suffix(".tmp")
        names = ("hidden", "positions", "labels", "example") + (("exit_hidden",) if feats.exit_hidden is not None else ())
        tensors = {k: getattr(feats, k).contiguous() for k in names}
        save_file(tensors, str(tmp), metadata={"key": key})
        tmp.replace(path)
        return feats

    def _split(self, feats: FeatureCache) -> tuple[FeatureCache, FeatureCache]:
        n_examples = int(feats.example.max()) + 1
        g = torch.Generator().manual_seed(self.cfg.run.seed)
        held = torch.randperm(n_examples, generator=g)[: max(1, int(n_examples * self.cfg.eval_fraction))]
        is_eval = torch.isin(feats.example, held)
        return feats.subset(~is_eval), feats.subset(is_eval)

    # ---------------------------------------------------------------- train
    def _lr(self, step: int) -> float:
        return lr_at(self.cfg.optim, step, self.total_steps)

    @property
    def num_outputs(self) -> int:
        """Predictions per position: K heads, or 1 for the layer-skip exit."""
        return self.cfg.medusa.num_heads if self.cfg.kind == "medusa" else 1

    @property
    def first(self) -> int:
        """Label offset of the first prediction (see ``training.features.head_labels``)."""
        return 2 if self.cfg.kind == "medusa" else 1

    @property
    def exit_layer(self) -> int | None:
        return self.cfg.layerskip.exit_layer if self.cfg.kind == "layerskip" else None

    def _batch(self, step: int) -> torch.Tensor:
        """Position indices of ``step``: a pure function of (seed, epoch, step) for exact resume."""
        n, bs = len(self.train_set.positions), self.cfg.optim.batch_size
        per_epoch = max(1, n // bs)
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.run.seed * 7919 + epoch))
        return order[i * bs: (i + 1) * bs]

    def _forward(self, cache: FeatureCache, idx: torch.Tensor):
        device = self.acc.device
        rows = cache.positions[idx]
        labels = cache.labels[idx].to(device)
        if self.cfg.kind == "medusa":
            h = cache.hidden[rows].to(device, torch.float32)
            logits = self.acc.unwrap_model(self.heads).logits(self.model, h)  # [B, K, V]
        else:
            h = self.acc.unwrap_model(self.heads)(cache.exit_hidden[rows].to(device, torch.float32))
            logits = lm_logits(self.model, self.drafter.norm(h))[:, None]  # [B, 1, V]
        target = None
        if self.cfg.loss == "kl":
            k = torch.arange(labels.shape[1]) + self.first - 1  # the target's law for label k sits here
            nxt = (rows[:, None] + k[None]).clamp_max(cache.hidden.shape[0] - 1)
            with torch.no_grad():
                target = lm_logits(self.model, cache.hidden[nxt].to(device, torch.float32))
        return logits, labels, target

    def train(self, stop_at: int | None = None) -> None:
        """Train to the end (or up to step ``stop_at``, as if the run were interrupted there)."""
        cfg = self.cfg
        end = min(self.total_steps, stop_at or self.total_steps)
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train heads", unit="step")
        started = time.time()
        while self.step < end:
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr(self.step)
            with self.acc.autocast():
                logits, labels, target = self._forward(self.train_set, self._batch(self.step))
                loss, per_head = head_loss(logits, labels, cfg.head_decay, target)
            self.acc.backward(loss)
            if cfg.optim.grad_clip:
                self.acc.clip_grad_norm_(self.heads.parameters(), cfg.optim.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            bar.update(1)
            if self.step % cfg.run.log_every == 0 or self.step == self.total_steps:
                row = {"train/loss": loss.item(), "lr": self._lr(self.step - 1), "step": self.step}
                row |= {f"train/loss_head{k + 1}": float(v) for k, v in enumerate(per_head)}
                self._log(row)
                bar.set_postfix(loss=f"{row['train/loss']:.3f}")
            if self.step % cfg.run.eval_every == 0 or self.step == self.total_steps:
                self._log(self.evaluate() | {"step": self.step})
            if self.step % cfg.run.ckpt_every == 0 or self.step == self.total_steps:
                self.save_checkpoint(wall=time.time() - started)
        bar.close()

    def _log(self, row: dict) -> None:
        self.history.append(row)
        self.acc.log({k: v for k, v in row.items() if not isinstance(v, list)}, step=row["step"])

    # ---------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self, batch: int = 512) -> dict:
        """Rank-wise head accuracy on held-out positions and the expected MAT of trees."""
        heads = self.acc.unwrap_model(self.heads).eval()
        K, R = self.num_outputs, self.cfg.eval_ranks
        hits, valid = torch.zeros(K, R), torch.zeros(K)
        loss_sum, n = 0.0, 0
        for s in range(0, len(self.eval_set.positions), batch):
            idx = torch.arange(s, min(s + batch, len(self.eval_set.positions)))
            logits, labels, target = self._forward(self.eval_set, idx)
            loss, _ = head_loss(logits, labels, self.cfg.head_decay, target)
            h, v = rank_hits(logits, labels, R)
            hits += h.cpu()
            valid += v.cpu()
            loss_sum, n = loss_sum + float(loss) * len(idx), n + len(idx)
        heads.train()
        acc = (hits / valid.clamp_min(1)[:, None]).tolist()
        out = {"eval/loss": loss_sum / max(1, n), "eval/rank_accuracy": acc}
        if self.cfg.kind == "medusa":
            tree = best_tree(acc, self.cfg.tree_budget)
            out["eval/expected_mat_current_tree"] = expected_accepted_length(self.drafter.template.paths, acc)
            out["eval/expected_mat_best_tree"] = expected_accepted_length(tree.paths, acc)
        else:  # a greedy chain of max_depth with independent acceptance acc[0][0] per token
            a = acc[0][0]
            out["eval/expected_mat_chain"] = sum(a ** d for d in range(self.cfg.layerskip.max_depth + 1))
        out |= {f"eval/top1_head{k + 1}": acc[k][0] for k in range(K)}
        out |= {f"eval/top{R}_head{k + 1}": sum(acc[k]) for k in range(K)}
        return out

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, wall: float = 0.0) -> None:
        """Atomically replace ``<out>/checkpoint`` (drafter + optimizer + step)."""
        with atomic_dir(self.out / "checkpoint") as tmp:
            save_drafter(self.drafter, tmp / "drafter", tokenizer=self.tokenizer)
            write_train_state(tmp, self.optimizer, self.step, {"wall_time_s": wall, "history": self.history})

    def _resume(self) -> None:
        folder = self.out / "checkpoint"
        loaded = selfspec.load_drafter(folder / "drafter", self.model)
        module = loaded.heads if self.cfg.kind == "medusa" else loaded.adapter
        self.acc.unwrap_model(self.heads).load_state_dict(module.float().state_dict())
        info = read_train_state(folder, self.optimizer)
        self.step, self.history = int(info["step"]), list(info.get("history", []))
        print(f"resumed from {folder} at step {self.step}")

    # ---------------------------------------------------------------- export
    def export(self) -> dict:
        """Choose the tree from measured accuracies, save the drafter and the curves plot."""
        metrics = self.evaluate()
        tree = None
        if self.cfg.kind == "medusa":
            tree = best_tree(metrics["eval/rank_accuracy"], self.cfg.tree_budget).to_list()
            self.drafter.set_tree(tree)
            metrics["eval/expected_mat_current_tree"] = expected_accepted_length(tree, metrics["eval/rank_accuracy"])
        summary = {"steps": self.step, "train_positions": len(self.train_set.positions),
                   "eval_positions": len(self.eval_set.positions), "metrics": metrics, "tree": tree}
        atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=1))
        self._plot()
        if self.cfg.export:
            save_drafter(self.drafter, self.cfg.export, tokenizer=self.tokenizer,
                         extra={"training": asdict(self.cfg), "eval": metrics, "steps": self.step})
        return summary

    def _plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        K = self.num_outputs
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        train = [r for r in self.history if "train/loss" in r]
        for k in range(K):
            a.plot([r["step"] for r in train], [r[f"train/loss_head{k + 1}"] for r in train], label=f"head {k + 1}")
        a.set(xlabel="step", ylabel="train loss", title="loss per head")
        a.legend()
        evals = [r for r in self.history if "eval/loss" in r]
        for k in range(K):
            b.plot([r["step"] for r in evals], [r[f"eval/top1_head{k + 1}"] for r in evals], marker="o", label=f"head {k + 1}")
        b.set(xlabel="step", ylabel="held-out top-1 accuracy", title="accuracy per head")
        b.legend()
        fig.tight_layout()
        fig.savefig(self.out / "training_curves.png", dpi=110)
        plt.close(fig)

    def cleanup(self) -> None:
        self.acc.end_training()


def run(cfg: HeadsTrainConfig, *, resume: bool = False, **given) -> dict:
    """setup -> train -> export -> cleanup; returns the export summary."""
    recipe = HeadsRecipe(cfg, **given)
    recipe.setup(resume=resume)
    recipe.train()
    summary = recipe.export()
    recipe.cleanup()
    return summary
