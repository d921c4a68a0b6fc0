"""Which CPU a measurement ran on.

Speedups here are ratios measured side by side in one process, but the ratio itself depends on the
CPU: on one with native bf16 dot products (``avx512_bf16`` / AMX) a bf16 decode step costs about
half a float32 one, on one without it can cost more. Results may be produced on different
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


#: Kernel classes, fastest bf16 path first: what decides a dtype's cost curve (a decode step and a
#: tree pass of n nodes) on a CPU: bf16 tree passes are cheaper with AMX than with avx512_bf16
#: alone, and float32 products of 2-16 rows pay to run weight-first with AVX2 only but not with
#: AVX-512 (the measurements are in docs/decisions.md).
CPU_CLASSES = ("amx", "avx512_bf16", "avx512", "avx2", "other")


def cpu_class(identity: dict | None = None) -> str:
    """The coarse kernel class of this CPU (one of :data:`CPU_CLASSES`): ``"amx"`` (AMX-BF16
    tiles), ``"avx512_bf16"`` (bf16 dot products without AMX), ``"avx512"``, ``"avx2"``, else
    ``"other"``."""
    flags = set((identity or cpu_identity()).get("flags") or [])
    for flag, name in (("amx_bf16", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"), ("avx2", "avx2")):
        if flag in flags:
            return name
    return "other"


def bf16_is_fast(device: str = "cpu") -> bool:
    """Whether bfloat16 matmuls run natively here: a CUDA device with bf16, or a CPU with
    AVX512-BF16 / AMX-BF16 (elsewhere bf16 is emulated and slower than float32)."""
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_class() in ("amx", "avx512_bf16")
