"""The one training loop every drafter kind shares: accelerate, data sharding, resume, logging.

A kind's recipe (``selfspec/training/recipes/<kind>.py``) subclasses :class:`TrainingRun` and fills in what
only it knows: its data and trainable module (:meth:`TrainingRun.prepare`), the items of each
step's global batch (:meth:`TrainingRun.step_items`), the loss of some of them
(:meth:`TrainingRun.loss`), evaluation, export and plots. This class does the rest, the same way
for every kind and for any number of processes (``accelerate launch --num_processes N``):

* **once, on the main process**: data preparation that writes files (feature caches: the main
  process builds them while the others wait, then they read them), checkpoints, exports, plots,
  the run's summary and wandb (offline by default); every other process waits at a barrier.
* **sharded data**: the global batch of step ``s`` is a pure function of (seed, s), whatever the
  process count; rank r trains on items ``r, r + N, ...`` of it, split into
  ``optim.grad_accum`` micro-batches. A recipe's :meth:`TrainingRun.loss` returns a micro-batch's
  *share* of the global batch's loss (its sum over the micro-batch's valid labels divided by the
  global batch's count of them, which every process can count from the data alone), so the
  shares of all micro-batches of all processes add up to the loss one process would compute on
  the whole batch; the loop backpropagates ``share * N`` (DDP averages over the N processes). A
  run on N processes therefore takes the same steps as one process with the same global batch, up
  to float summation order (tested: ``tests/test_distributed_training.py``).
* **the prepared module**: the trainable module is wrapped in :class:`TrainModule`, whose forward
  is the recipe's function, and prepared by accelerate; recipes call ``self.module(...)``, so
  gradients are synchronised by DDP's hooks (never around them).
* **checkpoints**: ``<out_dir>/checkpoint`` (drafter + optimizer + step, crash-safe, see
  :mod:`selfspec.checkpoint`) every ``run.ckpt_every`` steps. The state is global (no per-rank
  files), so ``--resume`` works with any process count, including a different one. A run whose
  folder already holds a checkpoint refuses to start over without ``--resume``.
"""

from __future__ import annotations

import json
import math
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

import selfspec
from selfspec.checkpoint import CheckpointError, atomic_dir, atomic_write_text, recover_dir

from .config import dump_config
from .state import check_export_target, read_train_state, write_train_state
from .tracking import REPORT_TO, tracker_init


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay to 10%.

    Attributes:
        lr: peak learning rate.
        weight_decay: decoupled weight decay.
        warmup_steps: linear warm-up length.
        batch_size: training items per step (the global batch, over all processes; what an item is
            depends on the kind: a position for cached-feature kinds; eagle3 batches by tokens).
        epochs: passes over the training items (may be fractional).
        grad_clip: max gradient norm (0 disables).
        grad_accum: micro-batches per step on each process (same global batch, less memory).
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 30
    batch_size: int = 256
    epochs: float = 2.0
    grad_clip: float = 1.0
    grad_accum: int = 1

    def __post_init__(self) -> None:
        at_least("optim.grad_accum", self.grad_accum, 1)
        at_least("optim.warmup_steps", self.warmup_steps, 0)
        at_least("optim.batch_size", self.batch_size, 0)
        at_least("optim.weight_decay", self.weight_decay, 0)
        at_least("optim.grad_clip", self.grad_clip, 0)
        positive("optim.lr", self.lr)
        positive("optim.epochs", self.epochs)


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
        wandb_mode: ``offline`` (default), ``disabled`` or ``online`` (wandb's own ``WANDB_MODE``
            environment variable wins, as in wandb).
        wandb_project: wandb project name.
        report_to: ``wandb`` (default), ``tensorboard`` (needs the ``tensorboard`` package) or ``none``.
        run_name / tags / run_id: the tracked run's name, tags and id (a run id shared by several
            stages or resumed runs makes them one tracked run).
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
    report_to: str = "wandb"
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("offline", "disabled", "online"):
            raise ValueError(f"run.wandb_mode must be offline, disabled or online, got {self.wandb_mode!r}")
        if self.report_to not in REPORT_TO:
            raise ValueError(f"run.report_to must be one of {REPORT_TO}, got {self.report_to!r}")
        for name in ("log_every", "eval_every", "ckpt_every"):
            at_least(f"run.{name}", getattr(self, name), 1)


