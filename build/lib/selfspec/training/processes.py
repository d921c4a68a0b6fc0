"""The processes of an ``accelerate launch`` (one state for distillation, training and the pipeline).

``accelerate.PartialState`` detects several CPU processes only when told to use the CPU, which the
launcher says through ``ACCELERATE_USE_CPU``; :class:`accelerate.Accelerator` reads the same flag,
so both see the same process group. Without a launcher: one process.
"""

from __future__ import annotations

import os


def process_state():
    """accelerate's process state (``num_processes``, ``process_index``, ``wait_for_everyone``, ...)."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))


def launched() -> bool:
    """Whether this process is one of several started by a launcher."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1
