"""Experiment tracking: one tracked run per training pipeline, whatever the stage.

``report_to``: ``wandb`` (offline unless ``WANDB_MODE`` or ``run.wandb_mode`` says otherwise),
``tensorboard`` (needs the ``tensorboard`` package) or ``none``. Stages that log (distillation,
training, calibration, the benchmark) open the run with the same id (``resume="allow"``), so wandb
shows one run; the training loop logs through accelerate's trackers with the same settings
(:func:`tracker_init`).
"""

from __future__ import annotations

import os
from pathlib import Path

REPORT_TO = ("wandb", "tensorboard", "none")


def _wandb_mode(configured: str) -> str:
    return os.environ.get("WANDB_MODE") or configured


def tracker_init(run, out: Path) -> tuple[str | None, dict]:
    """``(log_with, init_kwargs)`` for ``accelerate.Accelerator`` / ``init_trackers`` from a
    :class:`~selfspec.training.loop.RunConfig` ``run`` and the run folder ``out``."""
    if run.report_to == "none":
        return None, {}
    if run.report_to == "tensorboard":
        _need_tensorboard()
        return "tensorboard", {}
    import wandb

    kwargs = {"mode": _wandb_mode(run.wandb_mode), "dir": str(out), "settings": wandb.Settings(silent=True)}
    if run.run_name:
        kwargs["name"] = run.run_name
    if run.tags:
        kwargs["tags"] = list(run.tags)
    if run.run_id:
        kwargs |= {"id": run.run_id, "resume": "allow"}
    return "wandb", {"wandb": kwargs}


def _need_tensorboard() -> None:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ModuleNotFoundError("report_to=tensorboard needs the tensorboard package: pip install tensorboard")


class Tracker:
    """Log scalars, Markdown tables and images to the pipeline's run (a no-op for ``none``)."""

    def __init__(self, report_to: str, out: str | os.PathLike, *, project: str = "selfspec", name: str | None = None,
                 tags: list[str] | None = None, run_id: str | None = None, config: dict | None = None,
                 wandb_mode: str = "offline"):
        if report_to not in REPORT_TO:
            raise ValueError(f"report_to must be one of {REPORT_TO}, got {report_to!r}")
        self.kind, self._run, self._writer = report_to, None, None
        out = Path(out)
        if report_to == "wandb":
            import wandb

            self._wandb = wandb
            self._run = wandb.init(project=project, name=name, tags=tags or None, id=run_id, resume="allow",
                                   dir=str(out), mode=_wandb_mode(wandb_mode), config=config, reinit="finish_previous",
                                   settings=wandb.Settings(silent=True))
        elif report_to == "tensorboard":
            _need_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(out / project))

    def log(self, row: dict, step: int | None = None, axis: str | None = None) -> None:
        """Log the scalars of ``row`` at ``step``; with ``axis`` (e.g. ``"calibrate/depth"``) ``step``
        is a value on that metric's own x axis (the row's prefix plotted against it), not the run's
        step, so a stage's per-depth rows never go back on the run's step counter."""
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._run is not None:
            if axis is not None:
                self._run.define_metric(axis)
                self._run.define_metric(axis.rsplit("/", 1)[0] + "/*", step_metric=axis)
                self._run.log(scalars | {axis: step})
            else:
                self._run.log(scalars, step=step)
        elif self._writer is not None:
            for k, v in scalars.items():
                self._writer.add_scalar(k, v, step or 0)

    def table(self, key: str, columns: list[str], rows: list[list]) -> None:
        if self._run is not None:
            self._run.log({key: self._wandb.Table(columns=columns, data=rows)})
        elif self._writer is not None:
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
            self._writer.add_text(key, "\n".join(lines))

    def image(self, key: str, path: str | os.PathLike) -> None:
        if not Path(path).exists():
            return
        if self._run is not None:
            self._run.log({key: self._wandb.Image(str(path))})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
        if self._writer is not None:
            self._writer.close()