def at_least(key: str, value, low) -> None:
    """``ValueError`` naming the dotted config ``key`` unless ``value >= low`` (NaN fails)."""
    if not value >= low:
        raise ValueError(f"{key} must be >= {low}, got {value}")


def positive(key: str, value) -> None:
    """``ValueError`` naming ``key`` unless ``value`` is a finite number above 0."""
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{key} must be a finite number > 0, got {value}")


def check_example_limits(cfg) -> None:
    """The example-shape keys every recipe config has: ``max_len >= 2``, ``tokens_per_batch >= 1``,
    ``0 <= eval_fraction < 1``, ``max_eval_examples >= 1`` (or unset)."""
    at_least("max_len", cfg.max_len, 2)
    at_least("tokens_per_batch", cfg.tokens_per_batch, 1)
    if not 0 <= cfg.eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {cfg.eval_fraction}")
    if cfg.max_eval_examples is not None:
        at_least("max_eval_examples", cfg.max_eval_examples, 1)


def check_dtype(name: str, value: str) -> None:
    """Refuse a config dtype name other than float32 / bfloat16 / float16."""
    if value not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {value!r}")


class TrainModule(torch.nn.Module):
    """The trainable module with the recipe's forward: ``forward(*a) = fn(inner, *a)``. Only
    ``inner``'s parameters belong to it (the frozen target stays outside, so DDP never syncs it)."""

    def __init__(self, inner: torch.nn.Module, fn):
        super().__init__()
        self.inner = inner
        self._fn = fn

    def forward(self, *args, **kwargs):
        return self._fn(self.inner, *args, **kwargs)


