"""Optional dependencies: the inference core needs torch, transformers, safetensors and pyyaml;
the rest comes with extras (``pip install 'selfspec[gguf|tools|train|bench|all]'``)."""

from __future__ import annotations

import importlib


def need(module: str, extra: str, what: str):
    """Import ``module`` or raise an ``ImportError`` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{what} needs the package {module.split('.')[0]!r}: pip install 'selfspec[{extra}]'") from err
