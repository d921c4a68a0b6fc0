"""Which CPU a measurement ran on.

Speedups here are ratios measured side by side in one process, but the ratio itself depends on the
CPU: on one with native bf16 dot products (``avx512_bf16`` / AMX) a bf16 decode step costs about
half a float32 one, on one without it can cost more. Sessions of this project land on different
machines, so every result file and calibration records the CPU model and the instruction-set
flags that decide the dtype's speed, not just the architecture and core count.
"""

from __future__ import annotations

import os
import platform

#: Flags that change which dtype and which kernels are fast (x86; other architectures report none).
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_identity(cpuinfo: str | None = None) -> dict:
    """``{"model", "flags", "cores"}`` of this machine's CPU (``cpuinfo``: the text of
    ``/proc/cpuinfo``, read when ``None``; on systems without it the model is
    ``platform.processor()`` and the flags are empty)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return {"model": model or platform.processor() or platform.machine(),
            "flags": [f for f in SPEED_FLAGS if f in flags], "cores": os.cpu_count()}


def cpu_label(identity: dict | None = None) -> str:
    """One line: ``"AMD EPYC, 2 cores (avx2 avx512f avx512_bf16 ...)"``."""
    c = identity or cpu_identity()
    flags = " ".join(c.get("flags") or []) or "no listed speed flags"
    return f"{c.get('model', '?')}, {c.get('cores', '?')} cores ({flags})"