class TrainingRun(ABC):
    """One training run of one drafter kind. Use :meth:`run`, or call the stages yourself:
    :meth:`setup` -> :meth:`train` -> :meth:`export` -> :meth:`cleanup`.

    After :meth:`prepare`, a recipe has set ``self.drafter`` (the drafter being trained, saved in
    checkpoints) and ``self.trainable`` (its trainable ``nn.Module``) and implemented
    :meth:`forward` (what ``self.module(...)`` computes from ``self.trainable``)."""

    #: progress-bar label
    name = "drafter"
    #: cast the trainable module to float32 (off for modules sharing frozen weights with the target)
    cast_trainable = True

    def __init__(self, cfg, *, model=None, tokenizer=None):
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.out = Path(cfg.run.out_dir)
        self.step, self.history = 0, []
        self.acc = None

    # ------------------------------------------------------------------ what a recipe provides
    @abstractmethod
    def prepare(self) -> None:
        """Load data (and any feature cache), build ``self.drafter`` and ``self.trainable``.
        Runs on the main process first, then on the others (which then find its files)."""

    @abstractmethod
    def forward(self, trainable: torch.nn.Module, *args):
        """What the prepared module computes (``self.module(*args)``) from the trainable module."""

    @abstractmethod
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one pass over the training data."""

    @abstractmethod
    def step_items(self, step: int) -> list:
        """The global batch of ``step``: a list of items, a pure function of (seed, step)."""

    @abstractmethod
    def loss(self, items: list, batch: list) -> tuple[torch.Tensor, dict]:
        """The share of ``items`` (part of the global ``batch``) in the batch's loss, computed
        through ``self.module``, and the shares of the logged metrics (``train/...``; ``_tokens``:
        the items' token count, for the tokens/s column)."""

    @abstractmethod
    def evaluate(self) -> dict:
        """Held-out metrics (runs on the main process only; use the unwrapped ``self.trainable``)."""

    def export(self) -> dict:
        """Write the run's summary (and the exported drafter); returns the summary."""
        return {"steps": self.step}

    def final_metrics(self) -> dict:
        """Held-out metrics of the weights as they are now (main process; ``{}`` elsewhere): the
        loop's own evaluation at this step when it logged one (it always does at the last step),
        else a fresh :meth:`evaluate`. The weights do not change between the two, so evaluating
        again before the export only cost time (four minutes for an EAGLE-3 head here)."""
        if not self.acc.is_main_process:
            return {}
        last = next((r for r in reversed(self.history) if "step" in r and any(k.startswith("eval/") for k in r)), None)
        if last is not None and last["step"] == self.step:
            return {k: v for k, v in last.items() if k != "step"}
        return self.evaluate()

    def plot(self) -> None:
        """Draw the training curves into the run folder (main process)."""

    def plot_curves(self, train: dict[str, str], held_out: dict[str, str], labels: tuple[str, str, str, str]) -> None:
        """``training_curves.png``: the ``train`` series (legend label -> history key) on the left,
        the ``held_out`` ones on the right; ``labels``: left y-label, left title, right y-label,
        right title."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, series, marker, (ylabel, title) in zip(axes, (train, held_out), (None, "o"),
                                                      (labels[:2], labels[2:])):
            for label, key in series.items():
                rows = [r for r in self.history if key in r]
                ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker=marker, label=label)
            ax.set(xlabel="optimizer step", ylabel=ylabel, title=title)
            if len(series) > 1:
                ax.legend()
        fig.tight_layout()
        fig.savefig(self.out / "training_curves.png", dpi=110)
        plt.close(fig)

    def load_weights(self, drafter) -> None:
        """Copy a checkpointed drafter's trainable weights into ``self.trainable`` (resume)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the loop
    @property
    def module(self):
        """The prepared (possibly DDP-wrapped) trainable module: call it to train."""
        return self._module

    def setup(self, resume: bool = False, allow_config_change: bool = False) -> None:
        """Prepare a run; with ``resume``, continue the checkpointed one. A resumed run must have the
        stored ``config.yaml``'s config (a changed seed, learning rate or dataset would silently make
        another run) unless ``allow_config_change``; the stored file is never overwritten (an allowed
        change is written beside it as ``config.resumed-<step>.yaml``)."""
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        cfg = self.cfg
        check_export_target(cfg.export, cfg.overwrite_export)
        checkpoint = self.out / "checkpoint"
        log_with, init_kwargs = tracker_init(cfg.run, self.out)
        self.acc = Accelerator(mixed_precision=cfg.run.mixed_precision, log_with=log_with, project_dir=str(self.out))
        if self.acc.is_main_process and self.out.is_dir():
            recover_dir(checkpoint)  # finish a checkpoint write a crash interrupted
        self.acc.wait_for_everyone()
        if resume and not checkpoint.exists():
            raise FileNotFoundError(f"--resume: no checkpoint in {self.out}; drop --resume to start a new run")
        if not resume and checkpoint.exists():
            raise FileExistsError(f"{checkpoint} holds an earlier run: pass --resume to continue it, or set "
                                  "run.out_dir to a new folder (or delete it) to start over")
        if self.acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
        changed = self._config_changes() if resume else []
        if changed and not allow_config_change:
            raise ValueError(f"--resume with a config that differs from {self.out / 'config.yaml'} in "
                             f"{changed}: rerun with the stored config, or pass --allow-config-change")
        set_seed(cfg.run.seed)
        if self.model is None:
            dtype = getattr(cfg, "target_dtype", None)
            self.model, self.tokenizer = selfspec.load_target(cfg.target, device=str(self.acc.device),
                                                              dtype=getattr(torch, dtype) if dtype else torch.float32)
        self.model.requires_grad_(False).eval()
        with self.acc.main_process_first():  # feature caches: built once, read by the others
            self.prepare()
        self.total_steps = max(1, math.ceil(cfg.optim.epochs * self.steps_per_epoch()))
        if self.cast_trainable:
            self.trainable.float()
        self.trainable.train()
        params = [p for p in self.trainable.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        self._module, self.optimizer = self.acc.prepare(TrainModule(self.trainable, self.forward), self.optimizer)
        if resume:
            self._resume()
            if changed and self.acc.is_main_process:
                atomic_write_text(self.out / f"config.resumed-{self.step}.yaml", dump_config(cfg))
        elif self.acc.is_main_process:
            atomic_write_text(self.out / "config.yaml", dump_config(cfg))
        self.acc.init_trackers(cfg.run.wandb_project, config=_flat(asdict(cfg)) if log_with == "tensorboard" else asdict(cfg),
                               init_kwargs=init_kwargs)

    def _lr(self, step: int) -> float:
        return lr_at(self.cfg.optim, step, self.total_steps)

    def _shard(self, items: list) -> list[list]:
        """This process's micro-batches of a global batch (rank r: items r, r + N, ...)."""
        mine = items[self.acc.process_index:: self.acc.num_processes]
        k = self.cfg.optim.grad_accum
        return [mine[i * len(mine) // k: (i + 1) * len(mine) // k] for i in range(k)]

    def _train_step(self, items: list) -> dict:
        """One optimizer step on the global batch ``items``; returns the row to log (the global
        batch's values, reduced over processes)."""
        world = self.acc.num_processes
        if not items:
            raise ValueError(f"step {self.step} has an empty global batch")
        micro = self._shard(items)
        row_sum: dict[str, float] = {}
        for m, part in enumerate(micro):
            scale = 1.0
            if not part:  # fewer items than processes x micro-batches: still join the all-reduce
                part, scale = items[:1], 0.0
            last = m == len(micro) - 1
            with self.acc.autocast(), (torch.enable_grad() if last else self.acc.no_sync(self.module)):
                loss, row = self.loss(part, items)
            self.acc.backward(loss * (scale * world))
            row = {"loss": float(loss.detach())} | row
            for k, v in row.items():
                row_sum[k] = row_sum.get(k, 0.0) + float(v) * scale
        if self.cfg.optim.grad_clip:
            self.acc.clip_grad_norm_(self.module.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        names = sorted(row_sum)
        values = torch.tensor([row_sum[k] for k in names], dtype=torch.float64, device=self.acc.device)
        if world > 1:
            values = self.acc.reduce(values, reduction="sum")
        row = dict(zip(names, values.tolist()))
        if not math.isfinite(row["loss"]):  # every process sees the reduced loss: all stop here, nothing is saved
            raise FloatingPointError(f"training went non-finite at step {self.step + 1} (loss {row['loss']}): "
                                     "nothing from this step on is saved; lower optim.lr or check the data")
        return row

    def train(self, stop_at: int | None = None) -> None:
        """Train to the end (or up to step ``stop_at``, as if the run were interrupted there)."""
        cfg = self.cfg
        end = min(self.total_steps, stop_at or self.total_steps)
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {self.name}", unit="step",
                   disable=not self.acc.is_local_main_process)
        started, items_done, first = time.time(), 0, self.step
        while self.step < end:
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr(self.step)
            row = self._train_step(self.step_items(self.step))
            items_done += row.pop("_tokens", 0.0)
            self.step += 1
            bar.update(1)
            if self.step % cfg.run.log_every == 0 or self.step == self.total_steps:
                row = {"train/loss": row.pop("loss")} | row | {"lr": self._lr(self.step - 1), "step": self.step}
                if items_done:
                    row["train/tokens_per_s"] = items_done / max(time.time() - started, 1e-9)
                row["train/seconds_per_step"] = (time.time() - started) / max(1, self.step - first)
                row["train/peak_memory_gib"] = peak_memory_gib(self.acc.device)
                self._log(row)
                bar.set_postfix(loss=f"{row['train/loss']:.3f}")
            if self.step % cfg.run.eval_every == 0 or self.step == self.total_steps:
                self._evaluate_and_log()
            if self.step % cfg.run.ckpt_every == 0 or self.step == self.total_steps:
                self.save_checkpoint(wall=time.time() - started)
        bar.close()

    def _evaluate_and_log(self) -> None:
        if self.acc.is_main_process:
            self._log(self.evaluate() | {"step": self.step})
        self.acc.wait_for_everyone()

    def _log(self, row: dict) -> None:
        self.history.append(row)
        self.acc.log({k: v for k, v in row.items() if not isinstance(v, (list, dict))}, step=row["step"])

    def save_checkpoint(self, wall: float = 0.0) -> None:
        """Atomically replace ``<out>/checkpoint`` (drafter + optimizer + step), on the main process."""
        from selfspec.drafters import save_drafter

        if self.acc.is_main_process:
            with atomic_dir(self.out / "checkpoint") as tmp:
                save_drafter(self.drafter, tmp / "drafter", tokenizer=self.tokenizer)
                write_train_state(tmp, self.optimizer, self.step,
                                  {"wall_time_s": wall, "history": self.history,
                                   "processes": self.acc.num_processes})
        self.acc.wait_for_everyone()

    def _config_changes(self) -> list[str]:
        """Dotted keys whose values differ between the stored ``config.yaml`` and this run's config."""
        import yaml

        path = self.out / "config.yaml"
        try:
            stored = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as err:
            raise CheckpointError(f"--resume: the run's config {path} is missing or corrupt: {err}") from err
        now = yaml.safe_load(dump_config(self.cfg))

        def diff(a, b, where=""):
            if isinstance(a, dict) and isinstance(b, dict):
                return [k for key in sorted(set(a) | set(b)) for k in diff(a.get(key), b.get(key), f"{where}{key}.")]
            return [] if a == b else [f"{where[:-1]}: {a!r} -> {b!r}"]

        return diff(stored, now)

    def _resume(self) -> None:
        folder = self.out / "checkpoint"
        self.load_weights(selfspec.load_drafter(folder / "drafter", self.model))
        info = read_train_state(folder, self.optimizer)
        self.step, self.history = int(info["step"]), list(info.get("history", []))
        if self.acc.is_main_process:
            print(f"resumed from {folder} at step {self.step} (written by {info.get('processes', 1)} "
                  f"process(es), continuing on {self.acc.num_processes})")

    def write_summary(self, summary: dict) -> None:
        if self.acc.is_main_process:
            atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=1))
            self.plot()

    def cleanup(self, keep_processes: bool = False) -> None:
        """Close the trackers and (unless ``keep_processes``: a pipeline goes on with the same
        process group after training) end the process group."""
        if keep_processes:
            for tracker in self.acc.trackers:
                tracker.finish()
        else:
            self.acc.end_training()

    @classmethod
    def run(cls, cfg, *, resume: bool = False, allow_config_change: bool = False, keep_processes: bool = False,
            **given) -> dict:
        """setup -> train -> export -> cleanup; returns the export summary."""
        recipe = cls(cfg, **given)
        recipe.setup(resume=resume, allow_config_change=allow_config_change)
        recipe.train()
        summary = recipe.export()
        recipe.acc.wait_for_everyone()
        recipe.cleanup(keep_processes)
        return summary


def _flat(d: dict, prefix: str = "") -> dict:
    """A nested config as one level of scalars (TensorBoard's hyperparameters take nothing else)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def peak_memory_gib(device) -> float:
    """Peak memory of this process so far: the accelerator's allocator peak on a GPU, the
    resident set's high-water mark on a CPU (what a user sizes a machine by)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024 ** 3
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # kilobytes on Linux
