"""Your own chat data as distillation prompts: OpenAI ``messages`` JSON Lines, ShareGPT JSON, and
anything ``datasets`` loads (a ``save_to_disk`` folder, a folder of data files, parquet, JSON Lines,
or a Hub dataset id through ``datasets.load_dataset``, which honours ``HF_HUB_OFFLINE`` and its
cache).

Every record becomes a :class:`Conversation`: an optional system message, the user turns in order,
and optional tools (OpenAI / JSON-schema function list). The record's assistant turns are dropped:
the target writes its own (self-distillation regenerates every assistant turn, each after the
earlier turns *with the target's own earlier answers*, see :mod:`selfspec.training.distill`).

Field mapping (:class:`DataFile`): ``format`` ``auto`` detects ``messages`` (a list of ``{"role",
"content"}``, roles ``system`` / ``user`` / ``assistant`` / ``tool``), ``conversations`` (ShareGPT:
``{"from", "value"}`` with ``system`` / ``human`` / ``gpt``) or ``text`` (one plain prompt per
record, for base models without a chat template); ``messages_field`` / ``text_field`` /
``tools_field`` name the columns; ``id_field`` the record id (default: its position).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("auto", "messages", "sharegpt", "text")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}


@dataclass
class DataFile:
    """One data source of the user's (YAML copy under ``distill.data_files``).

    Attributes:
        path: a ``.jsonl`` / ``.json`` / ``.parquet`` file, a ``datasets`` folder (``save_to_disk``
            or data files), or a Hub dataset id (``owner/name``), read with ``datasets.load_dataset``.
        format: ``auto``, ``messages``, ``sharegpt`` or ``text`` (see the module docstring).
        limit: most conversations taken (0: all), after a seeded shuffle.
        messages_field / text_field / tools_field / id_field: column names.
        split: the split of a ``DatasetDict`` folder or a Hub dataset.
        name: the configuration (subset) of a Hub dataset.
        revision: the revision of a Hub dataset.
    """

    path: str = ""
    format: str = "auto"
    limit: int = 0
    messages_field: str = "messages"
    text_field: str = "text"
    tools_field: str = "tools"
    id_field: str = ""
    split: str = "train"
    name: str | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("a data file needs a path")
        if self.format not in FORMATS:
            raise ValueError(f"data file format must be one of {FORMATS}, got {self.format!r}")
        if self.limit < 0:
            raise ValueError(f"limit must be >= 0, got {self.limit}")


@dataclass
class Conversation:
    """What the target answers: ``system`` (or ``None``), ``users`` (the user turns, in order),
    ``tools`` (or ``None``), and where it came from."""

    source: str
    source_id: str
    system: str | None
    users: list[str]
    tools: list | None = None


def read_records(spec: DataFile) -> list[dict]:
    """The raw records of ``spec.path`` as dicts."""
    path = Path(spec.path)
    if not path.exists():
        if not is_dataset_id(spec.path):
            raise FileNotFoundError(f"data file {spec.path!r} does not exist (nor is it a Hub dataset id owner/name)")
        return _hub_records(spec)
    if path.is_dir() and not _saved_dataset(path):
        return _hub_records(spec)  # a folder of data files: load_dataset reads it as it reads a Hub repository
    if path.is_dir():
        from datasets import DatasetDict, load_from_disk

        data = load_from_disk(str(path))
        if isinstance(data, DatasetDict):
            if spec.split not in data:
                raise ValueError(f"{path} has splits {list(data)}, not {spec.split!r} (set split:)")
            data = data[spec.split]
        return list(data)
    if path.suffix == ".parquet":
        from datasets import load_dataset

        return list(load_dataset("parquet", data_files=str(path), split="train"))
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON list (ShareGPT's usual file)
        rows = json.loads(text)
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n} is not valid JSON: {err}") from None
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: every record must be a JSON object")
    return rows


def is_dataset_id(text: str) -> bool:
    """``owner/name`` (or a bare ``name``): letters, digits, ``-_.``, at most one slash, and not a
    data file's name (``.jsonl``, ``.json``, ``.parquet``, ``.csv``, ``.txt``, ``.gz``)."""
    import re

    if text.lower().endswith((".jsonl", ".json", ".parquet", ".csv", ".txt", ".gz")):
        return False
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?", text))


def _saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a ``save_to_disk`` folder (a Dataset or a DatasetDict)."""
    return (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() or \
        (path / "state.json").exists()


def _hub_records(spec: DataFile) -> list[dict]:
    """The records of a Hub dataset id or a folder of data files, through ``datasets.load_dataset``
    (offline with ``HF_HUB_OFFLINE=1``: from the local cache only)."""
    from datasets import load_dataset

    try:
        data = load_dataset(spec.path, spec.name, split=spec.split, revision=spec.revision)
    except ValueError as err:  # an unknown split or configuration
        raise ValueError(f"dataset {spec.path!r}: {err}") from err
    except (OSError, ConnectionError) as err:
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        why = "it is not in the local datasets cache and HF_HUB_OFFLINE is set" if offline else \
            "the Hub could not provide it (a typo, a gated dataset without a token, or no network)"
        raise FileNotFoundError(f"dataset {spec.path!r}: not a local file or folder, and {why} ({err})") from err
    return list(data)


def to_conversation(record: dict, spec: DataFile, index: int) -> Conversation:
    """One record as a :class:`Conversation` (``ValueError`` naming what is missing)."""
    fmt = spec.format
    if fmt == "auto":
        fmt = ("messages" if spec.messages_field in record else "sharegpt" if "conversations" in record
               else "text" if spec.text_field in record else None)
        if fmt is None:
            raise ValueError(f"{spec.path} record {index}: none of the fields {spec.messages_field!r}, "
                             f"'conversations', {spec.text_field!r}; set format and the field names")
    rid = str(record.get(spec.id_field, index)) if spec.id_field else str(index)
    tools = record.get(spec.tools_field) or None
    if isinstance(tools, str):
        tools = json.loads(tools)
    if fmt == "text":
        text = record.get(spec.text_field)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{spec.path} record {index}: {spec.text_field!r} is not a non-empty string")
        return Conversation(spec.path, rid, None, [text], tools)
    if fmt == "messages":
        turns = [(m.get("role"), m.get("content")) for m in record.get(spec.messages_field) or []]
    else:
        turns = [(SHAREGPT_ROLES.get(m.get("from"), m.get("from")), m.get("value")) for m in record.get("conversations") or []]
    system = next((c for r, c in turns if r == "system"), None)
    users = [c for r, c in turns if r == "user"]
    bad = {r for r, _ in turns} - {"system", "user", "assistant", "tool"}
    if bad:
        raise ValueError(f"{spec.path} record {index}: unknown roles {sorted(map(str, bad))}")
    if not users or not all(isinstance(u, str) and u.strip() for u in users):
        raise ValueError(f"{spec.path} record {index}: no user turn with text")
    return Conversation(spec.path, rid, system, users, tools)


def load_conversations(spec: DataFile) -> list[Conversation]:
    """Every record of ``spec`` as a conversation, in file order."""
    return [to_conversation(r, spec, i) for i, r in enumerate(read_records(spec))]
