"""Ship a retrained drafter into a checkpoint folder, keeping the folder's calibrated trees.

    python scripts/ship_head.py runs/eagle3-smollm2-r29-export checkpoints/smollm2-135m-instruct-eagle3

A shipped checkpoint holds trees raced on several classes of machine (``extra.options*_by_dtype``,
their race records in ``extra.calibration*``; ``scripts/calibrate.py``), most of them on machines
the next session may not have. A retrained head of the same kind and target drafts the same way
with a somewhat different acceptance, so its trees are carried over rather than dropped (dropping
them would fall back to the training config's tree everywhere), and every carried race record is
marked ``raced_with_head`` (the run folder of the head it measured) until ``scripts/calibrate.py``
races that key again on the new head, which replaces the record. The tree fields of ``config``
(the float32 tree ``calibrate.py`` writes there) are carried over too. The new weights, the new
training record and lineage come from the export; files other than ``drafter.json`` and
``adapter.safetensors`` (the model card) are kept. The folder is replaced atomically.

Refused: another drafter kind, another target (fingerprint), a checkpoint folder that does not exist.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from selfspec.checkpoint import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, atomic_dir, atomic_write_text, read_checkpoint  # noqa: E402

#: ``extra`` keys that hold calibrated trees (carried over as they are) and race records (marked)
TREES = ("options_by_dtype", "options_in_union_by_dtype", "options_sampled_by_dtype")
RECORDS = ("calibration", "calibration_by_dtype", "calibration_in_union_by_dtype", "calibration_sampled_by_dtype")
#: ``config`` fields that describe the tree rather than the head's shape
TREE_CONFIG = ("max_depth", "max_nodes", "width", "branch", "min_score", "head_weights")


def merged_meta(new: dict, old: dict) -> dict:
    """``new``'s drafter.json with ``old``'s calibrated trees carried over (see the module docstring)."""
    if new.get("kind") != old.get("kind"):
        raise CheckpointError(f"the new drafter is a {new.get('kind')!r}, the checkpoint a {old.get('kind')!r}")
    if new.get("target", {}).get("fingerprint") != old.get("target", {}).get("fingerprint"):
        raise CheckpointError("the new drafter was trained on another target than the checkpoint's "
                              f"({new.get('target')} vs {old.get('target')})")
    meta = copy.deepcopy(new)
    old_extra, extra = old.get("extra") or {}, meta.setdefault("extra", {})
    head = (old_extra.get("training") or {}).get("run", {}).get("out_dir") or "the previous head"
    for key in TREES:
        if key in old_extra:
            extra[key] = old_extra[key]
    for key in RECORDS:
        if key not in old_extra:
            continue
        records = copy.deepcopy(old_extra[key])
        per_key = records.values() if key.endswith("_by_dtype") else [records]
        for record in per_key:
            if isinstance(record, dict):
                record.setdefault("raced_with_head", head)
        extra[key] = records
    for field in TREE_CONFIG:
        if field in old.get("config", {}):
            meta["config"][field] = old["config"][field]
    return meta


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new", help="the retrained drafter folder (a training run's export)")
    ap.add_argument("checkpoint", help="the shipped checkpoint folder it replaces")
    args = ap.parse_args(argv)
    new_meta, _ = read_checkpoint(args.new)  # both read whole: corrupt or partial folders refuse here
    old_meta, _ = read_checkpoint(args.checkpoint)
    meta = merged_meta(new_meta, old_meta)
    src, dst = Path(args.new), Path(args.checkpoint)
    with atomic_dir(dst) as tmp:
        for f in dst.iterdir():
            if f.name not in (CONFIG_FILE, WEIGHTS_FILE) and f.is_file():
                shutil.copy2(f, tmp / f.name)
        shutil.copy2(src / WEIGHTS_FILE, tmp / WEIGHTS_FILE)
        atomic_write_text(tmp / CONFIG_FILE, json.dumps(meta, indent=1))
    read_checkpoint(dst)
    carried = [k for k in TREES if k in meta["extra"]]
    print(f"{dst}: weights of {src}; trees carried over: {', '.join(carried) or 'none'}")


if __name__ == "__main__":
    main()
