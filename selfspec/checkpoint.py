"""Drafter checkpoints: a folder with ``drafter.json`` and ``adapter.safetensors``.

``drafter.json`` holds ``format`` (``"selfspec-drafter"``), ``version``, ``kind``, the drafter's
typed ``config``, the ``target`` identity (model type, vocabulary size, hidden size, layer count,
weight fingerprint, tokenizer fingerprint) and free ``extra`` fields (tree, measured accuracies,
training provenance). Weights are safetensors, never pickles, under the drafter's name prefix.

Writes are crash-safe (:func:`atomic_dir`): a folder is written and fsynced under ``.NAME.new``
beside the destination, renamed to ``.NAME.ready`` once complete, then swapped into place (the old
folder moves to ``.NAME.old`` first, since POSIX cannot rename a folder over a non-empty one), with
the parent folder fsynced after every rename. :func:`recover_dir` finishes or discards whatever a
crash interrupted (a partial ``.new`` is dropped, a complete ``.ready`` is rolled forward), so a
reader always finds either the old checkpoint or the new one, never half of one and never none.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .drafters.base import TargetSignature
from .model.fingerprint import target_fingerprint, tokenizer_fingerprint

FORMAT, VERSION = "selfspec-drafter", 1
CONFIG_FILE, WEIGHTS_FILE = "drafter.json", "adapter.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, partial or made for another target."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            with open(Path(folder) / name, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(folder))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a fsynced temporary file, ``os.replace`` and a fsync of the
    folder (so the rename itself survives a power loss)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; checkpoints are meant to be shared
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _staging(path: Path) -> tuple[Path, Path, Path]:
    return (path.parent / f".{path.name}.new", path.parent / f".{path.name}.ready",
            path.parent / f".{path.name}.old")


def recover_dir(path: str | os.PathLike) -> None:
    """Finish or discard an :func:`atomic_dir` swap that a crash interrupted: afterwards ``path``
    is the newest complete folder (if any was ever complete) and no staging folder is left."""
    path = Path(path)
    new, ready, old = _staging(path)
    if new.exists():  # possibly partial: never used
        shutil.rmtree(new)
    if ready.exists():  # complete: roll forward
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
            _fsync_dir(path.parent)
        os.replace(ready, path)
        _fsync_dir(path.parent)
    if old.exists():
        if path.exists():
            shutil.rmtree(old)
        else:  # not produced by atomic_dir's order, but never lose the last good folder
            os.replace(old, path)
            _fsync_dir(path.parent)


def check_replaceable(path: str | os.PathLike, writes: set[str], what: str) -> Path:
    """``path`` as an absolute folder that a write of the files ``writes`` may replace whole: absent,
    empty, or holding nothing but those files. Anything else (another checkpoint, the source, a
    folder of unrelated files, a file) is refused with ``FileExistsError`` naming it, so a
    replacement never deletes what it did not write. ``what`` names the argument in the message."""
    path = Path(os.path.abspath(path))
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{what} {str(path)!r} is a file, not a folder")
    if path.is_dir():
        others = sorted(p.name for p in path.iterdir() if p.name not in writes)
        if others:
            shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            raise FileExistsError(f"{what} {str(path)!r} holds files this write did not make ({shown}); replacing it "
                                  "would delete them: choose a new or empty folder")
    return path


@contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a fresh staging folder; when the block ends without error it becomes ``path``
    (crash-safe, see the module docstring). An error inside the block leaves ``path`` untouched.
    ``path`` is made absolute first (``"."`` becomes the current folder's own path)."""
    path = Path(os.path.abspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(path)
    new, ready, _ = _staging(path)
    new.mkdir()
    os.chmod(new, 0o755)
    try:
        yield new
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    _fsync_tree(new)
    os.replace(new, ready)  # complete from here on: a crash rolls it forward
    _fsync_dir(path.parent)
    recover_dir(path)  # the swap itself: old -> .old, .ready -> path, drop .old


@dataclass(frozen=True)
class TargetIdentity:
    """What a checkpoint records about the target it was trained on."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    fingerprint: str
    tokenizer_fingerprint: str | None = None

    @classmethod
    def of(cls, model, tokenizer=None) -> "TargetIdentity":
        sig = TargetSignature.of(model)
        tok = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
        return cls(sig.model_type, sig.vocab_size, sig.hidden_size, sig.num_layers, target_fingerprint(model), tok)

    @property
    def signature(self) -> TargetSignature:
        return TargetSignature(self.model_type, self.vocab_size, self.hidden_size, self.num_layers)


def save_checkpoint(path, *, kind: str, config: dict, target: TargetIdentity, weights: dict[str, torch.Tensor],
                    extra: dict | None = None) -> None:
    """Atomically write a drafter checkpoint folder."""
    meta = dict(format=FORMAT, version=VERSION, kind=kind, config=config, target=asdict(target), extra=extra or {})
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ValueError(f"refusing to save a drafter with non-finite weights (NaN or inf) in {bad[:3]} to {str(path)!r}")
    with atomic_dir(path) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT, "kind": kind})
        atomic_write_text(tmp / CONFIG_FILE, json.dumps(meta, indent=1))


def read_checkpoint(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read ``(meta, weights)``; any missing, corrupt or foreign file raises :class:`CheckpointError`."""
    path = Path(path)
    if not path.is_dir() and any(p.exists() for p in _staging(path)):
        recover_dir(path)  # a write was interrupted by a crash: finish it
    if not path.is_dir():
        raise CheckpointError(f"no drafter checkpoint folder at {str(path)!r}")
    cfg_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_file.exists():
        raise CheckpointError(f"{str(path)!r} is not a selfspec drafter checkpoint: {CONFIG_FILE} is missing")
    try:
        meta = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{cfg_file} is corrupt (not valid JSON): {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{cfg_file} is not a selfspec drafter config (format {meta.get('format')!r})"
                              if isinstance(meta, dict) else f"{cfg_file} is not a selfspec drafter config")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{cfg_file} has format version {meta.get('version')}, this selfspec reads {VERSION}")
    if not weights_file.exists():
        raise CheckpointError(f"{str(path)!r} is partial: {WEIGHTS_FILE} is missing")
    try:
        weights = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{weights_file} is corrupt or truncated: {err}") from err
    return meta, weights


def check_target(meta: dict, model, path, strict: bool = True) -> None:
    """Refuse a checkpoint whose recorded target differs from ``model``: another architecture,
    shape or vocabulary always; other weights of the same shape unless ``strict=False`` (then a
    warning: a head trained on one model's hidden states may still draft for a fine-tune of it, and
    its measured acceptance is the judge; the output stays exact either way)."""
    try:
        want = TargetIdentity(**meta["target"])
    except (KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r} has no valid target identity: {err!r}") from None
    try:
        want.signature.check(model, what=f"checkpoint {str(path)!r}")
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    have = target_fingerprint(model)
    if have != want.fingerprint:
        msg = (f"checkpoint {str(path)!r} was trained on another target: weight fingerprint {want.fingerprint}, "
               f"this model has {have} (same architecture, different weights)")
        if strict:
            raise CheckpointError(msg + "; load_drafter(..., strict=False) loads it anyway")
        import warnings

        warnings.warn(msg + ": loaded with strict=False; its drafts may be accepted less often (the output "
                      "is exact either way): measure it with selfspec bench", RuntimeWarning, stacklevel=3)


def adapter_state(weights: dict, prefix: str, expected: dict) -> dict:
    """The tensors of ``weights`` under ``prefix`` (prefix removed), checked against a module's
    ``state_dict()`` ``expected``: same names and shapes, else ``ValueError`` naming them."""
    kind = prefix.rstrip(".")
    state = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    if missing or unexpected:
        raise ValueError(f"{kind} weights do not match the config: missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")
    bad = [k for k in expected if expected[k].shape != state[k].shape]
    if bad:
        raise ValueError(f"{kind} weights have wrong shapes for {bad[:4]}")
    return state
